"""The served adapters by name, and resolution of a request's adapter spec into a canonical
AdapterSet. Shared by the offline Engine and the scheduler process."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from radixlora.config import ModelConfig
from radixlora.errors import AdapterNotFoundError, InvalidRequestError
from radixlora.lora.adapter import LoraAdapter, load_adapter
from radixlora.request import AdapterSet

MAX_ADAPTER_NAME = 128


class AdapterRegistry:
    """With keep_weights=False (the scheduler process, which needs only ids and ranks; the
    worker reads the weights itself) registered adapters are kept without their tensors, so
    thousands of them cost kilobytes each."""

    def __init__(self, model_cfg: ModelConfig, max_rank: int, max_stacked: int, pool_rows: int,
                 keep_weights: bool = True):
        self.model_cfg = model_cfg
        self.max_rank = max_rank
        self.max_stacked = max_stacked
        self.pool_rows = pool_rows
        self.keep_weights = keep_weights
        self.by_name: dict[str, LoraAdapter] = {}

    def load(self, name: str, path: str | Path) -> tuple[LoraAdapter, LoraAdapter | None]:
        """Validate and register (re-using a name publishes a new version); returns the adapter
        and the version it replaced, if any."""
        check_adapter_name(name)
        return self.add(load_adapter(name, path, self.model_cfg, self.max_rank))

    def add(self, adapter: LoraAdapter) -> tuple[LoraAdapter, LoraAdapter | None]:
        if adapter.rank > self.pool_rows:
            raise InvalidRequestError(
                f"adapter {adapter.name!r} of rank {adapter.rank} exceeds the adapter pool "
                f"({self.pool_rows} rows)",
                param="name",
            )
        if not self.keep_weights:
            adapter = dataclasses.replace(adapter, weights={})
        previous = self.by_name.get(adapter.name)
        self.by_name[adapter.name] = adapter
        replaced = previous if previous and previous.adapter_id != adapter.adapter_id else None
        return adapter, replaced

    def remove(self, name: str) -> LoraAdapter:
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise AdapterNotFoundError(name)
        return adapter

    def drop(self, adapter_id: str) -> list[str]:
        """Remove every name of an adapter version; returns those names."""
        names = [n for n, a in self.by_name.items() if a.adapter_id == adapter_id]
        for name in names:
            del self.by_name[name]
        return names

    def is_named(self, adapter_id: str) -> bool:
        return any(a.adapter_id == adapter_id for a in self.by_name.values())

    def resolve(self, spec) -> AdapterSet:
        """None, a name, or a list of names / (name, weight) pairs -> canonical AdapterSet."""
        if spec is None:
            return AdapterSet()
        pairs = [spec] if isinstance(spec, str) else list(spec)
        if len(pairs) > self.max_stacked:
            raise InvalidRequestError(
                f"{len(pairs)} adapters requested; at most {self.max_stacked} can be stacked in "
                "one request",
                param="adapters",
                code="too_many_adapters",
            )
        resolved, seen = [], set()
        for pair in pairs:
            name, weight = (pair, 1.0) if isinstance(pair, str) else _pair(pair)
            if name not in self.by_name:
                raise AdapterNotFoundError(name)
            if name in seen:
                raise InvalidRequestError(f"adapter {name!r} is named twice", param="adapters")
            seen.add(name)
            resolved.append((self.by_name[name], weight))
        return AdapterSet.of(resolved)


def check_adapter_name(name) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_ADAPTER_NAME:
        raise InvalidRequestError(
            f"adapter names must be 1-{MAX_ADAPTER_NAME} characters", param="name"
        )
    if any(c in name for c in "/\\:\0") or name in (".", ".."):
        raise InvalidRequestError(
            f"adapter name {name!r} may not contain / \\ : or NUL", param="name"
        )


def _pair(pair) -> tuple[str, float]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
        raise InvalidRequestError(
            f"an adapter entry must be a name or (name, weight), got {pair!r}", param="adapters"
        )
    weight = pair[1]
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise InvalidRequestError(
            f"adapter weight must be a finite number, got {weight!r}", param="adapters"
        )
    return pair[0], float(weight)
