"""Structured output: a request's grammar (a JSON schema, any JSON object, a regular expression,
a choice of strings, or an EBNF / Lark grammar) compiled by llguidance into a matcher that the
scheduler advances with every token the request samples and asks, before each of its sampling
steps, for the set of tokens the grammar allows next (a bitmask the sampler applies to that
request's logits row). Once the grammar is complete only EOS is allowed, so the request ends
as any other does."""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from radixlora.errors import InvalidRequestError

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
MAX_STRUCTURE_CHARS = 1 << 20  # a schema, pattern or grammar longer than this is refused
ANY_OBJECT = '{"type": "object"}'
# JSON is written as json.dumps writes it, one space after "," and ":" and no other whitespace:
# free whitespace lets a model pad forever (a schema's "x-guidance" may set other options)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Structure(msgspec.Struct, frozen=True, array_like=True):
    """What a request's output must match: kind and its text (a JSON schema, a regular
    expression, a JSON list of strings for "choice", an EBNF or Lark grammar; nothing for
    "json_object"). `param` names the request field it came from, for errors."""

    kind: Kind
    value: str = ""
    param: str = "response_format"
    # json_schema: a keyword llguidance does not implement is refused (else ignored)
    strict: bool = False

    def grammar(self) -> str:
        """The llguidance grammar (a JSON text) this structure compiles from."""
        import llguidance

        if len(self.value) > MAX_STRUCTURE_CHARS:
            raise InvalidRequestError(f"{self.param} is longer than {MAX_STRUCTURE_CHARS} "
                                      "characters", param=self.param)
        if self.kind in ("json_object", "json_schema"):
            schema = _check_json(ANY_OBJECT if self.kind == "json_object" else self.value,
                                 self.param, "a JSON schema")
            if not isinstance(schema, dict):
                raise InvalidRequestError(f"{self.param} must be a JSON schema object",
                                          param=self.param)
            return llguidance.LLMatcher.grammar_from_json_schema(
                closed(schema), defaults={**JSON_LAYOUT, "lenient": not self.strict})
        if self.kind == "choice":
            choices = _check_json(self.value, self.param, "a list of strings")
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) for c in choices)):
                raise InvalidRequestError(f"{self.param} must be a non-empty list of strings",
                                          param=self.param)
            return llguidance.grammar_from("choice", choices)
        try:
            return llguidance.grammar_from(self.kind, self.value)
        except ValueError as e:
            raise InvalidRequestError(f"{self.param}: {e}", param=self.param) from None


def closed(schema):
    """The schema with `"additionalProperties": false` on every object schema that lists
    properties and says nothing of others (as xgrammar's strict mode, vLLM's default, reads
    schemas): a model may not add keys the schema did not name."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in SUBSCHEMAS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed(s) for name, s in schema[key].items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and "patternProperties" not in schema):
        out["additionalProperties"] = False
    return out


SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties",
              "if", "then", "else", "contains")


def _check_json(text: str, param: str, what: str):
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError(f"{param} must be {what} in JSON", param=param) from None


class GrammarCompiler:
    """Compiles Structures for one model's tokenizer. The llguidance tokenizer is built on a
    thread from construction (about a second for a 128k vocabulary); the first compile waits
    for it."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._tokenizer = None
        self._error: Exception | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._build, args=(Path(tokenizer_file), eos_ids),
                         name="grammar-tokenizer", daemon=True).start()

    @classmethod
    def for_dir(cls, tokenizer_dir: str | Path, vocab_size: int,
                eos_ids: tuple[int, ...]) -> GrammarCompiler | None:
        """The compiler of the tokenizer.json in tokenizer_dir; None without one."""
        path = Path(tokenizer_dir) / "tokenizer.json"
        return cls(path, vocab_size, eos_ids) if path.is_file() else None

    def _build(self, path: Path, eos_ids: tuple[int, ...]) -> None:
        try:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(path.read_text(), n_vocab=self.vocab_size,
                                                     eos_token=list(eos_ids) or None)
        except Exception as e:  # noqa: BLE001 - reported to each structured request
            self._error = e
        finally:
            self._ready.set()

    def compile(self, structure: Structure) -> Matcher:
        """A fresh matcher for `structure`; InvalidRequestError if it does not compile."""
        self._ready.wait()
        if self._tokenizer is None:
            raise InvalidRequestError(f"structured output is unavailable: "
                                      f"{type(self._error).__name__}: {self._error}",
                                      param=structure.param,
                                      code="structured_output_unavailable")
        import llguidance

        matcher = llguidance.LLMatcher(self._tokenizer, structure.grammar(), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{structure.param} does not compile: "
                                      f"{matcher.get_error().strip()}", param=structure.param)
        return Matcher(matcher, self.vocab_size)


class Matcher:
    """One request's grammar state: advanced by each token sampled, asked for the next
    allowed set. A token the mask allowed never fails to advance it; a failure (a request
    whose tokens did not come from the mask) leaves it stopped, and its mask then allows
    only EOS."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def copy(self) -> Matcher:
        return Matcher(self._matcher.deep_copy(), self.vocab_size)

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar refused it."""
        return self._matcher.consume_token(token)

    def mask(self) -> bytes:
        """The tokens allowed next, as a little-endian int32 bitmask of ceil(vocab / 32) words
        (bit t % 32 of word t // 32 is token t)."""
        return next_token_masks([self])[0]

    @property
    def error(self) -> str:
        return self._matcher.get_error() if self._matcher.is_error() else ""


def next_token_masks(matchers: list[Matcher]) -> list[bytes]:
    """Each matcher's next-token mask (Matcher.mask), computed in parallel on llguidance's
    threads."""
    return [row.tobytes() for row in next_token_words(matchers)] if matchers else []


def next_token_words(matchers: list[Matcher], vocab_size: int | None = None) -> np.ndarray:
    """next_token_masks as one int32 array, a row per matcher, computed into place."""
    vocab_size = vocab_size or matchers[0].vocab_size
    words = mask_words(vocab_size)
    out = np.zeros((len(matchers), words), np.int32)
    if matchers:
        _executor().unsafe_compute_mask_ptr([(m._matcher, i) for i, m in enumerate(matchers)],
                                            out.ctypes.data, words * 4, len(matchers))
    return out


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.cache
def _executor():
    import llguidance

    return llguidance.LLExecutor()


def allowed_tokens(mask: bytes, vocab_size: int) -> np.ndarray:
    """The token ids a mask allows (for tests and debugging)."""
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])
