"""LoRA on an MoE layer's stacked experts, added to the grouped GEMM's rows. Row m of a
projection (token m // top_k, routed to expert experts[m]) gets its token's adapter rows of
that expert: with the pool row of rank row j holding every expert's A row j side by side
(a_pool [rows, E * in]) and B column j likewise (b_pool [rows, E * out]),

    v[m, j] = x[m // rows_per_a] . a_pool[row_j, e * in:(e + 1) * in] * scale_j
    y[m] += (sum_j v[m, j] * b_pool[row_j, e * out:(e + 1) * out]) * out_scale[m]

so a step reads, per row, the rank rows of one expert of its adapter set: its LoRA cost follows
the adapter bytes it reads, not the experts' count. A token's rows come from its adapter set
(token_rows), the same rank rows and stacking weights every other module group reads."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .lora_ops import LoraBatchMeta
from .triton_compat import tl, triton

MAX_GATHER = 1 << 24  # elements of A or B gathered at once by the torch reference


class TokenRows(NamedTuple):
    """Each token's rank rows: row_ids[start[t]:start[t] + count[t]] with their stacking
    weights in row_scales (count 0: no adapter here); max_rows >= any count."""

    start: torch.Tensor  # [T] int64
    count: torch.Tensor  # [T] int64
    row_ids: torch.Tensor  # [N] int32
    row_scales: torch.Tensor  # [N] float32
    max_rows: int


def token_rows(meta: LoraBatchMeta) -> TokenRows:
    """A batch's TokenRows, from its groups when it is grouped, else from its segments. Tensor
    ops only (no host sync), so it runs inside a graph."""
    tokens = meta.token_seg.shape[0]
    if meta.groups is None:
        seg = meta.token_seg.long()
        start = meta.row_indptr[seg].long()
        return TokenRows(start, meta.row_indptr[seg + 1].long() - start, meta.row_ids,
                         meta.row_scales, meta.max_rows)
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
    first = g.row_indptr[group].long()
    start.scatter_(0, dest, first)
    count.scatter_(0, dest, g.row_indptr[group + 1].long() - first)
    return TokenRows(start[:tokens], count[:tokens], g.row_ids, g.row_scales, meta.max_rows)


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
def _expert_shrink(
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
def _expert_expand(
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


def expert_lora(x: torch.Tensor, rows_per_a: int, topk_ids: torch.Tensor,
                a_pool: torch.Tensor, b_pool: torch.Tensor, rows: TokenRows, y: torch.Tensor,
                out_scale: torch.Tensor | None = None,
                qscales: torch.Tensor | None = None) -> None:
    """expert_lora_ref in two Triton launches: the shrink (a program per row) and the expand
    (a program per row and block of outputs). Static shapes: it runs inside CUDA graphs."""
    experts = topk_ids.reshape(-1)
    total, top_k = experts.shape[0], topk_ids.shape[1]
    if total == 0:
        return
    r = triton.next_power_of_2(max(rows.max_rows, 16))
    in_dim = a_pool.shape[-1] // (b_pool.shape[-1] // y.shape[1])
    out_dim = y.shape[1]
    v = torch.empty(total, r, dtype=torch.float32, device=x.device)
    quant = qscales is not None
    _expert_shrink[(total,)](
        x, a_pool, v, experts, rows.start, rows.count, rows.row_ids, rows.row_scales,
        qscales if quant else rows.row_scales, in_dim, x.stride(0), a_pool.stride(-2),
        TOP_K=top_k, ROWS_PER_A=rows_per_a, QUANT=quant, R=r, BLOCK_K=64,
    )
    block_n = 64
    _expert_expand[(total, triton.cdiv(out_dim, block_n))](
        v, b_pool, y, experts, rows.start, rows.count, rows.row_ids,
        out_scale if out_scale is not None else rows.row_scales, out_dim, b_pool.stride(0),
        y.stride(0), TOP_K=top_k, SCALE=out_scale is not None, R=r, BLOCK_N=block_n,
    )
