"""Incremental detokenization and stop strings, one sample at a time.

Text is emitted only once it is final: a token sequence ending inside a multi-byte character
waits for the next token, and text that could be the start of a stop string waits until it is
known not to be one, so streamed chunks concatenate to exactly the final text."""

from __future__ import annotations

from radixlora.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """decode(ids) computed chunk by chunk: each push returns the new final characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tok.decode(self.ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """The characters still held back (an incomplete character at the very end)."""
        prefix_text = self.tok.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tok.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Finds the first stop string to complete in the generated text; holds back a tail that
    may still become one. `emitted` characters of `text` have been released."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.emitted = 0
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add text; returns what may be released now. After a match, `matched` is set and
        the text is cut just before the stop string."""
        scan_from = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        hit = self._earliest_stop(scan_from)
        if hit is not None:
            pos, stop = hit
            self.text = self.text[:pos]
            self.matched = stop
            return self._release(pos)
        return self._release(len(self.text) - self._held_tail())

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out

    def _earliest_stop(self, scan_from: int) -> tuple[int, str] | None:
        """The stop string that ends first (the longest one on a tie), as if the text had
        arrived one character at a time: the result never depends on how it was chunked."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            pos = self.text.find(stop, scan_from)
            if pos >= 0 and (best is None or (pos + len(stop), pos) < best[:2]):
                best = (pos + len(stop), pos, stop)
        return None if best is None else (best[1], best[2])

    def _held_tail(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        held = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return held
