"""Paged adapter memory (S-LoRA style). For each (layer, module group) the worker holds
  a_pool [n_slices, num_rows, in_dim] and b_pool [num_rows, out_total];
an adapter of rank r takes r rank rows from a free list shared by all layers, so any mix of ranks
fits without padding to a max rank and loads/unloads never fragment memory. The scheduler owns
row bookkeeping (RowAllocator, AdapterResidency); the worker owns the tensors (AdapterPool).

An int8 pool (--lora-dtype int8) stores both as int8 with a symmetric absmax scale per rank
row of each module (slice): A's over in_dim, B's over the module's output columns. Both lie on
the rank axis, the shrink's output axis and the expand's reduction axis, so they factor out of
both products: the shrink multiplies its fp32 accumulator by qscales[slice, row] (A's scale
times B's) along with the stacking weight, and the expand reads int8 B as it is, with no scale
of its own. (A scale per output column of B could not work: the columns are shared by every
adapter in the pool.) Paging never splits a rank row and tensor parallel never slices the rank
axis, so the scales survive both: modules are quantized whole, then sliced."""

from __future__ import annotations

import functools
import hashlib
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from radixlora.config import ModelConfig
from radixlora.distributed import Shard
from radixlora.kernels.lora_ops import LoraBatchMeta
from radixlora.lora.adapter import MODULE_GROUPS, LoraAdapter
from radixlora.lora.host_cache import HostAdapterCache, PackedAdapter
from radixlora.model.parallel import RowParallelLinear

QMAX = 127  # symmetric int8: -127..127, so a row's absmax maps to +-127 exactly
SCALE_BYTES = 4  # float32 dequantization scales
PACK_FORMAT = 1  # bumped whenever pack()'s byte layout changes


def group_dims(cfg: ModelConfig, group: str) -> tuple[int, list[int]]:
    """(in_dim, out_offsets) of a fused module group."""
    modules = MODULE_GROUPS[group]
    in_dim = cfg.module_shape(modules[0])[0]
    offsets = [0]
    for m in modules:
        offsets.append(offsets[-1] + cfg.module_shape(m)[1])
    return in_dim, offsets


@dataclass(frozen=True)
class PoolLayout:
    """Where an adapter's values go in one worker's pool: the shape of that rank's modules,
    the storage dtype and the tensor-parallel slice. Packing depends on nothing else, so the
    registry packs adapters ahead for the workers (packed files, radixlora.lora.host_cache),
    and `key` names the layout a packed file was made for."""

    cfg: ModelConfig  # this rank's shapes
    dtype: torch.dtype
    shard: Shard | None = None

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    @functools.cached_property
    def key(self) -> str:
        groups = {g: group_dims(self.cfg, g) for g in MODULE_GROUPS}
        shard = (self.shard.rank, self.shard.size) if self.shard is not None else None
        text = repr((PACK_FORMAT, self.cfg.num_layers, groups, str(self.dtype), shard))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def holds(self, packed: PackedAdapter) -> bool:
        """Whether `packed` has the groups in write() order and exactly the bytes this layout
        packs for their ranks (a packed file read back is checked before any scatter)."""
        ranks = packed.group_ranks
        in_order = list(ranks) == [g for g in MODULE_GROUPS if g in ranks]
        if not ranks or not in_order or min(ranks.values()) < 1:
            return False
        return packed.nbytes == AdapterPool.load_bytes(self.cfg, self.dtype, ranks)

    def pack(self, adapter: LoraAdapter) -> PackedAdapter:
        """The adapter's rows for each group pool it adapts (its group rank of them), flattened
        in AdapterPool.write() order, in the pool's dtype. An int8 pool's packing is one byte
        tensor: first the float32 qscales of every group ([layers, n_slices, rank] each), then
        the int8 A and B rows in the same order."""
        group_ranks = {g: adapter.group_ranks[g] for g in MODULE_GROUPS if g in adapter.group_ranks}
        if not self.quantized:
            return PackedAdapter(adapter.adapter_id, group_ranks,
                                 self._pack_float(adapter, group_ranks))
        groups = [self._int8_group_rows(adapter, g, r) for g, r in group_ranks.items()]
        rows = torch.cat([t.flatten() for a, b, _ in groups for t in (a, b)])
        scales = torch.cat([qs.flatten() for _, _, qs in groups]).view(torch.int8)
        return PackedAdapter(adapter.adapter_id, group_ranks, torch.cat([scales, rows]))

    def _pack_float(self, adapter: LoraAdapter, group_ranks: dict[str, int]) -> torch.Tensor:
        """A float pool's packing, written straight into one buffer of the pool's dtype: each
        float32 value is rounded once, as `.to(dtype)` of the whole would, with no float32
        copy of the adapter beside its weights."""
        out = torch.zeros(AdapterPool.load_bytes(self.cfg, self.dtype, group_ranks)
                          // self.dtype.itemsize, dtype=self.dtype)
        start = 0
        for group, rank in group_ranks.items():
            modules = MODULE_GROUPS[group]
            in_dim, offsets = group_dims(self.cfg, group)
            a_shape = (self.cfg.num_layers, len(modules), rank, in_dim)
            b_shape = (self.cfg.num_layers, rank, offsets[-1])
            a = out[start:start + math.prod(a_shape)].view(a_shape)
            start += a.numel()
            b = out[start:start + math.prod(b_shape)].view(b_shape)
            start += b.numel()
            for (layer, module), (lora_a, lora_b) in adapter.weights.items():
                if module not in modules:
                    continue
                if self.shard is not None:
                    lora_a, lora_b = self.shard.lora(module, lora_a, lora_b)
                slice_idx, r = modules.index(module), lora_a.shape[0]
                a[layer, slice_idx, :r] = lora_a
                b[layer, :r, offsets[slice_idx]:offsets[slice_idx + 1]] = lora_b.t()
        return out

    def _int8_group_rows(self, adapter: LoraAdapter, group: str, rank: int):
        """(a [layers, n_slices, rank, in_dim], b [layers, rank, out_total], qscales
        [layers, n_slices, rank] float32) of one group, int8. Each module is quantized whole,
        then sliced for this tensor-parallel rank: slicing cuts A's columns or B's output rows,
        never a rank row, so the scales hold for every slice and every TP degree stores the
        same values."""
        modules = MODULE_GROUPS[group]
        layers, n_slices = self.cfg.num_layers, len(modules)
        in_dim, offsets = group_dims(self.cfg, group)
        a = torch.zeros(layers, n_slices, rank, in_dim, dtype=torch.int8)
        b = torch.zeros(layers, rank, offsets[-1], dtype=torch.int8)
        qscales = torch.zeros(layers, n_slices, rank)
        for (layer, module), (lora_a, lora_b) in adapter.weights.items():
            if module not in modules:
                continue
            slice_idx, r = modules.index(module), lora_a.shape[0]
            (lora_a, a_scale), (b_t, b_scale) = quantize_rows(lora_a), quantize_rows(lora_b.t())
            lora_b = b_t.t()
            qscales[layer, slice_idx, :r] = a_scale * b_scale
            if self.shard is not None:
                lora_a, lora_b = self.shard.lora(module, lora_a, lora_b)
            a[layer, slice_idx, :r] = lora_a
            b[layer, :r, offsets[slice_idx] : offsets[slice_idx + 1]] = lora_b.t()
        return a, b, qscales


def pool_layouts(cfg: ModelConfig, dtype: torch.dtype, tp_size: int) -> tuple[PoolLayout, ...]:
    """The pool layout of every tensor-parallel rank of a model (`cfg`: the full model's)."""
    if tp_size == 1:
        return (PoolLayout(cfg, dtype),)
    shards = [Shard(rank, tp_size, cfg) for rank in range(tp_size)]
    return tuple(PoolLayout(shard.local, dtype, shard) for shard in shards)


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

    def __init__(self, cfg: ModelConfig, num_rows: int, dtype: torch.dtype, device,
                 host_bytes: int = 2 << 30, shard: Shard | None = None):
        """cfg: the shape of this rank's modules; dtype: the storage dtype, the model's or
        torch.int8; shard: under tensor parallel, the rank whose slice of each adapter this pool
        holds (packing slices)."""
        self.layout = PoolLayout(cfg, dtype, shard)
        self.num_rows = num_rows
        self.out_offsets = {g: group_dims(cfg, g)[1] for g in MODULE_GROUPS}
        self.dtype = dtype
        self.device = torch.device(device)
        self.a_all: dict[str, torch.Tensor] = {}
        self.b_all: dict[str, torch.Tensor] = {}
        self.qscales_all: dict[str, torch.Tensor] = {}
        for group, modules in MODULE_GROUPS.items():
            in_dim, offsets = group_dims(cfg, group)
            shape_a = (cfg.num_layers, len(modules), num_rows, in_dim)
            self.a_all[group] = torch.zeros(shape_a, dtype=dtype, device=device)
            shape_b = (cfg.num_layers, num_rows, offsets[-1])
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
        if cuda:  # the zero fill above must land before any load
            self.load_stream.wait_stream(torch.cuda.current_stream(self.device))

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    @staticmethod
    def bytes_per_row(cfg: ModelConfig, dtype: torch.dtype) -> int:
        """Device bytes of one rank row on every module group of every layer (int8: with its
        scales)."""
        return AdapterPool.load_bytes(cfg, dtype, dict.fromkeys(MODULE_GROUPS, 1))

    @staticmethod
    def load_bytes(cfg: ModelConfig, dtype: torch.dtype, group_ranks: Mapping[str, int]) -> int:
        """Bytes an adapter with these per-group ranks moves into the pool (its packed size):
        its A and B rows, and for an int8 pool a float32 scale per (slice, row)."""
        per_layer = 0
        for group, rank in group_ranks.items():
            in_dim, offsets = group_dims(cfg, group)
            n_slices = len(MODULE_GROUPS[group])
            per_layer += rank * (n_slices * in_dim + offsets[-1]) * dtype.itemsize
            if dtype == torch.int8:
                per_layer += rank * n_slices * SCALE_BYTES
        return per_layer * cfg.num_layers

    def write(self, adapter: LoraAdapter | PackedAdapter, rows: np.ndarray) -> None:
        """Copy an adapter's weights into `rows` (len == adapter.rank): one host-to-device copy
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
            self._scatter(packed.data, packed.group_ranks, rows)
            return
        with torch.cuda.stream(self.load_stream):
            # the pinned source stays alive until the copy ends: PyTorch's pinned allocator
            # records this stream's use and reuses the block only after it completes
            self._scatter(packed.data.to(self.device, non_blocking=True), packed.group_ranks,
                          rows)

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

    def _scatter(self, packed: torch.Tensor, group_ranks: Mapping[str, int],
                 rows: np.ndarray) -> None:
        idx = torch.as_tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":  # pinned: a pageable source would wait for earlier copies
            idx = idx.pin_memory()
        idx = idx.to(self.device, non_blocking=True)
        if self.quantized:
            scale_bytes = self._num_scales(group_ranks) * SCALE_BYTES
            self._scatter_pools(self.qscales_all, 2, packed[:scale_bytes].view(torch.float32),
                                group_ranks, idx)
            packed = packed[scale_bytes:]
        offset = 0
        for group, rank in group_ranks.items():
            for pool, row_dim in ((self.a_all[group], 2), (self.b_all[group], 1)):
                offset += _scatter_rows(pool, row_dim, packed[offset:], rank, idx)

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


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last axis: (q, scale) with t ~= q * scale[..., None]; an
    all-zero row gets scale 1 (q is zero)."""
    amax = t.abs().amax(-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(t / scale[..., None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


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

    def can_acquire(self, adapters: list[LoraAdapter]) -> bool:
        missing = sum(a.rank for a in adapters if a.adapter_id not in self.resident)
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
                if self.rows.num_free() < adapter.rank:
                    self._reclaim(adapter.rank, self._victims(protected, needs or {}))
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
        if self.rows.num_free() < adapter.rank:
            victims = [k for k in self._victims({adapter.adapter_id}, needs)
                       if needs.get(k, position + 1) > position]
            reclaimable = sum(len(self.resident[k].rows) for k in victims)
            if adapter.rank > self.rows.num_free() + reclaimable:
                return None
            self._reclaim(adapter.rank, victims)
        return self._place(adapter).rows

    def _place(self, adapter: LoraAdapter) -> ResidentAdapter:
        entry = ResidentAdapter(adapter, self.rows.alloc(adapter.rank),
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


class LoraSegments(dict):
    """group -> (rows per request, scales per request) of one batch, in plan order, plus
    request_sets: the adapter-set id of each request (-1: no adapter), by which the grouped
    SGMV path gathers the tokens of each distinct set."""

    def __init__(self, per_group: dict[str, tuple[list, list]], request_sets: np.ndarray):
        super().__init__(per_group)
        self.request_sets = request_sets


class LoraContext:
    """LoRA inputs of one forward batch: the pool, the backend, one metadata per module group
    (None when no request of the batch uses that group, so its work is skipped, not zeroed).

    `project` returns (y, delta): linear(x) plus the LoRA deltas of x is y + delta. By default
    the deltas are added into y after the GEMM and delta is None; eager batches of prefill
    segments (ungrouped metadata, no bias) instead store the deltas first and let the GEMM add
    them (`_delta_then_gemm`). Deferred (`defer`, small CUDA
    graph buckets), the deltas come back as a float32 delta that y's consumer adds as it loads y
    (rotary + KV store, the norms' residual add, SiLU-mul), so no LoRA launch follows the GEMM.
    A deferred forward draws its deltas from one workspace zeroed once per forward (`begin`):
    one delta per group shared by all layers, whose rows of tokens with no adapter are never
    written and stay zero. (The shrink's v needs no zeroing: its in_dim splits store partial
    sums that the expand adds up.)

    With a side stream (CUDA graph capture), the LoRA work that only reads x (the shrink, or
    the whole delta when deferred) runs on it beside the base GEMM; at decode sizes it is
    latency the GEMM hides. Invariant: the side stream waits for everything queued on the
    compute stream before each projection's LoRA work, and the compute stream waits for it right
    after the GEMM, so x is ready when read and v or delta when used, and a layer's delta is
    overwritten only after the previous layer's consumer has read it. Memory (the caching
    allocator reuses a block only on the stream that allocated it): delta is allocated on the
    compute stream (workspace); v on the side stream, reused only by later side-stream work,
    which runs after the expand that read it (the deferred expand runs on the side stream, the
    other after the join, before the next projection's fork); x belongs to the compute
    stream and is freed after the join, so its block is reused only by work queued after the
    LoRA work that read it."""

    def __init__(
        self,
        pool: AdapterPool,
        backend,
        metas: dict[str, LoraBatchMeta | None],
        side_stream: torch.cuda.Stream | None = None,
        defer: bool = False,
    ):
        self.pool = pool
        self.backend = backend
        self.metas = metas
        self.side_stream = side_stream
        self.defer = defer
        self._delta: dict[str, torch.Tensor] = {}  # deferred workspace, per group

    def begin(self, num_tokens: int, device) -> None:
        """Start a forward: a deferred context takes a zeroed workspace (one fill)."""
        if not self.defer:
            return
        used = [g for g, m in self.metas.items() if m is not None]
        shapes = [(num_tokens, self.pool.out_offsets[g][-1]) for g in used]
        sizes = [math.prod(shape) for shape in shapes]
        buf = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        views = zip(used, buf.split(sizes), shapes, strict=True)
        self._delta = {g: t.view(shape) for g, t, shape in views}

    def project(
        self, linear: torch.nn.Module, x: torch.Tensor, layer_id: int, group: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): linear(x) plus the batch's LoRA deltas of `group` in layer `layer_id`
        is y + delta (delta None: nothing to add)."""
        meta = self.metas[group]
        if meta is None:
            return linear(x), None
        a, b, out_offsets, qs = self._pools(layer_id, group)
        if isinstance(linear, RowParallelLinear):
            return self._row_parallel(linear, x, a, b, out_offsets, meta, qs), None
        if self.defer:
            delta = self._delta[group]
            y, _ = self._beside_gemm(linear, x, lambda: self.backend.deferred_delta(
                x, a, b, out_offsets, meta, delta, qs))
            return y, delta
        plain = isinstance(linear, torch.nn.Linear) and linear.bias is None
        if self.side_stream is None and meta.groups is None and plain:
            return self._delta_then_gemm(linear, x, a, b, out_offsets, meta, qs), None
        y, v = self._beside_gemm(linear, x, lambda: self.backend.shrink(x, a, meta, qs))
        if v is not None:
            self.backend.expand(v, b, out_offsets, meta, y)
        return y, None

    def _delta_then_gemm(self, linear, x: torch.Tensor, a, b, out_offsets, meta,
                         qs) -> torch.Tensor:
        """linear(x) plus the deltas, written first and added by the GEMM (beta = 1): the expand
        only stores, and the GEMM reads them in its epilogue instead of an expand reading and
        rewriting y after it. Every row of y is written first: the segments of a
        LoraBatchMeta cover all its tokens, and tokens with no adapter get zeros."""
        v = self.backend.shrink(x, a, meta, qs)
        if v is None:
            return linear(x)
        y = x.new_empty(x.shape[0], linear.out_features)
        self.backend.expand(v, b, out_offsets, meta, y, accumulate=False)
        return y.addmm_(x, linear.weight.t())

    def _row_parallel(self, linear: RowParallelLinear, x: torch.Tensor, a, b, out_offsets,
                      meta, qs) -> torch.Tensor:
        """Tensor parallel, o and down: x and A hold this rank's input columns, so both the
        base product and the shrink are partial sums; the expand is linear in the shrink, so
        each rank's partial delta (its partial shrink times the whole B) is added to its partial
        product and the one all-reduce of the output sums both: no collective of its own."""
        y = linear.partial(x)
        v = self.backend.shrink(x, a, meta, qs)
        if v is not None:
            self.backend.expand(v, b, out_offsets, meta, y)
        return linear.reduce(y)

    def _beside_gemm(self, linear, x: torch.Tensor, lora_work):
        """(linear(x), lora_work()), the LoRA work on the side stream beside the GEMM if any."""
        if self.side_stream is None:
            return linear(x), lora_work()
        compute = torch.cuda.current_stream(x.device)
        self.side_stream.wait_stream(compute)
        with torch.cuda.stream(self.side_stream):
            out = lora_work()
        y = linear(x)
        compute.wait_stream(self.side_stream)
        return y, out

    def _pools(self, layer_id: int, group: str):
        """(a_pool, b_pool, out_offsets, qscales) of one layer's group; qscales None unless the
        pool is int8."""
        pool = self.pool
        qscales = pool.qscales[layer_id].get(group)
        return pool.a[layer_id][group], pool.b[layer_id][group], pool.out_offsets[group], qscales


def high_priority_stream(device) -> torch.cuda.Stream:
    """A stream at the device's highest priority (torch clamps a priority past the device's
    range to its end): its CTAs are scheduled ahead of waiting CTAs of normal streams."""
    return torch.cuda.Stream(device, priority=-(1 << 20))
