"""4-bit NormalFloat (NF4) weights with bitsandbytes' semantics, in torch (the reference and the
CPU path; kernels/radixlora_kernels/nf4_dequant.py is the GPU path).

A weight [out, in] is flattened row-major and cut into blocks of `blocksize` values; each block
keeps its absolute maximum (fp32) and each value the index of the nearest NF4 code to
value / absmax, two indices a byte, the first in the high nibble. Dequantization is
code[index] * absmax in fp32, rounded once to the compute dtype. With double quantization the
absmaxes themselves are stored as 8-bit indices into bitsandbytes' dynamic map, in blocks of
256 with an fp32 absmax each, minus their mean (`offset`): absmax = dynamic[q] * absmax2 + offset,
each step rounded in fp32. That is the whole of what bitsandbytes computes, so it is
bit-identical to it (tests/test_quant_nf4.py compares against bitsandbytes itself)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixlora.model.quant_fp8 import swap_projections
from radixlora_kernels.nf4_dequant import nf4_dequant, nf4_dequant_ref
from radixlora_kernels.quant_gemv import NF4_MAX_M, nf4_gemv, nf4_span

# The NF4 code: quantiles of N(0, 1) normalised to [-1, 1], with an exact zero (QLoRA, App. E).
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=torch.float32)
NESTED_BLOCKSIZE = 256
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class NF4Weight:
    """One NF4-quantized weight of shape `shape`: `packed` [numel / 2] uint8, `absmax` [blocks]
    fp32 (double quantization already resolved to fp32, exactly as bitsandbytes resolves it)."""

    packed: torch.Tensor
    absmax: torch.Tensor
    shape: tuple[int, int]
    blocksize: int
    code: torch.Tensor

    def rows(self, cut: slice) -> NF4Weight:
        """Rows [cut.start, cut.stop), its blocks unchanged (check_nf4_cut)."""
        k, bs = self.shape[1], self.blocksize
        check_nf4_cut(self.shape, bs, rows=cut)
        start, stop = cut.start * k, cut.stop * k
        return NF4Weight(self.packed[start // 2 : stop // 2], self.absmax[start // bs : stop // bs],
                         (cut.stop - cut.start, k), bs, self.code)

    def columns(self, cut: slice) -> NF4Weight:
        """Columns [cut.start, cut.stop) of every row, its blocks unchanged (check_nf4_cut)."""
        (n, k), bs = self.shape, self.blocksize
        check_nf4_cut(self.shape, bs, columns=cut)
        packed = self.packed.view(n, k // 2)[:, cut.start // 2 : cut.stop // 2]
        absmax = self.absmax.view(n, k // bs)[:, cut.start // bs : cut.stop // bs]
        return NF4Weight(packed.reshape(-1), absmax.reshape(-1), (n, cut.stop - cut.start), bs,
                         self.code)


def nested_absmax(qabsmax: torch.Tensor, absmax2: torch.Tensor, code2: torch.Tensor,
                  offset: float | torch.Tensor) -> torch.Tensor:
    """The fp32 block absmaxes of a double-quantized weight: code2[q] * absmax2 (per 256
    blocks), then + offset, each rounded in fp32 as bitsandbytes does."""
    n = qabsmax.numel()
    scale = absmax2.float().repeat_interleave(NESTED_BLOCKSIZE)[:n]
    values = code2.float()[qabsmax.long()] * scale
    return values + torch.as_tensor(offset, dtype=torch.float32)


def dequantize_nf4(w: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in `dtype`: code[index] * absmax in fp32, then one rounding."""
    return nf4_dequant_ref(w.packed.reshape(-1), w.absmax, w.code.to(w.packed.device),
                           w.blocksize, w.shape, dtype)


def quantize_nf4(weight: torch.Tensor, blocksize: int = 64) -> NF4Weight:
    """bitsandbytes' quantize_4bit(weight, blocksize, quant_type="nf4") without double
    quantization (its default): x * (1 / absmax) clamped to [-1, 1], the nearest code (a tie
    goes to the lower one)."""
    check_nf4_shape(tuple(weight.shape), blocksize)
    flat = weight.reshape(-1, blocksize).float()
    absmax = flat.abs().amax(dim=1)
    scaled = torch.clamp(flat * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1), -1, 1)
    midpoints = (NF4_CODE[:-1] + NF4_CODE[1:]) / 2
    idx = torch.bucketize(scaled.reshape(-1), midpoints.to(flat.device)).to(torch.uint8)
    packed = (idx[0::2] << 4) | idx[1::2]
    return NF4Weight(packed, absmax, tuple(weight.shape), blocksize, NF4_CODE.to(flat.device))


def check_nf4_shape(shape: tuple[int, int], blocksize: int) -> None:
    if blocksize not in BLOCKSIZES:
        raise ValueError(f"NF4 blocksize must be one of {BLOCKSIZES}, got {blocksize}")
    if (shape[0] * shape[1]) % blocksize:
        raise ValueError(f"an NF4 weight {shape} is not a whole number of {blocksize}-blocks")


def check_nf4_cut(shape: tuple[int, int], blocksize: int, rows: slice | None = None,
                  columns: slice | None = None) -> None:
    """Raise ValueError unless the rows or the columns `cut` of an NF4 weight `shape` are whole
    blocks of its flat layout: the part is then quantized as it is inside the whole weight."""
    k = shape[1]
    if rows is not None and ((rows.start * k) % blocksize or (rows.stop * k) % blocksize):
        raise ValueError(f"rows {rows.start}:{rows.stop} of {k} weights each are not whole "
                         f"{blocksize}-blocks")
    if columns is not None and (k % blocksize or columns.start % blocksize
                                or columns.stop % blocksize):
        raise ValueError(f"columns {columns.start}:{columns.stop} of rows of {k} weights are "
                         f"not whole {blocksize}-blocks")


def nf4_from_bnb(parts: dict[str, torch.Tensor]) -> NF4Weight:
    """An NF4Weight from the tensors transformers saves for one bitsandbytes Linear4bit:
    `weight` (packed), `weight.absmax`, `weight.quant_map`, with double quantization
    `weight.nested_absmax` and `weight.nested_quant_map`, and the JSON of
    `weight.quant_state.bitsandbytes__nf4` (blocksize, shape, nested_offset)."""
    state = json.loads(bytes(parts["quant_state.bitsandbytes__nf4"].tolist()))
    if state["quant_type"] != "nf4":
        raise ValueError(f"bitsandbytes quant_type {state['quant_type']!r}: nf4 only")
    shape = tuple(state["shape"])
    absmax = parts["absmax"]
    if "nested_absmax" in parts:
        if state.get("nested_blocksize", NESTED_BLOCKSIZE) != NESTED_BLOCKSIZE:
            raise ValueError("double quantization with nested_blocksize != 256")
        absmax = nested_absmax(absmax, parts["nested_absmax"], parts["nested_quant_map"],
                               state["nested_offset"])
    check_nf4_shape(shape, state["blocksize"])
    return NF4Weight(parts["weight"].reshape(-1), absmax.float(), shape, state["blocksize"],
                     parts["quant_map"].float())


class NF4Linear(nn.Module):
    """A projection whose weight [out, in] is NF4 (a fused projection's parts concatenated
    along the rows, as bitsandbytes stores each part: its blocks never straddle two parts).
    On CUDA, up to NF4_MAX_M tokens (decode) run nf4_gemv, which dequantizes in registers as it
    reads the weight once; more tokens dequantize the weight to x's dtype in a Triton kernel,
    into `scratch` (one buffer shared by every NF4Linear of the model: layers run one after
    another on one stream), and run the dense GEMM. Elsewhere the torch reference."""

    def __init__(self, in_features: int, out_features: int, bias: bool, blocksize: int,
                 dtype: torch.dtype):
        super().__init__()
        numel = in_features * out_features
        check_nf4_shape((out_features, in_features), blocksize)
        self.in_features, self.out_features, self.blocksize = in_features, out_features, blocksize
        self.register_buffer("packed", torch.empty(numel // 2, dtype=torch.uint8))
        self.register_buffer("absmax", torch.empty(numel // blocksize, dtype=torch.float32))
        self.register_buffer("code", torch.empty(NF4_CODE.shape))  # on the current device
        self.code.copy_(NF4_CODE)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.scratch: torch.Tensor | None = None
        self.skinny = nf4_span(blocksize, in_features) is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T + bias, by the path forward takes."""
        if self.skinny and x.is_cuda and x.dim() == 2 and x.shape[0] <= NF4_MAX_M:
            return nf4_gemv(x, self.packed, self.absmax, self.code, self.blocksize,
                            self.out_features, bias)
        return F.linear(x, self.dequantized(x.dtype), bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        if self.scratch is None or not self.packed.is_cuda:
            return nf4_dequant_ref(self.packed, self.absmax, self.code, self.blocksize, shape,
                                   dtype)
        out = self.scratch[: shape[0] * shape[1]].view(shape)
        return nf4_dequant(self.packed, self.absmax, self.code, self.blocksize, out)

    def load_rows(self, rows: tuple[int, int], w: NF4Weight) -> None:
        """Copy one part (rows [start, end) of the fused weight) in."""
        if w.blocksize != self.blocksize or (rows[1] - rows[0], self.in_features) != w.shape:
            raise ValueError(f"NF4 part {w.shape} of blocksize {w.blocksize} does not fit rows "
                             f"{rows} of a [{self.out_features}, {self.in_features}] "
                             f"blocksize-{self.blocksize} weight")
        if not torch.equal(w.code.cpu(), NF4_CODE):
            raise ValueError("the checkpoint's quant_map is not the NF4 code")
        self.code.copy_(NF4_CODE)  # a buffer made on the meta device holds no values yet
        start, end = rows[0] * self.in_features, rows[1] * self.in_features
        self.packed[start // 2 : end // 2].copy_(w.packed)
        self.absmax[start // self.blocksize : end // self.blocksize].copy_(w.absmax)

    @classmethod
    def from_linear(cls, linear: nn.Linear, blocksize: int) -> NF4Linear:
        """`linear` quantized as bitsandbytes quantizes a dense weight (quantize_nf4)."""
        weight = linear.weight.detach()
        with torch.device(weight.device):
            out = cls(linear.in_features, linear.out_features, linear.bias is not None,
                      blocksize, weight.dtype)
        w = quantize_nf4(weight, blocksize)
        out.packed.copy_(w.packed)
        out.absmax.copy_(w.absmax)
        if linear.bias is not None:
            out.bias.data.copy_(linear.bias.detach())
        return out


def nf4_modules(model: nn.Module, blocksize: int) -> nn.Module:
    """Swap every projection of `model` (on the meta device, after its dtype is set) for an
    empty NF4Linear of the same shape."""
    dtype = model.embed_tokens.weight.dtype
    return swap_projections(model, lambda linear: NF4Linear(
        linear.in_features, linear.out_features, linear.bias is not None, blocksize, dtype))


@torch.no_grad()
def quantize_projections(model: nn.Module, blocksize: int) -> nn.Module:
    """Every dense projection of a loaded model quantized to NF4 (--quantization nf4)."""
    return swap_projections(model, lambda linear: NF4Linear.from_linear(linear, blocksize))


def attach_scratch(model: nn.Module, dtype: torch.dtype, device) -> None:
    """One dequantization buffer (the largest projection's size) shared by every NF4Linear."""
    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    if not layers or torch.device(device).type != "cuda":
        return
    size = max(m.in_features * m.out_features for m in layers)
    scratch = torch.empty(size, dtype=dtype, device=device)
    for m in layers:
        m.scratch = scratch
