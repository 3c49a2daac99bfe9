"""Paged decode attention (one query token per request), split along the KV sequence.

Flash-decoding: stage 1 runs one program per (request, kv head, split); it reads each key/value
once for the whole GQA query group and writes a normalised partial output plus its log-sum-exp.
Stage 2 merges the splits of each (request, q head); with one split (batches that fill the GPU
without splitting) stage 1 writes the output itself and stage 2 does not run. The KV layout and
CSR metadata are those of `attention_extend`; the query of request b is at position kv_len_b - 1.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .attention_extend import (
    LOG2E,
    _attend,
    _attend_kv_block,
    _block_d,
    _check_index,
    _check_window,
    _dot_precision,
    _interpreting,
    check_q_and_pool,
)
from .triton_compat import cdiv, next_power_of_2, tl, triton

MAX_SPLITS = 32


@triton.jit
def _request_and_row(k, req_index, qo_indptr, INDIRECT: tl.constexpr):
    """The batch request of a launch's k-th request and its token's q/o row: k and k, or, for
    the decodes of a mixed batch, req_index[k] and its first token qo_indptr[req_index[k]]."""
    if INDIRECT:
        req = tl.load(req_index + k)
        row = tl.load(qo_indptr + req)
    else:
        req = k
        row = k
    return req, row


@triton.jit
def _decode_split_kernel(
    q,
    k_cache,
    v_cache,
    kv_indptr,
    kv_indices,
    req_index,
    qo_indptr,
    mid_o,
    mid_lse,
    o,
    qk_scale,
    softcap,
    window,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INDIRECT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # program 0 axis: the launch's k-th request, batch request `req`, whose token is q/o row
    k = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req, row = _request_and_row(k, req_index, qo_indptr, INDIRECT)

    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, kv_len - window)
    split_len = tl.cdiv(tl.cdiv(kv_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    split_lo = lo + split * split_len
    split_hi = tl.minimum(kv_len, split_lo + split_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q_ptrs = q + row.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q_blk = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start_n in range(split_lo, split_hi, BLOCK_N):
        # The query, last in the sequence, sees every key of [split_lo, split_hi) (lo applies the
        # window): only padding is masked, and m_i is finite after each iteration.
        m_i, l_i, acc = _attend_kv_block(
            q_blk, m_i, l_i, acc, k_cache, v_cache, kv_indices + kv_start, kv_head,
            stride_ks, stride_kh, stride_vs, stride_vh, start_n + offs_n, split_hi, None, None,
            offs_d, d_mask, qk_scale, softcap, DOT_PRECISION=DOT_PRECISION, CAUSAL=False,
            USE_WINDOW=False, SOFTCAP=SOFTCAP,
        )

    # l_i >= 1 when the split saw a key (its max term is exp2(0)), else l_i = 0 and m_i = -inf:
    # clamping to 1 keeps empty splits at lse = -inf (weight 0 in the merge) without log2(0).
    l_i = tl.maximum(l_i, 1.0)
    acc = acc / l_i[:, None]
    hd_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        # the only split holds the whole softmax: no merge pass
        o_ptrs = o + row.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(o.dtype.element_ty), mask=hd_mask)
    else:
        lse = m_i + tl.math.log2(l_i)
        part = (k * GROUP * tl.num_programs(1) + heads).to(tl.int64) * NUM_SPLITS + split
        tl.store(mid_lse + part, lse, mask=h_mask)
        tl.store(mid_o + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=hd_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o,
    mid_lse,
    o,
    req_index,
    qo_indptr,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INDIRECT: tl.constexpr,
):
    k = tl.program_id(0)
    head = tl.program_id(1)
    _, out_row = _request_and_row(k, req_index, qo_indptr, INDIRECT)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM

    row0 = (k * tl.num_programs(1) + head).to(tl.int64) * NUM_SPLITS
    lse = tl.load(mid_lse + row0 + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    parts_ptrs = mid_o + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    parts = tl.load(parts_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    w_sum = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)
    o_ptrs = o + out_row.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, n_kv_heads: int, device: torch.device) -> int:
    """About 2 programs per SM; depends on (batch, heads) only, so a CUDA graph can fix it."""
    target = 2 * _num_sms(device)
    return max(1, min(MAX_SPLITS, cdiv(target, batch * n_kv_heads)))


def _check_decode_args(q, k_cache, v_cache, o, kv_indptr, kv_indices, num_splits,
                       rows) -> None:
    check_q_and_pool(q, o, k_cache, v_cache, "B")
    if rows is None:
        _check_index("kv_indptr", kv_indptr, q.shape[0] + 1, q.device)
    else:
        req_index, qo_indptr = rows
        _check_index("req_index", req_index, None, q.device)
        _check_index("qo_indptr", qo_indptr, kv_indptr.numel(), q.device)
        _check_index("kv_indptr", kv_indptr, None, q.device)
    _check_index("kv_indices", kv_indices, None, q.device)
    if num_splits is not None and not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Launch parameters of the split kernel (scripts/bench_attention.py --sweep-decode)."""

    block_n: int = 64  # keys per step of a program's loop (32 under the interpreter)
    num_warps: int = 4
    num_stages: int = 2


DEFAULT_DECODE_TUNING = DecodeTuning()


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    tuning: DecodeTuning = DEFAULT_DECODE_TUNING,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each request's single new token over its whole paged KV sequence; writes o.

    Semantics:
        for b in range(B):
            slots = kv_indices[kv_indptr[b] : kv_indptr[b + 1]]   # kv_len = len(slots) >= 1
            if sliding_window: slots = slots[-sliding_window:]
            k = k_cache[slots].repeat_interleave(group, dim=1)   # [kv_len, Hq, D]
            v = v_cache[slots].repeat_interleave(group, dim=1)
            s = einsum("hd,khd->hk", q[b], k) * sm_scale
            if softcap: s = softcap * tanh(s / softcap)
            o[b] = einsum("hk,khd->hd", softmax(s, -1), v)

    Args:
        q: [B, Hq, D] one query per request (qo_indptr = arange(B + 1)); fp16/bf16/fp32.
        k_cache, v_cache: [num_slots, Hkv, D] KV pool, same dtype; Hq = group * Hkv.
        o: [B, Hq, D] output, same dtype as q; written in place and returned.
        kv_indptr: [B + 1] int32, offsets of each request's slots in kv_indices.
        kv_indices: [N] int32, slots of each request's KV in position order (the new token last).
        sm_scale: softmax scale, usually D ** -0.5.
        sliding_window: if set, only the last sliding_window keys are seen.
        softcap: if set, scores are soft-capped (Gemma 2's attention logit soft-capping).
        num_splits: splits of each request's KV range; `default_num_splits` if None. With one
            split the split kernel writes o itself and no merge runs.
        tuning: launch parameters (the defaults are the H200's best in bench_attention.py).
        rows: (req_index, qo_indptr), int32, for the decodes of a mixed batch: q and o are the
            batch's [T, Hq, D] token rows, kv_indptr and qo_indptr its CSR over all requests,
            and only requests req_index (one token each) are attended, into their rows of o
            (qo_indptr[req]); the other rows of o are left alone.

    Any head_dim works (blocks are padded to a power of 2 >= 16); accumulation is fp32.
    """
    _check_decode_args(q, k_cache, v_cache, o, kv_indptr, kv_indices, num_splits, rows)
    _check_window(sliding_window)
    _, n_q_heads, head_dim = q.shape
    batch = q.shape[0] if rows is None else rows[0].numel()
    req_index, qo_indptr = rows if rows is not None else (None, None)
    n_kv_heads = k_cache.shape[1]
    if batch == 0:
        return o
    group = n_q_heads // n_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(batch, n_kv_heads, q.device)
    f32 = {"dtype": torch.float32, "device": q.device}
    parts = num_splits if num_splits > 1 else 0
    mid_o = torch.empty(batch, n_q_heads, parts, head_dim, **f32)
    mid_lse = torch.empty(batch, n_q_heads, parts, **f32)
    block_d = _block_d(head_dim)
    _decode_split_kernel[(batch, n_kv_heads, num_splits)](
        q, k_cache, v_cache, kv_indptr, kv_indices, req_index, qo_indptr, mid_o, mid_lse, o,
        sm_scale * LOG2E, (softcap or 0.0) * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_H=max(16, next_power_of_2(group)), BLOCK_D=block_d,
        BLOCK_N=32 if _interpreting() else tuning.block_n, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=tuning.num_warps,
        num_stages=tuning.num_stages, INDIRECT=rows is not None, SOFTCAP=softcap is not None,
    )
    if num_splits == 1:
        return o
    _decode_merge_kernel[(batch, n_q_heads)](
        mid_o, mid_lse, o, req_index, qo_indptr, o.stride(0), o.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
        BLOCK_S=next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        INDIRECT=rows is not None,
    )
    return o


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Pure-torch reference of `decode_attention`, one request at a time; returns [B, Hq, D]."""
    o = torch.empty_like(q)
    kv = kv_indptr.tolist()
    for b in range(q.shape[0]):
        slots = kv_indices[kv[b] : kv[b + 1]].long()
        if sliding_window is not None:
            slots = slots[-sliding_window:]
        visible = torch.ones(1, len(slots), dtype=torch.bool, device=q.device)
        out = _attend(q[b : b + 1], k_cache[slots], v_cache[slots], visible, sm_scale, softcap)
        o[b] = out[0].to(q.dtype)
    return o
