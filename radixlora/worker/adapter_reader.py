"""Where a step's adapter loads come from, and the reads that keep them from making a step wait.

An adapter load takes the adapter's packed rows from the pool's host tier, else from the
adapter's packed file for this pool's layout if its path is a snapshot of the server's store
(one file read into pinned memory: radixlora.lora.host_cache), else from a packing process
(the worker on CUDA: radixlora.lora.packer, which keeps the GIL free for the thread that
launches steps), else from the executor's adapter source (the Engine's registered versions;
the worker reads the files and checks they still hash to the version the scheduler
validated), packing them into the tier.
A plan whose loads fail does not run: its result names the failed adapters, and the scheduler
fails only the requests that use them (its other loads are written all the same: the scheduler
keeps their adapters resident).

Prefetch loads (StepPlan.prefetch_loads: adapters of waiting requests) never make a step wait,
neither for their copies (AdapterPool.write_all) nor for a disk read: one whose adapter is in
the host tier is copied behind the step's own loads; any other is owed, its adapter read,
validated and packed into the host tier by one background thread (at most PREFETCH_READS
queued or running), and copied by the first step launched after its read ends. Invariant:
before a step's forward, the last load the scheduler assigned to each row the step reads has
been queued. An owed load whose rows the step reads is completed first (taken from its read,
which is cancelled and done here if it has not started), and an owed load is dropped when a
later plan assigns its rows or its adapter again (the scheduler evicted it meanwhile; a row
is assigned again only after its adapter is evicted). An owed load whose read fails is read
again by the first step that reads its rows, and fails it as that step's own load would; one
that no step needs is only logged. Every result lists the adapters whose reads have not ended
(unread_adapters): the scheduler holds requests on them while other work runs."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from radixlora.errors import AdapterError
from radixlora.lora.adapter import LoraAdapter
from radixlora.lora.host_cache import PackedAdapter, read_packed
from radixlora.lora.packer import FILES_CHANGED, ProcessPacker
from radixlora.step_plan import AdapterLoad, StepPlan, bytes_to_ids

log = logging.getLogger(__name__)

AdapterSource = Callable[[AdapterLoad], LoraAdapter]
# Background adapter reads queued or running; each holds one packed adapter in host memory
# until its copy is written, and a step that needs a queued one cancels it and reads it itself.
PREFETCH_READS = 4
# Threads reading registered adapters into the host tier ahead of any need (host_reads): the
# reading is torch and hashing work that mostly releases the GIL, so several run at once.
WARM_READERS = 6


@dataclass
class OwedLoad:
    """A prefetch load whose device copy is owed: its adapter was not in the host tier."""

    load: AdapterLoad
    rows: np.ndarray
    failed: bool = False  # its background read failed: a step that needs it reads it again


class AdapterReader:
    """The StepExecutor's adapter reads: the loads of a plan resolved to packed adapters, the
    owed prefetch loads and their background reads, and the host tier filled ahead of need."""

    def __init__(self, runner, source: AdapterSource, snapshot_roots: tuple[Path, ...] = (),
                 packer: ProcessPacker | None = None):
        self.runner = runner
        self.source = source
        self.packer = packer
        self.snapshot_roots = {os.path.realpath(root) for root in snapshot_roots}
        self.owed: dict[str, OwedLoad] = {}  # by adapter id, in plan order
        self.reads: dict[str, Future] = {}  # background reads by adapter id
        self._reader: ThreadPoolExecutor | None = None
        self.warming: dict[str, Future] = {}  # host_reads by adapter id, not in the tier yet
        self._warmer: ThreadPoolExecutor | None = None
        self.read_counts: collections.Counter = collections.Counter()  # reads by source
        self._counts_lock = threading.Lock()
        self._warm_round: tuple[float, collections.Counter] | None = None  # (start, counts)

    def unread(self) -> list[str]:
        """Adapters of owed loads whose background read has not ended (queued or running);
        a failed read is not waited for: the step that needs it reads again and fails."""
        return [adapter_id for adapter_id, owed in self.owed.items()
                if not owed.failed and not (adapter_id in self.reads
                                            and self.reads[adapter_id].done())]

    def resolve(self, loads: list[AdapterLoad]):
        """The loads' packed adapters with their rows, and the adapters that failed to read
        (by id, with why)."""
        resolved, failed = [], {}
        for load in loads:
            try:
                resolved.append((self._packed(load), bytes_to_ids(load.rows)))
            except AdapterError as e:
                log.error("adapter %s: %s", load.name, e)
                failed[load.adapter_id] = str(e)
        return resolved, failed

    def _packed(self, load: AdapterLoad) -> PackedAdapter:
        """The adapter from the host tier, else from its background read (cancelled and read
        here if it has not started or read again if it failed), else read here."""
        pool = self.runner.adapter_pool
        packed = pool.host.get(load.adapter_id)
        if packed is not None:
            return packed
        read = self.reads.pop(load.adapter_id, None) or self.warming.pop(load.adapter_id, None)
        if read is not None and not read.cancel() and read.exception() is None:
            return pool.host.put(read.result())
        return pool.host.put(self._read(load))

    def _read(self, load: AdapterLoad) -> PackedAdapter:
        """Read an adapter's packed file, else read, check and pack the adapter (in the step
        loop or a background thread)."""
        pool = self.runner.adapter_pool
        if os.path.realpath(Path(load.path).parent) in self.snapshot_roots:
            packed = read_packed(load.path, pool.layout.key, load.adapter_id, pool.host.pin)
            if packed is not None and pool.layout.holds(packed):
                self._count("packed file")
                return packed
            if packed is not None:
                log.warning("adapter %s: its packed file does not fit this pool; reading its "
                            "files", load.name)
        if self.packer is not None:
            self._count("a packing process")
            return self.packer.read(load, pool.layout, pool.host.pin)
        self._count("adapter files")
        adapter = self.source(load)
        if adapter.adapter_id != load.adapter_id:
            raise AdapterError(load.name, FILES_CHANGED)
        packed = pool.pack(adapter)
        if pool.host.pin:
            packed = dataclasses.replace(packed, data=packed.data.pin_memory())
        return packed

    # ---- prefetch loads ----------------------------------------------------------------------

    def claim(self, plan: StepPlan) -> list[tuple[AdapterLoad, np.ndarray]]:
        """The plan's prefetch loads with their rows; owed loads whose rows or adapter the plan
        assigns again are dropped."""
        prefetch = [(load, bytes_to_ids(load.rows)) for load in plan.prefetch_loads]
        if not self.owed:
            return prefetch
        assigned = [(load, bytes_to_ids(load.rows)) for load in plan.adapter_loads] + prefetch
        ids = {load.adapter_id for load, _ in assigned}
        rows = {int(r) for _, load_rows in assigned for r in load_rows}
        for adapter_id, owed in list(self.owed.items()):
            if adapter_id in ids or not rows.isdisjoint(owed.rows.tolist()):
                del self.owed[adapter_id]
        return prefetch

    def settle_owed(self, plan: StepPlan) -> tuple[list, dict[str, str]]:
        """Complete the owed loads whose rows this step reads: (loads, failed adapters)."""
        if not self.owed:
            return [], {}
        reads = {r for groups in plan.adapter_sets for g in groups.values() for r in g.rows}
        loads, failed = [], {}
        for adapter_id, owed in list(self.owed.items()):
            if reads.isdisjoint(owed.rows.tolist()):
                continue
            del self.owed[adapter_id]
            try:
                loads.append((self._packed(owed.load), owed.rows))
            except AdapterError as e:
                log.error("adapter %s: %s", owed.load.name, e)
                failed[adapter_id] = str(e)
        return loads, failed

    def ready_prefetch(self, prefetch: list[tuple[AdapterLoad, np.ndarray]]) -> list:
        """The prefetch copies to queue now: owed loads whose read ended and the plan's loads
        whose adapter is in the host tier; the plan's others become owed, and reads start."""
        host = self.runner.adapter_pool.host
        self._collect_warm()
        done = self._collect_reads()
        ready = []
        for adapter_id, owed in list(self.owed.items()):
            packed = done.get(adapter_id) or host.get(adapter_id)
            if packed is not None:
                ready.append((packed, owed.rows))
                del self.owed[adapter_id]
        for load, rows in prefetch:
            packed = host.get(load.adapter_id)
            if packed is not None:
                ready.append((packed, rows))
                continue
            self.owed[load.adapter_id] = OwedLoad(load, rows)
            if load.adapter_id in self.warming:  # its read becomes the owed load's
                self.reads[load.adapter_id] = self.warming.pop(load.adapter_id)
        self._start_reads()
        return ready

    # ---- the host tier ahead of need ---------------------------------------------------------

    def warm(self, loads: list[AdapterLoad]) -> None:
        """Start background reads of adapters not in the host tier (see StepPlan.host_reads)."""
        host = self.runner.adapter_pool.host
        for load in loads:
            adapter_id = load.adapter_id
            if adapter_id in host or adapter_id in self.warming or adapter_id in self.reads:
                continue
            if self._warmer is None:
                self._warmer = ThreadPoolExecutor(WARM_READERS, thread_name_prefix="adapter-warm")
            if self._warm_round is None:
                self._warm_round = (time.perf_counter(), self._counts())
            self.warming[adapter_id] = self._warmer.submit(self._read, load)

    def _count(self, source: str) -> None:
        with self._counts_lock:
            self.read_counts[source] += 1

    def _counts(self) -> collections.Counter:
        with self._counts_lock:
            return self.read_counts.copy()

    def _collect_warm(self) -> None:
        """Put ended host_reads into the host tier while it has room: they never evict."""
        host = self.runner.adapter_pool.host
        for adapter_id, read in list(self.warming.items()):
            if not read.done():
                continue
            del self.warming[adapter_id]
            if read.exception() is not None:
                log.warning("reading adapter %s ahead failed: %s", adapter_id[:12],
                            read.exception())
                continue
            packed = read.result()
            if adapter_id not in host and host.nbytes + packed.nbytes <= host.budget_bytes:
                host.put(packed)
        if self._warm_round is not None and not self.warming:
            started, before = self._warm_round
            self._warm_round = None
            read = self._counts() - before
            log.info("reading ahead ended after %.1f s: %d adapter reads meanwhile (%s); the "
                     "host tier holds %d (%.2f GiB)", time.perf_counter() - started,
                     sum(read.values()),
                     ", ".join(f"{n} from {source}" for source, n in sorted(read.items())),
                     len(host), host.nbytes / 2**30)

    def _collect_reads(self) -> dict[str, PackedAdapter]:
        """Ended background reads, their adapters put into the host tier."""
        done = {}
        for adapter_id, read in list(self.reads.items()):
            if not read.done():
                continue
            del self.reads[adapter_id]
            error = read.exception()
            if error is None:
                done[adapter_id] = self.runner.adapter_pool.host.put(read.result())
                continue
            log.warning("prefetch of adapter %s failed: %s", adapter_id[:12], error)
            owed = self.owed.get(adapter_id)
            if owed is not None:
                owed.failed = True
        return done

    def _start_reads(self) -> None:
        for adapter_id, owed in self.owed.items():
            if len(self.reads) >= PREFETCH_READS:
                return
            if adapter_id not in self.reads and not owed.failed:
                if self._reader is None:
                    self._reader = ThreadPoolExecutor(1, thread_name_prefix="adapter-prefetch")
                self.reads[adapter_id] = self._reader.submit(self._read, owed.load)
