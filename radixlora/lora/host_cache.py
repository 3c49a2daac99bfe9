"""The host tier of adapters: each adapter packed once in the device pool's layout and dtype
(int8 pools: int8 rows and their scales; pinned on CUDA), so loading it into the pool is one
host-to-device copy. One LRU by adapter
id within one byte budget, shared by the offline Engine and the worker process."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedAdapter:
    """One adapter version's pool rows for the module groups it adapts, flattened in
    AdapterPool.write() order: `group_ranks[g]` rows for each group g it has (the rows the
    kernels read), none for the others. For an int8 pool `data` is one int8 tensor: the
    groups' float32 dequantization scales as bytes, then the int8 rows (AdapterPool.pack), so
    a load stays one host-to-device copy and nbytes counts the scales."""

    adapter_id: str
    group_ranks: dict[str, int]
    data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class HostAdapterCache:
    """Packed adapters by id, least recently used first. The newest entry is always kept,
    whatever its size, so an adapter larger than the budget can still be loaded."""

    def __init__(self, budget_bytes: int, pin: bool):
        if budget_bytes < 0:
            raise ValueError(f"host adapter budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._entries: OrderedDict[str, PackedAdapter] = OrderedDict()
        self._nbytes = 0

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def ids(self) -> list[str]:
        """Cached adapter ids, least recently used first."""
        return list(self._entries)

    def get(self, adapter_id: str) -> PackedAdapter | None:
        entry = self._entries.get(adapter_id)
        if entry is not None:
            self._entries.move_to_end(adapter_id)
        return entry

    def put(self, packed: PackedAdapter) -> PackedAdapter:
        """Cache `packed` (pinning it on CUDA) as the most recent entry; returns the cached one."""
        if self.pin and not packed.data.is_pinned():
            packed = dataclasses.replace(packed, data=packed.data.pin_memory())
        old = self._entries.pop(packed.adapter_id, None)
        if old is not None:
            self._nbytes -= old.nbytes
        self._entries[packed.adapter_id] = packed
        self._nbytes += packed.nbytes
        self._trim()
        return packed

    def _trim(self) -> None:
        while self._nbytes > self.budget_bytes and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self._nbytes -= dropped.nbytes
