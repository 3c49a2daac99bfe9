"""NF4 dequantization (bitsandbytes' semantics) into a dense weight, ahead of the GEMM: the
GPU path of radixlora.model.quant.NF4Linear, which dequantizes each projection into one scratch
buffer shared by every layer and hands it to cuBLAS."""

from __future__ import annotations

import torch

from .triton_compat import cdiv, tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_BYTES = 1024  # packed bytes per program (at least one block's): 2048 weights


def nf4_dequant_ref(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                    blocksize: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Pure-torch reference of `nf4_dequant`."""
    idx = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1).long()
    values = code.float()[idx].view(-1, blocksize)
    return (values * absmax.view(-1, 1)).view(shape).to(dtype)


@triton.jit
def _nf4_dequant_kernel(packed_ptr, absmax_ptr, code_ptr, word_ptr, num_blocks,
                        HALF_BLOCK: tl.constexpr, ROWS: tl.constexpr, OUT_DTYPE: tl.constexpr,
                        HALF_BITS: tl.constexpr):
    """OUT_DTYPE: "bfloat16" / "float16" (int32 words) or "float32" (int64 words); HALF_BITS:
    the output dtype's bits, half a word."""
    # a tile of ROWS quantization blocks, a row each; a byte's two weights share its row's
    # absmax and are one output word, the high nibble's in the low (first) half
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * HALF_BLOCK + tl.arange(0, HALF_BLOCK)[None, :]
    mask = (rows < num_blocks)[:, None]
    byte = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
    absmax = tl.load(absmax_ptr + rows, mask=rows < num_blocks, other=0.0)[:, None]
    # one fp32 product per weight, rounded once to the output dtype: exactly bitsandbytes'
    first = _value_bits(tl.load(code_ptr + (byte >> 4)) * absmax, OUT_DTYPE)
    second = _value_bits(tl.load(code_ptr + (byte & 0xF)) * absmax, OUT_DTYPE)
    tl.store(word_ptr + offs, first | (second << HALF_BITS), mask=mask)


@triton.jit
def _value_bits(value, OUT_DTYPE: tl.constexpr):
    """The bits of value rounded to OUT_DTYPE, zero-extended into the word type (int32 for
    16-bit outputs, int64 for float32)."""
    if OUT_DTYPE == "float32":
        bits = value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    elif OUT_DTYPE == "bfloat16":
        bits = (_round_to_bf16(value).to(tl.int32, bitcast=True) >> 16) & 0xFFFF
    else:
        bits = value.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return bits


@triton.jit
def _round_to_bf16(x):
    """x rounded to the nearest bfloat16 (ties to even), as torch rounds, spelled in integer
    bits: the interpreter's own cast truncates. Finite x only (weights are)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


def nf4_dequant(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                out: torch.Tensor) -> torch.Tensor:
    """Semantics:
        idx = stack((packed >> 4, packed & 0xF), -1).reshape(-1)     # high nibble first
        out[:] = (code[idx].view(-1, blocksize) * absmax[:, None]).view(out.shape)  # fp32
    packed [N / 2] uint8, absmax [N / blocksize] fp32 (double quantization resolved), code
    [16] fp32, out: N contiguous float16/bfloat16/float32 values (at an even element offset),
    written in place, two weights per store word."""
    _check(packed, absmax, code, blocksize, out)
    half = blocksize // 2
    num_blocks = absmax.numel()
    rows = max(1, BLOCK_BYTES // half)
    words = out.view(-1).view(torch.int64 if out.dtype == torch.float32 else torch.int32)
    _nf4_dequant_kernel[(cdiv(num_blocks, rows),)](
        packed, absmax, code, words, num_blocks, HALF_BLOCK=half, ROWS=rows,
        OUT_DTYPE=str(out.dtype).removeprefix("torch."), HALF_BITS=8 * out.element_size(),
    )
    return out


def _check(packed, absmax, code, blocksize, out) -> None:
    if packed.dtype != torch.uint8 or absmax.dtype != torch.float32:
        raise ValueError(f"packed must be uint8 and absmax float32, got {packed.dtype}, "
                         f"{absmax.dtype}")
    if code.dtype != torch.float32 or code.numel() != 16:
        raise ValueError("code must be the 16 float32 NF4 values")
    if out.dtype not in _FLOAT_DTYPES or not out.is_contiguous() or out.storage_offset() % 2:
        raise ValueError(f"out must be a contiguous float16/bfloat16/float32 tensor at an even "
                         f"element offset (pairs are written as words), got {out.dtype} at "
                         f"{out.storage_offset()}")
    if out.numel() != 2 * packed.numel() or absmax.numel() * blocksize != out.numel():
        raise ValueError(f"{packed.numel()} packed bytes and {absmax.numel()} absmaxes of "
                         f"{blocksize}-blocks do not make {out.numel()} weights")
