"""Per-batch forward context: token inputs plus the attention and LoRA metadata, built once per
batch and read by every layer (no wide forward() signatures, no module globals). The model owns
this contract: its attention and LoRA hooks are the protocols below, which the worker's
attention backends (radixlora.worker.attention) and LoRA context (radixlora.worker.lora_context)
implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class AttentionHook(Protocol):
    def forward_with_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, inv_freq: torch.Tensor, layer_id: int,
                          out_cache_loc: torch.Tensor, meta: Any, deltas=None,
                          rope_scale: float = 1.0) -> torch.Tensor:
        """Rotary embedding of q and k (cos and sin times rope_scale), KV store at
        out_cache_loc, attention."""


class LoraHook(Protocol):
    def begin(self, num_tokens: int, device: torch.device) -> None:
        """Per-forward setup (workspace for num_tokens tokens)."""

    def project(self, linear: torch.nn.Module, x: torch.Tensor, layer_id: int,
                group: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): linear(x) with the batch's LoRA deltas is y + delta."""

    def experts(self, layer_id: int):
        """The MoE layer's expert LoRA hook (radixlora_kernels.moe.moe_experts), or None when
        no request of the batch adapts the experts."""


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 KV slots the new tokens are written to
    logits_indices: torch.Tensor  # [num_logits] rows of the batch whose next token is sampled
    attn_backend: AttentionHook
    attn_meta: Any
    lora: LoraHook | None

    def begin(self) -> None:
        """Per-forward setup, called first by the model: the LoRA context's workspace."""
        if self.lora is not None:
            self.lora.begin(self.input_ids.shape[0], self.input_ids.device)

    def attention(
        self, q, k, v, layer_id: int, inv_freq: torch.Tensor, deltas=None,
        rope_scale: float = 1.0,
    ) -> torch.Tensor:
        """Rotary embedding of q and k at the batch's positions, KV store, attention; deltas:
        (dq, dk, dv), the deferred LoRA deltas of q, k, v, or None."""
        return self.attn_backend.forward_with_rope(
            q, k, v, self.positions, inv_freq, layer_id, self.out_cache_loc, self.attn_meta,
            deltas, rope_scale,
        )

    def lora_project(
        self, linear: torch.nn.Linear, x: torch.Tensor, layer_id: int, group: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): linear(x) with the batch's LoRA deltas is y + delta; delta is None unless
        the LoRA context defers the deltas to the consumer of y (LoraContext)."""
        if self.lora is None:
            return linear(x), None
        return self.lora.project(linear, x, layer_id, group)

    def expert_lora(self, layer_id: int):
        """The expert LoRA hook of MoE layer `layer_id` for this batch, or None."""
        return None if self.lora is None else self.lora.experts(layer_id)

