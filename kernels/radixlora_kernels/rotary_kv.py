"""Rotary embedding fused with the KV-cache store: one launch rotates q in place and writes
rotary(k) and v into the pool slots of the batch's new tokens. Unfused, a layer runs the rotary
kernel and then two index_put copies (k, v); at decode sizes each is a latency-bound launch."""

from __future__ import annotations

import torch

from .rmsnorm import add_delta_ref, load_with_delta
from .rotary import (
    _INDEX_DTYPES,
    _check_heads,
    _check_rotary_args,
    _cos_sin,
    _rotate_heads,
    _rotated_heads,
    apply_rotary_ref,
    rotary_blocks,
)
from .triton_compat import tl, triton


def rotary_store_kv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    deltas: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Pure-torch reference of `rotary_store_kv_`."""
    q_in, k, v = (q, k, v) if deltas is None else map(add_delta_ref, (q, k, v), deltas)
    q_rot, k_rot = apply_rotary_ref(q_in, k, positions, inv_freq)
    q.copy_(q_rot)
    k_cache[loc] = to_cache_dtype(k_rot, k_cache.dtype)
    v_cache[loc] = to_cache_dtype(v, v_cache.dtype)


FP8_MAX = 448.0  # e4m3's largest finite value


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in a KV pool's dtype: into FP8 e4m3, clamped to +-FP8_MAX (torch's cast would make a
    larger value NaN) and rounded to nearest even."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


@triton.jit
def _to_cache(x, cache_ptr):
    """x in the pool's dtype, as to_cache_dtype: for FP8, clamped and rounded to nearest even
    in fp32 first (to a multiple of e4m3's step in x's binade, 2^-9 for subnormals), so the
    cast itself is exact (the interpreter's cast misrounds where rounding carries into the
    exponent)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        exp = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
        magic = ((exp + 147) << 23).to(tl.float32, bitcast=True)  # 2^(exp + 20): ulp 2^(exp - 3)
        rounded = (tl.abs(x) + magic) - magic
        x = tl.where(x < 0, -rounded, rounded)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, positions_ptr,
                            inv_freq_ptr, dq_ptr, dk_ptr, dv_ptr, num_q_heads, num_kv_heads,
                            q_blocks, kv_blocks, stride_qt, stride_qh, stride_kt, stride_kh,
                            stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
                            stride_dt, stride_dh, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_HALF: tl.constexpr, HAS_DELTA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    slot = tl.load(loc_ptr + row).to(tl.int64)
    if block < q_blocks + kv_blocks:
        cos, sin = _cos_sin(positions_ptr, inv_freq_ptr, row, HALF, BLOCK_HALF)
        if block < q_blocks:
            _rotate_heads(q_ptr, row, block * BLOCK_H, num_q_heads, stride_qt, stride_qh, cos, sin,
                          HALF, BLOCK_H, BLOCK_HALF, dq_ptr, stride_dt, stride_dh,
                          HAS_DELTA)
        else:
            lo, hi, heads, offs_d, mask = _rotated_heads(
                k_ptr, row, (block - q_blocks) * BLOCK_H, num_kv_heads, stride_kt, stride_kh, cos,
                sin, HALF, BLOCK_H, BLOCK_HALF, dk_ptr, stride_dt, stride_dh,
                HAS_DELTA)
            out = k_cache_ptr + slot * stride_kcs + heads[:, None] * stride_kch + offs_d[None, :]
            tl.store(out, _to_cache(lo, k_cache_ptr), mask=mask)
            tl.store(out + HALF, _to_cache(hi, k_cache_ptr), mask=mask)
    else:
        heads = (block - q_blocks - kv_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, 2 * BLOCK_HALF)
        mask = (heads < num_kv_heads)[:, None] & (offs_d < 2 * HALF)[None, :]
        x = load_with_delta(v_ptr + row * stride_vt + heads[:, None] * stride_vh + offs_d[None, :],
                            dv_ptr + row * stride_dt + heads[:, None] * stride_dh + offs_d[None, :],
                            mask, HAS_DELTA)
        out = v_cache_ptr + slot * stride_vcs + heads[:, None] * stride_vch + offs_d[None, :]
        tl.store(out, _to_cache(x, v_cache_ptr), mask=mask)


def rotary_store_kv_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    deltas: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Semantics (neox rotary as in `apply_rotary_`, same rounding):
        if deltas is not None:          # deferred LoRA deltas of q, k, v
            q_in, k, v = ((x.float() + d).to(x.dtype) for x, d in zip((q, k, v), deltas))
        q_rot, k_rot = apply_rotary(q_in, k, positions, inv_freq)
        q.copy_(q_rot)            # in place
        k_cache[loc] = k_rot      # k itself is left as it is; to_cache_dtype for an FP8 pool
        v_cache[loc] = v

    Args:
        q: [T, Hq, D], k and v: [T, Hk, D]; one float dtype, any strides with stride 1 along D
           (views of a fused qkv projection output); q must not overlap k or the caches.
        positions: [T] int32/int64, contiguous; inv_freq: [D // 2] float32, contiguous.
        k_cache, v_cache: [num_slots, Hk, D] in q's dtype or float8_e4m3fn, stride 1 along D
            (one layer's pool).
        loc: [T] int32/int64, contiguous, slots < num_slots; a slot named twice (the padding
            slot of CUDA graphs) ends up holding one of its tokens' values.
        deltas: (dq, dk, dv) float32 shaped like q, k, v, with stride 1 along D and the
            strides of one another (views of one fused qkv delta) | None.
    """
    _check_rotary_args(q, k, positions, inv_freq)
    _check_store_args(k, v, k_cache, v_cache, loc)
    _check_deltas(deltas, (q, k, v))
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0 or num_q_heads + num_kv_heads == 0:
        return
    half, block_half, block_h, q_blocks, kv_blocks = rotary_blocks(q, k)
    dq, dk, dv = (q, k, v) if deltas is None else deltas
    _rotary_store_kv_kernel[(num_tokens, q_blocks + 2 * kv_blocks)](
        q, k, v, k_cache, v_cache, loc, positions, inv_freq, dq, dk, dv, num_q_heads,
        num_kv_heads, q_blocks, kv_blocks, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), dq.stride(0), dq.stride(1),
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, HAS_DELTA=deltas is not None,
        num_warps=4, enable_fp_fusion=False,
    )


def _check_store_args(k, v, k_cache, v_cache, loc) -> None:
    _check_heads("v", v)
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v {v.dtype} {tuple(v.shape)} must match k {k.dtype} {tuple(k.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or cache.stride(2) != 1:
            raise ValueError(f"{name} must be [num_slots, heads, head_dim] with stride 1 along "
                             f"head_dim, got {tuple(cache.shape)}")
        if (cache.shape[1:] != k.shape[1:] or cache.dtype not in (k.dtype, torch.float8_e4m3fn)
                or cache.device != k.device):
            raise ValueError(
                f"{name} {cache.dtype} {tuple(cache.shape)} must be [num_slots, "
                f"{k.shape[1]}, {k.shape[2]}] {k.dtype} on {k.device}"
            )
    if loc.shape != (k.shape[0],) or loc.dtype not in _INDEX_DTYPES or loc.stride(0) != 1:
        raise ValueError(
            f"loc must be contiguous int32/int64 [{k.shape[0]}], got {loc.dtype} "
            f"{tuple(loc.shape)}"
        )
    if loc.device != k.device:
        raise ValueError(f"loc is on {loc.device}, expected {k.device}")


def _check_deltas(deltas, heads: tuple[torch.Tensor, ...]) -> None:
    if deltas is None:
        return
    if len(deltas) != 3:
        raise ValueError(f"deltas must be (dq, dk, dv), got {len(deltas)} tensors")
    for name, d, x in zip(("dq", "dk", "dv"), deltas, heads, strict=True):
        if d.shape != x.shape or d.dtype != torch.float32 or d.device != x.device:
            raise ValueError(
                f"{name} must be float32 {tuple(x.shape)} on {x.device}, got {d.dtype} "
                f"{tuple(d.shape)} on {d.device}"
            )
        # the kernel steps all three by dq's strides (a dim of size 1 is never stepped)
        if d.stride(2) != 1 or any(
            d.shape[i] > 1 and d.stride(i) != deltas[0].stride(i) for i in (0, 1)
        ):
            raise ValueError(
                f"dq, dk, dv need stride 1 along D and equal strides, got "
                f"{[t.stride() for t in deltas]}"
            )
