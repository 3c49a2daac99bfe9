"""The decode kernels of quantized bases (kernels/radixlora_kernels/quant_gemv.py, interpreted)
against the product with the dequantized weight: NF4 weights quantized by bitsandbytes itself (with
double quantization, several blocksizes, blocks that straddle rows) for 1 and 3 rows of x (a program
each), FP8 weights with a scale per row, or per row and block of columns (block-wise FP8
checkpoints), for 1 row (the CUDA-core kernel) up to more than one program's rows (tl.dot); with
and without bias."""

from __future__ import annotations

import bitsandbytes.functional as bnb_functional
import pytest
import torch
import torch.nn.functional as F

from radixlora.model.quant import dequantize_nf4, nf4_from_bnb
from radixlora.model.quant_fp8 import Fp8Linear, quantize_fp8, row_block_scales
from radixlora_kernels.quant_gemv import Tile, fp8_gemv, nf4_gemv, nf4_span
from scripts.checkpoints import quantize_fp8_blocks

# relative Frobenius error against the dequantized product: fp32 is exact up to summation
# order; 16-bit outputs are rounded once, and the interpreter's casts truncate
REL_TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def bnb_nf4(shape: tuple[int, int], blocksize: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(*shape, generator=g) * 0.05
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4",
                                                 compress_statistics=True)
    return nf4_from_bnb({**state.as_dict(packed=True), "weight": packed})


@pytest.mark.parametrize(("shape", "blocksize"), [((48, 512), 64), ((40, 256), 256),
                                                  ((34, 96), 64), ((64, 640), 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3])
def test_nf4_gemv_equals_the_dequantized_product(shape, blocksize, dtype, m):
    """(34, 96) / 64: blocks straddle rows, so a tile is 32 weights; (64, 640) / 128: five
    tiles a row, so a loop step takes one (GROUPS divides K / SPAN)."""
    w = bnb_nf4(shape, blocksize, seed=m + blocksize)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, shape[1], generator=g).to(dtype)
    bias = torch.randn(shape[0], generator=g).to(dtype)
    y = nf4_gemv(x, w.packed, w.absmax, w.code, blocksize, shape[0], bias)
    ref = F.linear(x.float(), dequantize_nf4(w, dtype).float(), bias.float())
    assert y.dtype == dtype and y.shape == (m, shape[0])
    assert rel_err(y, ref) < REL_TOL[dtype]


def test_nf4_tiles_stay_inside_one_quantization_block():
    assert nf4_span(64, 4096) == (64, 16)  # blocksize 64, a 1024-weight step: 16 tiles
    assert nf4_span(4096, 14336) == (1024, 1)
    assert nf4_span(64, 96) == (32, 1)  # 96 = 3 x 32: one tile a step
    assert nf4_span(64, 640, Tile(32, 256, 4, 3)) == (64, 2)  # 10 tiles a row: steps of two
    assert nf4_span(64, 48) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "shape", "with_bias"), [(1, (48, 256), True), (7, (40, 200), False),
                                                       (70, (33, 96), True)])
def test_fp8_gemv_equals_the_dequantized_product(dtype, m, shape, with_bias):
    """(40, 200): K is not a multiple of the tile's 256, so the last tile is masked."""
    g = torch.Generator().manual_seed(m)
    w8, scale = quantize_fp8(torch.randn(*shape, generator=g) * 0.05)
    x = torch.randn(m, shape[1], generator=g).to(dtype)
    bias = torch.randn(shape[0], generator=g).to(dtype) if with_bias else None
    y = fp8_gemv(x, w8, scale, bias)
    ref = F.linear(x.float(), w8.float() * scale[:, None], None if bias is None else bias.float())
    assert y.dtype == dtype and y.shape == (m, shape[0])
    assert rel_err(y, ref) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "shape", "block"), [(1, (48, 256), (128, 128)),
                                                   (7, (40, 200), (16, 32)),
                                                   (70, (33, 96), (24, 16))])
def test_fp8_gemv_with_block_scales_equals_the_dequantized_product(dtype, m, shape, block):
    """Scales per block of a checkpoint's weight_block_size, partial blocks at the ends: (40,
    200) in blocks of 32 columns leaves an 8-column block; 16-column blocks make a loop step of
    16."""
    g = torch.Generator().manual_seed(m)
    w8, scale, full = quantize_fp8_blocks(torch.randn(*shape, generator=g) * 0.05, block)
    linear = Fp8Linear(shape[1], shape[0], False, dtype, block)
    linear.load_rows((0, shape[0]), w8, row_block_scales(scale, shape[0], block, shape[1]))
    x = torch.randn(m, shape[1], generator=g).to(dtype)
    y = fp8_gemv(x, linear.weight, linear.weight_scale, scale_k=block[1])
    assert torch.equal(linear.dequantized(torch.float32), w8.float() * full)
    ref = F.linear(x.float(), linear.dequantized(dtype).float())
    assert y.dtype == dtype and y.shape == (m, shape[0])
    assert rel_err(y, ref) < REL_TOL[dtype]


def test_bad_operands_are_refused():
    w = bnb_nf4((32, 64), 64, seed=0)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        nf4_gemv(torch.randn(2, 48), w.packed[:768], w.absmax[:24], w.code, 64, 32)
    with pytest.raises(ValueError, match="do not make"):
        nf4_gemv(x, w.packed[:-1], w.absmax, w.code, 64, 32)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        nf4_gemv(torch.randn(64, 2).t(), w.packed, w.absmax, w.code, 64, 32)
    w8, scale = quantize_fp8(torch.randn(32, 64))
    with pytest.raises(ValueError, match="one scale per output row"):
        fp8_gemv(x, w8, scale[:1])
    with pytest.raises(ValueError, match=r"weight must be \[N, 64\]"):
        fp8_gemv(x, w8.t().contiguous(), scale)
    with pytest.raises(ValueError, match=r"a scale per row and block: \[32, 4\]"):
        fp8_gemv(x, w8, scale, scale_k=16)
    with pytest.raises(ValueError, match="power of two"):
        fp8_gemv(x, w8, scale[:, None].expand(32, 3).contiguous(), scale_k=24)
