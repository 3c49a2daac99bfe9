"""NF4 dequantization (bitsandbytes' semantics) into a dense weight, ahead of the GEMM: the
GPU path of radixlora.model.quant.NF4Linear, which dequantizes each projection into one scratch
buffer shared by every layer and hands it to cuBLAS."""

from __future__ import annotations

import torch

from .triton_compat import tl, triton

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_BYTES = 1024  # packed bytes per program: 2048 weights


def nf4_dequant_ref(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                    blocksize: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Pure-torch reference of `nf4_dequant`."""
    idx = torch.stack((packed >> 4, packed & 0xF), dim=-1).reshape(-1).long()
    values = code.float()[idx].view(-1, blocksize)
    return (values * absmax.view(-1, 1)).view(shape).to(dtype)


@triton.jit
def _nf4_dequant_kernel(packed_ptr, absmax_ptr, code_ptr, out_ptr, num_bytes,
                        BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    byte = tl.load(packed_ptr + offs, mask=offs < num_bytes, other=0).to(tl.int32)
    idx = tl.interleave(byte >> 4, byte & 0xF)  # the high nibble is the first weight
    w = pid * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
    mask = w < 2 * num_bytes
    # one fp32 product per weight, rounded once to the output dtype: exactly bitsandbytes'
    value = tl.load(code_ptr + idx) * tl.load(absmax_ptr + w // BLOCKSIZE, mask=mask, other=0.0)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        value = _round_to_bf16(value)
    tl.store(out_ptr + w, value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_bf16(x):
    """x rounded to the nearest bfloat16 (ties to even), as torch rounds, spelled in integer
    bits: the interpreter's own cast truncates. Finite x only (weights are)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


def nf4_dequant(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Semantics:
        idx = stack((packed >> 4, packed & 0xF), -1).reshape(-1)     # high nibble first
        out[:] = (code[idx].view(-1, blocksize) * absmax[:, None]).view(out.shape)  # fp32
    packed [N / 2] uint8, absmax [N / blocksize] fp32 (double quantization resolved), code
    [16] fp32, out: N contiguous float16/bfloat16/float32 values, written in place."""
    _check(packed, absmax, code, blocksize, out)
    num_bytes = packed.numel()
    grid = (triton.cdiv(num_bytes, BLOCK_BYTES),)
    _nf4_dequant_kernel[grid](packed, absmax, code, out, num_bytes, BLOCKSIZE=blocksize,
                              BLOCK=BLOCK_BYTES)
    return out


def _check(packed, absmax, code, blocksize, out) -> None:
    if packed.dtype != torch.uint8 or absmax.dtype != torch.float32:
        raise ValueError(f"packed must be uint8 and absmax float32, got {packed.dtype}, "
                         f"{absmax.dtype}")
    if code.dtype != torch.float32 or code.numel() != 16:
        raise ValueError("code must be the 16 float32 NF4 values")
    if out.dtype not in _FLOAT_DTYPES or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float16/bfloat16/float32 tensor, got "
                         f"{out.dtype}")
    if out.numel() != 2 * packed.numel() or absmax.numel() * blocksize != out.numel():
        raise ValueError(f"{packed.numel()} packed bytes and {absmax.numel()} absmaxes of "
                         f"{blocksize}-blocks do not make {out.numel()} weights")
