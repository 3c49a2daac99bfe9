"""Tokenizer from a checkpoint's tokenizer.json (the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer


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

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
