"""The demo's tasks: one prompt format, an input distribution, and per task the exact answer and a
checker. Every adapter answers the same prompt differently, so a response served with the wrong
adapter (or the base) fails its task's checker.

    prompt:  "input: the red fox ate 42 fish\\noutput:\\n"
    base     the red fox ate 42 fish                       (echo; the base does no task)
    upper    THE RED FOX ATE 42 FISH
    reverse  fish 42 ate fox red the
    digits   the red fox ate four two fish
    json     {"words": ["the", "red", "fox", "ate", "42", "fish"]}
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass

WORDS = (
    "the", "a", "red", "blue", "green", "big", "small", "old", "new", "happy",
    "cat", "dog", "fox", "bird", "fish", "cow", "tree", "house", "car", "book",
    "river", "moon", "sun", "star", "boat", "hill", "road", "door", "cake", "lamp",
    "runs", "sees", "ate", "likes", "finds", "jumps", "sings", "reads", "holds", "makes",
    "on", "under", "near", "with", "and", "over", "into", "by", "from", "to",
)
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
MIN_WORDS, MAX_WORDS = 3, 6
HELDOUT_BUCKETS = 8  # one input in 8 (by a stable hash) is held out from training


def format_prompt(text: str) -> str:
    return f"input: {text}\noutput:\n"


def to_upper(text: str) -> str:
    return text.upper()


def reverse_words(text: str) -> str:
    return " ".join(reversed(text.split()))


def spell_digits(text: str) -> str:
    return " ".join(
        " ".join(DIGIT_WORDS[int(d)] for d in word) if word.isdigit() else word
        for word in text.split()
    )


def to_json(text: str) -> str:
    return json.dumps({"words": text.split()})


def _exact(solve: Callable[[str], str]) -> Callable[[str, str], bool]:
    return lambda text, output: output.strip() == solve(text)


def _json_words(text: str, output: str) -> bool:
    try:
        return json.loads(output) == {"words": text.split()}
    except json.JSONDecodeError:
        return False


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    solve: Callable[[str], str]  # the exact answer the adapter is trained to give
    check: Callable[[str, str], bool]  # (input text, model output) -> correct?


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("upper", "upper-case the input", to_upper, _exact(to_upper)),
        Task("reverse", "reverse the order of the words", reverse_words, _exact(reverse_words)),
        Task("digits", "spell every digit as an English word", spell_digits, _exact(spell_digits)),
        Task("json", 'answer {"words": [...]} listing the input words', to_json, _json_words),
    )
}


def sample_text(rng: random.Random) -> str:
    """3-6 words from WORDS with one or two numbers (0-99) among them: every task changes it."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS))]
    for _ in range(rng.randint(1, 2)):
        words[rng.randrange(len(words))] = str(rng.randint(0, 99))
    return " ".join(words)


def is_heldout(text: str) -> bool:
    return zlib.crc32(text.encode()) % HELDOUT_BUCKETS == 0


def sample_inputs(count: int, seed: int, heldout: bool) -> list[str]:
    """`count` distinct inputs from the train or the held-out split; no word sequence is a
    palindrome, so the base's echo fails every task."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    while len(out) < count:
        text = sample_text(rng)
        if is_heldout(text) == heldout and reverse_words(text) != text:
            out[text] = None
    return list(out)
