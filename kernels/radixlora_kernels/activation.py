"""SiLU-and-multiply of a fused gate_up projection output (the Llama MLP activation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention_extend import _interpreting
from .rmsnorm import add_delta_ref, check_delta, load_with_delta
from .triton_compat import cdiv, next_power_of_2, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK = 1024


def silu_and_mul_ref(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch reference of `silu_and_mul` (radixlora.model.decoder.MLP.forward)."""
    gate, up = add_delta_ref(gate_up, delta).chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(gate_up: torch.Tensor,
                          delta: torch.Tensor | None = None) -> torch.Tensor:
    """GELU (tanh approximation) of the gate times up, for gate_up = [gate | up] (Gemma's
    MLP)."""
    gate, up = add_delta_ref(gate_up, delta).chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, delta_ptr, inter, stride_in, stride_out,
                         stride_delta, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr,
                         GELU_TANH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptrs = gate_up_ptr + row * stride_in + cols
    delta_ptrs = delta_ptr + row * stride_delta + cols
    gate = load_with_delta(gate_ptrs, delta_ptrs, mask, HAS_DELTA)
    up = load_with_delta(gate_ptrs + inter, delta_ptrs + inter, mask, HAS_DELTA)
    g = gate.to(tl.float32)
    # the activation in fp32, rounded to the input dtype before the product, as torch does
    if GELU_TANH:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(y) = 2 sig(2y) - 1
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = (g * tl.sigmoid(2.0 * inner)).to(gate.dtype)
    else:  # F.silu: x / (1 + exp(-x))
        act = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_gate_up(gate_up: torch.Tensor) -> None:
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * I], got {tuple(gate_up.shape)}")
    if gate_up.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"gate_up must be float16/bfloat16/float32, got {gate_up.dtype}")
    if gate_up.shape[1] > 1 and gate_up.stride(1) != 1:
        raise ValueError(f"gate_up rows must be contiguous, got strides {gate_up.stride()}")


def _output(out: torch.Tensor | None, gate_up: torch.Tensor) -> torch.Tensor:
    shape = (gate_up.shape[0], gate_up.shape[1] // 2)
    if out is None:
        return torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)
    if out.shape != shape or out.dtype != gate_up.dtype or out.device != gate_up.device:
        raise ValueError(
            f"out must be {gate_up.dtype} {shape} on {gate_up.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    if shape[1] > 1 and out.stride(1) != 1:
        raise ValueError(f"out rows must be contiguous, got strides {out.stride()}")
    return out


def silu_and_mul(
    gate_up: torch.Tensor, out: torch.Tensor | None = None, delta: torch.Tensor | None = None,
    gelu_tanh: bool = False,
) -> torch.Tensor:
    """Semantics:
        if delta is not None:                            # a deferred LoRA delta of gate_up
            gate_up = (gate_up.float() + delta).to(gate_up.dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        if gelu_tanh: return F.gelu(gate, approximate="tanh") * up   # Gemma's MLP
        return F.silu(gate) * up

    silu is computed in fp32 and rounded to gate_up's dtype, then the product is computed in
    fp32 and rounded again, as the two eager torch ops do. exp is the GPU's fast exp2-based
    one (torch's is libdevice expf): the fp32 silu may differ in its last bits, which reach a
    bf16/fp16 output only when they move its rounding.

    Args:
        gate_up: [T, 2 * I] float16/bfloat16/float32 (T may be 0), rows of stride 1; gate is
            the first half of each row, up the second.
        out: [T, I] of gate_up's dtype, rows of stride 1 | None.
        delta: [T, 2 * I] float32, rows of stride 1 | None.

    Returns:
        out: [T, I], gate_up's dtype.
    """
    _check_gate_up(gate_up)
    check_delta(delta, gate_up)
    out = _output(out, gate_up)
    num_tokens, inter = out.shape
    if num_tokens == 0 or inter == 0:
        return out
    block = next_power_of_2(inter)
    if not _interpreting():  # the interpreter's cost is per program: one per row there
        block = min(block, _MAX_BLOCK)
    grid = (num_tokens, cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        gate_up, out, gate_up if delta is None else delta, inter, gate_up.stride(0), out.stride(0),
        0 if delta is None else delta.stride(0), BLOCK=block, HAS_DELTA=delta is not None,
        GELU_TANH=gelu_tanh, num_warps=4, enable_fp_fusion=False,
    )
    return out
