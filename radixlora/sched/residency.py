"""The scheduler's side of the adapter pool: which adapter holds which pool rows (the rows of
every layer's and module group's tensors share one free list), reference counts, pins and
eviction, and what the worker's adapter reads and host tier hold (ReaderView). Bookkeeping
only: the loads it returns are executed by the worker's AdapterPool
(radixlora.worker.adapter_pool)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from radixlora.lora.adapter import LoraAdapter


class RowAllocator:
    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))

    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise MemoryError(f"adapter pool exhausted: need {n} rows, {len(self._free)} free")
        return np.array([self._free.pop() for _ in range(n)], dtype=np.int32)

    def free(self, rows: np.ndarray) -> None:
        self._free.extend(int(r) for r in rows)


@dataclass
class ResidentAdapter:
    adapter: LoraAdapter
    rows: np.ndarray
    refs: int = 0
    pinned: bool = False
    group_rows: dict[str, list[int]] | None = None


class AdapterResidency:
    """Which adapter occupies which pool rows, with reference counts and eviction of
    unreferenced adapters. Bookkeeping only: loads are returned for the worker to execute.

    `needs` (adapter id -> position in the waiting queue of the first request that needs it)
    orders eviction: first the unreferenced adapters no queued request needs, least recently
    used first, then those needed only by requests furthest back in the queue. Referenced
    adapters (held by running or just scheduled requests) and pinned ones are never evicted.
    A prefetched adapter is resident with no reference until a request acquires it."""

    def __init__(self, num_rows: int):
        self.rows = RowAllocator(num_rows)
        self.resident: OrderedDict[str, ResidentAdapter] = OrderedDict()
        self.pinned: set[str] = set()  # adapter ids never evicted while resident
        self.num_evictions = 0

    def pin(self, adapter_id: str) -> None:
        self.pinned.add(adapter_id)
        if adapter_id in self.resident:
            self.resident[adapter_id].pinned = True

    def unpin(self, adapter_id: str) -> None:
        self.pinned.discard(adapter_id)
        if adapter_id in self.resident:
            self.resident[adapter_id].pinned = False

    def is_resident(self, adapter_id: str) -> bool:
        return adapter_id in self.resident

    def rows_of(self, adapter_id: str) -> np.ndarray:
        return self.resident[adapter_id].rows

    def group_rows(self, adapter_id: str) -> dict[str, list[int]]:
        """Pool rows each module group of a resident adapter uses (its first group-rank rows)."""
        entry = self.resident[adapter_id]
        if entry.group_rows is None:
            rows = entry.rows.tolist()
            entry.group_rows = {g: rows[:r] for g, r in entry.adapter.group_ranks.items()}
        return entry.group_rows

    def magnitude_row(self, adapter_id: str) -> int:
        """The pool row of a resident DoRA adapter's magnitude scales: its last row."""
        return int(self.resident[adapter_id].rows[-1])

    def can_acquire(self, adapters: list[LoraAdapter]) -> bool:
        missing = sum(a.pool_rows for a in adapters if a.adapter_id not in self.resident)
        if missing <= self.rows.num_free():
            return True
        protected = {a.adapter_id for a in adapters}
        reclaimable = sum(len(self.resident[k].rows) for k in self._idle(protected))
        return missing <= self.rows.num_free() + reclaimable

    def acquire(self, adapters: list[LoraAdapter],
                needs: Mapping[str, int] | None = None) -> list[tuple[LoraAdapter, np.ndarray]]:
        """Take a reference on each adapter, making it resident; returns the loads to execute.
        Call only after can_acquire() said yes."""
        loads = []
        protected = {a.adapter_id for a in adapters}
        for adapter in adapters:
            entry = self.resident.get(adapter.adapter_id)
            if entry is None:
                if self.rows.num_free() < adapter.pool_rows:
                    self._reclaim(adapter.pool_rows, self._victims(protected, needs or {}))
                entry = self._place(adapter)
                loads.append((adapter, entry.rows))
            entry.refs += 1
            self.resident.move_to_end(adapter.adapter_id)
        return loads

    def prefetch(self, adapter: LoraAdapter, needs: Mapping[str, int],
                 position: int) -> np.ndarray | None:
        """Make a non-resident adapter resident with no reference, ahead of the queued request
        at `position` that needs it: its rows are free rows or rows of adapters that no queued
        request at or before `position` needs. Returns the rows to load, None if too few."""
        if self.rows.num_free() < adapter.pool_rows:
            victims = [k for k in self._victims({adapter.adapter_id}, needs)
                       if needs.get(k, position + 1) > position]
            reclaimable = sum(len(self.resident[k].rows) for k in victims)
            if adapter.pool_rows > self.rows.num_free() + reclaimable:
                return None
            self._reclaim(adapter.pool_rows, victims)
        return self._place(adapter).rows

    def _place(self, adapter: LoraAdapter) -> ResidentAdapter:
        entry = ResidentAdapter(adapter, self.rows.alloc(adapter.pool_rows),
                                pinned=adapter.adapter_id in self.pinned)
        self.resident[adapter.adapter_id] = entry
        return entry

    def release(self, adapter_ids) -> None:
        for adapter_id in adapter_ids:
            entry = self.resident[adapter_id]
            if entry.refs <= 0:
                raise RuntimeError(f"adapter {adapter_id[:12]} released more often than acquired")
            entry.refs -= 1

    def refs(self, adapter_id: str) -> int:
        entry = self.resident.get(adapter_id)
        return entry.refs if entry else 0

    def evict(self, adapter_id: str) -> bool:
        """Drop an unreferenced adapter from the pool; False if it is in use."""
        entry = self.resident.get(adapter_id)
        if entry is None:
            return True
        if entry.refs > 0:
            return False
        self.rows.free(entry.rows)
        del self.resident[adapter_id]
        self.num_evictions += 1
        return True

    def _idle(self, protected: set[str]) -> list[str]:
        """Evictable adapters (unreferenced, unpinned, not protected), least recently used
        first."""
        return [k for k, r in self.resident.items()
                if r.refs == 0 and not r.pinned and k not in protected]

    def _victims(self, protected: set[str], needs: Mapping[str, int]) -> list[str]:
        """Evictable adapters in eviction order (see the class docstring)."""
        return sorted(self._idle(protected), key=lambda k: (k in needs, -needs.get(k, 0)))

    def _reclaim(self, need: int, victims: list[str]) -> None:
        for adapter_id in victims:
            if self.rows.num_free() >= need:
                return
            self.evict(adapter_id)


class ReaderView:
    """The scheduler's side of the worker's AdapterReader (radixlora.worker.adapter_reader), as the
    step results report it: the adapters whose prefetch read may not have ended, and those in
    its host tier. A request on an adapter that is being read, or is neither resident nor in
    the host tier, would make its step wait for a disk read."""

    def __init__(self) -> None:
        self.reading: dict[str, int] = {}  # adapter id -> step count of the plan that asked
        self.in_host: set[str] = set()

    def asked(self, adapter_id: str, made_at: int) -> None:
        """A prefetch load of the plan made at step count `made_at` reads this adapter."""
        self.reading[adapter_id] = made_at

    def note_reads(self, made_at: int, unread: list[str]) -> None:
        """The reader's unread adapters as of the result of the plan made at `made_at`: a read
        asked by that plan or an earlier one and not listed has ended (or its load was
        dropped)."""
        still = set(unread)
        for adapter_id, asked_at in list(self.reading.items()):
            if asked_at <= made_at and adapter_id not in still:
                del self.reading[adapter_id]

    def note_host(self, added: list[str], dropped: list[str]) -> None:
        self.in_host.difference_update(dropped)
        self.in_host.update(added)

    def waits_for_read(self, adapter_id: str, resident: bool) -> bool:
        return adapter_id in self.reading or not (resident or adapter_id in self.in_host)
