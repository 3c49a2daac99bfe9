"""Grouped LoRA in one launch: the grouped shrink and expand of one projection in a single grid,
for decode-scale batches whose adapter sets have at most MAX_FUSED_ROWS rank rows.

A chain of dependent launches pays a fixed cost per launch (docs/PERF.md run 12: 4-5 us each,
and the shrink's atomic split-K sums need a zero-filled v: 3 launches per projection). Here
programs take work items from an atomic ticket, every shrink item before any expand item. A
shrink item (group, slice, in_dim split) stores its partial product and counts itself done for
its (group, slice); an expand item (group, slice, column chunk) waits for all splits of its
(group, slice), sums them in split order (deterministic, no zeroed buffer) and streams B.

Invariant (no deadlock): an expand item waits only on shrink items, whose tickets were all taken
by programs already running, and shrink items wait on nothing. So the grid may be larger than
what fits on the GPU at once, and the CPU interpreter, which runs programs one by one, never
waits at all.

The counters (ticket, finished programs, shrink splits done per (group, slice)) live in one
buffer per device that is zero between launches: the last program to finish resets it. So two
launches on one device must not overlap in time; the engine issues them on one stream, or on a
side stream it joins before the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import triton
import triton.language as tl

from .sgmv_expand import _FLOAT_DTYPES, MAX_SLICES, check_offsets
from .sgmv_grouped import (
    DEFAULT_TUNING,
    GroupedTuning,
    _dot_vb,
    _load_b_tile,
    _num_programs,
    _write_y,
    check_groups,
    column_chunks,
    in_dim_splits,
)
from .sgmv_shrink import check_shrink_args, fp32_dot, pow2_block

MAX_FUSED_ROWS = 64  # one rank-row tile per item; wider sets take the two-kernel path
_SYNC_HEADER = 2  # ticket, finished programs; then MAX_SLICES counters per group
_sync_buffers: dict[torch.device, torch.Tensor] = {}
COUNTERS_PER_GROUP = tl.constexpr(MAX_SLICES)  # one per slice


def fused_applies(max_rows: int) -> bool:
    return 0 < max_rows <= MAX_FUSED_ROWS


@triton.jit
def _grouped_lora_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    sync_ptr,
    num_groups_ptr,
    group_indptr_ptr,
    token_ids_ptr,
    row_indptr_ptr,
    row_ids_ptr,
    row_scales_ptr,
    in_dim,
    max_rows,
    k_per_split,
    split_k,
    n_slices,
    off1,
    off2,
    off3,
    col_chunk,
    num_col_chunks,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_br,
    stride_bn,
    stride_yt,
    stride_yn,
    stride_ps,
    stride_pl,
    stride_pt,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    SHRINK_STAGES: tl.constexpr,
    EXPAND_STAGES: tl.constexpr,
):
    num_groups = tl.load(num_groups_ptr)
    shrink_per_group = n_slices * split_k
    num_shrink = num_groups * shrink_per_group
    num_items = num_shrink + num_groups * n_slices * num_col_chunks
    count_ptr = sync_ptr + 2  # after the ticket and the finished-program count
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    while item < num_items:
        if item < num_shrink:
            group = item // shrink_per_group
            slice_id = (item % shrink_per_group) // split_k
            split = item % split_k
            _shrink_item(
                x_ptr, a_ptr, part_ptr, group_indptr_ptr, token_ids_ptr, row_indptr_ptr,
                row_ids_ptr, row_scales_ptr, group, slice_id, split, in_dim, max_rows,
                k_per_split, stride_xt, stride_xk, stride_as, stride_ar, stride_ak,
                stride_ps, stride_pl, stride_pt,
                BLOCK_M, BLOCK_R, BLOCK_K, FP32_DOT, SHRINK_STAGES,
            )  # fmt: skip
            tl.debug_barrier()  # every thread's stores precede the release below
            tl.atomic_add(count_ptr + group * COUNTERS_PER_GROUP + slice_id, 1, sem="release")
        else:
            rest = item - num_shrink
            group = rest // (n_slices * num_col_chunks)
            slice_id = (rest // num_col_chunks) % n_slices
            done_ptr = count_ptr + group * COUNTERS_PER_GROUP + slice_id
            while tl.atomic_add(done_ptr, 0, sem="acquire") < split_k:  # a load-acquire
                pass
            _expand_item(
                b_ptr, y_ptr, part_ptr, group_indptr_ptr, token_ids_ptr, row_indptr_ptr,
                row_ids_ptr, group, slice_id, rest % num_col_chunks, split_k, max_rows,
                off1, off2, off3, col_chunk, stride_br, stride_bn, stride_yt, stride_yn,
                stride_ps, stride_pl, stride_pt,
                BLOCK_M, BLOCK_R, BLOCK_N, FP32_DOT, ACCUMULATE, EXPAND_STAGES,
            )  # fmt: skip
        item = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    # the last program out finds every other program done with the counters and zeroes them
    if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        tl.store(sync_ptr, 0)
        tl.store(sync_ptr + 1, 0)
        num_counters = num_groups * COUNTERS_PER_GROUP
        for c in range(0, num_counters, 256):
            offs = c + tl.arange(0, 256)
            tl.store(count_ptr + offs, tl.zeros((256,), tl.int32), mask=offs < num_counters)


@triton.jit
def _shrink_item(
    x_ptr, a_ptr, part_ptr, group_indptr_ptr, token_ids_ptr, row_indptr_ptr, row_ids_ptr,
    row_scales_ptr, group, slice_id, split, in_dim, max_rows, k_per_split,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_ps, stride_pl, stride_pt,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """part[split, slice, tokens, :] = scaled x[tokens, split's in_dim] @ A[rows].T (zero in
    the columns past the group's rows)."""
    m0 = tl.load(group_indptr_ptr + group)
    m1 = tl.load(group_indptr_ptr + group + 1)
    r0 = tl.load(row_indptr_ptr + group)
    num_rows = tl.minimum(tl.load(row_indptr_ptr + group + 1) - r0, max_rows)
    offs_j = tl.arange(0, BLOCK_R)
    j_mask = offs_j < num_rows
    rows = tl.load(row_ids_ptr + r0 + offs_j, mask=j_mask, other=0).to(tl.int64)
    scales = tl.load(row_scales_ptr + r0 + offs_j, mask=j_mask, other=0.0)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_dim)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slice_id * stride_as + rows[None, :] * stride_ar
    part_base = part_ptr + split * stride_ps + slice_id * stride_pl
    for m in range(m0, m1, BLOCK_M):
        offs_m = m + tl.arange(0, BLOCK_M)
        m_mask = offs_m < m1
        tokens = tl.load(token_ids_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
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
                acc += tl.dot(x, a)
        part_ptrs = part_base + tokens[:, None] * stride_pt + offs_j[None, :]
        tl.store(part_ptrs, acc * scales[None, :], mask=m_mask[:, None])


@triton.jit
def _expand_item(
    b_ptr, y_ptr, part_ptr, group_indptr_ptr, token_ids_ptr, row_indptr_ptr, row_ids_ptr,
    group, slice_id, chunk, split_k, max_rows, off1, off2, off3, col_chunk,
    stride_br, stride_bn, stride_yt, stride_yn, stride_ps, stride_pl, stride_pt,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr, ACCUMULATE: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """y[tokens, chunk's columns] (+)= (sum of the splits' parts) @ B[rows, columns]."""
    col_lo = tl.where(slice_id == 0, 0, tl.where(slice_id == 1, off1, off2))
    col_hi = tl.where(slice_id == 0, off1, tl.where(slice_id == 1, off2, off3))
    n_lo = col_lo + chunk * col_chunk
    n_hi = tl.minimum(n_lo + col_chunk, col_hi)
    m0 = tl.load(group_indptr_ptr + group)
    m1 = tl.load(group_indptr_ptr + group + 1)
    r0 = tl.load(row_indptr_ptr + group)
    num_rows = tl.minimum(tl.load(row_indptr_ptr + group + 1) - r0, max_rows)
    m_end = tl.where(n_lo < n_hi, m1, m0)
    offs_j = tl.arange(0, BLOCK_R)
    j_mask = offs_j < num_rows
    rows = tl.load(row_ids_ptr + r0 + offs_j, mask=j_mask, other=0).to(tl.int64)
    part_base = part_ptr + slice_id * stride_pl + offs_j[None, :]
    for m in range(m0, m_end, BLOCK_M):
        offs_m = m + tl.arange(0, BLOCK_M)
        m_mask = offs_m < m1
        tokens = tl.load(token_ids_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for s in range(split_k):  # another program's stores: read from L2, not L1
            v += tl.load(part_base + s * stride_ps + tokens[:, None] * stride_pt,
                         mask=m_mask[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
        for n in tl.range(n_lo, n_hi, BLOCK_N, num_stages=STAGES):
            offs_n = n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < n_hi
            b = _load_b_tile(b_ptr, rows, j_mask, offs_n, n_mask, stride_br, stride_bn)
            acc = _dot_vb(v, b, FP32_DOT)
            _write_y(y_ptr, tokens, m_mask, offs_n, n_mask, acc, stride_yt, stride_yn,
                     ACCUMULATE)  # fmt: skip


def grouped_lora_ref(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    b_pool: torch.Tensor,
    out_offsets: Sequence[int],
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    token_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    row_scales: torch.Tensor,
    y: torch.Tensor,
    accumulate: bool = True,
) -> None:
    """Pure-torch reference of `grouped_lora` (a loop over groups)."""
    off = list(out_offsets)
    tok_at, rows_at = group_indptr.tolist(), row_indptr.tolist()
    for g in range(int(num_groups.item())):
        tokens = token_ids[tok_at[g] : tok_at[g + 1]].long()
        r0, r1 = rows_at[g], rows_at[g + 1]
        rows, scales = row_ids[r0:r1].long(), row_scales[r0:r1]
        for i in range(len(off) - 1):
            v = (x[tokens].float() @ a_pool[i, rows].float().T) * scales
            delta = v @ b_pool[rows, off[i] : off[i + 1]].float()
            if accumulate:
                delta += y[tokens, off[i] : off[i + 1]].float()
            y[tokens, off[i] : off[i + 1]] = delta.to(y.dtype)


def sync_buffer(device: torch.device, max_groups: int) -> torch.Tensor:
    """The device's counters, zero between launches; grown outside graph capture (the engine's
    warm-up runs every graph's shapes before capturing them)."""
    need = _SYNC_HEADER + MAX_SLICES * max_groups
    buf = _sync_buffers.get(device)
    if buf is None or buf.numel() < need:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"grouped_lora needs {need} counters on {device} and may not allocate them "
                "during CUDA graph capture: run the same shapes once before capturing"
            )
        buf = torch.zeros(max(need, 4096), dtype=torch.int32, device=device)
        _sync_buffers[device] = buf
    return buf


def _check_output(x: torch.Tensor, b_pool: torch.Tensor, y: torch.Tensor) -> None:
    if b_pool.dim() != 2 or y.dim() != 2 or y.shape != (x.shape[0], b_pool.shape[1]):
        raise ValueError(
            f"expected b_pool [num_rows, out_total] and y [T={x.shape[0]}, out_total], got "
            f"{tuple(b_pool.shape)} and {tuple(y.shape)}"
        )
    if b_pool.dtype not in _FLOAT_DTYPES or y.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"b_pool and y must be float tensors, got {b_pool.dtype}, {y.dtype}")
    if b_pool.device != x.device or y.device != x.device:
        raise ValueError(f"x, b_pool, y on {x.device}, {b_pool.device}, {y.device}")


def grouped_lora(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    b_pool: torch.Tensor,
    out_offsets: Sequence[int],
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    token_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    row_scales: torch.Tensor,
    max_rows: int,
    y: torch.Tensor,
    *,
    tuning: GroupedTuning = DEFAULT_TUNING,
    accumulate: bool = True,
) -> None:
    """Semantics:
        for g in range(num_groups):
            tokens = token_ids[group_indptr[g]:group_indptr[g + 1]]
            r0, r1 = row_indptr[g], row_indptr[g + 1]
            rows, sc = row_ids[r0:r1], row_scales[r0:r1]
            for i in range(n_slices):
                cols = slice(out_offsets[i], out_offsets[i + 1])
                v = (x[tokens].float() @ a_pool[i, rows].float().T) * sc
                delta = v @ b_pool[rows, cols].float()
                y[tokens, cols] = y[tokens, cols] + delta if accumulate else delta

    grouped_shrink then grouped_expand in one launch (fp32 accumulation, v rounded to b_pool's
    dtype before the expand product, one rounding to y's dtype); tokens of no group are left
    untouched. Needs max_rows <= MAX_FUSED_ROWS.

    Args:
        x: [T, in_dim]; a_pool: [n_slices, num_rows, in_dim], same float dtype (any strides).
        b_pool: [num_rows, out_total]; out_offsets: n_slices + 1 python ints from 0 to out_total.
        num_groups, group_indptr, token_ids, row_indptr, row_ids, row_scales: as for
            sgmv_grouped.grouped_shrink.
        max_rows: int, >= r1 - r0 for every group.
        y: [T, out_total], updated in place.
    """
    check_shrink_args(x, a_pool, max_rows, None)
    check_groups(num_groups, group_indptr, token_ids, row_indptr, row_ids, x.device, row_scales)
    n_slices, num_tokens, in_dim = a_pool.shape[0], x.shape[0], x.shape[1]
    if not fused_applies(max_rows):
        raise ValueError(f"max_rows {max_rows} must be in 1..{MAX_FUSED_ROWS}")
    _check_output(x, b_pool, y)
    off = check_offsets(out_offsets, n_slices, b_pool.shape[1])
    max_groups = group_indptr.numel() - 1
    if max_groups == 0 or num_tokens == 0 or row_ids.numel() == 0:
        return
    block_r = pow2_block(max_rows, 16, MAX_FUSED_ROWS)
    block_k, k_per_split, split_k = in_dim_splits(in_dim, max_groups * n_slices, x.device, tuning)
    widest = max(b - a for a, b in pairwise(off))
    block_n, chunk, num_col_chunks = column_chunks(widest, max_groups * n_slices, x.device, tuning)
    part = torch.empty(split_k, n_slices, num_tokens, block_r, dtype=torch.float32,
                       device=x.device)  # fmt: skip
    sync = sync_buffer(x.device, max_groups)
    max_items = max_groups * n_slices * (split_k + num_col_chunks)
    programs = _num_programs(max_items, x.device, tuning)
    off += [off[-1]] * (MAX_SLICES + 1 - len(off))
    _grouped_lora_kernel[(programs,)](
        x, a_pool, b_pool, y, part, sync,
        num_groups, group_indptr, token_ids, row_indptr, row_ids, row_scales,
        in_dim, max_rows, k_per_split, split_k, n_slices,
        off[1], off[2], off[3], chunk, num_col_chunks,
        x.stride(0), x.stride(1),
        a_pool.stride(0), a_pool.stride(1), a_pool.stride(2),
        b_pool.stride(0), b_pool.stride(1),
        y.stride(0), y.stride(1),
        part.stride(0), part.stride(1), part.stride(2),
        BLOCK_M=tuning.block_m, BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_N=block_n,
        FP32_DOT=fp32_dot(x.dtype, x.device), ACCUMULATE=accumulate,
        SHRINK_STAGES=tuning.shrink_stages, EXPAND_STAGES=tuning.expand_stages,
        num_warps=tuning.expand_warps,
    )  # fmt: skip
