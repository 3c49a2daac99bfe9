"""A decode projection and its grouped LoRA deltas in one launch: y = x @ W.T + the deltas, for
batches of at most MAX_TOKENS tokens (CUDA-graph decode steps; opt-in through
EngineConfig.lora_fused_gemm).

Beside a cuBLAS GEMM the LoRA kernels hold SMs that the GEMM's one wave of blocks wants (a
block uses the whole register file), so the GEMM waits (docs/PERF.md, run 20). Here one grid
holds both. Its first programs compute the shrink as extra row tiles of the same product: the
A rows of every group in use, against all tokens at once (decode is memory-bound, so the
products of tokens with other groups' rows cost no time), stored into v with each token's
entries masked to its own group. The other programs are the GEMM's column tiles: they stream
their weight rows, wait on a counter in global memory until the shrink programs are done, and
add v @ B for their columns in the epilogue (one product over all row positions, thanks to the
mask; so B's rows must be finite, as adapters are checked to be at load). The shrink
programs have the lowest program ids, and the GPU dispatches a grid's blocks in id order (what
GPUs do in practice, not a CUDA promise), so they run before any tile waits
and the wait cannot deadlock; the interpreter runs programs in order, so there it never waits.
The counters reset themselves (the last tile to finish zeroes them), so a graph replays the
kernel with no fill.

A Triton GEMM with this tile loop matched cuBLAS and cublasLt on the decode projections in a
sweep of tile sizes (docs/PERF.md, run 21); the tilings here are its winners without split-K.
With the LoRA parts the kernel is slower than the side branch today; why is not profiled yet
(run 21 lists the suspects: shrink tiles as long as GEMM tiles, so the epilogues wait, and
the chain of dependent metadata loads in each tile).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .sgmv_expand import MAX_SLICES, check_offsets
from .sgmv_grouped import check_groups, grouped_expand_ref, grouped_shrink_ref
from .sgmv_shrink import fp32_dot, pow2_block, sm_count

MAX_TOKENS = 32  # tokens per launch at most (one BLOCK_M tile of the GEMM)
SYNC_WORDS = 2  # [shrink programs done, GEMM tiles done]
# the shrink's tiles go to at most one persistent program per this many SMs: they start first,
# and the GEMM tiles fill the rest of the GPU
SMS_PER_SHRINK_PROGRAM = 4


@dataclass(frozen=True)
class GemmTiling:
    block_n: int
    block_k: int
    stages: int
    block_r: int  # row positions per step of the expand (the first step's B is prefetched)
    warps: int = 4


def pick_tiling(out_features: int, in_features: int) -> GemmTiling | None:
    """Tiles from the H200 sweep (run 21): narrow tiles with deep pipelines for the
    4k-6k-wide projections, wide ones for gate_up; None where no tile divides the shape."""
    for t in (
        (GemmTiling(128, 128, 3, 32),) if out_features >= 16384 else ()
    ) + (GemmTiling(32, 256, 5, 64), GemmTiling(32, 128, 4, 64), GemmTiling(16, 64, 3, 16),
         GemmTiling(16, 32, 2, 16)):
        if out_features % t.block_n == 0 and in_features % t.block_k == 0:
            return t
    return None


def lora_gemm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    a_pool: torch.Tensor,
    b_pool: torch.Tensor,
    out_offsets: Sequence[int],
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    token_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    row_scales: torch.Tensor,
) -> torch.Tensor:
    """Pure-torch reference of `lora_gemm` (fp32 throughout, one rounding)."""
    y = x.float() @ weight.float().T
    n = int(num_groups.item())
    max_rows = int((row_indptr[1 : n + 1] - row_indptr[:n]).max()) if n else 0
    v = grouped_shrink_ref(x, a_pool, num_groups, group_indptr, token_ids, row_indptr, row_ids,
                           row_scales, max_rows)  # fmt: skip
    grouped_expand_ref(v, b_pool.float(), out_offsets, num_groups, group_indptr, token_ids,
                       row_indptr, row_ids, y)  # fmt: skip
    return y.to(x.dtype)


@triton.jit
def _lora_gemm_kernel(
    x_ptr, w_ptr, y_ptr, a_ptr, b_ptr, v_ptr, sync_ptr,
    num_groups_ptr, group_indptr_ptr, token_ids_ptr, row_indptr_ptr, row_ids_ptr, row_scales_ptr,
    num_tokens, out_features, in_features, n_slices, shrink_programs, gemm_tiles,
    off1, off2, stride_as, stride_ar, stride_br, stride_vs, stride_vt,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr, STAGES: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < num_tokens
    if pid < shrink_programs:
        _shrink_tiles(x_ptr, a_ptr, v_ptr, num_groups_ptr, group_indptr_ptr, token_ids_ptr,
                      row_indptr_ptr, row_ids_ptr, row_scales_ptr, offs_m, m_mask, in_features,
                      n_slices, shrink_programs, stride_as, stride_ar, stride_vs, stride_vt,
                      BLOCK_M, BLOCK_N, BLOCK_K, STAGES, FP32_DOT)  # fmt: skip
        tl.debug_barrier()  # every thread's v stores precede the release
        tl.atomic_add(sync_ptr, 1, sem="release")
    else:
        n0 = (pid - shrink_programs) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # the first chunk of B rows is loaded before the weight stream, so the epilogue waits
        # on no dependent load chain in the common case of one chunk
        total_rows = tl.load(row_indptr_ptr + tl.load(num_groups_ptr))
        offs_p = tl.arange(0, BLOCK_R)
        b_first = _load_b(b_ptr, row_ids_ptr, offs_p, total_rows, offs_n, stride_br)
        w_rows = w_ptr + offs_n[:, None].to(tl.int64) * in_features
        acc = _tile_product(x_ptr, w_rows, offs_n >= 0, offs_m, m_mask, in_features, BLOCK_M,
                            BLOCK_N, BLOCK_K, STAGES, FP32_DOT, False)  # fmt: skip
        while tl.load(sync_ptr, volatile=True) < shrink_programs:  # plain loads: no atomic storm
            pass
        tl.atomic_add(sync_ptr, 0, sem="acquire")  # orders the reads of v after the count
        tl.debug_barrier()
        slice_id = (n0 >= off1).to(tl.int32) + (n0 >= off2).to(tl.int32)
        v_slice = v_ptr + slice_id * stride_vs
        acc = _add_v_b(acc, v_slice, b_first, offs_m, m_mask, offs_p, total_rows, stride_vt,
                       FP32_DOT)  # fmt: skip
        for p0 in range(BLOCK_R, total_rows, BLOCK_R):
            b = _load_b(b_ptr, row_ids_ptr, p0 + offs_p, total_rows, offs_n, stride_br)
            acc = _add_v_b(acc, v_slice, b, offs_m, m_mask, p0 + offs_p, total_rows, stride_vt,
                           FP32_DOT)  # fmt: skip
        y_ptrs = y_ptr + offs_m[:, None] * out_features + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None])
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == gemm_tiles - 1:
            # every tile has passed its wait: the counters are free for the next launch
            tl.atomic_xchg(sync_ptr, 0)
            tl.atomic_xchg(sync_ptr + 1, 0)


@triton.jit
def _load_b(b_ptr, row_ids_ptr, offs_p, total_rows, offs_n, stride_br):
    """B's rows at row positions offs_p (zero past total_rows), columns offs_n."""
    p_mask = offs_p < total_rows
    rows = tl.load(row_ids_ptr + offs_p, mask=p_mask, other=0).to(tl.int64)
    return tl.load(b_ptr + rows[:, None] * stride_br + offs_n[None, :], mask=p_mask[:, None],
                   other=0.0)  # fmt: skip


@triton.jit
def _add_v_b(acc, v_slice, b, offs_m, m_mask, offs_p, total_rows, stride_vt,
             FP32_DOT: tl.constexpr):  # fmt: skip
    """acc + v[:, offs_p] @ b; v is zero where a token and a row position belong to different
    groups, so one product covers every group."""
    v = tl.load(v_slice + offs_m[:, None] * stride_vt + offs_p[None, :],
                mask=m_mask[:, None] & (offs_p < total_rows)[None, :], other=0.0,
                cache_modifier=".cg")  # a hint only: the acquire and barrier order the reads
    if FP32_DOT:
        acc = tl.dot(v, b.to(tl.float32), acc, input_precision="ieee")
    else:  # v rounded to B's dtype, as in grouped_expand
        acc = tl.dot(v.to(b.dtype), b, acc)
    return acc


@triton.jit
def _tile_product(x_ptr, w_rows, n_mask, offs_m, m_mask, in_features, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                  FP32_DOT: tl.constexpr, MASK_N: tl.constexpr):  # fmt: skip
    """x @ W.T for BLOCK_N rows of W (w_rows: their addresses, [BLOCK_N, 1]) over in_dim."""
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * in_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, in_features, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_rows + (k + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        if MASK_N:
            w = tl.load(w_rows + (k + offs_k)[None, :], mask=n_mask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + (k + offs_k)[None, :])
        acc = _dot(x, tl.trans(w), acc, FP32_DOT)
    return acc


@triton.jit
def _dot(a, b, acc, FP32_DOT: tl.constexpr):
    if FP32_DOT:  # fp32 data, and the interpreter, which multiplies bf16 bit patterns
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _shrink_tiles(x_ptr, a_ptr, v_ptr, num_groups_ptr, group_indptr_ptr, token_ids_ptr,
                  row_indptr_ptr, row_ids_ptr, row_scales_ptr, offs_m, m_mask, in_features,
                  n_slices, shrink_programs, stride_as, stride_ar, stride_vs, stride_vt,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr, FP32_DOT: tl.constexpr):  # fmt: skip
    """v[slice, t, p] = x[t] @ A[slice, row_ids[p]] * row_scales[p] where token t and row
    position p belong to one group, else 0, for every position p of the groups in use. The
    rows are tiles like the weight's, all tokens at once (decode is memory-bound: the products
    with other groups' rows cost no time), so the expand is one product over all positions."""
    num_groups = tl.load(num_groups_ptr)
    total_rows = tl.load(row_indptr_ptr + num_groups)
    token_group = _token_groups(num_groups, group_indptr_ptr, token_ids_ptr, offs_m, BLOCK_M)
    offs_g = tl.arange(0, BLOCK_M)  # groups never outnumber tokens
    row_ends = tl.load(row_indptr_ptr + 1 + offs_g, mask=offs_g < num_groups, other=2**30)
    row_tiles = tl.cdiv(total_rows, BLOCK_N)
    for item in range(tl.program_id(0), n_slices * row_tiles, shrink_programs):
        slice_id = item // row_tiles
        offs_p = (item % row_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        p_mask = offs_p < total_rows
        rows = tl.load(row_ids_ptr + offs_p, mask=p_mask, other=0).to(tl.int64)
        scales = tl.load(row_scales_ptr + offs_p, mask=p_mask, other=0.0)
        a_rows = a_ptr + slice_id.to(tl.int64) * stride_as + rows[:, None] * stride_ar
        acc = _tile_product(x_ptr, a_rows, p_mask, offs_m, m_mask, in_features, BLOCK_M,
                            BLOCK_N, BLOCK_K, STAGES, FP32_DOT, True)  # fmt: skip
        row_group = tl.sum((row_ends[None, :] <= offs_p[:, None]).to(tl.int32), axis=1)
        own = token_group[:, None] == row_group[None, :]
        v_ptrs = v_ptr + slice_id * stride_vs + offs_m[:, None] * stride_vt + offs_p[None, :]
        tl.store(v_ptrs, tl.where(own, acc * scales[None, :], 0.0),
                 mask=m_mask[:, None] & p_mask[None, :])  # fmt: skip


@triton.jit
def _token_groups(num_groups, group_indptr_ptr, token_ids_ptr, offs_m, BLOCK_M: tl.constexpr):
    """The group of each token offs_m (-1: in no group)."""
    offs_i = tl.arange(0, BLOCK_M)
    offs_g = tl.arange(0, BLOCK_M)
    grouped = tl.load(group_indptr_ptr + num_groups)
    listed = tl.load(token_ids_ptr + offs_i, mask=offs_i < grouped, other=-1)
    found = offs_m[:, None] == listed[None, :]
    at = tl.sum(tl.where(found, offs_i[None, :], 0), axis=1)  # where each token is listed
    ends = tl.load(group_indptr_ptr + 1 + offs_g, mask=offs_g < num_groups, other=2**30)
    group = tl.sum((ends[None, :] <= at[:, None]).to(tl.int32), axis=1)
    return tl.where(tl.max(found.to(tl.int32), axis=1) > 0, group, -1)


def _problem(x, weight, a_pool, b_pool, out_offsets) -> str | None:
    """Why `lora_gemm` cannot take these operands (None: it can)."""
    if x.dim() != 2 or a_pool.dim() != 3 or b_pool.dim() != 2 or weight.dim() != 2:
        return (f"expected x [T, in_dim], weight [out, in_dim], a_pool [n_slices, rows, in_dim] "
                f"and b_pool [rows, out], got {tuple(x.shape)}, {tuple(weight.shape)}, "
                f"{tuple(a_pool.shape)}, {tuple(b_pool.shape)}")  # fmt: skip
    in_dim, out = x.shape[1], weight.shape[0]
    if weight.shape[1] != in_dim or a_pool.shape[2] != in_dim or b_pool.shape[1] != out:
        return (f"shapes disagree: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                f"a_pool {tuple(a_pool.shape)}, b_pool {tuple(b_pool.shape)}")  # fmt: skip
    if len({x.dtype, weight.dtype, a_pool.dtype, b_pool.dtype}) != 1:
        return (f"x, weight, a_pool and b_pool must share a dtype, got {x.dtype}, "
                f"{weight.dtype}, {a_pool.dtype}, {b_pool.dtype}")  # fmt: skip
    if len({x.device, weight.device, a_pool.device, b_pool.device}) != 1:
        return "x, weight, a_pool and b_pool must be on one device"
    if x.shape[0] > MAX_TOKENS:
        return f"x has {x.shape[0]} tokens, at most {MAX_TOKENS} fit one tile"
    if not (x.is_contiguous() and weight.is_contiguous()):
        return "x and weight must be contiguous"
    if a_pool.stride(2) != 1 or b_pool.stride(1) != 1:
        return f"a_pool and b_pool need unit inner strides: {a_pool.stride()}, {b_pool.stride()}"
    tiling = pick_tiling(out, in_dim)
    if tiling is None or any(int(o) % tiling.block_n for o in out_offsets):
        return f"no tile of lora_gemm fits out_offsets {list(out_offsets)} and in_dim {in_dim}"
    return None


def supports(x, weight, a_pool, b_pool, out_offsets: Sequence[int]) -> bool:
    """Whether `lora_gemm` takes these operands (shapes, dtypes, strides, a fitting tile)."""
    return _problem(x, weight, a_pool, b_pool, out_offsets) is None


_SYNC_WORDS: dict[torch.device, torch.Tensor] = {}


def _sync_words(device: torch.device) -> torch.Tensor:
    """The counters all launches on a device share: launches in one stream never overlap, and
    each leaves them zero. They must outlive every graph that uses them, so they are allocated
    outside graph capture (the engine's warm-up launches come first)."""
    words = _SYNC_WORDS.get(device)
    if words is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("lora_gemm's first launch on a device must come before CUDA graph "
                               "capture: its counters would live in the graph's memory pool")
        words = _SYNC_WORDS[device] = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=device)
    return words


def lora_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    a_pool: torch.Tensor,
    b_pool: torch.Tensor,
    out_offsets: Sequence[int],
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    token_ids: torch.Tensor,
    row_indptr: torch.Tensor,
    row_ids: torch.Tensor,
    row_scales: torch.Tensor,
) -> torch.Tensor:
    """Semantics:
        y = x.float() @ weight.float().T
        for g in range(num_groups):
            tokens = token_ids[group_indptr[g]:group_indptr[g + 1]]
            r0, r1 = row_indptr[g], row_indptr[g + 1]
            rows, sc = row_ids[r0:r1], row_scales[r0:r1]
            for i in range(n_slices):
                cols = slice(out_offsets[i], out_offsets[i + 1])
                v = (x[tokens].float() @ a_pool[i, rows].float().T) * sc
                y[tokens, cols] += v @ b_pool[rows, cols].float()
        return y.to(x.dtype)

    fp32 accumulation with one rounding at the end; with 16-bit pools v is rounded to b_pool's
    dtype before its product, as in grouped_expand. Launches on one device must never run
    concurrently (they share a device-wide pair of counters: the engine launches them on its
    one compute stream), and never with programmatic dependent launch.

    Args:
        x: [T, in_dim] contiguous, T <= MAX_TOKENS; float16/bfloat16/float32.
        weight: [out_total, in_dim] contiguous, x's dtype (the base projection, no bias).
        a_pool: [n_slices, num_rows, in_dim], unit in_dim stride; b_pool: [num_rows, out_total],
            unit column stride; both x's dtype.
        out_offsets: n_slices + 1 ints rising from 0 to out_total (1 <= n_slices <= 3), each a
            multiple of the chosen tile width (`supports` says whether one fits).
        num_groups, group_indptr, token_ids, row_indptr, row_ids, row_scales: the grouping of
            `kernels.sgmv_grouped.grouped_shrink` (row_indptr rising from 0: the groups' rows
            are consecutive in row_ids).

    Returns:
        y: [T, out_total] in x's dtype.
    """
    if (problem := _problem(x, weight, a_pool, b_pool, out_offsets)) is not None:
        raise ValueError(problem)
    off = check_offsets(out_offsets, a_pool.shape[0], weight.shape[0])
    tiling = pick_tiling(weight.shape[0], x.shape[1])
    check_groups(num_groups, group_indptr, token_ids, row_indptr, row_ids, x.device, row_scales)
    num_tokens, in_features = x.shape
    out_features, n_slices = weight.shape[0], a_pool.shape[0]
    y = torch.empty(num_tokens, out_features, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return y
    v = torch.empty(n_slices, num_tokens, max(row_ids.numel(), 1), dtype=torch.float32,
                    device=x.device)  # fmt: skip
    max_tiles = n_slices * triton.cdiv(row_ids.numel(), tiling.block_n)
    sms = sm_count(x.device.index) if x.device.type == "cuda" else 8
    shrink_programs = max(1, min(max_tiles, sms // SMS_PER_SHRINK_PROGRAM))
    gemm_tiles = out_features // tiling.block_n
    off += [off[-1]] * (MAX_SLICES + 1 - len(off))
    _lora_gemm_kernel[(shrink_programs + gemm_tiles,)](
        x, weight, y, a_pool, b_pool, v, _sync_words(x.device),
        num_groups, group_indptr, token_ids, row_indptr, row_ids, row_scales,
        num_tokens, out_features, in_features, n_slices, shrink_programs, gemm_tiles,
        off[1], off[2], a_pool.stride(0), a_pool.stride(1), b_pool.stride(0), v.stride(0),
        v.stride(1),
        BLOCK_M=pow2_block(num_tokens, 16, MAX_TOKENS), BLOCK_N=tiling.block_n,
        BLOCK_K=tiling.block_k, BLOCK_R=tiling.block_r, STAGES=tiling.stages,
        FP32_DOT=fp32_dot(x.dtype, x.device), num_warps=tiling.warps, num_stages=tiling.stages,
    )  # fmt: skip
    return y
