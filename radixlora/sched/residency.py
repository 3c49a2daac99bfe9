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

from radixlora.config import MODULE_GROUPS
from radixlora.lora.adapter import LoraAdapter


class RowAllocator:
    """Free pool rows in two zones: rows below `low` exist in every module group's pool, the
    others only in the target groups' (EngineConfig.group_rows). alloc(n, low_only=False)
    takes the high rows first, so the low ones stay for the adapters that can use no other."""

    def __init__(self, num_rows: int, low: int | None = None):
        self.num_rows = num_rows
        self.low = num_rows if low is None else low
        self._free_low = list(range(self.low - 1, -1, -1))
        self._free_high = list(range(num_rows - 1, self.low - 1, -1))

    def num_free(self, low_only: bool = False) -> int:
        return len(self._free_low) + (0 if low_only else len(self._free_high))

    def free_rows(self) -> list[int]:
        return self._free_low + self._free_high

    def num_low(self, rows: np.ndarray) -> int:
        return int((rows < self.low).sum())

    def alloc(self, n: int, low_only: bool = False) -> np.ndarray:
        if n > self.num_free(low_only):
            zone = f" below row {self.low}" if low_only else ""
            raise MemoryError(f"adapter pool exhausted: need {n} rows{zone}, "
                              f"{self.num_free(low_only)} free")
        high = [] if low_only else self._free_high
        rows = [high.pop() for _ in range(min(n, len(high)))]
        rows += [self._free_low.pop() for _ in range(n - len(rows))]
        return np.array(rows, dtype=np.int32)

    def free(self, rows: np.ndarray) -> None:
        for r in rows:
            (self._free_low if r < self.low else self._free_high).append(int(r))


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

    def __init__(self, group_rows: int | Mapping[str, int]):
        """group_rows: the rows of each module group's pool (EngineConfig.group_rows), or one
        count for all."""
        if isinstance(group_rows, int):
            group_rows = {"": group_rows}
        self.rows_per_group = dict(group_rows)
        counts = [n for n in self.rows_per_group.values() if n] or [0]
        self.rows = RowAllocator(max(counts), min(counts))
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

    def low_only(self, adapter: LoraAdapter) -> bool:
        """Whether the adapter adapts a group that has only the low rows."""
        return any(self.rows_per_group.get(g, self.rows.num_rows) <= self.rows.low
                   for g in adapter.group_ranks) and self.rows.low < self.rows.num_rows

    def oversized(self, adapters: list[LoraAdapter]) -> str | None:
        """Why these adapters can never be resident together, or None."""
        adapted = {g for a in adapters for g in a.group_ranks}
        missing = [g for g in MODULE_GROUPS
                   if g in adapted and not self.rows_per_group.get(g, self.rows.num_rows)]
        if missing:
            modules = ", ".join(m for g in missing for m in MODULE_GROUPS[g])
            return (f"the adapter adapts {modules}, which the adapter pool holds no rows of "
                    f"(start with --lora-target-modules naming them)")
        total = sum(a.pool_rows for a in adapters)
        low = sum(a.pool_rows for a in adapters if self.low_only(a))
        if total > self.rows.num_rows:
            return (f"the adapter set needs {total} pool rows, the adapter pool holds "
                    f"{self.rows.num_rows}")
        if low > self.rows.low:
            return (f"the adapter set needs {low} pool rows on modules the pool holds "
                    f"{self.rows.low} rows of (start with --lora-target-modules naming them)")
        return None

    def can_acquire(self, adapters: list[LoraAdapter]) -> bool:
        missing = [a for a in adapters if a.adapter_id not in self.resident]
        need = sum(a.pool_rows for a in missing)
        need_low = sum(a.pool_rows for a in missing if self.low_only(a))
        if need <= self.rows.num_free() and need_low <= self.rows.num_free(low_only=True):
            return True
        idle = [self.resident[k].rows for k in self._idle({a.adapter_id for a in adapters})]
        return (need <= self.rows.num_free() + sum(len(rows) for rows in idle)
                and need_low <= self.rows.num_free(low_only=True)
                + sum(self.rows.num_low(rows) for rows in idle))

    def acquire(self, adapters: list[LoraAdapter],
                needs: Mapping[str, int] | None = None) -> list[tuple[LoraAdapter, np.ndarray]]:
        """Take a reference on each adapter, making it resident; returns the loads to execute.
        Call only after can_acquire() said yes."""
        loads = []
        protected = {a.adapter_id for a in adapters}
        # those that need low rows first: the others would take low rows only when no high
        # row is left
        for adapter in sorted(adapters, key=lambda a: not self.low_only(a)):
            entry = self.resident.get(adapter.adapter_id)
            if entry is None:
                self._reclaim(adapter, self._victims(protected, needs or {}))
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
        low_only = self.low_only(adapter)
        if self.rows.num_free(low_only) < adapter.pool_rows:
            victims = [k for k in self._victims({adapter.adapter_id}, needs)
                       if needs.get(k, position + 1) > position]
            if adapter.pool_rows > self.rows.num_free(low_only) + sum(
                    self._usable(self.resident[k].rows, low_only) for k in victims):
                return None
            self._reclaim(adapter, victims)
        return self._place(adapter).rows

    def _usable(self, rows: np.ndarray, low_only: bool) -> int:
        return self.rows.num_low(rows) if low_only else len(rows)

    def _place(self, adapter: LoraAdapter) -> ResidentAdapter:
        entry = ResidentAdapter(adapter, self.rows.alloc(adapter.pool_rows,
                                                         self.low_only(adapter)),
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

    def _reclaim(self, adapter: LoraAdapter, victims: list[str]) -> None:
        """Evict victims, in order, until the adapter's rows are free; with low_only, only
        victims holding low rows."""
        low_only = self.low_only(adapter)
        for adapter_id in victims:
            if self.rows.num_free(low_only) >= adapter.pool_rows:
                return
            if self._usable(self.resident[adapter_id].rows, low_only):
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
