"""Tokenizer from a checkpoint's tokenizer.json (the `tokenizers` library)."""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.pre_tokenizers import ByteLevel

from radixlora.errors import InvalidRequestError

# A character takes at most 4 UTF-8 bytes; an unknown one costs a token of its own.
MAX_CHAR_BYTES = 4
# Unicode normal forms and lower case delete no text. An output character is one input
# character (at most 4 bytes in, at least 1 out) or a composition of at most 4 (at most 16
# bytes in, a non-ASCII character of at least 2 out): input bytes <= 8 * output bytes.
UNICODE_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase"})
UNICODE_SHRINK = 8
# pre-tokenizers that split text without dropping any of it (unless behavior is "Removed")
KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}
)


class Tokenizer:
    def __init__(self, tok: HFTokenizer):
        self._tok = tok

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        file = Path(path) / "tokenizer.json"
        return cls(HFTokenizer.from_file(str(file))) if file.is_file() else None

    @property
    def hf(self) -> HFTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    @cached_property
    def max_bytes_per_token(self) -> int | None:
        """At most how many UTF-8 bytes of input text one token stands for, or None where the
        pipeline may drop or merge text without bound: a text of more than
        max_bytes_per_token * N bytes is certainly more than N tokens."""
        return _max_bytes_per_token(self._tok)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def check_fits(self, text: str, max_tokens: int, param: str = "prompt") -> None:
        """Raise InvalidRequestError if `text` is certainly more than max_tokens tokens, judged
        from its length alone (nothing is tokenized; texts of pipelines with no bound pass)."""
        bound = self.max_bytes_per_token
        if bound is None or len(text) * MAX_CHAR_BYTES <= max_tokens * bound:
            return
        size = len(text.encode())
        if size > max_tokens * bound:
            raise InvalidRequestError(
                f"the prompt ({size} bytes) cannot fit in the context of {max_tokens} tokens "
                f"(a token stands for at most {bound} bytes)",
                param=param, code="context_length_exceeded")

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode(), through encode_batch, which releases the GIL while it runs: for threads
        that must not stall the others."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def bad_words_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences: each word as it is tokenized at the start of a
        text, and, when a leading space makes it another token sequence of the same length
        (the word inside a text), that one too."""
        out: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.encode(word.lstrip(), add_special_tokens=False))
            if not alone:
                continue  # nothing to ban (SamplingParams.validate refuses such a word)
            spaced = tuple(self.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return tuple(out)


def _max_bytes_per_token(tok: HFTokenizer) -> int | None:
    spec = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if (shrink is None or spec.get("truncation") is not None
            or not _keeps_text(spec.get("pre_tokenizer"))
            or not _model_keeps_text(spec["model"], vocab, spec.get("pre_tokenizer"))
            or any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens", []))):
        return None
    longest = max((len(token.encode()) for token in vocab), default=0)
    return math.ceil(shrink * max(MAX_CHAR_BYTES, longest))


def _normalizer_shrink(spec: dict | None) -> float | None:
    """How many times more UTF-8 bytes a text may have than its normalized form; None when the
    normalizer may delete text."""
    if spec is None:
        return 1
    kind = spec["type"]
    if kind == "Sequence":
        factor = 1
        for part in spec["normalizers"]:
            part_factor = _normalizer_shrink(part)
            if part_factor is None:
                return None
            factor *= part_factor
        return factor
    if kind in UNICODE_NORMALIZERS:
        return UNICODE_SHRINK
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern, content = spec["pattern"].get("String"), spec["content"]
        if not pattern or not content:
            return None
        return max(1, len(pattern.encode()) / len(content.encode()))
    return None


def _keeps_text(spec: dict | None) -> bool:
    """The pre-tokenizer splits the text without dropping any of it."""
    if spec is None:
        return True
    if spec["type"] == "Sequence":
        return all(_keeps_text(part) for part in spec["pretokenizers"])
    return spec["type"] in KEEPING_PRE_TOKENIZERS and spec.get("behavior") != "Removed"


def _model_keeps_text(model: dict, vocab: dict[str, int], pre_tokenizer: dict | None) -> bool:
    """Every character reaches a token: an unknown one becomes bytes or an unknown token of
    its own, never dropped and never fused with its neighbours."""
    if model["type"] != "BPE":
        return False
    if model.get("unk_token") is not None and not model.get("fuse_unk"):
        return True
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    return _has_byte_level(pre_tokenizer) and all(c in vocab for c in ByteLevel.alphabet())


def _has_byte_level(spec: dict | None) -> bool:
    if spec is None:
        return False
    if spec["type"] == "Sequence":
        return any(_has_byte_level(part) for part in spec["pretokenizers"])
    return spec["type"] == "ByteLevel"
