"""Grouped SGMV for decode-scale batches: the LoRA work is split by distinct adapter set, not
by request. A group owns its rank rows (a stack of k adapters is one group) and a list of token
indices (a gather: activations are not reordered); each program takes (group, tile) work items
and loops over the group's tokens BLOCK_M at a time, so a set's rows are read once per group
per step and the grid depends on neither group lengths nor batch order (one graph serves every
adapter mix). The metadata splits a popular set's tokens into groups of at most 16
(kernels.lora_ops.GROUP_TOKENS): one program looping over 50 tokens serialises.

Programs are persistent: a fixed number of programs strides over the num_groups * tiles work
items, num_groups being read on the device, so groups a CUDA-graph bucket holds but a step does
not use cost no thread blocks.

Launches use programmatic dependent launch where the GPU has it (GroupedTuning.pdl): a
kernel's programs start, and read the host-written metadata, while the previous kernel drains.

Prefill chunks are grouped too, 16 tokens a group: a step mixing 900 decodes over 100 adapters
with 44 prefill chunks runs its LoRA deltas 8x faster than with the per-segment kernels
(sgmv_shrink/sgmv_expand, whose grid is every segment times the longest one's tiles), and a
lone 2k-token prompt no slower (docs/PERF.md)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import NamedTuple

import torch

from .sgmv_expand import MAX_SLICES, check_expand_args, check_offsets, expand_fp32_dot
from .sgmv_shrink import (
    check_index_tensors,
    check_shrink_args,
    dequantized_rows,
    fp32_dot,
    pow2_block,
    qscale_strides,
    sm_count,
)
from .triton_compat import cdiv, gdc_launch_dependents, gdc_wait, next_power_of_2, tl, triton

_CPU_PROGRAMS = 3  # the interpreter runs programs one by one: a few exercise the striding
MIN_BLOCK_N = 64  # expand tiles are never narrower than this (small buckets narrow them)
MAX_PARTS_PER_STEP = 8  # the expand's loads of the shrink's partial sums in flight at once
MAX_MERGED_ROWS = 64  # merge_slices: columns of a merged shrink tile (slices x row tile)


@dataclass(frozen=True)
class GroupedTuning:
    """Launch parameters of the grouped kernels (defaults from the H200 sweeps of
    scripts/bench_sgmv.py)."""

    k_chunk: int = 1024  # shrink: in_dim per split (split_k = cdiv(in_dim, k_chunk))
    block_k: int = 128
    shrink_warps: int = 2
    shrink_stages: int = 3  # software pipelining depth of the shrink's in_dim loop
    block_n: int = 128  # expand: output columns per step of a work item's column loop
    col_chunk: int = 2048  # expand: output columns per work item (block_n times a power of 2)
    expand_warps: int = 4
    expand_stages: int = 3  # software pipelining depth of the expand's column loop
    block_m: int = 16  # tokens per step of a group's token loop
    programs_per_sm: int = 8  # persistent programs per SM (0: one program per work item)
    # small buckets (batch 1, a few groups) split in_dim finer and use narrower expand tiles
    # until a full bucket has this many work items per SM: at those sizes every launch is
    # latency-bound, so short programs beat long ones (0: off)
    min_items_per_sm: int = 4
    # programmatic dependent launch (sm_90+): a kernel's programs start while the kernel
    # before it in the stream drains, and wait (griddepcontrol.wait) before reading its output
    pdl: bool = True
    # shrink: one work item covers every slice of a fused projection (q/k/v, gate/up) as one
    # tile of up to MAX_MERGED_ROWS columns, so a program has n_slices times the bytes in
    # flight
    merge_slices: bool = True


DEFAULT_TUNING = GroupedTuning()
WIDE_ROWS_TUNING = GroupedTuning(k_chunk=2048)  # faster than k_chunk=1024 at 80 rows
WIDE_ROWS = 32


# A deferred delta's kernels run beside a base GEMM on a side stream (LoraContext, graphs of
# <= 32 tokens). There, early-launched PDL programs hold SM slots the GEMM needs, so they run
# without PDL, with fewer, wider and longer-stepping shrink programs.
BESIDE_GEMM = {"pdl": False, "shrink_warps": 8, "block_k": 256, "block_n": 256, "col_chunk": 256,
               "expand_stages": 1, "min_items_per_sm": 1}


def tuning_for_rows(max_rows: int, beside_gemm: bool = False) -> GroupedTuning:
    tuning = WIDE_ROWS_TUNING if max_rows > WIDE_ROWS else DEFAULT_TUNING
    return dataclasses.replace(tuning, **BESIDE_GEMM) if beside_gemm else tuning


def grouped_shrink_ref(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    token_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    row_scales: torch.Tensor,
    max_rows: int,
    qscales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference of `grouped_shrink` (a loop over groups; zero where unspecified)."""
    v = torch.zeros(a_pool.shape[0], x.shape[0], max_rows, dtype=torch.float32, device=x.device)
    tok_at, rows_at = group_indptr.tolist(), row_indptr.tolist()
    for g in range(int(num_groups.item())):
        tokens = token_ids[tok_at[g] : tok_at[g + 1]].long()
        r0, r1 = rows_at[g], rows_at[g + 1]
        a_rows = dequantized_rows(a_pool, row_ids[r0:r1].long(), qscales)
        delta = (x[tokens].float() @ a_rows.transpose(1, 2)) * row_scales[r0:r1]
        v[:, tokens, : r1 - r0] = delta
    return v


def grouped_expand_ref(
    v: torch.Tensor,
    b_pool: torch.Tensor,
    out_offsets: Sequence[int],
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    token_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    y: torch.Tensor,
    accumulate: bool = True,
) -> None:
    """Pure-torch reference of `grouped_expand` (a loop over groups)."""
    if v.dim() == 4:
        v = v.sum(0)
    off = list(out_offsets)
    tok_at, rows_at = group_indptr.tolist(), row_indptr.tolist()
    for g in range(int(num_groups.item())):
        tokens = token_ids[tok_at[g] : tok_at[g + 1]].long()
        r0, r1 = rows_at[g], rows_at[g + 1]
        b_rows = b_pool[row_ids[r0:r1].long()].float()
        for i in range(len(off) - 1):
            delta = v[i][tokens][:, : r1 - r0] @ b_rows[:, off[i] : off[i + 1]]
            if accumulate:
                delta += y[tokens, off[i] : off[i + 1]].float()
            y[tokens, off[i] : off[i + 1]] = delta.to(y.dtype)


# the work-item counts follow a step's groups and rows: were they specialized (Triton does on 1
# and on divisibility by 16), a step with a new group count could compile a variant of its own
@triton.jit(do_not_specialize=["items_per_group", "num_row_tiles", "split_k"])
def _grouped_shrink_kernel(
    x_ptr,
    a_ptr,
    v_ptr,
    num_groups_ptr,
    group_indptr_ptr,
    token_ids_ptr,
    row_indptr_ptr,
    row_ids_ptr,
    row_scales_ptr,
    qscales_ptr,
    in_dim,
    max_rows,
    n_slices,
    slices_per_item,
    k_per_split,
    items_per_group,
    num_row_tiles,
    split_k,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_qs,
    stride_qr,
    stride_vp,
    stride_vs,
    stride_vt,
    stride_vr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SLICE_TILE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DEQUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    _launch_next_kernel(PDL)
    num_items = tl.load(num_groups_ptr) * items_per_group
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        group = item // items_per_group
        rest = item % items_per_group
        row_tile = rest % num_row_tiles
        split = (rest // num_row_tiles) % split_k
        slice_tile = rest // (num_row_tiles * split_k)
        m0 = tl.load(group_indptr_ptr + group)
        m1 = tl.load(group_indptr_ptr + group + 1)
        r0 = tl.load(row_indptr_ptr + group)
        num_rows = tl.minimum(tl.load(row_indptr_ptr + group + 1) - r0, max_rows)
        # column c of the tile: row (row tile, c % BLOCK_R) of slice (slice tile, c // BLOCK_R)
        offs_c = tl.arange(0, SLICE_TILE * BLOCK_R)
        in_item = offs_c // BLOCK_R
        slice_ids = slice_tile * slices_per_item + in_item
        offs_j = row_tile * BLOCK_R + offs_c % BLOCK_R
        j_mask = (offs_j < num_rows) & (in_item < slices_per_item) & (slice_ids < n_slices)
        rows = tl.load(row_ids_ptr + r0 + offs_j, mask=j_mask, other=0).to(tl.int64)
        scales = tl.load(row_scales_ptr + r0 + offs_j, mask=j_mask, other=0.0)
        if DEQUANT:
            qs_ptrs = qscales_ptr + slice_ids.to(tl.int64) * stride_qs + rows * stride_qr
            scales *= tl.load(qs_ptrs, mask=j_mask, other=0.0)
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, in_dim)
        offs_k = tl.arange(0, BLOCK_K)
        a_base = a_ptr + slice_ids[None, :].to(tl.int64) * stride_as + rows[None, :] * stride_ar
        _wait_for_previous_kernel(PDL)  # x is the previous kernel's output
        if row_tile * BLOCK_R < num_rows:
            for m in range(m0, m1, BLOCK_M):
                offs_m = m + tl.arange(0, BLOCK_M)
                m_mask = offs_m < m1
                tokens = tl.load(token_ids_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
                acc = tl.zeros((BLOCK_M, SLICE_TILE * BLOCK_R), dtype=tl.float32)
                for k in range(k_lo, k_hi, BLOCK_K):
                    k_mask = (k + offs_k) < k_hi
                    x = tl.load(
                        x_ptr + tokens[:, None] * stride_xt + (k + offs_k)[None, :] * stride_xk,
                        mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0,
                    )
                    a = tl.load(
                        a_base + (k + offs_k)[:, None] * stride_ak,
                        mask=k_mask[:, None] & j_mask[None, :],
                        other=0.0,
                    )
                    if FP32_DOT:
                        acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
                    else:
                        acc += tl.dot(x, a.to(x.dtype))  # a no-op cast unless the pool is int8
                v_ptrs = (
                    v_ptr
                    + split * stride_vp
                    + slice_ids[None, :] * stride_vs
                    + tokens[:, None] * stride_vt
                    + offs_j[None, :] * stride_vr
                )
                tl.store(v_ptrs, acc * scales[None, :], mask=m_mask[:, None] & j_mask[None, :])
    _wait_for_previous_kernel(PDL)  # a program with no work item must wait too


@triton.jit(do_not_specialize=["num_col_chunks", "items_per_group", "num_parts"])  # see shrink
def _grouped_expand_kernel(
    v_ptr,
    b_ptr,
    y_ptr,
    num_groups_ptr,
    group_indptr_ptr,
    token_ids_ptr,
    row_indptr_ptr,
    row_ids_ptr,
    max_rows,
    off1,
    off2,
    off3,
    col_chunk,
    num_col_chunks,
    items_per_group,
    num_parts,
    stride_vp,
    stride_vs,
    stride_vt,
    stride_vr,
    stride_br,
    stride_bn,
    stride_yt,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_ROW_TILE: tl.constexpr,
    PARTS_PER_STEP: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INT8_B: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    _launch_next_kernel(PDL)
    num_items = tl.load(num_groups_ptr) * items_per_group
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        group = item // items_per_group
        rest = item % items_per_group
        slice_id = rest // num_col_chunks
        col_lo = tl.where(slice_id == 0, 0, tl.where(slice_id == 1, off1, off2))
        col_hi = tl.where(slice_id == 0, off1, tl.where(slice_id == 1, off2, off3))
        n_lo = col_lo + (rest % num_col_chunks) * col_chunk
        n_hi = tl.minimum(n_lo + col_chunk, col_hi)
        m0 = tl.load(group_indptr_ptr + group)
        m1 = tl.load(group_indptr_ptr + group + 1)
        r0 = tl.load(row_indptr_ptr + group)
        num_rows = tl.minimum(tl.load(row_indptr_ptr + group + 1) - r0, max_rows)
        m_end = tl.where((num_rows > 0) & (n_lo < n_hi), m1, m0)
        v_slice = v_ptr + slice_id * stride_vs
        _wait_for_previous_kernel(PDL)  # v (and y) come from earlier kernels
        if ONE_ROW_TILE:  # rows and v are loaded once per token block, B streams by column
            offs_j = tl.arange(0, BLOCK_R)
            j_mask = offs_j < num_rows
            rows = tl.load(row_ids_ptr + r0 + offs_j, mask=j_mask, other=0).to(tl.int64)
            for m in range(m0, m_end, BLOCK_M):
                offs_m = m + tl.arange(0, BLOCK_M)
                m_mask = offs_m < m1
                tokens = tl.load(token_ids_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
                v = _load_v(v_slice, tokens, offs_j, m_mask, j_mask, num_parts, stride_vp,
                            stride_vt, stride_vr, BLOCK_M, BLOCK_R, PARTS_PER_STEP)
                for n in tl.range(n_lo, n_hi, BLOCK_N, num_stages=NUM_STAGES):
                    offs_n = n + tl.arange(0, BLOCK_N)
                    n_mask = offs_n < n_hi
                    b = _load_b_tile(b_ptr, rows, j_mask, offs_n, n_mask, stride_br, stride_bn)
                    acc = dot_vb(v, b, FP32_DOT, INT8_B)
                    _write_y(y_ptr, tokens, m_mask, offs_n, n_mask, acc, stride_yt, stride_yn,
                             ACCUMULATE)
        else:
            for m in range(m0, m_end, BLOCK_M):
                offs_m = m + tl.arange(0, BLOCK_M)
                m_mask = offs_m < m1
                tokens = tl.load(token_ids_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
                for n in range(n_lo, n_hi, BLOCK_N):
                    offs_n = n + tl.arange(0, BLOCK_N)
                    n_mask = offs_n < n_hi
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                    for j in range(0, num_rows, BLOCK_R):
                        offs_j = j + tl.arange(0, BLOCK_R)
                        j_mask = offs_j < num_rows
                        rows = tl.load(row_ids_ptr + r0 + offs_j, mask=j_mask, other=0)
                        v = _load_v(v_slice, tokens, offs_j, m_mask, j_mask, num_parts,
                                    stride_vp, stride_vt, stride_vr, BLOCK_M, BLOCK_R,
                                    PARTS_PER_STEP)
                        b = _load_b_tile(b_ptr, rows.to(tl.int64), j_mask, offs_n, n_mask,
                                         stride_br, stride_bn)
                        acc += dot_vb(v, b, FP32_DOT, INT8_B)
                    _write_y(y_ptr, tokens, m_mask, offs_n, n_mask, acc, stride_yt, stride_yn,
                             ACCUMULATE)
    _wait_for_previous_kernel(PDL)  # a program with no work item must wait too


@triton.jit
def _launch_next_kernel(PDL: tl.constexpr):
    """Programmatic dependent launch: the next kernel's programs may start now; they wait for
    this whole grid (and, through its waits, every earlier kernel) before reading its output."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _wait_for_previous_kernel(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has completed and its writes are visible.
    Only the metadata (written by host copies before the launch) is read before it. Every
    program must wait at least once, or a grid could finish before its predecessor."""
    if PDL:
        gdc_wait()


@triton.jit
def _load_v(v_slice, tokens, offs_j, m_mask, j_mask, num_parts, stride_vp, stride_vt, stride_vr,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
            PARTS_PER_STEP: tl.constexpr):
    """The tokens' rank-space activations: the shrink's in_dim partial sums, added in order,
    PARTS_PER_STEP loads in flight at a time (a batch-1 expand adds up to 16 of them)."""
    ptrs = v_slice + tokens[:, None] * stride_vt + offs_j[None, :] * stride_vr
    mask = m_mask[:, None] & j_mask[None, :]
    v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for first in range(0, num_parts, PARTS_PER_STEP):
        for i in tl.static_range(PARTS_PER_STEP):
            part = tl.full((1, 1), first + i, tl.int32)
            v += tl.load(ptrs + part * stride_vp, mask=mask & (part < num_parts), other=0.0)
    return v


@triton.jit
def _load_b_tile(b_ptr, rows, j_mask, offs_n, n_mask, stride_br, stride_bn):
    return tl.load(
        b_ptr + rows[:, None] * stride_br + offs_n[None, :] * stride_bn,
        mask=j_mask[:, None] & n_mask[None, :],
        other=0.0,
    )


@triton.jit
def dot_vb(v, b, FP32_DOT: tl.constexpr, INT8_B: tl.constexpr):
    """v @ b as an expand multiplies: fp32 (ieee) with FP32_DOT; int8 b in bfloat16, in which
    its values are exact (v carries its row scales); else in b's dtype."""
    if FP32_DOT:
        out = tl.dot(v, b.to(tl.float32), input_precision="ieee")
    elif INT8_B:  # int8 values are exact in bfloat16; v carries B's row scales
        out = tl.dot(v.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        out = tl.dot(v.to(b.dtype), b)
    return out


@triton.jit
def _write_y(y_ptr, tokens, m_mask, offs_n, n_mask, acc, stride_yt, stride_yn,
             ACCUMULATE: tl.constexpr):
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :] * stride_yn
    y_mask = m_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def check_groups(
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    token_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    device: torch.device,
    row_scales: torch.Tensor | None = None,
) -> None:
    """Shape/dtype/device checks of the group metadata (host-only, never syncs)."""
    named = {
        "num_groups": num_groups,
        "group_indptr": group_indptr,
        "token_ids": token_ids,
        "row_indptr": row_indptr,
        "row_ids": row_ids,
    }
    if num_groups.numel() != 1:
        raise ValueError(f"num_groups must hold one count, got shape {tuple(num_groups.shape)}")
    if group_indptr.numel() < 1 or row_indptr.shape != group_indptr.shape:
        raise ValueError(
            f"group_indptr {tuple(group_indptr.shape)} and row_indptr "
            f"{tuple(row_indptr.shape)} must both have shape [max_groups + 1]"
        )
    check_index_tensors(named, row_ids, row_scales, device)


def _wanted_splits(items: int, device: torch.device, tuning: GroupedTuning) -> int:
    """How many times finer a launch of `items` work items should split them to reach
    tuning.min_items_per_sm per SM (1: enough items already)."""
    sms = sm_count(device.index) if device.type == "cuda" else _CPU_PROGRAMS
    return max(1, cdiv(tuning.min_items_per_sm * sms, max(items, 1)))


def _use_pdl(device: torch.device, tuning: GroupedTuning) -> bool:
    """griddepcontrol needs sm_90 (Hopper) or newer; ROCm and the CPU interpreter lack it."""
    return tuning.pdl and device.type == "cuda" and _has_griddepcontrol(device.index)


@functools.cache
def _has_griddepcontrol(device_index: int | None) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] >= 9


def _launch_options(device: torch.device, tuning: GroupedTuning) -> dict:
    return {"launch_pdl": True} if _use_pdl(device, tuning) else {}


def _num_programs(max_items: int, device: torch.device, tuning: GroupedTuning) -> int:
    if device.type != "cuda":
        return max(1, min(max_items, _CPU_PROGRAMS))
    if tuning.programs_per_sm == 0:
        return max(1, max_items)
    return max(1, min(max_items, tuning.programs_per_sm * sm_count(device.index)))


class _ShrinkPlan(NamedTuple):
    block_k: int
    block_r: int
    num_row_tiles: int
    slices_per_item: int
    slice_tile: int
    k_per_split: int
    split_k: int
    items_per_group: int
    programs: int


@functools.lru_cache(maxsize=4096)
def _shrink_plan(n_slices: int, in_dim: int, max_rows: int, max_groups: int,
                 device: torch.device, tuning: GroupedTuning) -> _ShrinkPlan:
    """grouped_shrink's tiles, splits and programs, by its shapes (worked out once each: the
    Python a projection's launch costs)."""
    block_k = pow2_block(min(tuning.block_k, in_dim), 16, 256)
    block_r = pow2_block(max_rows, 16, 64)
    num_row_tiles = cdiv(max_rows, block_r)
    slice_tile = next_power_of_2(n_slices)
    merge = tuning.merge_slices and n_slices > 1 and slice_tile * block_r <= MAX_MERGED_ROWS
    slices_per_item, slice_tile = (n_slices, slice_tile) if merge else (1, 1)
    num_slice_tiles = cdiv(n_slices, slices_per_item)
    wanted = _wanted_splits(max_groups * num_slice_tiles * num_row_tiles, device, tuning)
    k_chunk = min(tuning.k_chunk, in_dim, cdiv(in_dim, wanted))
    k_per_split = cdiv(k_chunk, block_k) * block_k
    split_k = cdiv(in_dim, k_per_split)
    items_per_group = num_slice_tiles * split_k * num_row_tiles
    programs = _num_programs(max_groups * items_per_group, device, tuning)
    return _ShrinkPlan(block_k, block_r, num_row_tiles, slices_per_item, slice_tile,
                       k_per_split, split_k, items_per_group, programs)


class _ExpandPlan(NamedTuple):
    block_r: int
    block_n: int
    chunk: int
    num_col_chunks: int
    items_per_group: int
    programs: int


@functools.lru_cache(maxsize=4096)
def _expand_plan(n_slices: int, widest: int, max_rows: int, max_groups: int,
                 device: torch.device, tuning: GroupedTuning) -> _ExpandPlan:
    """grouped_expand's tiles, column chunks and programs, by its shapes (as _shrink_plan)."""
    block_r = pow2_block(max_rows, 16, 32)
    block_n = pow2_block(min(widest, tuning.block_n), 16, 512)
    chunk = block_n  # columns per work item: block_n times a power of 2
    while chunk * 2 <= tuning.col_chunk and chunk < widest:
        chunk *= 2
    while chunk > MIN_BLOCK_N and _wanted_splits(
        max_groups * n_slices * cdiv(max(widest, 1), chunk), device, tuning
    ) > 1:
        chunk //= 2
        block_n = min(block_n, chunk)
    num_col_chunks = cdiv(max(widest, 1), chunk)
    items_per_group = n_slices * num_col_chunks
    programs = _num_programs(max_groups * items_per_group, device, tuning)
    return _ExpandPlan(block_r, block_n, chunk, num_col_chunks, items_per_group, programs)


def grouped_shrink(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    token_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    row_scales: torch.Tensor,
    max_rows: int,
    *,
    tuning: GroupedTuning = DEFAULT_TUNING,
    qscales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics:
        # ks_list: P column ranges that tile in_dim (chunks of k_chunk, see below)
        v = empty(P, n_slices, T, max_rows, dtype=float32)
        for g in range(num_groups):
            tokens = token_ids[group_indptr[g]:group_indptr[g + 1]]
            r0, r1 = row_indptr[g], row_indptr[g + 1]
            rows, sc = row_ids[r0:r1], row_scales[r0:r1]
            for i in range(n_slices):
                a_rows = a_pool[i, rows].float()
                if qscales is not None:  # an int8 pool
                    a_rows *= qscales[i, rows, None]
                for p, ks in enumerate(ks_list):
                    v[p, i, tokens, :r1 - r0] = (x[tokens, ks].float() @ a_rows[:, ks].T) * sc
        # v.sum(0)[i, tokens, :r1 - r0] is the group's x @ A.T * sc

    Only those entries are defined; every other entry of v is unspecified (grouped_expand never
    reads them). Groups must not share tokens. in_dim is split in chunks of at most
    tuning.k_chunk (finer for small buckets: GroupedTuning.min_items_per_sm); each split stores
    its partial sum and the expand adds them up in order, so nothing needs zeroing and results
    are deterministic.

    Args:
        x: [T, in_dim], float16/bfloat16/float32.
        a_pool: [n_slices, num_rows, in_dim], same dtype as x, or int8 (any strides).
        num_groups: [1] int32 on the device, groups in use (<= max_groups).
        group_indptr: [max_groups + 1] int32, offsets into token_ids.
        token_ids: [M] int32, tokens of each group (M <= T, no token twice).
        row_indptr: [max_groups + 1] int32, offsets into row_ids.
        row_ids: [N] int32, pool rows of each group; row_scales: [N] float32, their weights.
        max_rows: int, >= r1 - r0 for every group; the width of v.
        qscales: [n_slices, num_rows] float32, given exactly for an int8 a_pool (as for
            sgmv_shrink).

    Returns:
        v: [P, n_slices, T, max_rows] float32, the partial sums of the P in_dim splits.
    """
    check_shrink_args(x, a_pool, max_rows, None, qscales)
    check_groups(num_groups, group_indptr, token_ids, row_indptr, row_ids, x.device, row_scales)
    n_slices, num_tokens, in_dim = a_pool.shape[0], x.shape[0], x.shape[1]
    max_groups = group_indptr.numel() - 1
    plan = _shrink_plan(n_slices, in_dim, max_rows, max_groups, x.device, tuning)
    v = torch.empty(plan.split_k, n_slices, num_tokens, max_rows, dtype=torch.float32,
                    device=x.device)
    if max_groups == 0 or num_tokens == 0 or max_rows == 0 or row_ids.numel() == 0:
        return v
    _grouped_shrink_kernel[(plan.programs,)](
        x, a_pool, v, num_groups, group_indptr, token_ids, row_indptr, row_ids, row_scales,
        row_scales if qscales is None else qscales,
        in_dim, max_rows, n_slices, plan.slices_per_item, plan.k_per_split,
        plan.items_per_group, plan.num_row_tiles, plan.split_k,
        x.stride(0), x.stride(1),
        a_pool.stride(0), a_pool.stride(1), a_pool.stride(2),
        *qscale_strides(qscales),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3),
        BLOCK_M=tuning.block_m, BLOCK_R=plan.block_r, SLICE_TILE=plan.slice_tile,
        BLOCK_K=plan.block_k,
        FP32_DOT=fp32_dot(x.dtype, x.device), DEQUANT=qscales is not None,
        PDL=_use_pdl(x.device, tuning),
        num_warps=tuning.shrink_warps, num_stages=tuning.shrink_stages,
        **_launch_options(x.device, tuning),
    )
    return v


def grouped_expand(
    v: torch.Tensor,
    b_pool: torch.Tensor,
    out_offsets: Sequence[int],
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    token_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    y: torch.Tensor,
    *,
    tuning: GroupedTuning = DEFAULT_TUNING,
    accumulate: bool = True,
    act_dtype: torch.dtype | None = None,
) -> None:
    """Semantics:
        for g in range(num_groups):
            tokens = token_ids[group_indptr[g]:group_indptr[g + 1]]
            r0, r1 = row_indptr[g], row_indptr[g + 1]
            rows = row_ids[r0:r1]
            for i in range(n_slices):
                cols = slice(out_offsets[i], out_offsets[i + 1])
                delta = v[i, tokens, :r1 - r0] @ b_pool[rows, cols].float()
                y[tokens, cols] = y[tokens, cols] + delta if accumulate else delta

    Accumulates into y in place, or overwrites (accumulate=False), with fp32 accumulation and
    one rounding to y's dtype; tokens of no group and groups with no rows leave y untouched.
    With a 16-bit b_pool, v is rounded to b_pool's dtype before the product (tensor cores), as
    in sgmv_expand, which also says how an int8 b_pool is read.

    Args:
        v: [n_slices, T, max_rows] float32, or [P, n_slices, T, max_rows]: `grouped_shrink`'s
            P partial sums, which are added in order (the Semantics' v is their sum).
        b_pool: [num_rows, out_total], float16/bfloat16/float32/int8 (any strides).
        out_offsets: n_slices + 1 python ints rising from 0 to out_total; 1 <= n_slices <= 3.
        num_groups, group_indptr, token_ids, row_indptr, row_ids: as for `grouped_shrink`.
        y: [T, out_total], float16/bfloat16/float32, updated in place.
        act_dtype: the model's activation dtype (None: y's), as for sgmv_expand.
    """
    parts = v if v.dim() == 4 else v.unsqueeze(0)
    check_expand_args(parts[0], b_pool, y)
    check_groups(num_groups, group_indptr, token_ids, row_indptr, row_ids, v.device)
    n_slices, num_tokens, max_rows = parts.shape[1:]
    off = check_offsets(out_offsets, n_slices, b_pool.shape[1])
    max_groups = group_indptr.numel() - 1
    if max_groups == 0 or num_tokens == 0 or max_rows == 0 or row_ids.numel() == 0:
        return
    widest = max(b - a for a, b in pairwise(off))
    plan = _expand_plan(n_slices, widest, max_rows, max_groups, v.device, tuning)
    off += [off[-1]] * (MAX_SLICES + 1 - len(off))
    _grouped_expand_kernel[(plan.programs,)](
        parts, b_pool, y, num_groups, group_indptr, token_ids, row_indptr, row_ids,
        max_rows, off[1], off[2], off[3], plan.chunk, plan.num_col_chunks, plan.items_per_group,
        parts.shape[0], parts.stride(0), parts.stride(1), parts.stride(2), parts.stride(3),
        b_pool.stride(0), b_pool.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=tuning.block_m, BLOCK_R=plan.block_r, BLOCK_N=plan.block_n,
        ONE_ROW_TILE=max_rows <= plan.block_r,
        PARTS_PER_STEP=min(MAX_PARTS_PER_STEP, next_power_of_2(parts.shape[0])),
        FP32_DOT=expand_fp32_dot(b_pool.dtype, act_dtype or y.dtype, b_pool.device),
        INT8_B=b_pool.dtype == torch.int8, ACCUMULATE=accumulate,
        NUM_STAGES=tuning.expand_stages, PDL=_use_pdl(v.device, tuning),
        num_warps=tuning.expand_warps, **_launch_options(v.device, tuning),
    )
