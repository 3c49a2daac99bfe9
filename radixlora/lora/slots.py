"""Adapter slots: the LoRA shrink inside the base GEMM, for decode graphs.

Each projection's weight is stored with spare rows below it, [W; A slot rows], one tensor per
module group across layers. Before a decode step the A rows of the batch's distinct adapter
sets are copied into those rows (slot row j's slice i at row n_out + j * n_slices + i) and
their B rows into a matching B table; the GEMM then computes y_aug = [y | x @ A_slots.T] in
one cuBLAS call and `slot_expand_` adds each token's own v @ B into y. No side-stream branch,
no separate shrink launch: the adapter rows stream with the weight at GEMM speed (docs/PERF.md,
run 22). The copies happen only when the batch's sets (or the pool's contents) change.

The model's nn.Linear weights are views of the first n_out rows, so every other path (prefill,
eager, larger graphs) reads the base weight as before. Opt-in (EngineConfig.lora_slots): the
expand is still one launch per projection on the critical path, which today costs more than
the side branch saves (folded into y's consumer kernels it cost them as much: runs 22
and 23)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixlora.forward_batch import to_device
from radixlora.kernels.lora_ops import HostGroups
from radixlora.kernels.slot_expand import block_for, slot_expand_, slot_expand_ref
from radixlora.lora.adapter import MODULE_GROUPS

PROJECTIONS = {
    "qkv": ("self_attn", "qkv_proj"),
    "o": ("self_attn", "o_proj"),
    "gate_up": ("mlp", "gate_up_proj"),
    "down": ("mlp", "down_proj"),
}
SLOT_BUCKETS = (16, 32, 64, 128, 256, 512)


def projection(layer: torch.nn.Module, group: str) -> torch.nn.Linear:
    block, name = PROJECTIONS[group]
    return getattr(getattr(layer, block), name)


def stack_projections(model: torch.nn.Module, num_slots: int, device) -> dict[str, tuple]:
    """Before the model is materialized (meta parameters): give every projection's weight (and
    bias) storage in one zeroed tensor per module group with n_slices * num_slots spare rows
    below it, [num_layers, n_out + n_slices * num_slots, in_dim]; the layers' parameters become
    views of their rows. Returns group -> (weights, biases or None)."""
    if num_slots < 1:
        raise ValueError(f"lora_slots must be >= 1 to stack projections, got {num_slots}")
    out = {}
    for group, modules in MODULE_GROUPS.items():
        first = projection(model.layers[0], group)
        n_out, in_dim = first.weight.shape
        rows = n_out + len(modules) * num_slots
        like = {"dtype": first.weight.dtype, "device": device}
        weights = torch.zeros(len(model.layers), rows, in_dim, **like)
        biases = None if first.bias is None else torch.zeros(len(model.layers), rows, **like)
        for i, layer in enumerate(model.layers):
            linear = projection(layer, group)
            linear.weight = torch.nn.Parameter(weights[i, :n_out], requires_grad=False)
            if biases is not None:
                linear.bias = torch.nn.Parameter(biases[i, :n_out], requires_grad=False)
        out[group] = (weights, biases)
    return out


@dataclass
class SlotTable:
    """One module group's slot contents: the pool rows and scales in slot order, and the pool
    version they were copied at."""

    rows: tuple[int, ...]
    scales: tuple[float, ...]
    version: int


class AdapterSlots:
    """The slot tensors of every module group and what they hold now.

    Tables are per group (a set that does not adapt a group takes no rows there) and are
    rebuilt, all rows at once, whenever the batch's sets or the pool's contents change. The
    copies are queued on the current stream after the adapter loads (ModelRunner.launch waits
    for them), in stream order with the steps before and after, so a step never sees another
    step's slots."""

    def __init__(self, stacked: dict[str, tuple], pool, num_slots: int):
        self.pool = pool
        self.num_slots = num_slots
        self.weights = {g: w for g, (w, _) in stacked.items()}
        self.biases = {g: b for g, (_, b) in stacked.items()}
        self.out_offsets = pool.out_offsets
        self.n_slices = {g: len(m) for g, m in MODULE_GROUPS.items()}
        num_layers = next(iter(self.weights.values())).shape[0]
        like = {"dtype": pool.dtype, "device": pool.device}
        self.b = {g: torch.zeros(num_layers, num_slots, off[-1], **like)
                  for g, off in self.out_offsets.items()}  # fmt: skip
        self.scales = {g: torch.zeros(num_slots, dtype=torch.float32, device=pool.device)
                       for g in MODULE_GROUPS}  # fmt: skip
        self.tables: dict[str, SlotTable | None] = dict.fromkeys(MODULE_GROUPS)
        self.buckets = [b for b in SLOT_BUCKETS if b < num_slots] + [num_slots]
        if any(block_for(off) is None for off in self.out_offsets.values()):
            raise ValueError("lora_slots needs projection widths that are multiples of 16")

    def rows_needed(self, segments) -> int:
        """Slot rows the batch's distinct sets take in its widest group."""
        first = _first_request_of_each_set(segments.request_sets)
        return max(sum(len(rows[i]) for i in first) for rows, _ in segments.values())

    def bucket_for(self, rows: int) -> int | None:
        if rows > self.num_slots:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, max(rows, 1))]

    def fill(self, segments) -> dict[str, np.ndarray]:
        """Point every module group's slots at the batch's sets (copying rows if they changed)
        and return the kernel's inputs: the tokens grouped by set (num_groups, group_indptr,
        group_tokens, as lora_ops.HostGroups builds them) and per module group each group's
        first slot row and row count (slot_start.{g}, slot_count.{g}). One token per request
        (decode)."""
        if (needed := self.rows_needed(segments)) > self.num_slots:
            raise ValueError(
                f"the batch's sets take {needed} slot rows; there are {self.num_slots}"
            )
        sets = segments.request_sets
        host = HostGroups.build([1] * len(sets), sets)
        parts = {"num_groups": np.array([host.num_groups]), "group_indptr": host.group_indptr,
                 "group_tokens": host.token_ids}  # fmt: skip
        first = _first_request_of_each_set(sets)
        for group, (rows, scales) in segments.items():
            start_of_set, table_rows, table_scales = {}, [], []
            for i in first:
                start_of_set[sets[i]] = len(table_rows)
                table_rows += rows[i]
                table_scales += scales[i]
            self._load(group, SlotTable(tuple(table_rows), tuple(table_scales), self.pool.version))
            parts[f"slot_start.{group}"] = np.array([start_of_set[sets[i]] for i in host.first_seg],
                                                    np.int32)  # fmt: skip
            parts[f"slot_count.{group}"] = np.array([len(rows[i]) for i in host.first_seg],
                                                    np.int32)  # fmt: skip
        return parts

    def _load(self, group: str, table: SlotTable) -> None:
        if self.tables[group] == table or not table.rows:
            return
        n, n_slices = len(table.rows), self.n_slices[group]
        n_out = self.out_offsets[group][-1]
        idx = to_device(table.rows, torch.int64, self.pool.device)
        layers, _, in_dim = self.weights[group].shape
        a = self.pool.a_all[group].index_select(2, idx)  # [L, n_slices, n, in_dim]
        spare = self.weights[group][:, n_out : n_out + n_slices * n]
        spare.view(layers, n, n_slices, in_dim).copy_(a.transpose(1, 2))
        self.b[group][:, :n].copy_(self.pool.b_all[group].index_select(1, idx))
        self.scales[group][:n].copy_(to_device(table.scales, torch.float32, self.pool.device))
        self.tables[group] = table

    def project(self, x: torch.Tensor, layer: int, group: str, bucket: int,
                groups: tuple[torch.Tensor, ...]) -> torch.Tensor:  # fmt: skip
        """y = linear(x) plus each token's LoRA delta: one GEMM over the weight and the first
        `bucket` slots' A rows, then the slot expand. groups: (num_groups, group_indptr,
        group_tokens, group_start, group_count) of slot_expand_. Returns a view of the GEMM's
        output."""
        n_out = self.out_offsets[group][-1]
        rows = n_out + self.n_slices[group] * bucket
        bias = self.biases[group]
        y = F.linear(x, self.weights[group][layer, :rows],
                     None if bias is None else bias[layer, :rows])  # fmt: skip
        expand = slot_expand_ if y.is_cuda else slot_expand_ref
        expand(y, self.out_offsets[group], self.b[group][layer, :bucket],
               self.scales[group][:bucket], *groups)  # fmt: skip
        return y[:, :n_out]


@dataclass
class SlotBatch:
    """The slot inputs of one forward: the bucket (slot rows the GEMMs read), the tokens
    grouped by set (num_groups, group_indptr, group_tokens) and per module group each group's
    (first slot row, slot row count)."""

    slots: AdapterSlots
    bucket: int
    token_groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    rows: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def project(self, x: torch.Tensor, layer: int, group: str) -> torch.Tensor:
        groups = (*self.token_groups, *self.rows[group])
        return self.slots.project(x, layer, group, self.bucket, groups)


def _first_request_of_each_set(request_sets: np.ndarray) -> list[int]:
    """Index of the first request of each distinct set (>= 0), in order of first use."""
    seen: dict[int, int] = {}
    for i, k in enumerate(request_sets.tolist()):
        if k >= 0:
            seen.setdefault(k, i)
    return list(seen.values())
