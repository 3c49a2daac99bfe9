"""vLLM's bad_words: each word's token sequences (at the start of a text, and after a space),
and the rule that bans a sequence's last token when the output ends with the rest; greedy
decoding with bad words equals transformers + PEFT decoding greedily under the same bans, on
the base and an adapter, beside requests without them (overlap scheduling on)."""

from __future__ import annotations

import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.errors import InvalidRequestError
from radixlora.sampling_params import banned_tokens
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.conftest import assert_all_free
from tests.oracle import logprobs, peft_model

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-words")
    model = build_tiny_model(root / "model")
    adapter = build_tiny_adapter(model, root / "a1", rank=4, seed=3)
    return model, {"a1": adapter}, Engine(model, adapters={"a1": adapter}, kv_pages=256)


def test_the_ban_rule():
    params = SamplingParams(bad_words_ids=((7,), (3, 4), (1, 2, 5)))
    assert banned_tokens(params, []) == [7]
    assert banned_tokens(params, [9, 3]) == [7, 4]
    assert banned_tokens(params, [1, 2]) == [7, 5]
    assert banned_tokens(params, [2, 1, 2, 3]) == [7, 4]


def test_words_become_their_token_sequences(tiny):
    tok = tiny[2].tokenizer
    for word in ("fox", "the cache"):
        ids = tok.bad_words_ids((word,))
        assert ids[0] == tuple(tok.encode(word, add_special_tokens=False))
        spaced = tuple(tok.encode(" " + word, add_special_tokens=False))
        assert (spaced in ids) == (spaced[0] != ids[0][0] and len(spaced) == len(ids[0]))


def _oracle(hf, prompt, adapter, bad: tuple[tuple[int, ...], ...]) -> list[int]:
    params = SamplingParams(bad_words_ids=bad)
    out: list[int] = []
    while len(out) < MAX_TOKENS:
        scores = logprobs(hf, prompt + out, active=[adapter] if adapter else None)[-1]
        scores[torch.tensor(banned_tokens(params, out), dtype=torch.long)] = -torch.inf
        out.append(int(scores.argmax()))
    return out


def test_bad_words_equal_banned_greedy_transformers(tiny):
    model, adapters, engine = tiny
    prompt = engine.tokenizer.encode("A radix cache shares prefix")
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    free = {a: engine.generate(prompt, plain, adapters=a)[0].outputs[0] for a in (None, "a1")}
    hf = peft_model(model, adapters)
    for adapter, out in free.items():
        ids = out.token_ids
        words = (engine.tokenizer.decode(ids[2:4]), engine.tokenizer.decode(ids[6:7]))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                bad_words=words)
        got = engine.generate([prompt, prompt], [params, plain], adapters=adapter)
        bad = engine.tokenizer.bad_words_ids(words)
        banned = got[0].outputs[0].token_ids
        assert banned == _oracle(hf, prompt, adapter, bad), adapter
        assert banned != ids and got[1].outputs[0].token_ids == ids  # the neighbour is free
        for seq in bad:
            n = len(seq)
            assert all(tuple(banned[i:i + n]) != seq for i in range(len(banned) - n + 1))
    assert_all_free(engine)


def test_bad_words_are_checked(tiny):
    engine = tiny[2]
    for words in (("",), ("x" * 300,), tuple(f"w{i}" for i in range(65))):
        with pytest.raises(InvalidRequestError) as e:
            engine.generate([5, 6], SamplingParams(max_tokens=2, bad_words=words))
        assert e.value.param == "bad_words"
