"""Paged adapter memory (S-LoRA style). For each (layer, module group) the worker holds
  a_pool [n_slices, num_rows, in_dim] and b_pool [num_rows, out_total];
an adapter of rank r takes r rank rows from a free list shared by all layers, so any mix of ranks
fits without padding to a max rank and loads/unloads never fragment memory. The groups the pool
is sized for (EngineConfig.lora_target_modules) have every row; the others have the first
max_rank + 1, which only adapters on them are given (radixlora.sched.residency). The scheduler owns
the row bookkeeping (radixlora.sched.residency); the worker owns the tensors (AdapterPool, here)
and a step's forward context (radixlora.worker.lora_context).

An int8 pool (--lora-dtype int8) stores both as int8 with a symmetric absmax scale per rank
row of each module (slice): A's over in_dim, B's over the module's output columns. Both lie on
the rank axis, the shrink's output axis and the expand's reduction axis, so they factor out of
both products: the shrink multiplies its fp32 accumulator by qscales[slice, row] (A's scale
times B's) along with the stacking weight, and the expand reads int8 B as it is, with no scale
of its own. (A scale per output column of B could not work: the columns are shared by every
adapter in the pool.) Paging never splits a rank row and tensor parallel never slices the rank
axis, so the scales survive both: modules are quantized whole, then sliced."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from radixlora.config import MODULE_GROUPS, ModelConfig
from radixlora.distributed import Shard
from radixlora.lora.adapter import LoraAdapter
from radixlora.lora.host_cache import HostAdapterCache, PackedAdapter
from radixlora.lora.layout import (
    SCALE_BYTES,
    PoolLayout,
    group_dims,
    quantize_rows,
)
from radixlora.worker.dora import (
    DORA_VANISHES,
    DoraBase,
    scales_from,
    squared_norms,
    vanishing_norms,
)
from radixlora_kernels.device import to_device


class AdapterPool:
    """Device tensors of the paged adapter pool: per module group one A tensor
    [num_layers, n_slices, num_rows, in_dim] and one B tensor [num_layers, num_rows, out_total];
    a[layer][group] / b[layer][group] are (contiguous) views of one layer. With dtype int8,
    qscales[layer][group] [n_slices, num_rows] float32 are the rows' dequantization scales
    (module docstring); otherwise qscales[layer] is empty. `host` is the host tier: adapters
    packed for write(), by adapter id.

    On CUDA, write() runs on a side stream (`load_stream`), so a load overlaps the compute work
    already queued; the compute stream must call wait_loads() before a forward that reads the
    new rows. Invariant that makes this safe: the rows being overwritten are free rows or rows
    of evicted adapters (no reference), so no live request reads them; a forward still queued
    that does read them belongs to a request already finished or aborted, whose output is
    discarded. On CPU, write() is synchronous and wait_loads() does nothing.

    Prefetch copies (prefetch(): adapters loaded ahead of the requests that need them) are
    queued on the load stream after the event the last launched step waits on, so that step
    does not wait for them. The load stream runs its copies in order, so any event recorded
    later covers them: a later step records one when it has loads of its own or reads rows of
    a prefetch copy that no recorded event covers yet (`_uncovered`). Their rows obey the
    invariant above: free rows or rows of evicted adapters."""

    def __init__(self, cfg: ModelConfig, num_rows: int | Mapping[str, int], dtype: torch.dtype,
                 device, host_bytes: int = 2 << 30, shard: Shard | None = None):
        """cfg: the shape of this rank's modules; num_rows: of every module group, or of each
        (EngineConfig.group_rows); dtype: the storage dtype, the model's or torch.int8; shard:
        under tensor parallel, the rank whose slice of each adapter this pool holds (packing
        slices)."""
        self.layout = PoolLayout(cfg, dtype, shard)
        if isinstance(num_rows, int):
            num_rows = dict.fromkeys(cfg.lora_groups, num_rows)
        self.group_rows = {g: n for g, n in num_rows.items() if n}
        self.groups = tuple(g for g in MODULE_GROUPS if g in self.group_rows)
        self.out_offsets = {g: group_dims(cfg, g)[1] for g in self.groups}
        self.dtype = dtype
        self.device = torch.device(device)
        self.a_all: dict[str, torch.Tensor] = {}
        self.b_all: dict[str, torch.Tensor] = {}
        self.qscales_all: dict[str, torch.Tensor] = {}
        for group in self.groups:
            modules = MODULE_GROUPS[group]
            in_dim, offsets = group_dims(cfg, group)
            shape_a = (cfg.num_layers, len(modules), num_rows[group], in_dim)
            self.a_all[group] = torch.zeros(shape_a, dtype=dtype, device=device)
            shape_b = (cfg.num_layers, num_rows[group], offsets[-1])
            self.b_all[group] = torch.zeros(shape_b, dtype=dtype, device=device)
            if self.quantized:
                self.qscales_all[group] = torch.zeros(shape_a[:3], device=device)
        self.a = [{g: t[layer] for g, t in self.a_all.items()} for layer in range(cfg.num_layers)]
        self.b = [{g: t[layer] for g, t in self.b_all.items()} for layer in range(cfg.num_layers)]
        self.qscales = [{g: t[layer] for g, t in self.qscales_all.items()}
                        for layer in range(cfg.num_layers)]
        cuda = self.device.type == "cuda"
        self.host = HostAdapterCache(host_bytes, pin=cuda)
        self.load_stream = torch.cuda.Stream(self.device) if cuda else None
        self._loaded = torch.cuda.Event() if cuda else None
        self._loads_pending = False
        self._uncovered: set[int] = set()  # rows of prefetch copies queued after the last event
        self.dora_base: DoraBase | None = None  # the model's weights, set by its runner
        # magnitude row -> (group, m, partial squares) of a DoRA adapter's row-parallel groups,
        # until the first step that reads it (finish_dora)
        self._dora_pending: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        # magnitude row -> (adapter id, a device flag: its norms vanish on some row), from its
        # write until the first step that reads it looks (dora_faults)
        self._dora_checks: dict[int, tuple[str, torch.Tensor]] = {}
        if cuda:  # the zero fill above must land before any load
            self.load_stream.wait_stream(torch.cuda.current_stream(self.device))

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    def write(self, adapter: LoraAdapter | PackedAdapter, rows: np.ndarray) -> None:
        """Copy an adapter's weights into `rows` (len == adapter.pool_rows): one host-to-device copy
        of the adapter packed in pool layout, then one row scatter per group it adapts, for all
        layers. A group's first group-rank rows are the only ones the kernels read for it
        (AdapterResidency.group_rows), so the other rows keep whatever they held. On CUDA this
        is queued on the load stream (see wait_loads)."""
        self._copy(adapter, rows)
        self._record()

    def write_all(self, loads, adapter_sets=()) -> None:
        """Queue a step's loads, then record the event its forward waits on (wait_loads),
        also when the step's `adapter_sets` read rows of prefetch copies not covered yet."""
        for adapter, rows in loads:
            self._copy(adapter, rows)
        if loads or self._uncovered and self._reads_uncovered(adapter_sets):
            self._record()

    def prefetch(self, copies) -> None:
        """Queue copies of adapters that no step launched so far reads, after the event of the
        last step's loads, so that step does not wait for them."""
        for adapter, rows in copies:
            self._copy(adapter, rows)
            if self.load_stream is not None:
                self._uncovered.update(int(r) for r in rows)

    def _reads_uncovered(self, adapter_sets) -> bool:
        return any(not self._uncovered.isdisjoint(g.rows)
                   for groups in adapter_sets for g in groups.values())

    def _copy(self, adapter: LoraAdapter | PackedAdapter, rows: np.ndarray) -> None:
        packed = adapter if isinstance(adapter, PackedAdapter) else self.packed(adapter)
        if self.load_stream is None:
            self._scatter(packed, packed.data, rows)
            return
        with torch.cuda.stream(self.load_stream):
            # the pinned source stays alive until the copy ends: PyTorch's pinned allocator
            # records this stream's use and reuses the block only after it completes
            self._scatter(packed, packed.data.to(self.device, non_blocking=True), rows)

    def _record(self) -> None:
        if self.load_stream is None:
            return
        self._loaded.record(self.load_stream)
        self._loads_pending = True
        self._uncovered.clear()

    def wait_loads(self, stream=None) -> None:
        """Make `stream` (default: the current one) wait for every write() queued so far."""
        if self._loads_pending:
            (stream or torch.cuda.current_stream(self.device)).wait_event(self._loaded)
            self._loads_pending = False

    def _scatter(self, adapter: PackedAdapter, packed: torch.Tensor, rows: np.ndarray) -> None:
        """`packed` (adapter.data, on the device) into `rows`."""
        group_ranks, dora_groups = adapter.group_ranks, adapter.dora_groups
        idx = to_device(rows, torch.long, self.device)
        for row in rows:  # what waited for the rows' previous adapter is void
            self._dora_pending.pop(int(row), None)
            self._dora_checks.pop(int(row), None)
        magnitudes = None
        if dora_groups:
            n = sum(self.out_offsets[g][-1] for g in dora_groups) * self.layout.cfg.num_layers
            magnitudes = packed[:n * 4 // self.dtype.itemsize].view(torch.float32)
            packed = packed[magnitudes.numel() * 4 // self.dtype.itemsize:]
        if self.quantized:
            scale_bytes = self._num_scales(group_ranks) * SCALE_BYTES
            self._scatter_pools(self.qscales_all, 2, packed[:scale_bytes].view(torch.float32),
                                group_ranks, idx)
            packed = packed[scale_bytes:]
        offset = 0
        for group, rank in group_ranks.items():
            for pool, row_dim in ((self.a_all[group], 2), (self.b_all[group], 1)):
                offset += _scatter_rows(pool, row_dim, packed[offset:], rank, idx)
        if magnitudes is not None:
            self._write_dora_scales(adapter.adapter_id, magnitudes, group_ranks, dora_groups,
                                    rows)

    def _write_dora_scales(self, adapter_id: str, magnitudes: torch.Tensor,
                           group_ranks: Mapping[str, int], dora_groups: tuple[str, ...],
                           rows: np.ndarray) -> None:
        """A DoRA adapter's scales into its magnitude row (its last row), from its magnitude
        vectors and the rows just written (radixlora.worker.dora); whether its norms vanish
        (vanishing_norms) is kept on the device for dora_faults."""
        if self.dora_base is None:
            raise RuntimeError("a DoRA adapter needs the pool's dora_base (the model's weights)")
        offset, row = 0, int(rows[-1])
        faults = []
        for group in dora_groups:
            size = self.layout.cfg.num_layers * self.out_offsets[group][-1]
            m = magnitudes[offset:offset + size].view(self.layout.cfg.num_layers, -1)
            offset += size
            a, b = self.rank_rows(group, rows[:group_ranks[group]])
            squares = squared_norms(a, b, self.out_offsets[group], self.dora_base, group)
            if self.dora_base.row_parallel(group) is None:
                self._store_dora_scales(group, scales_from(m, squares), row)
                faults.append(vanishing_norms(m, squares, self.dora_base.row_squares(group),
                                              self.dora_base.dtype))
            else:
                self._dora_pending.setdefault(row, []).append((group, m.clone(), squares))
        if faults and self.layout.shard is None:  # a tensor-parallel rank sees its rows only
            self._dora_checks[row] = (adapter_id, torch.stack(faults).any())

    def rank_rows(self, group: str, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(a [layers, n_slices, r, in], b [layers, out_total, r]) of a group's rank `rows`,
        float32 (an int8 pool's dequantized)."""
        idx = torch.as_tensor(np.asarray(rows, np.int64), device=self.device)
        a = self.a_all[group][:, :, idx].float()
        b = self.b_all[group][:, idx].float().transpose(1, 2)
        if self.quantized:
            a = a * self.qscales_all[group][:, :, idx, None]
        return a, b

    def dora_faults(self, adapter_sets) -> dict[str, str]:
        """The DoRA adapters this step reads whose norms vanish (written since the last look;
        one host sync when there are any), by id, with why: their scales are not finite, and
        the step must not run with them."""
        rows = {g.magnitude for groups in adapter_sets for g in groups.values()}
        checks = [self._dora_checks.pop(r) for r in sorted(rows & self._dora_checks.keys())]
        return {adapter_id: DORA_VANISHES for adapter_id, fault in checks if fault.item()}

    def finish_dora(self, adapter_sets) -> None:
        """Under tensor parallelism, before a step that reads them: the scales of the DoRA
        adapters written since their partial squared norms were taken (radixlora.worker.dora).
        Every rank calls this for the same steps in the same order, and has the same adapters
        waiting among those the step reads, so the one all-reduce matches; on the compute
        stream, after wait_loads."""
        rows = sorted({g.magnitude for groups in adapter_sets for g in groups.values()}
                      & self._dora_pending.keys())
        if not rows:
            return
        entries = [(row, *entry) for row in rows for entry in self._dora_pending.pop(row)]
        if self.device.type == "cuda":  # made on the load stream, freed after use on this one
            for _, _, m, squares in entries:
                m.record_stream(torch.cuda.current_stream(self.device))
                squares.record_stream(torch.cuda.current_stream(self.device))
        total = torch.cat([squares.flatten() for *_, squares in entries])
        self.dora_base.row_parallel(entries[0][1]).tp.all_reduce(total)
        for (row, group, m, _), squares in zip(entries, total.split([m.numel() for _, _, m, _ in
                                                                    entries])):
            self._store_dora_scales(group, scales_from(m, squares.view_as(m)), row)

    def _store_dora_scales(self, group: str, gm1: torch.Tensor, row: int) -> None:
        """g - 1 [layers, out_total] into one row of the group's B pool; an int8 pool
        quantizes each slice of each layer with its own scale."""
        if not self.quantized:
            self.b_all[group][:, row] = gm1
            return
        offsets = self.out_offsets[group]
        for i in range(len(offsets) - 1):
            q, scale = quantize_rows(gm1[:, offsets[i]:offsets[i + 1]])
            self.b_all[group][:, row, offsets[i]:offsets[i + 1]] = q
            self.qscales_all[group][:, i, row] = scale

    def _scatter_pools(self, pools: dict[str, torch.Tensor], row_dim: int, packed: torch.Tensor,
                       group_ranks: Mapping[str, int], idx: torch.Tensor) -> None:
        offset = 0
        for group, rank in group_ranks.items():
            offset += _scatter_rows(pools[group], row_dim, packed[offset:], rank, idx)

    def _num_scales(self, group_ranks: Mapping[str, int]) -> int:
        return sum(math.prod(self.qscales_all[g].shape[:2]) * r for g, r in group_ranks.items())

    def packed(self, adapter: LoraAdapter) -> PackedAdapter:
        """The adapter from the host tier, packed and cached there on a miss."""
        return self.host.get(adapter.adapter_id) or self.host.put(self.pack(adapter))

    def pack(self, adapter: LoraAdapter) -> PackedAdapter:
        return self.layout.pack(adapter)


def _scatter_rows(pool: torch.Tensor, row_dim: int, packed: torch.Tensor, rank: int,
                  idx: torch.Tensor) -> int:
    """Copy the first rows of `packed` (the pool's shape with `rank` along row_dim) into the
    pool's rows idx[:rank]; returns how many elements of `packed` they took."""
    shape = list(pool.shape)
    shape[row_dim] = rank
    size = math.prod(shape)
    pool.index_copy_(row_dim, idx[:rank], packed[:size].view(shape))
    return size
