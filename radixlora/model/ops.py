"""Elementwise ops of the model: fused Triton kernels on CUDA, their torch references elsewhere
(the references are the CPU path and define the semantics)."""

from __future__ import annotations

import torch

from radixlora_kernels.activation import silu_and_mul, silu_and_mul_ref
from radixlora_kernels.rmsnorm import (
    add_delta_ref,
    fused_add_rmsnorm,
    fused_add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
)
from radixlora_kernels.rotary import apply_rotary_, apply_rotary_ref


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); without a residual, (rmsnorm(x), x). delta: x's
    deferred LoRA delta (float32), added to x first."""
    if residual is None:
        x = add_delta_ref(x, delta)
        return (rmsnorm(x, weight, eps) if x.is_cuda else rmsnorm_ref(x, weight, eps)), x
    if x.is_cuda:
        return fused_add_rmsnorm(x, residual, weight, eps, delta=delta)
    return fused_add_rmsnorm_ref(x, residual, weight, eps, delta)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding of q [T, Hq, D] and k [T, Hk, D] (in place on CUDA)."""
    if q.is_cuda:
        apply_rotary_(q, k, positions, inv_freq)
        return q, k
    return apply_rotary_ref(q, k, positions, inv_freq)


def silu_mul(gate_up: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim; delta: gate_up's deferred
    LoRA delta (float32), added first."""
    if gate_up.is_cuda:
        return silu_and_mul(gate_up, delta=delta)
    return silu_and_mul_ref(gate_up, delta)
