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
that packs it has no base weights); the worker turns m into g - 1 on the worker, on every
write into the pool, from the rows just written and the base's dense weights (NF4 and FP8
dequantized). Under tensor parallelism a column-parallel rank holds whole rows of W (its norms
are local); a row-parallel one holds a slice of every row, so its squared norms are partial and
summed over the ranks. Not in the write: the ranks write prefetched adapters when their reads
end, which differs from rank to rank, and a rank whose read failed writes nothing. The partial
squares wait in the pool (AdapterPool.finish_dora) until the first step that reads the adapter,
which every rank launches in the same order, after its writes: one all-reduce there for all the
adapters that step finishes.

In the forward pass LoraContext calls the backend's scale_dora once the projection's output is
complete (radixlora_kernels.dora_scale)."""

from __future__ import annotations

import torch

from radixlora.model.parallel import RowParallelLinear

NORM_ROWS = 4096  # rows of W squared in float32 at once


class DoraBase:
    """The base projections DoRA's norms are taken of: each layer's fused projection of each
    module group (this rank's part under tensor parallelism), and the squared norms of their
    rows, computed on first use and kept (a float32 per output row: 5.5 MB at the 8B
    shape)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        """dtype: the model's activation dtype (PEFT takes the norms of W in it)."""
        self.model = model
        self.dtype = dtype
        self._squares: dict[str, torch.Tensor] = {}

    def linear(self, layer: int, group: str) -> torch.nn.Module:
        block = self.model.layers[layer]
        owner = block.self_attn if group in ("qkv", "o") else block.mlp
        return getattr(owner, f"{group}_proj")

    def weight(self, layer: int, group: str) -> torch.Tensor:
        return dense_weight(self.linear(layer, group), self.dtype)

    def row_parallel(self, group: str) -> RowParallelLinear | None:
        """The group's first row-parallel projection under tensor parallelism (its ranks hold
        a slice of every row, so their squared norms must be summed), else None."""
        linear = self.linear(0, group)
        return linear if isinstance(linear, RowParallelLinear) else None

    def row_squares(self, group: str) -> torch.Tensor:
        """[layers, out_total] float32: ||W_j||^2 of each row of each layer's projection."""
        if group not in self._squares:
            self._squares[group] = torch.stack([
                torch.cat([w.float().square().sum(1) for w in self.weight(layer, group)
                           .split(NORM_ROWS)])
                for layer in range(len(self.model.layers))])
        return self._squares[group]


def dense_weight(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """[out, in] of a projection in the model's dtype (NF4 and FP8 dequantized), as PEFT reads
    it (dequantize_module_weight, then .to(x.dtype))."""
    dequantized = getattr(linear, "dequantized", None)
    return linear.weight if dequantized is None else dequantized(dtype)


DORA_VANISHES = ("DoRA: ||W + s*B*A|| (nearly) vanishes on some output rows, where what is "
                 "left of the projection is rounding noise that the scale m / ||W + s*B*A|| "
                 "would blow up (or the norm is zero and the scale infinite)")


def vanishing_norms(magnitudes: torch.Tensor, squares: torch.Tensor, base_squares: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """A device flag: some adapted row's squared norm of W + s B A is at most eps ||W||^2 (eps
    of the dtype W is read in: the rounding of squared_norms' expansion, below which its value
    says nothing), or is not finite. Such a row's scale is noise or infinite; PEFT's output
    there is noise or NaN too."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    adapted = ~torch.isnan(magnitudes)
    return (adapted & ~(squares > eps * base_squares)).any()


def scales_from(magnitudes: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
    """g - 1 [layers, out_total] float32 from the magnitudes (NaN: a column the adapter does not
    adapt, whose g is 1) and the squared norms of W + s B A."""
    return torch.where(torch.isnan(magnitudes), 0.0, magnitudes / squares.sqrt() - 1)


@torch.inference_mode()
def squared_norms(a: torch.Tensor, b: torch.Tensor, offsets: list[int], base: DoraBase,
                  group: str) -> torch.Tensor:
    """[layers, out_total] float32: each output row's squared norm of W + s B A, this rank's
    part (a row-parallel rank's columns only), from the delta's rank rows as the pool holds
    them (AdapterPool.rank_rows: a [layers, n_slices, r, in], b [layers, out_total, r], float32,
    dequantized), `offsets` the group's output offsets. Expanded as
    ||W_j||^2 + 2 b_j . (W A^T)_j + b_j^T (A A^T) b_j: W is read once, by one GEMM of rank
    width per layer and slice, and never added to a dense delta; everything else is batched
    over the layers. No host sync, no collective."""
    gram = a @ a.transpose(2, 3)  # [layers, n_slices, r, r]
    cross = torch.empty(b.shape[:2], dtype=torch.float32, device=b.device)
    squares = base.row_squares(group).clone()
    slices = [slice(offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1)]
    for i, cols in enumerate(slices):
        squares[:, cols] += ((b[:, cols] @ gram[:, i]) * b[:, cols]).sum(2)
    a_t = a.to(base.dtype).transpose(2, 3)  # [layers, n_slices, in, r], W's dtype
    for layer in range(a.shape[0]):
        weight = base.weight(layer, group)
        for i, cols in enumerate(slices):
            wa = (weight[cols] @ a_t[layer, i]).float()  # [out_i, r]
            torch.linalg.vecdot(b[layer, cols], wa, out=cross[layer, cols])
    return squares.add_(cross, alpha=2)
