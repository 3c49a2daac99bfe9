"""SGMV shrink: per-segment x @ A^T over a paged LoRA pool (Punica SGMV, S-LoRA pages)."""

from __future__ import annotations

import functools

import torch

from .triton_compat import cdiv, next_power_of_2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK_K = 128
_PROGRAMS_PER_SM = 4


def sgmv_shrink_ref(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    seg_indptr: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    row_scales: torch.Tensor,
    max_rows: int,
    qscales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference of `sgmv_shrink` (a loop over segments; slow, exact)."""
    v = torch.zeros(a_pool.shape[0], x.shape[0], max_rows, dtype=torch.float32, device=x.device)
    seg, rows_at = seg_indptr.tolist(), row_indptr.tolist()
    for s in range(len(seg) - 1):
        t0, t1, r0, r1 = seg[s], seg[s + 1], rows_at[s], rows_at[s + 1]
        rows = row_ids[r0:r1].long()
        a_rows = dequantized_rows(a_pool, rows, qscales)
        v[:, t0:t1, : r1 - r0] = (x[t0:t1].float() @ a_rows.transpose(1, 2)) * row_scales[r0:r1]
    return v


def dequantized_rows(
    a_pool: torch.Tensor, rows: torch.Tensor, qscales: torch.Tensor | None
) -> torch.Tensor:
    """a_pool[:, rows] in float32, times each (slice, row)'s dequantization scale if any."""
    a_rows = a_pool[:, rows].float()
    return a_rows if qscales is None else a_rows * qscales[:, rows, None]


# sizes that change from step to step are not specialized on (divisible by 16, equal to 1), so an
# unseen batch composition never compiles a new variant while serving
@triton.jit(do_not_specialize=["num_tokens", "max_rows", "split_k"])
def _sgmv_shrink_kernel(
    x_ptr,
    a_ptr,
    v_ptr,
    seg_indptr_ptr,
    row_indptr_ptr,
    row_ids_ptr,
    row_scales_ptr,
    qscales_ptr,
    num_tokens,
    in_dim,
    max_rows,
    k_per_split,
    split_k,
    num_row_tiles,
    n_slices,
    stride_xt,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_qs,
    stride_qr,
    stride_vs,
    stride_vt,
    stride_vr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_DOT: tl.constexpr,
    DEQUANT: tl.constexpr,
):
    # the slices and splits of one token tile are neighbours in launch order, so the programs
    # reading the same x tile run together and all but the first find it in L2
    per_tile = split_k * n_slices
    tile = tl.program_id(0) // per_tile
    seg = tl.program_id(1)
    slice_id = (tl.program_id(0) % per_tile) // split_k
    split = tl.program_id(0) % split_k
    t0 = tl.load(seg_indptr_ptr + seg)
    t1 = tl.minimum(tl.load(seg_indptr_ptr + seg + 1), num_tokens)
    r0 = tl.load(row_indptr_ptr + seg)
    num_rows = tl.minimum(tl.load(row_indptr_ptr + seg + 1) - r0, max_rows)
    t_start = t0 + (tile // num_row_tiles) * BLOCK_T
    j_start = (tile % num_row_tiles) * BLOCK_R
    if (t_start >= t1) | (j_start >= num_rows):
        return

    offs_t = t_start + tl.arange(0, BLOCK_T)
    offs_j = j_start + tl.arange(0, BLOCK_R)
    t_mask = offs_t < t1
    j_mask = offs_j < num_rows
    rows = tl.load(row_ids_ptr + r0 + offs_j, mask=j_mask, other=0).to(tl.int64)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_dim)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + slice_id * stride_as + rows[None, :] * stride_ar + offs_k[:, None] * stride_ak

    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_mask = (k - k_lo + offs_k) < k_hi
        x = tl.load(x_ptrs, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_mask[:, None] & j_mask[None, :], other=0.0)
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, a.to(x.dtype))  # a no-op cast unless the pool is int8
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    scales = tl.load(row_scales_ptr + r0 + offs_j, mask=j_mask, other=0.0)
    if DEQUANT:
        qs_ptrs = qscales_ptr + slice_id * stride_qs + rows * stride_qr
        scales *= tl.load(qs_ptrs, mask=j_mask, other=0.0)
    acc = acc * scales[None, :]
    v_ptrs = (
        v_ptr
        + slice_id * stride_vs
        + offs_t[:, None].to(tl.int64) * stride_vt
        + offs_j[None, :] * stride_vr
    )
    out_mask = t_mask[:, None] & j_mask[None, :]
    if split_k > 1:
        tl.atomic_add(v_ptrs, acc, mask=out_mask)
    else:
        tl.store(v_ptrs, acc, mask=out_mask)


def check_batch_meta(
    seg_indptr: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    device: torch.device,
    row_scales: torch.Tensor | None = None,
) -> None:
    """Shape/dtype/device checks shared by the SGMV launchers (host-only, never syncs)."""
    named = {"seg_indptr": seg_indptr, "row_indptr": row_indptr, "row_ids": row_ids}
    if seg_indptr.numel() < 1 or row_indptr.shape != seg_indptr.shape:
        raise ValueError(
            f"seg_indptr {tuple(seg_indptr.shape)} and row_indptr {tuple(row_indptr.shape)} "
            "must both have shape [num_segments + 1]"
        )
    check_index_tensors(named, row_ids, row_scales, device)


def check_index_tensors(
    named: dict[str, torch.Tensor],
    row_ids: torch.Tensor,
    row_scales: torch.Tensor | None,
    device: torch.device,
) -> None:
    """Index tensors are 1-D int32, row_scales (if any) float32 like row_ids, all on device."""
    for name, t in named.items():
        if t.dtype != torch.int32 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if row_scales is not None:
        named = {**named, "row_scales": row_scales}
        if row_scales.dtype != torch.float32 or row_scales.shape != row_ids.shape:
            raise ValueError(
                f"row_scales must be float32 of shape {tuple(row_ids.shape)}, "
                f"got {row_scales.dtype} {tuple(row_scales.shape)}"
            )
    for name, t in named.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_shrink_args(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    max_rows: int,
    split_k: int | None,
    qscales: torch.Tensor | None = None,
) -> None:
    if x.dim() != 2 or a_pool.dim() != 3:
        raise ValueError(
            f"expected x [T, in_dim] and a_pool [n_slices, num_rows, in_dim], "
            f"got {tuple(x.shape)} and {tuple(a_pool.shape)}"
        )
    if a_pool.shape[2] != x.shape[1]:
        raise ValueError(f"a_pool in_dim {a_pool.shape[2]} != x in_dim {x.shape[1]}")
    if x.dtype not in _FLOAT_DTYPES or a_pool.dtype not in (x.dtype, torch.int8):
        raise ValueError(
            f"a_pool must be int8 or share x's float dtype, got {x.dtype}, {a_pool.dtype}"
        )
    if a_pool.device != x.device:
        raise ValueError(f"a_pool is on {a_pool.device}, x on {x.device}")
    check_qscales(a_pool, qscales)
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0, got {max_rows}")
    if split_k is not None and split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")


def check_qscales(a_pool: torch.Tensor, qscales: torch.Tensor | None) -> None:
    """An int8 a_pool comes with float32 qscales [n_slices, num_rows]; a float one without."""
    if (a_pool.dtype == torch.int8) != (qscales is not None):
        raise ValueError(f"qscales must be given exactly for an int8 a_pool, got {a_pool.dtype}")
    if qscales is None:
        return
    shape = tuple(a_pool.shape[:2])
    if tuple(qscales.shape) != shape or qscales.dtype != torch.float32:
        raise ValueError(f"qscales must be float32 {shape}, got {qscales.dtype} "
                         f"{tuple(qscales.shape)}")
    if qscales.device != a_pool.device:
        raise ValueError(f"qscales is on {qscales.device}, a_pool on {a_pool.device}")


def pow2_block(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= n, clamped to [lo, hi] (tl.dot needs every dim >= 16)."""
    return max(lo, min(hi, next_power_of_2(max(n, 1))))


def fp32_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """Multiply in fp32 (ieee) for fp32 data, and off CUDA: the interpreter multiplies bf16
    bit patterns as integers in tl.dot (triton-lang/triton#11584)."""
    return dtype == torch.float32 or device.type != "cuda"


@functools.cache
def sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_split_k(base_programs: int, in_dim: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    wanted = cdiv(_PROGRAMS_PER_SM * sm_count(device.index), max(base_programs, 1))
    return max(1, min(wanted, cdiv(in_dim, 2 * _MAX_BLOCK_K)))


def _k_partition(in_dim: int, split_k: int) -> tuple[int, int, int]:
    """(split_k, k_per_split, block_k): k_per_split is a multiple of block_k, so a split's
    BLOCK_K steps never cross into the next split; split_k shrinks if splits would be empty."""
    block_k = pow2_block(cdiv(in_dim, split_k), 16, _MAX_BLOCK_K)
    k_per_split = cdiv(cdiv(in_dim, split_k), block_k) * block_k
    return cdiv(in_dim, k_per_split), k_per_split, block_k


def sgmv_shrink(
    x: torch.Tensor,
    a_pool: torch.Tensor,
    seg_indptr: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    row_scales: torch.Tensor,
    max_rows: int,
    *,
    max_seg_len: int | None = None,
    split_k: int | None = None,
    out: torch.Tensor | None = None,
    qscales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Semantics:
        v = zeros(n_slices, T, max_rows, dtype=float32)
        for s in range(S):
            t0, t1 = seg_indptr[s], seg_indptr[s + 1]
            r0, r1 = row_indptr[s], row_indptr[s + 1]
            rows, sc = row_ids[r0:r1], row_scales[r0:r1]
            for i in range(n_slices):
                a_rows = a_pool[i, rows].float()
                if qscales is not None:  # an int8 pool
                    a_rows *= qscales[i, rows, None]
                v[i, t0:t1, :r1 - r0] = (x[t0:t1].float() @ a_rows.T) * sc

    One launch for every segment, slice and adapter stack; a segment's rows may be any rows of
    the pool in any order (paged, no padding), and a segment with no rows is skipped.
    Split-K over in_dim keeps decode (one token per segment) bandwidth bound: each adapter row
    is read once per token tile. With split_k > 1 partial sums are added atomically in fp32,
    so the summation order (last bits) is not deterministic; pass split_k=1 to make it so.

    Args:
        x: [T, in_dim], float16/bfloat16/float32.
        a_pool: [n_slices, num_rows, in_dim], same dtype as x, or int8 (any strides).
        seg_indptr: [S + 1] int32, token offsets of the segments (seg_indptr[S] <= T).
        row_indptr: [S + 1] int32, offsets into row_ids.
        row_ids: [N] int32, pool rows of each segment (a stack is its adapters' rows joined).
        row_scales: [N] float32, multiplier of each row (the stacking weight).
        max_rows: int, >= r1 - r0 for every segment; the width of v.
        max_seg_len: int | None, >= t1 - t0 for every segment (None: T); sizes the grid only.
        split_k: int | None, in_dim splits (None: enough programs to fill the GPU; 1 on CPU).
        out: [n_slices, T, max_rows] float32 | None; overwritten when given.
        qscales: [n_slices, num_rows] float32, given exactly for an int8 a_pool: the
            dequantization scale of each (slice, row), applied to the fp32 accumulator.

    Returns:
        v: [n_slices, T, max_rows] float32, zero beyond each segment's rows and outside segments.
    """
    check_shrink_args(x, a_pool, max_rows, split_k, qscales)
    check_batch_meta(seg_indptr, row_indptr, row_ids, x.device, row_scales)
    n_slices, num_tokens, in_dim = a_pool.shape[0], x.shape[0], x.shape[1]
    v = _zeroed_output(out, (n_slices, num_tokens, max_rows), x.device)
    num_segments = seg_indptr.numel() - 1
    if num_segments == 0 or num_tokens == 0 or max_rows == 0 or row_ids.numel() == 0:
        return v

    seg_len = num_tokens if max_seg_len is None else min(max_seg_len, num_tokens)
    block_t = pow2_block(seg_len, 16, 64)
    block_r = pow2_block(max_rows, 16, 64)
    num_row_tiles = cdiv(max_rows, block_r)
    tiles = cdiv(max(seg_len, 1), block_t) * num_row_tiles
    if split_k is None:
        split_k = _default_split_k(tiles * num_segments * n_slices, in_dim, x.device)
    split_k, k_per_split, block_k = _k_partition(in_dim, split_k)

    grid = (tiles * split_k * n_slices, num_segments)
    _sgmv_shrink_kernel[grid](
        x, a_pool, v, seg_indptr, row_indptr, row_ids, row_scales,
        row_scales if qscales is None else qscales,
        num_tokens, in_dim, max_rows, k_per_split, split_k, num_row_tiles, n_slices,
        x.stride(0), x.stride(1),
        a_pool.stride(0), a_pool.stride(1), a_pool.stride(2),
        *qscale_strides(qscales),
        v.stride(0), v.stride(1), v.stride(2),
        BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_K=block_k,
        FP32_DOT=fp32_dot(x.dtype, x.device), DEQUANT=qscales is not None,
    )
    return v


def qscale_strides(qscales: torch.Tensor | None) -> tuple[int, int]:
    """(slice, row) strides of qscales; (0, 0) when there are none (the kernel reads none)."""
    return (0, 0) if qscales is None else (qscales.stride(0), qscales.stride(1))


def _zeroed_output(
    out: torch.Tensor | None, shape: tuple[int, int, int], device: torch.device
) -> torch.Tensor:
    if out is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or out.device != device:
        raise ValueError(
            f"out must be float32 {shape} on {device}, got {out.dtype} {tuple(out.shape)} "
            f"on {out.device}"
        )
    return out.zero_()
