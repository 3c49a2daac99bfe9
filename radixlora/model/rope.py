"""Rotary position embedding (neox layout, as in HF Llama), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from radixlora.config import RopeConfig


def inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    low_wavelen = rope.original_max_position / rope.low_freq_factor
    high_wavelen = rope.original_max_position / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig):
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        # on the meta device (the loader's) only allocated: arithmetic there imports
        # torch._dynamo; the loader calls reset_parameters once the model has a device
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        if not self.inv_freq.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inv_freq = inv_frequencies(self.head_dim, self.rope).to(self.inv_freq.device)
