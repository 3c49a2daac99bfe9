"""SGMV expand: per-segment y += v @ B (or y = v @ B) over a paged LoRA pool (Punica SGMV, S-LoRA
pages)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch

from .sgmv_shrink import check_batch_meta, fp32_dot, pow2_block
from .triton_compat import cdiv, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_B_DTYPES = (*_FLOAT_DTYPES, torch.int8)
MAX_SLICES = 3


def sgmv_expand_ref(
    v: torch.Tensor,
    b_pool: torch.Tensor,
    out_offsets: Sequence[int],
    seg_indptr: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    y: torch.Tensor,
    accumulate: bool = True,
) -> None:
    """Pure-torch reference of `sgmv_expand` (a loop over segments; slow, exact)."""
    off = list(out_offsets)
    seg, rows_at = seg_indptr.tolist(), row_indptr.tolist()
    for s in range(len(seg) - 1):
        t0, t1, r0, r1 = seg[s], seg[s + 1], rows_at[s], rows_at[s + 1]
        b_rows = b_pool[row_ids[r0:r1].long()].float()
        for i in range(len(off) - 1):
            delta = v[i, t0:t1, : r1 - r0] @ b_rows[:, off[i] : off[i + 1]]
            if accumulate:
                delta += y[t0:t1, off[i] : off[i + 1]].float()
            y[t0:t1, off[i] : off[i + 1]] = delta.to(y.dtype)


@triton.jit(do_not_specialize=["num_tokens", "max_rows"])  # step sizes: see sgmv_shrink
def _sgmv_expand_kernel(
    v_ptr,
    b_ptr,
    y_ptr,
    seg_indptr_ptr,
    row_indptr_ptr,
    row_ids_ptr,
    num_tokens,
    max_rows,
    off1,
    off2,
    off3,
    num_col_tiles,
    num_slices,
    stride_vs,
    stride_vt,
    stride_vr,
    stride_br,
    stride_bn,
    stride_yt,
    stride_yn,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32_DOT: tl.constexpr,
    INT8_B: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    tile_t = tile // (num_slices * num_col_tiles)
    slice_id = (tile // num_col_tiles) % num_slices
    col_lo = tl.where(slice_id == 0, 0, tl.where(slice_id == 1, off1, off2))
    col_hi = tl.where(slice_id == 0, off1, tl.where(slice_id == 1, off2, off3))
    n_start = col_lo + (tile % num_col_tiles) * BLOCK_N
    t0 = tl.load(seg_indptr_ptr + seg)
    t1 = tl.minimum(tl.load(seg_indptr_ptr + seg + 1), num_tokens)
    r0 = tl.load(row_indptr_ptr + seg)
    num_rows = tl.minimum(tl.load(row_indptr_ptr + seg + 1) - r0, max_rows)
    t_start = t0 + tile_t * BLOCK_T
    if (t_start >= t1) | (n_start >= col_hi):
        return
    if ACCUMULATE & (num_rows <= 0):
        return

    offs_t = t_start + tl.arange(0, BLOCK_T)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    t_mask = offs_t < t1
    n_mask = offs_n < col_hi
    v_base = v_ptr + slice_id * stride_vs + offs_t[:, None].to(tl.int64) * stride_vt
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for j in range(0, num_rows, BLOCK_R):
        offs_j = j + tl.arange(0, BLOCK_R)
        j_mask = offs_j < num_rows
        rows = tl.load(row_ids_ptr + r0 + offs_j, mask=j_mask, other=0).to(tl.int64)
        v_mask = t_mask[:, None] & j_mask[None, :]
        v = tl.load(v_base + offs_j[None, :] * stride_vr, mask=v_mask, other=0.0)
        b_ptrs = b_ptr + rows[:, None] * stride_br + offs_n[None, :] * stride_bn
        b = tl.load(b_ptrs, mask=j_mask[:, None] & n_mask[None, :], other=0.0)
        if FP32_DOT:
            acc += tl.dot(v, b.to(tl.float32), input_precision="ieee")
        elif INT8_B:  # int8 values are exact in bfloat16; v carries B's row scales
            acc += tl.dot(v.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            acc += tl.dot(v.to(b.dtype), b)

    y_ptrs = y_ptr + offs_t[:, None].to(tl.int64) * stride_yt + offs_n[None, :] * stride_yn
    y_mask = t_mask[:, None] & n_mask[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)


def expand_fp32_dot(b_dtype: torch.dtype, act_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an expand multiplies in fp32: as fp32_dot says for a float b_pool; an int8 b_pool
    takes the activations' precision (fp32 for a float32 model; otherwise v is rounded to
    bfloat16, in which int8 values are exact)."""
    return fp32_dot(act_dtype if b_dtype == torch.int8 else b_dtype, device)


def check_offsets(out_offsets: Sequence[int], n_slices: int, out_total: int) -> list[int]:
    off = [int(o) for o in out_offsets]
    if not 1 <= n_slices <= MAX_SLICES or len(off) != n_slices + 1:
        raise ValueError(
            f"out_offsets must have n_slices + 1 entries with 1 <= n_slices <= {MAX_SLICES}, "
            f"got {off} for n_slices={n_slices}"
        )
    if off[0] != 0 or off[-1] != out_total or any(b < a for a, b in pairwise(off)):
        raise ValueError(f"out_offsets {off} must rise from 0 to b_pool width {out_total}")
    return off


def check_expand_args(v: torch.Tensor, b_pool: torch.Tensor, y: torch.Tensor) -> None:
    if v.dim() != 3 or b_pool.dim() != 2 or y.dim() != 2:
        raise ValueError(
            f"expected v [n_slices, T, max_rows], b_pool [num_rows, out_total], y [T, out_total], "
            f"got {tuple(v.shape)}, {tuple(b_pool.shape)}, {tuple(y.shape)}"
        )
    if v.dtype != torch.float32:
        raise ValueError(f"v must be float32 (the sgmv_shrink output), got {v.dtype}")
    if b_pool.dtype not in _B_DTYPES or y.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"b_pool must be float or int8 and y float, got {b_pool.dtype}, "
                         f"{y.dtype}")
    if y.shape[0] != v.shape[1] or y.shape[1] != b_pool.shape[1]:
        raise ValueError(
            f"y {tuple(y.shape)} must be [T={v.shape[1]}, out_total={b_pool.shape[1]}]"
        )
    if b_pool.device != v.device or y.device != v.device:
        raise ValueError(f"v, b_pool, y on {v.device}, {b_pool.device}, {y.device}")


def sgmv_expand(
    v: torch.Tensor,
    b_pool: torch.Tensor,
    out_offsets: Sequence[int],
    seg_indptr: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    y: torch.Tensor,
    *,
    max_seg_len: int | None = None,
    block_t: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    accumulate: bool = True,
    act_dtype: torch.dtype | None = None,
) -> None:
    """Semantics:
        for s in range(S):
            t0, t1 = seg_indptr[s], seg_indptr[s + 1]
            r0, r1 = row_indptr[s], row_indptr[s + 1]
            rows = row_ids[r0:r1]
            for i in range(n_slices):
                cols = slice(out_offsets[i], out_offsets[i + 1])
                delta = v[i, t0:t1, :r1 - r0] @ b_pool[rows, cols].float()
                y[t0:t1, cols] = y[t0:t1, cols] + delta if accumulate else delta

    Accumulates into y in place, or overwrites the segments' rows (accumulate=False: store
    only, so a GEMM can then add into y with beta = 1), with fp32 accumulation and one rounding
    to y's dtype. One launch for every segment and slice; slices may have different widths
    (q/k/v under GQA); when accumulating, segments with no rows leave y untouched (overwriting,
    they get zeros). With a 16-bit b_pool, v is rounded to b_pool's dtype before the product
    (tensor cores), as in Punica; with an int8 b_pool (its row scales already in v: the
    shrink's qscales) on CUDA and 16-bit activations, v is rounded to bfloat16 and B read as
    bfloat16 (exact); with float32 activations the product is fp32 (expand_fp32_dot).

    Args:
        v: [n_slices, T, max_rows] float32, from `sgmv_shrink` (scales already applied).
        b_pool: [num_rows, out_total], float16/bfloat16/float32/int8 (any strides).
        out_offsets: n_slices + 1 python ints, 0 = out_offsets[0] <= ... <= out_total;
            slice i is b_pool[:, out_offsets[i]:out_offsets[i + 1]]. 1 <= n_slices <= 3.
        seg_indptr: [S + 1] int32, token offsets of the segments (seg_indptr[S] <= T).
        row_indptr: [S + 1] int32, offsets into row_ids.
        row_ids: [N] int32, pool rows of each segment.
        y: [T, out_total], float16/bfloat16/float32, updated in place.
        max_seg_len: int | None, >= t1 - t0 for every segment (None: T); sizes the grid only.
        block_t, block_n, num_warps: launch settings (tokens and columns per program; None:
            by segment length and slice width), for sweeps.
        act_dtype: the model's activation dtype (None: y's); it sets an int8 b_pool's product
            precision where y is a float32 delta buffer of a 16-bit model.
    """
    check_expand_args(v, b_pool, y)
    check_batch_meta(seg_indptr, row_indptr, row_ids, v.device)
    n_slices, num_tokens, max_rows = v.shape
    off = check_offsets(out_offsets, n_slices, b_pool.shape[1])
    num_segments = seg_indptr.numel() - 1
    nothing_to_add = max_rows == 0 or row_ids.numel() == 0
    if num_segments == 0 or num_tokens == 0 or (accumulate and nothing_to_add):
        return

    seg_len = num_tokens if max_seg_len is None else min(max_seg_len, num_tokens)
    block_t = block_t or pow2_block(seg_len, 16, 64)
    block_r = pow2_block(max_rows, 16, 32)
    widest = max(b - a for a, b in pairwise(off))
    block_n = block_n or pow2_block(widest, 16, 128)
    num_col_tiles = cdiv(max(widest, 1), block_n)
    tiles = cdiv(max(seg_len, 1), block_t) * n_slices * num_col_tiles
    off += [off[-1]] * (MAX_SLICES + 1 - len(off))

    _sgmv_expand_kernel[(tiles, num_segments)](
        v, b_pool, y, seg_indptr, row_indptr, row_ids,
        num_tokens, max_rows, off[1], off[2], off[3], num_col_tiles, n_slices,
        v.stride(0), v.stride(1), v.stride(2),
        b_pool.stride(0), b_pool.stride(1),
        y.stride(0), y.stride(1),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_N=block_n,
        FP32_DOT=expand_fp32_dot(b_pool.dtype, act_dtype or y.dtype, b_pool.device),
        INT8_B=b_pool.dtype == torch.int8, ACCUMULATE=accumulate, num_warps=num_warps,
    )
