"""Structured output: a request's grammar (a JSON schema, any JSON object, a regular expression,
a choice of strings, or an EBNF / Lark grammar) compiled by llguidance into a matcher that the
scheduler advances with every token the request samples and asks, before each of its sampling
steps, for the set of tokens the grammar allows next (a bitmask the sampler applies to that
request's logits row). Once the grammar is complete only EOS is allowed, so the request ends
as any other does.

Before it compiles, a grammar's limits are checked (nesting through $refs, rule count, regex
repetition): radixlora.sched.grammar_compiler compiles what passes off every loop that must beat."""

from __future__ import annotations

import functools
import json
import logging
import re
import re._constants as sre_constants
import re._parser as sre_parse
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np

from radixlora.errors import InvalidRequestError

log = logging.getLogger(__name__)

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
MAX_STRUCTURE_CHARS = 1 << 20  # a schema, pattern or grammar longer than this is refused
# JSON objects and arrays a schema may nest, counted through its $refs (a $ref back into its
# own path is recursion, which llguidance compiles lazily, and counts nothing): the library
# recurses once per level, and a chain of a few thousand overflows a thread's stack
MAX_SCHEMA_DEPTH = 64
MAX_GRAMMAR_RULES = 1000  # rules and terminals of an EBNF / Lark grammar
# product of the bounds of nested regex repetitions: every mask of such a regex costs about
# 0.2 us per unit of the product, and llguidance's fuel does not bound it ((a{100}){100}:
# 1.4 ms a mask, (a{300}){300}: 20 ms, (a{1000}){1000}: 1.3 s for the first one; a step
# computes one mask per constrained request)
MAX_REGEX_REPEAT = 1000
ANY_OBJECT = '{"type": "object"}'
# JSON is written as json.dumps writes it, one space after "," and ":" and no other whitespace:
# free whitespace lets a model pad forever (a schema's "x-guidance" may set other options)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# a compiling thread's stack (address space only; pages are touched as recursion needs): the
# library recurses once per nesting level of a grammar
COMPILE_STACK_BYTES = 256 << 20


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
        """The llguidance grammar (a JSON text) this structure compiles from, its limits
        checked (InvalidRequestError naming the field and the limit)."""
        import llguidance
        from llguidance.gbnf_to_lark import any_to_lark

        if len(self.value) > MAX_STRUCTURE_CHARS:
            raise InvalidRequestError(f"{self.param} is longer than {MAX_STRUCTURE_CHARS} "
                                      "characters", param=self.param)
        if self.kind in ("json_object", "json_schema"):
            schema = _check_json(ANY_OBJECT if self.kind == "json_object" else self.value,
                                 self.param, "a JSON schema")
            if not isinstance(schema, dict):
                raise InvalidRequestError(f"{self.param} must be a JSON schema object",
                                          param=self.param)
            check_schema(schema, self.param)
            return llguidance.LLMatcher.grammar_from_json_schema(
                closed(schema), defaults={**JSON_LAYOUT, "lenient": not self.strict})
        if self.kind == "choice":
            choices = _check_json(self.value, self.param, "a list of strings")
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) for c in choices)):
                raise InvalidRequestError(f"{self.param} must be a non-empty list of strings",
                                          param=self.param)
            return llguidance.grammar_from("choice", choices)
        if self.kind == "regex":
            check_regex(self.value, self.param)
            return llguidance.grammar_from("regex", self.value)
        try:
            lark = any_to_lark(self.value)  # GBNF (llama.cpp's, SGLang's EBNF) or Lark
        except Exception as e:  # noqa: BLE001 - the converter's errors are the grammar's
            raise InvalidRequestError(f"{self.param}: the grammar does not convert to Lark: "
                                      f"{e}", param=self.param) from None
        check_lark(lark, self.param)
        return llguidance.LLMatcher.grammar_from_lark(lark)


def check_schema(schema: dict, param: str) -> None:
    """A JSON schema within MAX_SCHEMA_DEPTH through its local $refs, its regexes within
    MAX_REGEX_REPEAT."""
    heights: dict[str, int] = {}  # a $ref's target: the levels at and below it

    def check_depth(depth: int) -> None:
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels "
                                      "(counted through its $refs)", param=param)

    def height(node, depth: int, refs: frozenset) -> int:
        check_depth(depth)
        if isinstance(node, list):
            return 1 + max((height(v, depth + 1, refs) for v in node), default=0)
        if not isinstance(node, dict):
            return 0
        _check_patterns(node, param)
        below = max((height(v, depth + 1, refs) for k, v in node.items() if k != "$ref"),
                    default=0)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in refs:
            if ref not in heights:
                heights[ref] = height(_pointer(schema, ref, param), depth + 1, refs | {ref})
            check_depth(depth + heights[ref])
            below = max(below, heights[ref])
        return 1 + below

    height(schema, 1, frozenset())


def _check_patterns(node: dict, param: str) -> None:
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], param)
    if isinstance(node.get("patternProperties"), dict):
        for pattern in node["patternProperties"]:
            check_regex(pattern, param)


def _pointer(schema: dict, ref: str, param: str):
    """The part of `schema` a local $ref ("#/$defs/a") points to."""
    node = schema
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise InvalidRequestError(f"{param}: $ref {ref[:80]!r} points nowhere",
                                      param=param) from None
    return node


def check_regex(pattern: str, param: str) -> None:
    """A regular expression whose nested repetition bounds multiply to at most
    MAX_REGEX_REPEAT. Python's parser reads the common syntax; a pattern it cannot read is
    left to llguidance (and the compile budget)."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, OverflowError, RecursionError, ValueError):
        return
    if _repeat_product(parsed) > MAX_REGEX_REPEAT:
        raise InvalidRequestError(
            f"{param}: the regular expression {pattern[:80]!r} repeats more than "
            f"{MAX_REGEX_REPEAT} times (nested bounds multiply)", param=param)


def _repeat_product(sub) -> int:
    most = 1
    for op, av in sub:
        factor = 1
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT,
                  sre_constants.POSSESSIVE_REPEAT):
            low, high = av[0], av[1]
            factor = max(1, low if high == sre_constants.MAXREPEAT else high)
        inner = max((_repeat_product(child) for child in subpatterns(av)), default=1)
        most = max(most, factor * inner)
    return most


def subpatterns(av):
    """The parsed subpatterns inside a node's argument of a sre_parse tree (its branches,
    groups and repeated items), at any depth of tuples and lists."""
    if isinstance(av, sre_parse.SubPattern):
        yield av
    elif isinstance(av, (tuple, list)):
        for item in av:
            yield from subpatterns(item)


LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_]\w*(\.-?\d+)?[ \t]*:", re.MULTILINE)
LARK_REGEX = re.compile(r"/((?:\\.|[^/\\\n])+)/")


def check_lark(lark: str, param: str) -> None:
    """A Lark grammar (GBNF is converted to Lark first) of at most MAX_GRAMMAR_RULES rules and
    terminals, each /regex/ within MAX_REGEX_REPEAT."""
    rules = len(LARK_RULE.findall(lark))
    if rules > MAX_GRAMMAR_RULES:
        raise InvalidRequestError(f"{param} has {rules} rules; at most {MAX_GRAMMAR_RULES}",
                                  param=param)
    for pattern in LARK_REGEX.findall(lark):
        check_regex(pattern, param)


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
    except RecursionError:
        raise InvalidRequestError(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels",
                                  param=param) from None
    except ValueError:
        raise InvalidRequestError(f"{param} must be {what} in JSON", param=param) from None


@dataclass(frozen=True)
class GrammarBudget:
    """What compiling one grammar (and its first mask) may take, in the sandbox: wall-clock
    seconds and bytes of memory beyond the sandbox's own."""

    seconds: float = 10.0
    memory_bytes: int = 512 << 20

    def limits(self):
        """llguidance's limits for this budget: lexer states of about 2 kB each, so a matcher
        grows no further while requests advance it than its first mask may."""
        import llguidance

        return llguidance.LLParserLimits(
            max_lexer_states=min(250_000, max(1024, self.memory_bytes // 2048)))


def build_matcher(tokenizer, grammar: str, budget: GrammarBudget,
                  vocab_size: int) -> tuple[Matcher | None, str]:
    """(the Matcher of `grammar` with its first mask computed, the library's error or "")."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=budget.limits())
    if not matcher.is_error():
        next_token_words([Matcher(matcher, vocab_size)])  # builds what the first step needs
    if matcher.is_error():
        return None, matcher.get_error()
    return Matcher(matcher, vocab_size), ""


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
