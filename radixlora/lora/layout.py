"""Where an adapter's values go in a worker's paged pool (PoolLayout), and how many bytes that
takes: the layout the registry packs adapters for ahead of the workers (packed files,
radixlora.lora.host_cache) and the worker's AdapterPool writes (radixlora.worker.adapter_pool);
the scheduler counts rows and bytes with it. An int8 layout stores A and B rows as int8 with a
float32 scale per rank row of each module slice (quantize_rows)."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from radixlora.config import EXPERT_GROUPS, GROUP_OF, MODULE_GROUPS, ModelConfig
from radixlora.distributed import Shard
from radixlora.lora.adapter import LoraAdapter
from radixlora.lora.host_cache import PackedAdapter

QMAX = 127  # symmetric int8: -127..127, so a row's absmax maps to +-127 exactly
SCALE_BYTES = 4  # float32 dequantization scales
PACK_FORMAT = 2  # bumped whenever pack()'s byte layout changes


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
        groups = {g: group_dims(self.cfg, g) for g in self.cfg.lora_groups}
        shard = (self.shard.rank, self.shard.size) if self.shard is not None else None
        text = repr((PACK_FORMAT, self.cfg.num_layers, groups, str(self.dtype), shard))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def holds(self, packed: PackedAdapter) -> bool:
        """Whether `packed` has the groups in write() order and exactly the bytes this layout
        packs for their ranks (a packed file read back is checked before any scatter)."""
        ranks, dora = packed.group_ranks, packed.dora_groups
        in_order = list(ranks) == [g for g in MODULE_GROUPS if g in ranks]
        if not ranks or not in_order or min(ranks.values()) < 1:
            return False
        if list(dora) != [g for g in ranks if g in dora] or len(set(dora)) != len(dora):
            return False
        return packed.nbytes == load_bytes(self.cfg, self.dtype, ranks, dora)

    def pack(self, adapter: LoraAdapter) -> PackedAdapter:
        """The adapter's rows for each group pool it adapts (its group rank of them), flattened
        in AdapterPool.write() order, in the pool's dtype. An int8 pool's packing is one byte
        tensor: first the float32 qscales of every group ([layers, n_slices, rank] each), then
        the int8 A and B rows in the same order. A DoRA adapter's packing starts with its
        float32 magnitude vectors (_pack_magnitudes), whatever the pool's dtype."""
        group_ranks = {g: adapter.group_ranks[g] for g in MODULE_GROUPS if g in adapter.group_ranks}
        if not self.quantized:
            data = self._pack_float(adapter, group_ranks)
        else:
            groups = [self._int8_group_rows(adapter, g, r) for g, r in group_ranks.items()]
            rows = torch.cat([t.flatten() for a, b, _ in groups for t in (a, b)])
            scales = torch.cat([qs.flatten() for _, _, qs in groups]).view(torch.int8)
            data = torch.cat([scales, rows])
        if adapter.dora_groups:
            data = torch.cat([self._pack_magnitudes(adapter).view(self.dtype), data])
        return PackedAdapter(adapter.adapter_id, group_ranks, data, adapter.dora_groups)

    def _pack_magnitudes(self, adapter: LoraAdapter) -> torch.Tensor:
        """Float32 [layers, out_total] for each DoRA group, flattened: each DoRA module's
        magnitude vector in its columns (this rank's output features of a column-parallel
        module, as for its bias), NaN in the columns of the modules and layers it does not
        adapt."""
        parts = {g: torch.full((self.cfg.num_layers, group_dims(self.cfg, g)[1][-1]), math.nan)
                 for g in adapter.dora_groups}
        for (layer, module), m in adapter.magnitudes.items():
            group = GROUP_OF[module]
            offsets = group_dims(self.cfg, group)[1]
            if self.shard is not None:
                m = self.shard.weight(module, "bias", m)
            i = MODULE_GROUPS[group].index(module)
            parts[group][layer, offsets[i]:offsets[i + 1]] = m
        return torch.cat([t.flatten() for t in parts.values()])

    def _pack_float(self, adapter: LoraAdapter, group_ranks: dict[str, int]) -> torch.Tensor:
        """A float pool's packing, written straight into one buffer of the pool's dtype: each
        float32 value is rounded once, as `.to(dtype)` of the whole would, with no float32
        copy of the adapter beside its weights."""
        out = torch.zeros(load_bytes(self.cfg, self.dtype, group_ranks)
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


def bytes_per_row(cfg: ModelConfig, dtype: torch.dtype, groups=None) -> int:
    """Device bytes of one rank row on these module groups (default every linear one the model
    has: not an MoE base's experts) of every layer (int8: with its scales)."""
    if groups is None:
        groups = [g for g in cfg.lora_groups if g not in EXPERT_GROUPS]
    return load_bytes(cfg, dtype, dict.fromkeys(groups, 1))


def group_row_bytes(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """bytes_per_row of each module group alone."""
    return {g: bytes_per_row(cfg, dtype, (g,)) for g in cfg.lora_groups}


def load_bytes(cfg: ModelConfig, dtype: torch.dtype, group_ranks: Mapping[str, int],
               dora_groups: tuple[str, ...] = ()) -> int:
    """Bytes an adapter with these per-group ranks moves into the pool (its packed size): its A
    and B rows, for an int8 pool a float32 scale per (slice, row), and for DoRA its float32
    magnitude vectors."""
    per_layer = sum(group_dims(cfg, g)[1][-1] * 4 for g in dora_groups)
    for group, rank in group_ranks.items():
        in_dim, offsets = group_dims(cfg, group)
        n_slices = len(MODULE_GROUPS[group])
        per_layer += rank * (n_slices * in_dim + offsets[-1]) * dtype.itemsize
        if dtype == torch.int8:
            per_layer += rank * n_slices * SCALE_BYTES
    return per_layer * cfg.num_layers


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 over the last axis: (q, scale) with t ~= q * scale[..., None]; an
    all-zero row gets scale 1 (q is zero)."""
    amax = t.abs().amax(-1)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(t / scale[..., None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale
