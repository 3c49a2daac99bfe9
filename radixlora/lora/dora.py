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

from radixlora.lora.adapter import MODULE_GROUPS
from radixlora.model.parallel import RowParallelLinear

if TYPE_CHECKING:
    from radixlora.lora.pool import AdapterPool

NORM_ROWS = 4096  # output rows whose W + B A exists at once while norms are computed


class DoraBase:
    """The base projections DoRA's norms are taken of: each layer's fused projection of each
    module group (this rank's part under tensor parallelism)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        """dtype: the model's activation dtype (PEFT takes the norms of W in it)."""
        self.model = model
        self.dtype = dtype

    def linear(self, layer: int, group: str) -> torch.nn.Module:
        block = self.model.layers[layer]
        return {"qkv": block.self_attn.qkv_proj, "o": block.self_attn.o_proj,
                "gate_up": block.mlp.gate_up_proj, "down": block.mlp.down_proj}[group]


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
    the group's rank rows already in the pool."""
    rows = torch.as_tensor(np.asarray(rank_rows, np.int64), device=pool.device)
    out = torch.zeros_like(magnitudes)
    for layer in range(magnitudes.shape[0]):
        m = magnitudes[layer]
        adapted = ~torch.isnan(m)
        if not bool(adapted.any()):
            continue
        linear = base.linear(layer, group)
        squares = _squared_norms(pool, layer, group, rows, dense_weight(linear, base.dtype))
        if isinstance(linear, RowParallelLinear):
            linear.tp.all_reduce(squares)
        out[layer] = torch.where(adapted, m / squares.sqrt() - 1, out[layer])
    return out


def _squared_norms(pool: AdapterPool, layer: int, group: str, rows: torch.Tensor,
                   weight: torch.Tensor) -> torch.Tensor:
    """[out_total] float32: each output row's squared norm of W + s B A, the adapter's delta
    read back from the pool (dequantized from an int8 pool), NORM_ROWS rows at a time."""
    a = pool.a[layer][group][:, rows].float()  # [n_slices, r, in]
    b = pool.b[layer][group][rows].float()  # [r, out_total]
    if pool.quantized:
        a = a * pool.qscales[layer][group][:, rows, None]
    offsets = pool.out_offsets[group]
    squares = torch.empty(offsets[-1], dtype=torch.float32, device=weight.device)
    for i in range(len(MODULE_GROUPS[group])):
        for start in range(offsets[i], offsets[i + 1], NORM_ROWS):
            end = min(start + NORM_ROWS, offsets[i + 1])
            dense = weight[start:end].float() + b[:, start:end].t() @ a[i]
            squares[start:end] = dense.square().sum(1)
    return squares
