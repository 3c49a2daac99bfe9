"""A request's adapter choice as it arrives, before resolution (radixlora.sched.adapter_registry
resolves it): AdapterChoice, the Python spec parser, the one bound on stack weights, and the
rules for adapter names. Free of
torch, so that the processes that only parse requests (the api) start without it."""

from __future__ import annotations

import math

import msgspec

from radixlora.errors import InvalidRequestError

MAX_ADAPTER_NAME = 128
MAX_ADAPTER_WEIGHT = 100.0  # |weight| of one adapter in a stack: larger only overflows activations
# `model` in a request naming the base model whatever its served name (SGLang's default)
BASE_ALIAS = "default"


class AdapterChoice(msgspec.Struct, array_like=True):
    """One adapter of a request's choice, by served name, not yet resolved."""

    name: str
    weight: float = 1.0


def parse_spec(spec) -> list[AdapterChoice] | None:
    """A Python adapter spec (None, a name, or a list of names / (name, weight) pairs) as
    AdapterChoices; None is the base model."""
    if spec is None:
        return None
    pairs = [spec] if isinstance(spec, (str, AdapterChoice)) else list(spec)
    return [p if isinstance(p, AdapterChoice) else _choice(p) for p in pairs]


def _choice(pair) -> AdapterChoice:
    if isinstance(pair, str):
        return AdapterChoice(pair)
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
        raise InvalidRequestError(
            f"an adapter entry must be a name or (name, weight), got {pair!r}", param="adapters"
        )
    return AdapterChoice(pair[0], adapter_weight(pair[1]))


def adapter_weight(weight) -> float:
    """The one bound on stack weights, for every edge (HTTP, ZeroMQ, Python)."""
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
        or abs(weight) > MAX_ADAPTER_WEIGHT
    ):
        raise InvalidRequestError(
            f"adapter weight must be a finite number in [-{MAX_ADAPTER_WEIGHT:g}, "
            f"{MAX_ADAPTER_WEIGHT:g}], got {weight!r}", param="adapters"
        )
    return float(weight)


def check_adapter_name(name, reserved: frozenset[str] = frozenset()) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_ADAPTER_NAME:
        raise InvalidRequestError(
            f"adapter names must be 1-{MAX_ADAPTER_NAME} characters", param="name"
        )
    if any(c in name for c in "/\\:\0") or name in (".", ".."):
        raise InvalidRequestError(
            f"adapter name {name!r} may not contain / \\ : or NUL", param="name"
        )
    if name in reserved:
        raise InvalidRequestError(
            f"adapter name {name!r} is the served model's name; choose another", param="name"
        )
    if name == BASE_ALIAS:
        raise InvalidRequestError(
            f"adapter name {name!r} stands for the base model in requests (as in SGLang); "
            "choose another", param="name"
        )
