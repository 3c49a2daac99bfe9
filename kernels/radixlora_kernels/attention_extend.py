"""Paged causal attention for prefill / extend: new tokens over a cached prefix plus themselves.

The KV pool holds one token per slot; a request's slots come from a page free list and are listed,
in position order, by a FlashInfer-style CSR (`kv_indptr`, `kv_indices`). The new tokens' K/V are
already written into the pool, so they are the last `qo_len` entries of each request's kv list.
`_attend_kv_block`, one online-softmax step over a block of paged keys, is shared with
`attention_decode`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from .triton_compat import cdiv, next_power_of_2, tl, triton

LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _load_kv_rows(cache, slots, kv_head, stride_s, stride_h, offs_d, mask, dtype: tl.constexpr):
    """The rows in `dtype` (q's): an FP8 pool's values widen exactly."""
    ptrs = cache + slots[:, None] * stride_s + kv_head * stride_h + offs_d[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(dtype)


@triton.jit
def _attend_kv_block(
    q_blk,
    m_i,
    l_i,
    acc,
    k_cache,
    v_cache,
    req_kv_indices,
    kv_head,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    kv_pos,
    kv_end,
    q_pos,
    window,
    offs_d,
    d_mask,
    qk_scale,
    softcap,
    DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step of q_blk [R, D] (rows at positions q_pos) over the keys at kv_pos
    of one request (slots at req_kv_indices + kv_pos; positions >= kv_end are padding). Scores
    are in log2 units (qk_scale = sm_scale * log2(e)); with SOFTCAP, softcap is the cap in those
    units and a score s becomes softcap * tanh(s / softcap).

    Returns the running (max, sum of exp2, unnormalised output), all fp32, after this block.
    """
    n_mask = kv_pos < kv_end
    slots = tl.load(req_kv_indices + kv_pos, mask=n_mask, other=0).to(tl.int64)
    kv_ld_mask = n_mask[:, None] & d_mask[None, :]
    k_blk = _load_kv_rows(k_cache, slots, kv_head, stride_ks, stride_kh, offs_d, kv_ld_mask,
                          q_blk.dtype)
    qk = tl.dot(q_blk, tl.trans(k_blk), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP:  # tanh(x) = 2 sigmoid(2x) - 1
        qk = softcap * (2.0 * tl.sigmoid(2.0 * qk / softcap) - 1.0)

    visible = n_mask[None, :]
    if CAUSAL:
        visible = visible & (kv_pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (kv_pos[None, :] > q_pos[:, None] - window)
    qk = tl.where(visible, qk, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_shift = m_new
    if CAUSAL or USE_WINDOW:
        # Rows with nothing visible yet keep m = -inf; shift by 0 so exp2 yields 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_shift)
    p = tl.math.exp2(qk - m_shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    v_blk = _load_kv_rows(v_cache, slots, kv_head, stride_vs, stride_vh, offs_d, kv_ld_mask,
                          q_blk.dtype)
    acc = acc * alpha[:, None]
    acc += tl.dot(p.to(v_blk.dtype), v_blk, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q,
    k_cache,
    v_cache,
    o,
    qo_indptr,
    kv_indptr,
    kv_indices,
    qk_scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    tile_req,
    tile_m,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TILES: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    head = tl.program_id(1)
    if TILES:  # program 0 axis: one (request, query block) tile of the list
        req = tl.load(tile_req + tl.program_id(0))
        m_block = tl.load(tile_m + tl.program_id(0))
    else:
        req = tl.program_id(0)
        m_block = tl.program_id(2)
    kv_head = head // GROUP

    qo_start = tl.load(qo_indptr + req)
    qo_len = tl.load(qo_indptr + req + 1) - qo_start
    if m_block * BLOCK_M >= qo_len:
        return
    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    prefix_len = kv_len - qo_len

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < qo_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m

    q_rows = (qo_start + offs_m).to(tl.int64)
    q_ptrs = q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q_blk = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    # Keys this query block can see: [lo, hi); lo is rounded down so blocks stay aligned.
    hi = tl.minimum(kv_len, prefix_len + (m_block + 1) * BLOCK_M)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(0, prefix_len + m_block * BLOCK_M - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_kv_block(
            q_blk, m_i, l_i, acc, k_cache, v_cache, kv_indices + kv_start, kv_head,
            stride_ks, stride_kh, stride_vs, stride_vh, start_n + offs_n, hi, q_pos, window,
            offs_d, d_mask, qk_scale, softcap, DOT_PRECISION=DOT_PRECISION, CAUSAL=True,
            USE_WINDOW=USE_WINDOW, SOFTCAP=SOFTCAP,
        )

    # l_i >= 1 for any row that saw a key; padded rows have l_i = 0 and acc = 0.
    acc = acc / tl.maximum(l_i, 1.0)[:, None]
    o_ptrs = o + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(o.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@dataclass(frozen=True)
class _ExtendConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def extend_block_m(head_dim: int, dtype: torch.dtype) -> int:
    """Query tokens per program of `extend_attention`: the size of a tile of `extend_tiles`."""
    return _extend_config(head_dim, dtype).block_m


def extend_tiles(qo_lens, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """(request, query block) of every tile that has query tokens, for extend_attention's
    `tiles`: requests whose qo_len is 0 get none, a request of n tokens cdiv(n, block_m)."""
    lens = np.asarray(qo_lens, np.int64)
    per_req = -(-lens // block_m)
    reqs = np.repeat(np.arange(len(lens)), per_req)
    first = np.repeat(np.cumsum(per_req) - per_req, per_req)
    return reqs.astype(np.int32), (np.arange(len(reqs)) - first).astype(np.int32)


def _extend_config(head_dim: int, dtype: torch.dtype) -> _ExtendConfig:
    if _interpreting():
        return _ExtendConfig(block_m=32, block_n=32, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return _ExtendConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)
    if head_dim <= 64:
        return _ExtendConfig(block_m=128, block_n=64, num_warps=4, num_stages=2)
    if head_dim <= 128:
        return _ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    # wider heads (Gemma's 256): a 128-row fp32 accumulator would not fit the registers
    return _ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


def _block_d(head_dim: int) -> int:
    # tl.dot needs every block dimension >= 16.
    return max(16, next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_window(sliding_window: int | None) -> None:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")


def _check_kv_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype, device) -> None:
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must be equal [num_slots, n_kv_heads, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in (dtype, torch.float8_e4m3fn) or t.device != device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, q is {dtype} on {device} "
                             "(a pool is in q's dtype or float8_e4m3fn)")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")


def _check_index(name: str, t: torch.Tensor, length: int | None, device) -> None:
    if t.dim() != 1 or t.dtype != torch.int32 or t.device != device:
        raise ValueError(f"{name} must be a 1-D int32 tensor on {device}, got {t.dtype} {t.device}")
    if length is not None and t.numel() != length:
        raise ValueError(f"{name} must have {length} entries, got {t.numel()}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_extend_args(q, k_cache, v_cache, o, qo_indptr, kv_indptr, kv_indices) -> None:
    check_q_and_pool(q, o, k_cache, v_cache, "T")
    _check_index("qo_indptr", qo_indptr, None, q.device)
    _check_index("kv_indptr", kv_indptr, qo_indptr.numel(), q.device)
    _check_index("kv_indices", kv_indices, None, q.device)


def check_q_and_pool(q, o, k_cache, v_cache, rows: str) -> None:
    """Checks shared by the attention launchers: q/o [rows, Hq, D] against the KV pool."""
    if q.dim() != 3 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"q must be [{rows}, Hq, D] fp16/bf16/fp32, got {tuple(q.shape)} {q.dtype}"
        )
    if o.shape != q.shape or o.dtype != q.dtype or o.device != q.device:
        raise ValueError(f"o must match q ({tuple(q.shape)} {q.dtype}), got {tuple(o.shape)}")
    if q.stride(-1) != 1 or o.stride(-1) != 1:
        raise ValueError("q and o must be contiguous in head_dim")
    _check_kv_pool(k_cache, v_cache, q.dtype, q.device)
    if k_cache.shape[2] != q.shape[2]:
        raise ValueError(f"head_dim mismatch: q {q.shape[2]}, k_cache {k_cache.shape[2]}")
    if q.shape[1] % k_cache.shape[1] != 0:
        raise ValueError(f"n_q_heads {q.shape[1]} not a multiple of n_kv_heads {k_cache.shape[1]}")


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None = None,
    max_qo_len: int | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal paged attention of each request's new tokens over its whole KV sequence; writes o.

    Semantics:
        for b in range(B):
            qs, qe = qo_indptr[b], qo_indptr[b + 1]
            slots = kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
            k = k_cache[slots].repeat_interleave(group, dim=1)   # [kv_len, Hq, D]
            v = v_cache[slots].repeat_interleave(group, dim=1)
            pos_q = kv_len - qo_len + arange(qo_len)            # absolute query positions
            visible = (arange(kv_len)[None] <= pos_q[:, None])
            if sliding_window: visible &= pos_q[:, None] - arange(kv_len)[None] < sliding_window
            s = einsum("qhd,khd->hqk", q[qs:qe], k) * sm_scale   # masked where not visible
            if softcap: s = softcap * tanh(s / softcap)
            o[qs:qe] = einsum("hqk,khd->qhd", softmax(s, -1), v)

    Args:
        q: [T, Hq, D] new-token queries of all requests, concatenated; fp16/bf16/fp32.
        k_cache, v_cache: [num_slots, Hkv, D] KV pool, same dtype; Hq = group * Hkv.
        o: [T, Hq, D] output, same dtype as q; written in place and returned.
        qo_indptr: [B + 1] int32, offsets of each request's queries in q.
        kv_indptr: [B + 1] int32, offsets of each request's slots in kv_indices.
        kv_indices: [N] int32, slots of each request's KV (prefix + new tokens) in position order;
            the last qo_len entries of request b are its new tokens (so kv_len >= qo_len).
        sm_scale: softmax scale, usually D ** -0.5.
        sliding_window: if set, a query at position p sees only keys k with p - k < sliding_window.
        softcap: if set, scores are soft-capped (Gemma 2's attention logit soft-capping).
        max_qo_len: max over requests of qo_len; computed from qo_indptr (a device sync) if None.
        tiles: (request, query block) int32 pairs from `extend_tiles`: one program per tile and
            head, and only the tokens of the requests they name are written (a batch of
            unequal lengths launches no idle program). None: every request's blocks up to
            max_qo_len.

    Any head_dim works (blocks are padded to a power of 2 >= 16); accumulation is fp32.
    """
    _check_extend_args(q, k_cache, v_cache, o, qo_indptr, kv_indptr, kv_indices)
    _check_window(sliding_window)
    batch = qo_indptr.numel() - 1
    if batch <= 0 or q.shape[0] == 0:
        return o
    head_dim = q.shape[2]
    cfg = _extend_config(head_dim, q.dtype)
    if tiles is not None:
        for name, t in zip(("tile_req", "tile_m"), tiles, strict=True):
            _check_index(name, t, tiles[0].numel(), q.device)
        grid = (tiles[0].numel(), q.shape[1], 1)
        if not grid[0]:
            return o
    else:
        if max_qo_len is None:
            max_qo_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item())
        grid = (batch, q.shape[1], cdiv(max_qo_len, cfg.block_m))
    tile_req, tile_m = tiles if tiles is not None else (None, None)
    _extend_kernel[grid](
        q, k_cache, v_cache, o, qo_indptr, kv_indptr, kv_indices,
        sm_scale * LOG2E, (softcap or 0.0) * LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), o.stride(0), o.stride(1), tile_req, tile_m,
        GROUP=q.shape[1] // k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_D=_block_d(head_dim),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        TILES=tiles is not None, SOFTCAP=softcap is not None,
    )
    return o


def _visible_mask(
    kv_len: int, qo_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    pos_q = torch.arange(kv_len - qo_len, kv_len, device=device)[:, None]
    pos_k = torch.arange(kv_len, device=device)[None, :]
    visible = pos_k <= pos_q
    if sliding_window is not None:
        visible &= pos_q - pos_k < sliding_window
    return visible


def _attend(q, k, v, visible, sm_scale: float, softcap: float | None = None) -> torch.Tensor:
    """q [Lq, Hq, D], k/v [Lk, Hkv, D], visible [Lq, Lk] -> [Lq, Hq, D] in fp32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * sm_scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def extend_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Pure-torch reference of `extend_attention`, one request at a time; returns [T, Hq, D]."""
    o = torch.empty_like(q)
    qo, kv = qo_indptr.tolist(), kv_indptr.tolist()
    for b in range(len(qo) - 1):
        slots = kv_indices[kv[b] : kv[b + 1]].long()
        visible = _visible_mask(len(slots), qo[b + 1] - qo[b], sliding_window, q.device)
        out = _attend(q[qo[b] : qo[b + 1]], k_cache[slots], v_cache[slots], visible, sm_scale,
                      softcap)
        o[qo[b] : qo[b + 1]] = out.to(q.dtype)
    return o
