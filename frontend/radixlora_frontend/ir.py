"""The DSL's expressions: text, `gen`, `select`, chat roles, and their concatenation with `+`.

Expressions are inert data; a ProgramState turns them into executor ops when they are added to
it (`s += expr`), resolving each call's adapter at that moment (explicit `adapter=`, else the
innermost `with s.adapter(...)`, else the base model)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from radixlora.errors import InvalidRequestError
from radixlora.sampling_params import SamplingParams
from radixlora.structured import Structure

# None = the base model, a name = one adapter at weight 1, a list = a weighted stack.
AdapterSpec = None | str | tuple[tuple[str, float], ...]
SELECT_METHODS = ("normalized", "sum")


class _Unset:
    """Marker for an `adapter=` that was not given (None means the base model)."""

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


def normalize_adapters(spec) -> AdapterSpec:
    """None | name | [(name, weight) or name, ...] -> None | name | ((name, weight), ...)."""
    if spec is None or isinstance(spec, str):
        return spec
    if not isinstance(spec, Sequence):
        raise InvalidRequestError(
            f"adapter must be None, a name or a list, got {spec!r}", param="adapter"
        )
    pairs = tuple(_adapter_pair(entry) for entry in spec)
    return pairs or None


def _adapter_pair(entry) -> tuple[str, float]:
    if isinstance(entry, str):
        return entry, 1.0
    if isinstance(entry, Sequence) and len(entry) == 2 and isinstance(entry[0], str):
        return entry[0], float(entry[1])
    raise InvalidRequestError(
        f"an adapter entry must be a name or (name, weight), got {entry!r}", param="adapter"
    )


@dataclass(frozen=True)
class GenParams:
    """Sampling parameters of one `gen` call (SGLang's defaults)."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    regex: str | None = None  # the output matches it (structured output)
    json_schema: str | None = None  # the output is JSON valid against it

    def structure(self) -> Structure | None:
        if self.regex is not None:
            return Structure("regex", self.regex, param="regex")
        if self.json_schema is not None:
            return Structure("json_schema", self.json_schema, param="json_schema")
        return None

    def sampling_params(self) -> SamplingParams:
        """The Engine's SamplingParams (stop strings are applied by the backend)."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            structure=self.structure(),
        )

    def sglang(self) -> dict:
        """SGLang-native `sampling_params` of /generate."""
        out = {
            "max_new_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        if self.regex is not None:
            out["regex"] = self.regex
        if self.json_schema is not None:
            out["json_schema"] = self.json_schema
        return out


class Expr:
    """Anything that can be added to a state; `a + b` concatenates."""

    def __add__(self, other) -> Concat:
        return Concat((*_parts(self), *_parts(other)))

    def __radd__(self, other) -> Concat:
        return Concat((*_parts(other), *_parts(self)))


def _parts(value) -> tuple:
    if isinstance(value, Concat):
        return value.parts
    if isinstance(value, (str, Expr)):
        return (value,)
    raise TypeError(f"cannot add {type(value).__name__} to a program expression")


@dataclass(frozen=True)
class Concat(Expr):
    parts: tuple = ()


@dataclass(frozen=True)
class Gen(Expr):
    name: str | None
    params: GenParams
    adapter: AdapterSpec | _Unset = UNSET


@dataclass(frozen=True)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    adapter: AdapterSpec | _Unset = UNSET
    method: str = "normalized"


@dataclass(frozen=True)
class Role(Expr):
    role: str
    content: tuple = field(default_factory=tuple)


def gen(
    name: str | None = None,
    *,
    max_tokens: int = 128,
    stop: str | Sequence[str] | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    min_p: float = 0.0,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    adapter=UNSET,
    regex: str | None = None,
    json_schema: str | dict | None = None,
) -> Gen:
    """Generate text from the state so far and append it; stored as `s[name]`. The output is
    cut just before the first stop string (the stop string itself is not appended). With
    `regex` the output matches it; with `json_schema` (a dict or its JSON text) it is JSON
    valid against it."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if regex is not None and json_schema is not None:
        raise InvalidRequestError("give regex or json_schema, not both", param="json_schema")
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    params = GenParams(
        max_tokens, temperature, top_p, top_k, min_p, seed, stops, tuple(stop_token_ids),
        ignore_eos, regex, json_schema,
    )
    return Gen(name, params, _adapter_arg(adapter))


def select(
    name: str | None = None,
    choices: Sequence[str] = (),
    *,
    adapter=UNSET,
    method: str = "normalized",
) -> Select:
    """Append the choice the model ranks highest: by the mean logprob of its tokens
    (`method="normalized"`, SGLang's default) or by their summed logprob (`method="sum"`)."""
    choices = tuple(choices)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(
            "select needs a non-empty list of non-empty strings", param="choices"
        )
    if method not in SELECT_METHODS:
        raise InvalidRequestError(f"method must be one of {SELECT_METHODS}", param="method")
    return Select(name, choices, _adapter_arg(adapter), method)


def _adapter_arg(adapter) -> AdapterSpec | _Unset:
    return adapter if adapter is UNSET else normalize_adapters(adapter)


def _role(role: str, content) -> Role:
    return Role(role, _parts(content))


def system(content: str | Expr) -> Role:
    return _role("system", content)


def user(content: str | Expr) -> Role:
    return _role("user", content)


def assistant(content: str | Expr) -> Role:
    return _role("assistant", content)
