"""Incremental detokenization and stop strings, one sample at a time.

Text is emitted only once it is final: a token sequence ending inside a multi-byte character
waits for the next token, and text that could be the start of a stop string waits until it is
known not to be one, so streamed chunks concatenate to exactly the final text."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from radixlora.text.tokenizer import Tokenizer

INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDecoder:
    """decode(ids) computed chunk by chunk with tokenizers' DecodeStream: each push returns the
    new final characters, flush the ones held back at the end (an incomplete character)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=self.skip)
        self.released: list[int] = []  # the ids whose text the last released chunk completed
        self.pending: list[int] = []  # the ids after them, their text not final yet

    def push(self, new_ids: list[int]) -> str:
        return "".join(self._step(token_id) for token_id in new_ids)

    def flush(self) -> str:
        """The characters still held back; the decoder is done after it."""
        if not self.pending:
            return ""
        prefix = self.tok.decode(self.released, self.skip)
        full = self.tok.decode(self.released + self.pending, self.skip)
        self.released, self.pending = self.released + self.pending, []
        return full[len(prefix) :]

    def _step(self, token_id: int) -> str:
        self.pending.append(token_id)
        try:
            text = self.stream.step(self.tok.hf, token_id)
        except Exception as e:  # tokenizers raises a bare Exception
            if not str(e).startswith(INVALID_PREFIX):
                raise
            text = self._restart()
        if text is None:
            return ""
        self.released, self.pending = self.pending, []
        return text

    def _restart(self) -> str:
        """A decoder whose text for more tokens does not extend its text for fewer (byte
        fallback around invalid UTF-8): the released text stays, the characters beyond its
        length are released, and a fresh stream continues from the pending ids."""
        prefix = self.tok.decode(self.released, self.skip)
        full = self.tok.decode(self.released + self.pending, self.skip)
        self.stream = DecodeStream(skip_special_tokens=self.skip)
        try:
            for token_id in self.pending:
                self.stream.step(self.tok.hf, token_id)
        except Exception as e:
            if not str(e).startswith(INVALID_PREFIX):
                raise
            self.stream = DecodeStream(skip_special_tokens=self.skip)
        return full[len(prefix) :]


class StopMatcher:
    """Finds the first stop string to complete in the generated text; holds back a tail that
    may still become one. `emitted` characters of `text` have been released. With
    include_stop, the text ends with the matched stop string instead of just before it."""

    def __init__(self, stops: list[str], include_stop: bool = False, min_tokens: int = 0):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.emitted = 0
        self.matched: str | None = None
        self.min_tokens = min_tokens  # a stop string must end in the text of token min_tokens
        self.tokens = 0  # tokens fed through feed_tokens
        self.no_stop_before = 0  # no match may end at or before this text position

    def feed_tokens(self, decoder, ids: list[int]) -> str:
        """feed() the text of `ids` from `decoder` (an IncrementalDecoder); a stop string that
        ends within the text of the first min_tokens - 1 tokens does not count."""
        if self.tokens + 1 >= self.min_tokens:
            self.tokens += len(ids)
            return self.feed(decoder.push(ids))
        out = ""
        for token in ids:
            self.tokens += 1
            text = decoder.push([token])
            if self.tokens < self.min_tokens:
                self.no_stop_before = len(self.text) + len(text)
            out += self.feed(text)
            if self.matched is not None:
                break
        return out

    def feed(self, delta: str) -> str:
        """Add text; returns what may be released now. After a match, `matched` is set and
        the text is cut just before the stop string (just after it with include_stop)."""
        scan_from = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        hit = self._earliest_stop(scan_from)
        if hit is not None:
            pos, stop = hit
            end = pos + len(stop) if self.include_stop else pos
            self.text = self.text[:end]
            self.matched = stop
            return self._release(end)
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
            pos = self.text.find(stop, max(scan_from, self.no_stop_before - len(stop) + 1))
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


class StopStream:
    """One sample's output as it grows, as the Engine, the frontend's runtime and the server's
    tokenizer process all apply it: new token ids detokenized incrementally into a
    StopMatcher. `step` returns the text that became final, the finish reason ("stop" once a
    stop string matched, else the one given) and what stopped it (the stop string, or the
    last token id when the sample ended on a stop token)."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], include_stop: bool = False,
                 min_tokens: int = 0, skip_special_tokens: bool = True):
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self.matcher = StopMatcher(stops, include_stop, min_tokens)

    def step(self, ids: list[int], finish_reason: str | None
             ) -> tuple[str, str | None, str | int | None]:
        matcher = self.matcher
        text = matcher.feed_tokens(self.decoder, ids)
        if matcher.matched is None and finish_reason is not None:
            text += matcher.feed(self.decoder.flush())
            if matcher.matched is None:
                text += matcher.flush()
                return text, finish_reason, ids[-1] if finish_reason == "stop" and ids else None
        if matcher.matched is not None:
            return text, "stop", matcher.matched
        return text, finish_reason, None
