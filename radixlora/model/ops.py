"""Elementwise ops of the model: fused Triton kernels on CUDA, their torch references elsewhere
(the references are the CPU path and define the semantics)."""

from __future__ import annotations

import torch

from radixlora.kernels.activation import silu_and_mul, silu_and_mul_ref
from radixlora.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from radixlora.kernels.rotary import apply_rotary_, apply_rotary_ref


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); without a residual, (rmsnorm(x), x)."""
    if residual is None:
        return (rmsnorm(x, weight, eps) if x.is_cuda else rmsnorm_ref(x, weight, eps)), x
    if x.is_cuda:
        return fused_add_rmsnorm(x, residual, weight, eps)
    return fused_add_rmsnorm_ref(x, residual, weight, eps)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding of q [T, Hq, D] and k [T, Hk, D] (in place on CUDA)."""
    if q.is_cuda:
        apply_rotary_(q, k, positions, inv_freq)
        return q, k
    return apply_rotary_ref(q, k, positions, inv_freq)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    return silu_and_mul(gate_up) if gate_up.is_cuda else silu_and_mul_ref(gate_up)
