"""The served adapters by name, and resolution of a request's adapter choice into a canonical
AdapterSet. Shared by the offline Engine and the scheduler process.

A choice arrives as AdapterChoice values (HTTP bodies, the ZeroMQ client and Python specs are
all parsed into them at the edge) and is resolved once, at intake, into an AdapterSet: the
request's adapter identity, from which the cache namespace and the pool rows derive."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from radixlora.config import ModelConfig
from radixlora.errors import AdapterError, AdapterNotFoundError, InvalidRequestError
from radixlora.lora.adapter import LoraAdapter, load_adapter
from radixlora.lora.registration import HashCache, load_adapters
from radixlora.sched.adapter_choice import (
    AdapterChoice,
    adapter_weight,
    check_adapter_name,
)
from radixlora.sched.request import AdapterSet


class AdapterRegistry:
    """With keep_weights=False (the scheduler process, which needs only ids and ranks; the
    worker reads the weights itself) registered adapters are kept without their tensors, so
    thousands of them cost kilobytes each. `reserved` names (the base model's served name) are
    never an adapter's. Several names may share one content hash: aliases of one identity."""

    def __init__(self, model_cfg: ModelConfig, max_rank: int, max_stacked: int, pool_rows: int,
                 keep_weights: bool = True, reserved: frozenset[str] = frozenset()):
        self.model_cfg = model_cfg
        self.reserved = reserved
        self.max_rank = max_rank
        self.max_stacked = max_stacked
        self.pool_rows = pool_rows
        self.keep_weights = keep_weights
        self.by_name: dict[str, LoraAdapter] = {}

    def load(self, name: str, path: str | Path) -> tuple[LoraAdapter, LoraAdapter | None]:
        """Validate and register (re-using a name publishes a new version); returns the adapter
        and the version it replaced, if any."""
        self.check_name(name)
        return self.add(load_adapter(name, path, self.model_cfg, self.max_rank))

    def load_all(self, items: Mapping[str, str | Path],
                 cache: HashCache | None = None) -> list[LoraAdapter]:
        """Validate many adapters in parallel (with `cache` only when weights are not kept)
        and register them in order; the first name or adapter that fails raises, as `load`
        one by one would."""
        outcomes = load_adapters(items, self.model_cfg, self.max_rank,
                                 keep_weights=self.keep_weights,
                                 cache=None if self.keep_weights else cache)
        registered = []
        for name, outcome in outcomes.items():
            self.check_name(name)
            if isinstance(outcome, AdapterError):
                raise outcome
            registered.append(self.add(outcome)[0])
        return registered

    def check_name(self, name) -> None:
        check_adapter_name(name, self.reserved)

    def add(self, adapter: LoraAdapter) -> tuple[LoraAdapter, LoraAdapter | None]:
        self.check_name(adapter.name)
        if adapter.pool_rows > self.pool_rows:
            raise InvalidRequestError(
                f"adapter {adapter.name!r} of rank {adapter.rank} exceeds the adapter pool "
                f"({self.pool_rows} rows)",
                param="name",
            )
        if not self.keep_weights:
            adapter = dataclasses.replace(adapter, weights={}, magnitudes={})
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

    def resolve(self, choices: list[AdapterChoice] | None) -> AdapterSet:
        """The canonical AdapterSet of a choice (None or [] is the base model)."""
        if not choices:
            return AdapterSet()
        if len(choices) > self.max_stacked:
            raise InvalidRequestError(
                f"{len(choices)} adapters requested; at most {self.max_stacked} can be stacked "
                "in one request",
                param="adapters",
                code="too_many_adapters",
            )
        resolved, seen = [], set()
        for choice in choices:
            if choice.name not in self.by_name:
                raise AdapterNotFoundError(choice.name)
            if choice.name in seen:
                raise InvalidRequestError(f"adapter {choice.name!r} is named twice",
                                          param="adapters")
            seen.add(choice.name)
            resolved.append((self.by_name[choice.name], adapter_weight(choice.weight)))
        _check_dora_alone(resolved)
        return AdapterSet.of(resolved)


def _check_dora_alone(resolved: list[tuple[LoraAdapter, float]]) -> None:
    """A DoRA adapter is served alone at weight 1: its magnitudes rescale the whole projection
    (base and delta) to the norms it was trained to, and PEFT defines no stack or weighting of
    that, so radixlora does not invent one."""
    dora = [a.name for a, _ in resolved if a.dora_groups]
    if dora and (len(resolved) > 1 or resolved[0][1] != 1.0):
        raise InvalidRequestError(
            f"adapter {dora[0]!r} is a DoRA adapter: it is served alone at weight 1, not in a "
            "stack or with another weight",
            param="adapters",
            code="dora_not_stackable",
        )


