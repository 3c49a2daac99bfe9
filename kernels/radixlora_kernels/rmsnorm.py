"""RMSNorm (HF Llama rounding) and residual-add + RMSNorm, one program per token row."""

from __future__ import annotations

import torch

from .triton_compat import next_power_of_2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 16384  # one row is one block held in registers


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                offset: float = 0.0) -> torch.Tensor:
    """Pure-torch reference of `rmsnorm` (radixlora.model.decoder.RMSNorm.forward). offset: the
    scale is offset + weight, taken in float32 with the normalised row (Gemma's 1 + weight)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (offset + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


def add_delta_ref(x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """x + delta rounded once to x's dtype (delta: a float32 LoRA delta, or None)."""
    return x if delta is None else (x.float() + delta).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `fused_add_rmsnorm`."""
    new_residual = add_delta_ref(x, delta) + residual
    return rmsnorm_ref(new_residual, weight, eps, offset), new_residual


@triton.jit
def _scaled_rms(h, w, n_cols, eps, offset, x_dtype: tl.constexpr, HAS_OFFSET: tl.constexpr):
    """weight * (h * rsqrt(mean(h^2) + eps)).to(x_dtype), in fp32; h is zero past n_cols. With
    HAS_OFFSET, (h * rsqrt(...)) * (offset + weight), all in fp32 (Gemma's norm)."""
    var = tl.sum(h * h, axis=0) / n_cols
    if HAS_OFFSET:
        return (h * tl.rsqrt(var + eps)) * (offset + w.to(tl.float32))
    normed = (h * tl.rsqrt(var + eps)).to(x_dtype)
    return w.to(tl.float32) * normed.to(tl.float32)


@triton.jit
def _rmsnorm_kernel(x_ptr, w_ptr, out_ptr, n_cols, stride_x, stride_out, eps, offset,
                    BLOCK: tl.constexpr, HAS_OFFSET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = _scaled_rms(x.to(tl.float32), w, n_cols, eps, offset, x_ptr.dtype.element_ty,
                    HAS_OFFSET)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_with_delta(ptrs, delta_ptrs, mask, HAS_DELTA: tl.constexpr):
    """The values at ptrs, plus the float32 values at delta_ptrs rounded once to their dtype."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d).to(x.dtype)
    return x


@triton.jit
def _fused_add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, delta_ptr, n_cols,
                              stride_x, stride_res, stride_out, stride_res_out, stride_delta, eps,
                              offset, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
                              HAS_OFFSET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = load_with_delta(x_ptr + row * stride_x + cols, delta_ptr + row * stride_delta + cols, mask,
                        HAS_DELTA)
    r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    # rounded to x's dtype before the norm reads it, as the unfused `x + residual` is
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
    y = _scaled_rms(s.to(tl.float32), w, n_cols, eps, offset, x_ptr.dtype.element_ty,
                    HAS_OFFSET)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    """t must be a float tensor shaped like `like` ([T, H]), on its device, unit column stride."""
    if t.dim() != 2 or t.shape != like.shape:
        raise ValueError(f"{name} must have shape {tuple(like.shape)}, got {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float16/bfloat16/float32, got {t.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, expected {like.device}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous (stride 1 along H), got {t.stride()}")


def check_delta(delta: torch.Tensor | None, like: torch.Tensor) -> None:
    """A deferred LoRA delta must be float32 shaped like `like`, with rows of stride 1."""
    if delta is None:
        return
    _check_rows("delta", delta, like)
    if delta.dtype != torch.float32:
        raise ValueError(f"delta must be float32, got {delta.dtype}")


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    _check_rows("x", x, x)
    hidden = x.shape[1]
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"H must be in [1, {MAX_HIDDEN}], got {hidden}")
    if weight.shape != (hidden,) or weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"weight must be a float [{hidden}] tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    if weight.device != x.device or weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous on {x.device}, got {weight.device}")


def _output(out: torch.Tensor | None, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    _check_rows("out", out, x)
    if out.dtype != dtype:
        raise ValueError(f"out must be {dtype}, got {out.dtype}")
    return out


def _launch_config(hidden: int) -> dict[str, int]:
    block = next_power_of_2(hidden)
    # about 8 elements (16 bytes of bf16) per thread
    return {"BLOCK": block, "num_warps": max(1, min(16, block // 256))}


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
    offset: float = 0.0,
) -> torch.Tensor:
    """Semantics (rmsnorm_ref):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if offset: return (h * (offset + weight.float())).to(x.dtype)   # Gemma's 1 + weight
        return weight * h.to(x.dtype)

    The normalised row is rounded to x's dtype before the weight multiplies it (HF Llama);
    the product is computed in fp32 and rounded once to the output dtype, as torch does.
    Only the fp32 statistic differs in its last bits (summation order, rsqrt), which reaches
    a bf16/fp16 output only when it moves a rounding.

    Args:
        x: [T, H] float16/bfloat16/float32 (T may be 0, H <= MAX_HIDDEN), rows of stride 1.
        weight: [H] float, contiguous.
        eps: float, added to the mean square.
        out: [T, H] of dtype promote_types(x.dtype, weight.dtype) | None; may be x itself.

    Returns:
        out: [T, H], promote_types(x.dtype, weight.dtype).
    """
    _check_norm_args(x, weight)
    out = _output(out, x, torch.promote_types(x.dtype, weight.dtype))
    if x.shape[0] == 0:
        return out
    _rmsnorm_kernel[(x.shape[0],)](
        x, weight, out, x.shape[1], x.stride(0), out.stride(0), eps, offset,
        HAS_OFFSET=bool(offset), enable_fp_fusion=False, **_launch_config(x.shape[1]),
    )
    return out


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics:
        if delta is not None:                            # a deferred LoRA delta of x
            x = (x.float() + delta).to(x.dtype)
        new_residual = x + residual                      # in x.dtype
        return rmsnorm(new_residual, weight, eps, offset=offset), new_residual

    new_residual is bit-exact; the norm reads it after rounding to x.dtype, so `normed` equals
    `rmsnorm` of the returned new_residual. Pass residual_out=residual (and/or out=x) to update
    in place: each program reads its whole row before writing it.

    Args:
        x: [T, H] float16/bfloat16/float32 (T may be 0, H <= MAX_HIDDEN), rows of stride 1.
        residual: [T, H], x's dtype, rows of stride 1.
        weight: [H] float, contiguous.
        eps: float, added to the mean square.
        out: [T, H] of dtype promote_types(x.dtype, weight.dtype) | None.
        residual_out: [T, H] of x's dtype | None.
        delta: [T, H] float32, rows of stride 1 | None.

    Returns:
        (normed [T, H] promote_types(x.dtype, weight.dtype), new_residual [T, H] x.dtype).
    """
    _check_norm_args(x, weight)
    _check_rows("residual", residual, x)
    if residual.dtype != x.dtype:
        raise ValueError(f"residual must be {x.dtype} like x, got {residual.dtype}")
    check_delta(delta, x)
    out = _output(out, x, torch.promote_types(x.dtype, weight.dtype))
    residual_out = _output(residual_out, x, x.dtype)
    if x.shape[0] == 0:
        return out, residual_out
    _fused_add_rmsnorm_kernel[(x.shape[0],)](
        x, residual, weight, out, residual_out, x if delta is None else delta, x.shape[1],
        x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
        0 if delta is None else delta.stride(0), eps, offset, HAS_DELTA=delta is not None,
        HAS_OFFSET=bool(offset), enable_fp_fusion=False, **_launch_config(x.shape[1]),
    )
    return out, residual_out
