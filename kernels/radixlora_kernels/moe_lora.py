"""LoRA on an MoE layer's stacked experts, added to the grouped GEMM's rows. Row m of a
projection (token m // top_k, routed to expert experts[m]) gets its token's adapter rows of
that expert: with the pool row of rank row j holding every expert's A row j side by side
(a_pool [rows, E * in]) and B column j likewise (b_pool [rows, E * out]),

    v[m, j] = x[m // rows_per_a] . a_pool[row_j, e * in:(e + 1) * in] * scale_j
    y[m] += (sum_j v[m, j] * b_pool[row_j, e * out:(e + 1) * out]) * out_scale[m]

A token's rows come from its adapter set (token_rows), the same rank rows and stacking weights
every other module group reads. Two kernel pairs: for few rows (decode steps, CUDA graphs) a
program per row, which reads its pair's rank rows itself; for many (prefill), the rows grouped
by (expert, adapter set) into blocks (align_blocks) and each block multiplied by its pair's
rank rows read once, so the cost follows the distinct (expert, set) pairs, not the rows."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .lora_ops import LoraBatchMeta
from .moe import align_blocks
from .sgmv_expand import expand_fp32_dot
from .sgmv_grouped import dot_vb
from .sgmv_shrink import fp32_dot, sm_count
from .triton_compat import cdiv, next_power_of_2, tl, triton

MAX_GATHER = 1 << 24  # elements of A or B gathered at once by the torch reference
BLOCK_M = 16  # rows of one expert and adapter set per block (tl.dot's least)
# Above this many rows a projection's rows are grouped by (expert, adapter set) first. An
# earlier blocked version lost to the per-row kernels up to 256 tokens (its sort's torch ops)
# and won from 1,024 (docs/PERF.md: mixture-of-experts bases); until both are measured side by
# side the switch sits at the largest CUDA graph's rows at top-8 (1,024 tokens), so graphs
# never sort.
PER_ROW_MAX_ROWS = 8192
# The blocked kernels' grid: up to 16 programs of 4 warps a multiprocessor (2,048 threads, an
# H100's most), taking the blocks in use in turn, so the unused blocks launch nothing.
BLOCKED_PROGRAMS_PER_SM = 16


@dataclass
class TokenRows:
    """Each token's rank rows: row_ids[start[t]:start[t] + count[t]] with their stacking
    weights in row_scales (count 0: no adapter here); max_rows >= any count. Token t's rows are
    those of range token_range[t] of indptr (a segment or a group)."""

    start: torch.Tensor  # [T] int64
    count: torch.Tensor  # [T] int64
    row_ids: torch.Tensor  # [N] int32
    row_scales: torch.Tensor  # [N] float32
    max_rows: int
    indptr: torch.Tensor  # [R + 1] int32, the ranges' rows
    token_range: torch.Tensor  # [T] int64

    @functools.cached_property
    def set_id(self) -> torch.Tensor:
        """[T] int64, < num_sets: equal for tokens with equal rows and weights whose ranges the
        batch lists side by side (a request's tokens, a set's groups), -1 for count 0: a key
        that groups rows (computed on first use, for the blocked kernels only)."""
        if self.num_sets == 0:  # no token has rows here
            return torch.full_like(self.count, -1)
        sets = _range_sets(self.indptr, self.row_ids, self.row_scales, self.max_rows)
        return torch.where(self.count > 0, sets[self.token_range], -1)

    @property
    def num_sets(self) -> int:
        return self.indptr.shape[0] - 1


def token_rows(meta: LoraBatchMeta) -> TokenRows:
    """A batch's TokenRows, from its groups when it is grouped, else from its segments. Tensor
    ops only (no host sync), so it runs inside a graph."""
    tokens = meta.token_seg.shape[0]
    if meta.groups is None:
        seg = meta.token_seg.long()
        start = meta.row_indptr[seg].long()
        return TokenRows(start, meta.row_indptr[seg + 1].long() - start, meta.row_ids,
                         meta.row_scales, meta.max_rows, meta.row_indptr, seg)
    g = meta.groups
    device = g.token_ids.device
    ends = g.group_indptr[1:].long()
    used = torch.arange(ends.shape[0], device=device) < g.num_groups.long()
    # entries past num_groups are stale in a graph's static buffers: made monotonic here
    ends = torch.where(used, ends, torch.iinfo(torch.int64).max)
    pos = torch.arange(g.token_ids.shape[0], device=device)  # in the groups' token order
    group = torch.searchsorted(ends, pos, right=True).clamp_(max=ends.shape[0] - 1)
    valid = pos < g.group_indptr[g.num_groups.long()].long()
    dest = torch.where(valid, g.token_ids.long(), tokens)
    start = torch.zeros(tokens + 1, dtype=torch.int64, device=device)
    count = torch.zeros(tokens + 1, dtype=torch.int64, device=device)
    token_range = torch.zeros(tokens + 1, dtype=torch.int64, device=device)
    first = g.row_indptr[group].long()
    start.scatter_(0, dest, first)
    count.scatter_(0, dest, g.row_indptr[group + 1].long() - first)
    token_range.scatter_(0, dest, group)
    return TokenRows(start[:tokens], count[:tokens], g.row_ids, g.row_scales, meta.max_rows,
                     g.row_indptr, token_range[:tokens])


def _range_sets(indptr: torch.Tensor, row_ids: torch.Tensor, row_scales: torch.Tensor,
                max_rows: int) -> torch.Tensor:
    """A set id per range i (rows indptr[i]:indptr[i + 1]): a range with the rows and weights
    of the one before it shares its id (a set's groups, a request's segments)."""
    starts, ends = indptr[:-1].long(), indptr[1:].long()
    if row_ids.numel() == 0:
        return torch.zeros(starts.shape[0], dtype=torch.int64, device=indptr.device)
    lengths = ends - starts
    rank = torch.arange(max(max_rows, 1), device=indptr.device)
    inside = rank < lengths[:, None]
    pos = (starts[:, None] + rank).clamp_(0, row_ids.numel() - 1)
    ids = torch.where(inside, row_ids[pos].long(), -1)
    scales = torch.where(inside, row_scales[pos], 0.0)
    same = ((lengths[1:] == lengths[:-1]) & (ids[1:] == ids[:-1]).all(1)
            & (scales[1:] == scales[:-1]).all(1))
    new = torch.ones(starts.shape[0], dtype=torch.int64, device=indptr.device)
    new[1:] = (~same).long()
    return new.cumsum(0) - 1


def expert_lora_ref(x: torch.Tensor, rows_per_a: int, topk_ids: torch.Tensor,
                    a_pool: torch.Tensor, b_pool: torch.Tensor, rows: TokenRows,
                    y: torch.Tensor, out_scale: torch.Tensor | None = None,
                    qscales: torch.Tensor | None = None) -> None:
    """The module docstring's sum in torch (the CPU path and the kernels' reference), in
    chunks of rows. x [M / rows_per_a, in]; topk_ids [T, top_k]; a_pool [1, rows, E * in]
    and b_pool [rows, E * out] (int8 with qscales [1, rows]); rows = token_rows(meta); y
    [M, out], updated in place; out_scale [M] float32 or None."""
    experts = topk_ids.reshape(-1).long()
    total, top_k = experts.shape[0], topk_ids.shape[1]
    row_ids, row_scales, max_rows = rows.row_ids, rows.row_scales, rows.max_rows
    if total == 0 or row_ids.numel() == 0:
        return
    num_rows, count = b_pool.shape[0], a_pool.shape[-1] // x.shape[1]
    a_view = a_pool.reshape(num_rows, count, -1)
    b_view = b_pool.reshape(num_rows, count, -1)
    width = max(a_view.shape[-1], b_view.shape[-1])
    step = max(1, MAX_GATHER // (max_rows * width))
    rank = torch.arange(max_rows, device=x.device)
    for m0 in range(0, total, step):
        m = torch.arange(m0, min(total, m0 + step), device=x.device)
        token, expert = m // top_k, experts[m][:, None]
        valid = rank[None, :] < rows.count[token][:, None]
        pos = (rows.start[token][:, None] + rank).clamp_(max=row_ids.numel() - 1)
        ids = torch.where(valid, row_ids[pos].long(), 0)
        weight = torch.where(valid, row_scales[pos], 0.0)
        if qscales is not None:
            weight = weight * qscales[0, ids]
        v = torch.einsum("mri,mi->mr", a_view[ids, expert].float(), x[m // rows_per_a].float())
        delta = torch.einsum("mr,mro->mo", v * weight, b_view[ids, expert].float())
        if out_scale is not None:
            delta = delta * out_scale[m, None]
        y[m] = (y[m].float() + delta).to(y.dtype)


@triton.jit
def _row_entries(m, experts_ptr, start_ptr, count_ptr, row_ids_ptr, TOP_K: tl.constexpr,
                 R: tl.constexpr):
    """(count, start, rank, valid, ids, expert) of row m: its token's rank rows and its
    expert."""
    token = m // TOP_K
    count = tl.load(count_ptr + token)
    start = tl.load(start_ptr + token)
    rank = tl.arange(0, R)
    valid = rank < count
    ids = tl.load(row_ids_ptr + start + rank, mask=valid, other=0).to(tl.int64)
    expert = tl.load(experts_ptr + m).to(tl.int64)
    return count, start, rank, valid, ids, expert


@triton.jit
def _row_shrink(
    x_ptr, a_ptr, v_ptr, experts_ptr, start_ptr, count_ptr, row_ids_ptr, row_scales_ptr,
    qscales_ptr, in_dim, stride_x, stride_a, TOP_K: tl.constexpr, ROWS_PER_A: tl.constexpr,
    QUANT: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """v[m, :count] for one row m (nothing for a token with no rows here)."""
    m = tl.program_id(0)
    count, start, rank, valid, ids, expert = _row_entries(
        m, experts_ptr, start_ptr, count_ptr, row_ids_ptr, TOP_K, R)
    if count == 0:
        return
    x_row = (m // ROWS_PER_A).to(tl.int64)
    acc = tl.zeros((R,), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        inside = kk < in_dim
        x = tl.load(x_ptr + x_row * stride_x + kk, mask=inside, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + ids[:, None] * stride_a + expert * in_dim + kk[None, :],
                    mask=valid[:, None] & inside[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    weight = tl.load(row_scales_ptr + start + rank, mask=valid, other=0.0)
    if QUANT:
        weight *= tl.load(qscales_ptr + ids, mask=valid, other=0.0)
    tl.store(v_ptr + m.to(tl.int64) * R + rank, acc * weight, mask=valid)


@triton.jit
def _row_expand(
    v_ptr, b_ptr, y_ptr, experts_ptr, start_ptr, count_ptr, row_ids_ptr, out_scale_ptr,
    out_dim, stride_b, stride_y, TOP_K: tl.constexpr, SCALE: tl.constexpr, R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y[m, n-block] += the deltas of v[m] (times out_scale[m])."""
    m = tl.program_id(0)
    count, _, rank, valid, ids, expert = _row_entries(
        m, experts_ptr, start_ptr, count_ptr, row_ids_ptr, TOP_K, R)
    if count == 0:
        return
    v = tl.load(v_ptr + m.to(tl.int64) * R + rank, mask=valid, other=0.0)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = offs < out_dim
    b = tl.load(b_ptr + ids[:, None] * stride_b + expert * out_dim + offs[None, :],
                mask=valid[:, None] & inside[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(v[:, None] * b, axis=0)
    if SCALE:
        delta *= tl.load(out_scale_ptr + m)
    y = y_ptr + m.to(tl.int64) * stride_y + offs
    tl.store(y, (tl.load(y, mask=inside, other=0.0).to(tl.float32) + delta).to(
        y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _block_entries(block, sorted_rows_ptr, experts_ptr, start_ptr, count_ptr, row_ids_ptr,
                   num_rows, TOP_K: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr):
    """(rows, valid, start, rank, rank_ok, ids, expert) of a block in use: its rows (one
    expert, one adapter set: align_blocks) and their rank rows."""
    rows = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    first = tl.load(sorted_rows_ptr + block * BLOCK_M)
    start = tl.load(start_ptr + first // TOP_K)
    rank = tl.arange(0, R)
    rank_ok = rank < tl.load(count_ptr + first // TOP_K)
    ids = tl.load(row_ids_ptr + start + rank, mask=rank_ok, other=0).to(tl.int64)
    expert = tl.load(experts_ptr + first).to(tl.int64)
    return rows, valid, start, rank, rank_ok, ids, expert


@triton.jit(do_not_specialize=["num_rows"])  # a step's rows (moe._align)
def _block_shrink(
    x_ptr, a_ptr, v_ptr, sorted_rows_ptr, num_padded_ptr, experts_ptr, start_ptr, count_ptr,
    row_ids_ptr, row_scales_ptr, qscales_ptr, num_rows, in_dim, stride_x, stride_a,
    TOP_K: tl.constexpr, ROWS_PER_A: tl.constexpr, QUANT: tl.constexpr, FP32_DOT: tl.constexpr,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """v[rows, :count] = x[rows] @ A[rank rows of the block's set and expert].T, weighted, for
    the blocks in use, taken in turn by the grid's programs."""
    blocks = tl.load(num_padded_ptr) // BLOCK_M
    for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
        rows, valid, start, rank, rank_ok, ids, expert = _block_entries(
            block, sorted_rows_ptr, experts_ptr, start_ptr, count_ptr, row_ids_ptr, num_rows,
            TOP_K, R, BLOCK_M)
        x_rows = (rows // ROWS_PER_A).to(tl.int64)
        acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
        for k0 in range(0, in_dim, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            inside = kk < in_dim
            x = tl.load(x_ptr + x_rows[:, None] * stride_x + kk[None, :],
                        mask=valid[:, None] & inside[None, :], other=0.0)
            a = tl.load(a_ptr + ids[None, :] * stride_a + expert * in_dim + kk[:, None],
                        mask=rank_ok[None, :] & inside[:, None], other=0.0)
            if FP32_DOT:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, a.to(x.dtype))  # int8 values are exact in 16-bit floats
        weight = tl.load(row_scales_ptr + start + rank, mask=rank_ok, other=0.0)
        if QUANT:
            weight *= tl.load(qscales_ptr + ids, mask=rank_ok, other=0.0)
        tl.store(v_ptr + rows[:, None].to(tl.int64) * R + rank[None, :],
                 acc * weight[None, :], mask=valid[:, None] & rank_ok[None, :])


@triton.jit(do_not_specialize=["num_rows"])  # a step's rows (moe._align)
def _block_expand(
    v_ptr, b_ptr, y_ptr, sorted_rows_ptr, num_padded_ptr, experts_ptr, start_ptr, count_ptr,
    row_ids_ptr, out_scale_ptr, num_rows, out_dim, stride_b, stride_y, TOP_K: tl.constexpr,
    SCALE: tl.constexpr, FP32_DOT: tl.constexpr, INT8_B: tl.constexpr, R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """y[rows, n-block] += v[rows] @ B[rank rows of the block's set and expert] (times
    out_scale[rows]) for each block in use and block of outputs, taken in turn."""
    tiles = tl.cdiv(out_dim, BLOCK_N)
    work = tl.load(num_padded_ptr) // BLOCK_M * tiles
    for item in range(tl.program_id(0), work, tl.num_programs(0)):
        rows, valid, _, rank, rank_ok, ids, expert = _block_entries(
            item // tiles, sorted_rows_ptr, experts_ptr, start_ptr, count_ptr, row_ids_ptr,
            num_rows, TOP_K, R, BLOCK_M)
        offs = item % tiles * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = offs < out_dim
        v = tl.load(v_ptr + rows[:, None].to(tl.int64) * R + rank[None, :],
                    mask=valid[:, None] & rank_ok[None, :], other=0.0)
        b = tl.load(b_ptr + ids[:, None] * stride_b + expert * out_dim + offs[None, :],
                    mask=rank_ok[:, None] & inside[None, :], other=0.0)
        delta = dot_vb(v, b, FP32_DOT, INT8_B)
        if SCALE:
            delta *= tl.load(out_scale_ptr + rows, mask=valid, other=0.0)[:, None]
        y = y_ptr + rows[:, None].to(tl.int64) * stride_y + offs[None, :]
        mask = valid[:, None] & inside[None, :]
        tl.store(y, (tl.load(y, mask=mask, other=0.0).to(tl.float32) + delta).to(
            y_ptr.dtype.element_ty), mask=mask)


def expert_lora(x: torch.Tensor, rows_per_a: int, topk_ids: torch.Tensor,
                a_pool: torch.Tensor, b_pool: torch.Tensor, rows: TokenRows, y: torch.Tensor,
                out_scale: torch.Tensor | None = None, qscales: torch.Tensor | None = None,
                blocked: bool | None = None) -> None:
    """expert_lora_ref in two Triton launches, a shrink and an expand. blocked (None: above
    PER_ROW_MAX_ROWS rows): the rows grouped by (expert, adapter set) in blocks (align_blocks),
    each block's rows multiplied by its pair's rank rows, read once per block; else a program
    per row. Static shapes: it runs inside CUDA graphs."""
    experts = topk_ids.reshape(-1)
    total, top_k = experts.shape[0], topk_ids.shape[1]
    if total == 0:
        return
    num_experts = b_pool.shape[-1] // y.shape[1]
    r = next_power_of_2(max(rows.max_rows, 16))
    v = torch.empty(total, r, dtype=torch.float32, device=x.device)
    shapes = (a_pool.shape[-1] // num_experts, y.shape[1], r)
    if total > PER_ROW_MAX_ROWS if blocked is None else blocked:
        _blocked(x, rows_per_a, experts, top_k, a_pool, b_pool, rows, y, out_scale, qscales, v,
                 shapes, num_experts)
    else:
        _per_row(x, rows_per_a, experts, top_k, a_pool, b_pool, rows, y, out_scale, qscales, v,
                 shapes)


def _per_row(x, rows_per_a, experts, top_k, a_pool, b_pool, rows, y, out_scale, qscales, v,
             shapes) -> None:
    in_dim, out_dim, r = shapes
    total, quant, block_n = experts.shape[0], qscales is not None, 64
    _row_shrink[(total,)](
        x, a_pool, v, experts, rows.start, rows.count, rows.row_ids, rows.row_scales,
        qscales if quant else rows.row_scales, in_dim, x.stride(0), a_pool.stride(-2),
        TOP_K=top_k, ROWS_PER_A=rows_per_a, QUANT=quant, R=r, BLOCK_K=64,
    )
    _row_expand[(total, cdiv(out_dim, block_n))](
        v, b_pool, y, experts, rows.start, rows.count, rows.row_ids,
        out_scale if out_scale is not None else rows.row_scales, out_dim, b_pool.stride(0),
        y.stride(0), TOP_K=top_k, SCALE=out_scale is not None, R=r, BLOCK_N=block_n,
    )


def _blocked(x, rows_per_a, experts, top_k, a_pool, b_pool, rows, y, out_scale, qscales, v,
             shapes, num_experts) -> None:
    in_dim, out_dim, r = shapes
    total, block_n = experts.shape[0], 64
    set_id = rows.set_id[torch.arange(total, device=x.device) // top_k]
    keys = torch.where(set_id < 0, -1, experts.long() * rows.num_sets + set_id)
    sorted_rows, num_padded = align_blocks(keys, BLOCK_M, num_experts * rows.num_sets)
    blocks = sorted_rows.numel() // BLOCK_M
    programs = (BLOCKED_PROGRAMS_PER_SM * sm_count(x.device.index) if x.device.type == "cuda"
                else 8)
    common = (sorted_rows, num_padded, experts, rows.start, rows.count, rows.row_ids)
    _block_shrink[(min(blocks, programs),)](
        x, a_pool, v, *common, rows.row_scales,
        qscales if qscales is not None else rows.row_scales, total, in_dim, x.stride(0),
        a_pool.stride(-2), TOP_K=top_k, ROWS_PER_A=rows_per_a, QUANT=qscales is not None,
        FP32_DOT=fp32_dot(x.dtype, x.device), R=r, BLOCK_M=BLOCK_M, BLOCK_K=64,
    )
    _block_expand[(min(blocks * cdiv(out_dim, block_n), programs),)](
        v, b_pool, y, *common, out_scale if out_scale is not None else rows.row_scales, total,
        out_dim, b_pool.stride(0), y.stride(0), TOP_K=top_k, SCALE=out_scale is not None,
        FP32_DOT=expand_fp32_dot(b_pool.dtype, x.dtype, x.device),
        INT8_B=b_pool.dtype == torch.int8, R=r, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
    )
