"""Rotary position embedding (neox layout) applied in place to q and k in one launch.

cos/sin are computed in the kernel from the token positions, so no per-layer cos/sin casts
or tables exist; q and k may be strided views sliced out of a fused qkv projection output.
"""

from __future__ import annotations

import torch

from .attention_extend import _interpreting
from .rmsnorm import load_with_delta
from .triton_compat import cdiv, next_power_of_2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_TILE_ELEMS = 1024  # heads x half head_dim of one program


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `apply_rotary_` (radixlora.model.rope), out of place. The first
    2 * len(inv_freq) channels of each head rotate; the others pass (partial rotary). scale:
    multiplies cos and sin (rope's attention factor: yarn, longrope)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return _rotate_ref(q, cos, sin), _rotate_ref(k, cos, sin)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    dim = cos.shape[-1]
    x, rest = x[..., :dim], x[..., dim:]
    rotated = torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), dim=-1)
    return torch.cat((x * cos + rotated * sin, rest), dim=-1)


@triton.jit
def _mul_rounded(a, b):
    """a * b rounded to a's dtype (one torch elementwise op on a and b of that dtype)."""
    return (a.to(tl.float32) * b.to(tl.float32)).to(a.dtype)


@triton.jit
def _rotated_heads(ptr, row, head0, num_heads, stride_t, stride_h, cos, sin, HALF: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, delta_ptr, stride_dt, stride_dh,
                   HAS_DELTA: tl.constexpr):
    """(lo, hi, heads, offs_d, mask): the rotated halves of heads [head0, head0 + BLOCK_H) of
    token `row` (plus its float32 delta, rounded once), in x's dtype."""
    heads = head0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (offs_d < HALF)[None, :]
    lo_ptrs = ptr + row * stride_t + heads[:, None] * stride_h + offs_d[None, :]
    d_ptrs = delta_ptr + row * stride_dt + heads[:, None] * stride_dh + offs_d[None, :]
    x_lo = load_with_delta(lo_ptrs, d_ptrs, mask, HAS_DELTA)
    x_hi = load_with_delta(lo_ptrs + HALF, d_ptrs + HALF, mask, HAS_DELTA)
    cos = cos.to(x_lo.dtype)[None, :]
    sin = sin.to(x_lo.dtype)[None, :]
    # x * cos + cat(-x_hi, x_lo) * sin, each product and the sum rounded to x's dtype
    lo = _mul_rounded(x_lo, cos).to(tl.float32) - _mul_rounded(x_hi, sin).to(tl.float32)
    hi = _mul_rounded(x_hi, cos).to(tl.float32) + _mul_rounded(x_lo, sin).to(tl.float32)
    return lo.to(x_lo.dtype), hi.to(x_lo.dtype), heads, offs_d, mask


@triton.jit
def _rotate_heads(ptr, row, head0, num_heads, stride_t, stride_h, cos, sin,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  delta_ptr, stride_dt, stride_dh, HAS_DELTA: tl.constexpr):
    """Rotates heads [head0, head0 + BLOCK_H) of token `row` in place (delta: as _rotated_heads)."""
    lo, hi, heads, offs_d, mask = _rotated_heads(ptr, row, head0, num_heads, stride_t, stride_h,
                                                 cos, sin, HALF, BLOCK_H, BLOCK_HALF, delta_ptr,
                                                 stride_dt, stride_dh, HAS_DELTA)
    lo_ptrs = ptr + row * stride_t + heads[:, None] * stride_h + offs_d[None, :]
    tl.store(lo_ptrs, lo, mask=mask)
    tl.store(lo_ptrs + HALF, hi, mask=mask)


@triton.jit
def _cos_sin(positions_ptr, inv_freq_ptr, row, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + offs_d, mask=offs_d < HALF, other=0.0)
    freqs = tl.load(positions_ptr + row).to(tl.float32) * inv_freq
    return tl.cos(freqs), tl.sin(freqs)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, inv_freq_ptr, num_q_heads, num_k_heads,
                   q_blocks, stride_qt, stride_qh, stride_kt, stride_kh,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cos, sin = _cos_sin(positions_ptr, inv_freq_ptr, row, HALF, BLOCK_HALF)
    if block < q_blocks:
        _rotate_heads(q_ptr, row, block * BLOCK_H, num_q_heads, stride_qt, stride_qh, cos, sin,
                      HALF, BLOCK_H, BLOCK_HALF, q_ptr, 0, 0, False)
    else:
        _rotate_heads(k_ptr, row, (block - q_blocks) * BLOCK_H, num_k_heads, stride_kt,
                      stride_kh, cos, sin, HALF, BLOCK_H, BLOCK_HALF, k_ptr, 0, 0,
                      False)


def _check_heads(name: str, x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [T, heads, head_dim], got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16/bfloat16/float32, got {x.dtype}")
    if x.stride(2) != 1:
        raise ValueError(f"{name} must have stride 1 along head_dim, got strides {x.stride()}")


def _check_rotary_args(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> None:
    _check_heads("q", q)
    _check_heads("k", k)
    num_tokens, head_dim = q.shape[0], q.shape[2]
    if k.shape[0] != num_tokens or k.shape[2] != head_dim or k.dtype != q.dtype:
        raise ValueError(
            f"q {q.dtype} {tuple(q.shape)} and k {k.dtype} {tuple(k.shape)} must share T, "
            "head_dim and dtype"
        )
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if positions.shape != (num_tokens,) or positions.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"positions must be int32/int64 [{num_tokens}], got {positions.dtype} "
            f"{tuple(positions.shape)}"
        )
    if inv_freq.shape != (head_dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(
            f"inv_freq must be float32 [{head_dim // 2}], got {inv_freq.dtype} "
            f"{tuple(inv_freq.shape)}"
        )
    for name, t in {"k": k, "positions": positions, "inv_freq": inv_freq}.items():
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, expected {q.device}")
    if positions.stride(0) != 1 or inv_freq.stride(0) != 1:
        raise ValueError("positions and inv_freq must be contiguous")


def rotary_blocks(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(HALF, BLOCK_HALF, BLOCK_H, q head blocks, k head blocks) of a rotary launch."""
    half = q.shape[2] // 2
    block_half = next_power_of_2(half)
    block_h = _heads_per_program(block_half, max(q.shape[1], k.shape[1]))
    q_blocks, k_blocks = cdiv(q.shape[1], block_h), cdiv(k.shape[1], block_h)
    return half, block_half, block_h, q_blocks, k_blocks


def _heads_per_program(block_half: int, max_heads: int) -> int:
    if _interpreting():  # fewest programs: the interpreter's cost is per program
        return next_power_of_2(max_heads)
    return max(1, min(next_power_of_2(max_heads), _TILE_ELEMS // block_half))


def apply_rotary_(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> None:
    """Semantics (in place on q and k, neox layout):
        freqs = positions.float()[:, None] * inv_freq[None, :]        # fp32
        emb = torch.cat((freqs, freqs), dim=-1)
        for x in (q, k):
            cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
            rotated = torch.cat((-x[..., D // 2:], x[..., :D // 2]), dim=-1)
            x.copy_(x * cos + rotated * sin)

    Every product and the sum are rounded to x's dtype as the eager torch ops round them
    (computed in fp32, no FMA contraction), so the only differences from the eager code are
    the last bits of the fp32 cos/sin (libdevice on CUDA, numpy in the interpreter, vs torch's
    own), which reach the output only when they move a cos/sin rounding to x's dtype.

    Args:
        q: [T, Hq, D] float16/bfloat16/float32, any strides with stride 1 along D
           (e.g. a view of a fused qkv projection output [T, Hq*D + 2*Hk*D]).
        k: [T, Hk, D], q's dtype, any strides with stride 1 along D; must not overlap q.
        positions: [T] int32/int64, contiguous, any values (need not be sorted or distinct).
        inv_freq: [D // 2] float32, contiguous (RotaryEmbedding.inv_freq, scaling applied).
    """
    _check_rotary_args(q, k, positions, inv_freq)
    num_tokens, num_q_heads, _ = q.shape
    num_k_heads = k.shape[1]
    if num_tokens == 0 or num_q_heads + num_k_heads == 0:
        return
    half, block_half, block_h, q_blocks, k_blocks = rotary_blocks(q, k)
    grid = (num_tokens, q_blocks + k_blocks)
    _rotary_kernel[grid](
        q, k, positions, inv_freq, num_q_heads, num_k_heads, q_blocks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=4, enable_fp_fusion=False,
    )
