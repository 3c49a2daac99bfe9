"""Elementwise ops of the model: fused Triton kernels on CUDA, their torch references elsewhere
(the references are the CPU path and define the semantics)."""

from __future__ import annotations

import torch

from radixlora_kernels.activation import gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref
from radixlora_kernels.moe import moe_experts, moe_experts_ref
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
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); without a residual, (rmsnorm(x), x). delta: x's
    deferred LoRA delta (float32), added to x first. offset: the scale is offset + weight."""
    if residual is None:
        x = add_delta_ref(x, delta)
        if x.is_cuda:
            return rmsnorm(x, weight, eps, offset=offset), x
        return rmsnorm_ref(x, weight, eps, offset), x
    if x.is_cuda:
        return fused_add_rmsnorm(x, residual, weight, eps, delta=delta, offset=offset)
    return fused_add_rmsnorm_ref(x, residual, weight, eps, delta, offset)


def add_delta(x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    """x + its deferred LoRA delta (float32), rounded once to x's dtype."""
    return add_delta_ref(x, delta)


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary embedding of q [T, Hq, D] and k [T, Hk, D] over their first
    2 * len(inv_freq) channels, cos and sin times `scale` (in place on CUDA when that is every
    channel at scale 1)."""
    if q.is_cuda and full_rotary(q, inv_freq, scale):
        apply_rotary_(q, k, positions, inv_freq)
        return q, k
    return apply_rotary_ref(q, k, positions, inv_freq, scale)


def full_rotary(q: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> bool:
    """Whether rotary covers every channel of q's heads at scale 1 (what the fused kernels
    do)."""
    return 2 * inv_freq.numel() == q.shape[-1] and scale == 1.0


def gated_act(gate_up: torch.Tensor, delta: torch.Tensor | None = None,
              activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for gate_up = [gate | up] along the last dim (act: "silu" or
    "gelu_tanh"); delta: gate_up's deferred LoRA delta (float32), added first."""
    gelu = activation == "gelu_tanh"
    if gate_up.is_cuda:
        return silu_and_mul(gate_up, delta=delta, gelu_tanh=gelu)
    return (gelu_tanh_and_mul_ref if gelu else silu_and_mul_ref)(gate_up, delta)


def route(logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, experts [T, k]): the top_k experts of each token by softmax of
    its router logits, the weights renormalised to sum to 1 where the family does."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def sparse_moe(x: torch.Tensor, logits: torch.Tensor, gate_up, down, top_k: int,
               renormalize: bool, lora=None) -> torch.Tensor:
    """The mixture-of-experts MLP of x [T, H]: routing by the router's logits [T, E], then each
    token's experts (SiLU-gated, stacked weights gate_up [E, 2I, H] and down [E, H, I], tensors
    or Fp8Experts) summed by their weights; lora: the batch's expert LoRA hook for this layer,
    or None (radixlora_kernels.moe.moe_experts)."""
    weights, experts = route(logits, top_k, renormalize)
    run = moe_experts if x.is_cuda else moe_experts_ref
    return run(x, experts, weights, gate_up, down, lora)
