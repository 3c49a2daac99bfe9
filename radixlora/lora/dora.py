"""DoRA (weight-decomposed LoRA, PEFT's use_dora): the per-output-channel scales of an adapter,
computed when it is written into the pool.

PEFT computes a DoRA projection as base(x) + (g - 1) * (x W^T) + g * s * B(A(x)), with
g = m / ||W + s * B A|| per output row (m: the adapter's magnitude vector, the norm detached).
With W fixed, g is a constant of (adapter, layer, module), and the output is
g * (x W^T + s * B A x) + bias: the whole projection, base and delta, scaled per output channel.

Each DoRA adapter takes one pool row more than its rank, its magnitude row: the row's B columns
of each DoRA group hold g - 1 (zero where a module or layer is not adapted), in the pool's dtype
(an int8 pool: with a float32 scale per (slice, row), like the rank rows). g - 1 is small, so
its rounding costs far less than g's would. The row lives and dies with the adapter's rank rows:
evicted, reloaded and host-cached with them. The packed adapter carries m, not g (the registry
that packs it has no base weights); dora_scales turns m into g - 1 on the worker, on every
write into the pool, from the rows just written and the base's dense weights (NF4 and FP8
dequantized). Under tensor parallelism a column-parallel rank holds whole rows of W (its norms
are local); a row-parallel one holds a slice of every row, so the squared norms are summed over
the ranks (an all-reduce in every rank's write, which the ranks run in the same order).

In the forward pass LoraContext calls the backend's scale_dora once the projection's output is
complete (radixlora.kernels.dora_scale)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from radixlora.model.parallel import RowParallelLinear

if TYPE_CHECKING:
    from radixlora.lora.pool import AdapterPool

NORM_ROWS = 4096  # output rows whose W + B A exists at once while norms are computed


class DoraBase:
    """The base projections DoRA's norms are taken of: each layer's fused projection of each
    module group (this rank's part under tensor parallelism), and the squared norms of their
    rows, computed on first use and kept (a float32 per output row: 5.5 MB at the 8B
    shape)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        """dtype: the model's activation dtype (PEFT takes the norms of W in it)."""
        self.model = model
        self.dtype = dtype
        self._squares: dict[tuple[int, str], torch.Tensor] = {}

    def linear(self, layer: int, group: str) -> torch.nn.Module:
        block = self.model.layers[layer]
        return {"qkv": block.self_attn.qkv_proj, "o": block.self_attn.o_proj,
                "gate_up": block.mlp.gate_up_proj, "down": block.mlp.down_proj}[group]

    def weight(self, layer: int, group: str) -> torch.Tensor:
        return dense_weight(self.linear(layer, group), self.dtype)

    def row_squares(self, layer: int, group: str, weight: torch.Tensor) -> torch.Tensor:
        """[out] float32: ||W_j||^2 of each row of `weight` (this layer's and group's)."""
        key = (layer, group)
        if key not in self._squares:
            self._squares[key] = torch.cat([w.float().square().sum(1)
                                            for w in weight.split(NORM_ROWS)])
        return self._squares[key]


def dense_weight(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] of a projection in the model's dtype (NF4 and FP8 dequantized), as PEFT reads
    it (dequantize_module_weight, then .to(x.dtype))."""
    dequantized = getattr(linear, "dequantized", None)
    return linear.weight if dequantized is None else dequantized(dtype)


@torch.inference_mode()
def dora_scales(pool: AdapterPool, base: DoraBase, group: str, magnitudes: torch.Tensor,
                rank_rows: np.ndarray) -> torch.Tensor:
    """g - 1 [layers, out_total] float32 of one DoRA group, from its magnitudes
    [layers, out_total] float32 (NaN: a column the adapter does not adapt, whose g is 1) and
    the group's rank rows already in the pool. No host sync."""
    rows = torch.as_tensor(np.asarray(rank_rows, np.int64), device=pool.device)
    squares = torch.stack([_squared_norms(pool, base, layer, group, rows)
                           for layer in range(magnitudes.shape[0])])
    return torch.where(torch.isnan(magnitudes), 0.0, magnitudes / squares.sqrt() - 1)


def _squared_norms(pool: AdapterPool, base: DoraBase, layer: int, group: str,
                   rows: torch.Tensor) -> torch.Tensor:
    """[out_total] float32: each output row's squared norm of W + s B A (the delta read back
    from the pool, dequantized from an int8 pool), summed over the ranks of a row-parallel
    projection. Expanded as ||W_j||^2 + 2 b_j . (W A^T)_j + b_j^T (A A^T) b_j, so W is read
    once, by one GEMM of rank width, and never added to a dense delta."""
    a = pool.a[layer][group][:, rows].float()  # [n_slices, r, in]
    b = pool.b[layer][group][rows].float().t()  # [out_total, r]
    if pool.quantized:
        a = a * pool.qscales[layer][group][:, rows, None]
    weight = base.weight(layer, group)
    squares = base.row_squares(layer, group, weight).clone()
    offsets = pool.out_offsets[group]
    for i in range(len(offsets) - 1):
        cols = slice(offsets[i], offsets[i + 1])
        cross = (weight[cols] @ a[i].to(weight.dtype).t()).float()  # [out_i, r]
        gram = a[i] @ a[i].t()
        squares[cols] += (b[cols] * (2 * cross + b[cols] @ gram)).sum(1)
    linear = base.linear(layer, group)
    if isinstance(linear, RowParallelLinear):
        linear.tp.all_reduce(squares)
    return squares
