"""Per-batch forward context: token inputs plus the attention and LoRA metadata, built once per
batch and read by every layer (no wide forward() signatures, no module globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixlora.attention import AttentionBackend
    from radixlora.lora.context import LoraContext


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 KV slots the new tokens are written to
    logits_indices: torch.Tensor  # [num_logits] rows of the batch whose next token is sampled
    attn_backend: AttentionBackend
    attn_meta: Any
    lora: LoraContext | None

    def begin(self) -> None:
        """Per-forward setup, called first by the model: the LoRA context's workspace."""
        if self.lora is not None:
            self.lora.begin(self.input_ids.shape[0], self.input_ids.device)

    def attention(
        self, q, k, v, layer_id: int, inv_freq: torch.Tensor, deltas=None
    ) -> torch.Tensor:
        """Rotary embedding of q and k at the batch's positions, KV store, attention; deltas:
        (dq, dk, dv), the deferred LoRA deltas of q, k, v, or None."""
        return self.attn_backend.forward_with_rope(
            q, k, v, self.positions, inv_freq, layer_id, self.out_cache_loc, self.attn_meta,
            deltas,
        )

    def lora_project(
        self, linear: torch.nn.Linear, x: torch.Tensor, layer_id: int, group: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): linear(x) with the batch's LoRA deltas is y + delta; delta is None unless
        the LoRA context defers the deltas to the consumer of y (LoraContext)."""
        if self.lora is None:
            return linear(x), None
        return self.lora.project(linear, x, layer_id, group)

