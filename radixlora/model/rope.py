"""Rotary position embedding (neox layout, as in HF Llama) over the first `dim` channels of each
head (all of them unless the family rotates part of a head), with the frequency scalings
transformers implements: llama3, linear, yarn and longrope (radixlora.config.RopeConfig)."""

from __future__ import annotations

import math

import torch
from torch import nn

from radixlora.config import RopeConfig


def inv_frequencies(dim: int, rope: RopeConfig) -> torch.Tensor:
    """[dim / 2] float32 inverse frequencies of `dim` rotated channels."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "yarn":
        return _yarn_scale(inv_freq, dim, rope)
    if rope.rope_type == "longrope":
        factors = rope.long_factor if rope.use_long else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    return inv_freq


def _yarn_scale(inv_freq: torch.Tensor, dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: interpolated frequencies below the correction range, extrapolated above it, a
    linear ramp between (as transformers' _compute_yarn_parameters)."""
    def correction(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = correction(rope.beta_fast), correction(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return inv_freq / rope.factor * (1 - extrapolation) + inv_freq * extrapolation


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
    def __init__(self, dim: int, rope: RopeConfig):
        """dim: the rotated channels of a head."""
        super().__init__()
        self.dim = dim
        self.rope = rope
        # on the meta device (the loader's) only allocated: arithmetic there imports
        # torch._dynamo; the loader calls reset_parameters once the model has a device
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        if not self.inv_freq.is_meta:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        self.inv_freq = inv_frequencies(self.dim, self.rope).to(self.inv_freq.device)
