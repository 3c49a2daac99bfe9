"""Fused grouped SGMV: the shrink and the expand of one projection in one launch, for
decode-scale batches grouped by distinct adapter set (the metadata of `sgmv_grouped`).

A work item is (group, slice, column chunk). Its program computes the group's
v = (x[tokens] @ A_slice[rows]^T) * scales over the whole in_dim, keeps v in registers and adds
v @ B[rows, chunk] to y one BLOCK_N tile at a time. v never goes through memory, so the split-K
zero-fill and the second launch of the two-kernel path are gone: a projection's LoRA is one
graph node instead of three, and at decode sizes each of those nodes is latency-bound, not
bandwidth-bound (docs/PERF.md run 8). The price is that v is recomputed once per column chunk;
the chunks of one (group, slice) are adjacent work items, so they run side by side and all but
the first read A from L2.

Persistent programs stride over num_groups * items_per_group work items, num_groups being read
on the device, so one launch (one CUDA graph) serves every adapter mix, as in `sgmv_grouped`.
v must fit one row tile: max_rows <= MAX_FUSED_ROWS; wider sets use the two-kernel path."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import triton
import triton.language as tl

from .sgmv_expand import MAX_SLICES, check_offsets
from .sgmv_grouped import (
    _add_to_y,
    _dot_vb,
    _load_b_tile,
    _num_programs,
    check_groups,
    grouped_expand_ref,
    grouped_shrink_ref,
)
from .sgmv_shrink import _FLOAT_DTYPES, check_shrink_args, fp32_dot, pow2_block

MAX_FUSED_ROWS = 64


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
    max_rows: int,
    y: torch.Tensor,
) -> None:
    """Pure-torch reference of `grouped_lora`: the grouped shrink then the grouped expand."""
    index = (num_groups, group_indptr, token_ids, row_indptr, row_ids)
    v = grouped_shrink_ref(x, a_pool, *index, row_scales, max_rows)
    grouped_expand_ref(v, b_pool, out_offsets, *index, y)


@triton.jit
def _grouped_lora_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    y_ptr,
    num_groups_ptr,
    group_indptr_ptr,
    token_ids_ptr,
    row_indptr_ptr,
    row_ids_ptr,
    row_scales_ptr,
    in_dim,
    max_rows,
    off1,
    off2,
    off3,
    chunk_cols,
    chunks_per_slice,
    items_per_group,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_br,
    stride_bn,
    stride_yt,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    num_items = tl.load(num_groups_ptr) * items_per_group
    offs_j = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        group = item // items_per_group
        rest = item % items_per_group
        slice_id = rest // chunks_per_slice
        col_lo = tl.where(slice_id == 0, 0, tl.where(slice_id == 1, off1, off2))
        col_hi = tl.where(slice_id == 0, off1, tl.where(slice_id == 1, off2, off3))
        n_lo = col_lo + (rest % chunks_per_slice) * chunk_cols
        n_hi = tl.minimum(n_lo + chunk_cols, col_hi)
        m0 = tl.load(group_indptr_ptr + group)
        m1 = tl.load(group_indptr_ptr + group + 1)
        r0 = tl.load(row_indptr_ptr + group)
        num_rows = tl.minimum(tl.load(row_indptr_ptr + group + 1) - r0, max_rows)
        j_mask = offs_j < num_rows
        rows = tl.load(row_ids_ptr + r0 + offs_j, mask=j_mask, other=0).to(tl.int64)
        scales = tl.load(row_scales_ptr + r0 + offs_j, mask=j_mask, other=0.0)
        a_base = a_ptr + slice_id * stride_as + rows[None, :] * stride_ar
        m_end = tl.where((num_rows > 0) & (n_lo < n_hi), m1, m0)
        for m in range(m0, m_end, BLOCK_M):
            offs_m = m + tl.arange(0, BLOCK_M)
            m_mask = offs_m < m1
            tokens = tl.load(token_ids_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
            acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k in range(0, in_dim, BLOCK_K):
                k_mask = (k + offs_k) < in_dim
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
            v = acc * scales[None, :]
            for n in range(n_lo, n_hi, BLOCK_N):
                offs_n = n + tl.arange(0, BLOCK_N)
                n_mask = offs_n < n_hi
                b = _load_b_tile(b_ptr, rows, j_mask, offs_n, n_mask, stride_br, stride_bn)
                out = _dot_vb(v, b, FP32_DOT)
                _add_to_y(y_ptr, tokens, m_mask, offs_n, n_mask, out, stride_yt, stride_yn)


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
    tuning,
) -> None:
    """Semantics:
        for g in range(num_groups):
            tokens = token_ids[group_indptr[g]:group_indptr[g + 1]]
            r0, r1 = row_indptr[g], row_indptr[g + 1]
            rows, sc = row_ids[r0:r1], row_scales[r0:r1]
            for i in range(n_slices):
                cols = slice(out_offsets[i], out_offsets[i + 1])
                v = (x[tokens].float() @ a_pool[i, rows].float().T) * sc
                y[tokens, cols] += v @ b_pool[rows, cols].float()

    Updates y in place (fp32 accumulation, one rounding to y's dtype); tokens of no group and
    groups with no rows leave y untouched. With a 16-bit b_pool, v is rounded to b_pool's dtype
    before the expand product, as in grouped_expand.

    Args:
        x: [T, in_dim], float16/bfloat16/float32; a_pool: [n_slices, num_rows, in_dim], same dtype.
        b_pool: [num_rows, out_total], float16/bfloat16/float32 (any strides).
        out_offsets: n_slices + 1 python ints rising from 0 to out_total; 1 <= n_slices <= 3.
        num_groups, group_indptr, token_ids, row_indptr, row_ids, row_scales: the groups, as for
            `grouped_shrink`.
        max_rows: int, >= r1 - r0 for every group, <= MAX_FUSED_ROWS.
        y: [T, out_total], float16/bfloat16/float32, updated in place.
        tuning: a sgmv_grouped.GroupedTuning (fused_block_k, chunk_cols, block_n, block_m,
            programs_per_sm, num_warps, num_stages).
    """
    check_shrink_args(x, a_pool, max_rows, None)
    check_groups(num_groups, group_indptr, token_ids, row_indptr, row_ids, x.device, row_scales)
    _check_fused_args(x, b_pool, y, max_rows)
    n_slices, num_tokens, in_dim = a_pool.shape[0], x.shape[0], x.shape[1]
    off = check_offsets(out_offsets, n_slices, b_pool.shape[1])
    max_groups = group_indptr.numel() - 1
    if max_groups == 0 or num_tokens == 0 or max_rows == 0 or row_ids.numel() == 0:
        return
    widest = max(b - a for a, b in pairwise(off))
    block_n = pow2_block(min(widest, tuning.block_n), 16, 512)
    chunk_cols = triton.cdiv(max(tuning.chunk_cols, block_n), block_n) * block_n
    chunks_per_slice = triton.cdiv(max(widest, 1), chunk_cols)
    items_per_group = n_slices * chunks_per_slice
    programs = _num_programs(max_groups * items_per_group, x.device, tuning)
    off += [off[-1]] * (MAX_SLICES + 1 - len(off))
    _grouped_lora_kernel[(programs,)](
        x, a_pool, b_pool, y, num_groups, group_indptr, token_ids, row_indptr, row_ids,
        row_scales, in_dim, max_rows, off[1], off[2], off[3], chunk_cols, chunks_per_slice,
        items_per_group,
        x.stride(0), x.stride(1),
        a_pool.stride(0), a_pool.stride(1), a_pool.stride(2),
        b_pool.stride(0), b_pool.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_M=tuning.block_m, BLOCK_R=pow2_block(max_rows, 16, MAX_FUSED_ROWS),
        BLOCK_K=pow2_block(min(tuning.fused_block_k, in_dim), 16, 512), BLOCK_N=block_n,
        FP32_DOT=fp32_dot(x.dtype, x.device), num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
    )  # fmt: skip


def _check_fused_args(x: torch.Tensor, b_pool: torch.Tensor, y: torch.Tensor, max_rows) -> None:
    if b_pool.dim() != 2 or y.dim() != 2:
        raise ValueError(
            f"expected b_pool [num_rows, out_total] and y [T, out_total], "
            f"got {tuple(b_pool.shape)}, {tuple(y.shape)}"
        )
    if y.shape != (x.shape[0], b_pool.shape[1]):
        raise ValueError(f"y {tuple(y.shape)} must be [T={x.shape[0]}, {b_pool.shape[1]}]")
    if b_pool.dtype not in _FLOAT_DTYPES or y.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"b_pool and y must be float tensors, got {b_pool.dtype}, {y.dtype}")
    if b_pool.device != x.device or y.device != x.device:
        raise ValueError(f"b_pool ({b_pool.device}) and y ({y.device}) must be on {x.device}")
    if max_rows > MAX_FUSED_ROWS:
        raise ValueError(f"max_rows {max_rows} > {MAX_FUSED_ROWS}: use the two-kernel path")
