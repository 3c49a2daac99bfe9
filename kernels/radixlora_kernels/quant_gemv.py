"""Products for decode batches that read a quantized weight once and dequantize it in
registers: y [M, N] = x [M, K] @ W.T (+ bias), W [N, K] either NF4 (bitsandbytes' layout, as
radixlora.model.quant stores it) or e4m3 with a float32 scale per row, or per row and block of
SCALE_K columns (block-wise FP8 checkpoints: DeepSeek's and Qwen's weight_block_size).

At decode a projection's time is its weight read. Dequantizing the whole weight ahead of a
cuBLAS GEMM reads the 4-bit weight, writes 16 bits and reads them again; FP8 W8A8 through
torch._scaled_mm runs at 2-3x its read floor at batch 1 on an H200. These kernels read each
weight byte once: a program owns BLOCK_N output rows and walks K.

fp8_gemv casts each e4m3 tile exactly to x's dtype and multiplies it on the tensor cores
(tl.dot, M padded to 16), or for a single row of x on the CUDA cores, summing the rows at the
end; the row sums are scaled by the row's scale in fp32 (W8A16, as the dequantized reference
computes: activations are not quantized). Up to FP8_MAX_M rows it beats _scaled_mm. With block
scales a loop step lies in one scale block (BLOCK_K divides SCALE_K), and its tile is scaled
before the product, cast to x's dtype, as the dequantized reference rounds it.

nf4_gemv runs one row of x a program on the CUDA cores, the only form that beat dequantize +
cuBLAS (a tensor-core version was 4x slower than that, see the performance log), so it serves
batch 1. A tile of SPAN weights of one row lies in one quantization block (SPAN divides the
blocksize and K, and rows start at multiples of K), so it needs one absmax per row; a loop step
takes GROUPS tiles, GROUPS dividing K / SPAN, so no tile needs a mask along K. A weight is
code[index] * absmax in fp32, rounded once to x's dtype: the weight the dequantizing path hands
to cuBLAS, bit for bit on the GPU, so the products differ from cuBLAS's by summation order only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_compat import cdiv, next_power_of_2, tl, triton

FP8_MAX_M = 16  # rows of x up to which fp8_gemv is used; above, W8A8 through torch._scaled_mm
NF4_MAX_M = 1  # rows of x up to which nf4_gemv is used; above, dequantize + cuBLAS


@dataclass(frozen=True)
class Tile:
    """Launch shape: BLOCK_N output rows per program, BLOCK_K weights of each row per loop
    step."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# chosen on an H200 over Llama-3-8B's projections (the performance log's run 29); FP8's VECTOR
# tile is for a single row of x, which multiplies on the CUDA cores, not the tensor cores
NF4_TILE = Tile(block_n=8, block_k=1024, num_warps=4, num_stages=3)
FP8_TILE = Tile(block_n=32, block_k=512, num_warps=4, num_stages=3)
FP8_VECTOR_TILE = Tile(block_n=8, block_k=1024, num_warps=4, num_stages=3)


@triton.jit
def _nf4_gemv_kernel(x_ptr, packed_ptr, absmax_ptr, code_ptr, bias_ptr, y_ptr, N, K, HALF_K,
                     stride_xm, stride_ym, BLOCKSIZE: tl.constexpr, SPAN: tl.constexpr,
                     GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
    """One row of x a program. HALF_K = K / 2, the packed bytes of a row: a row's bytes start
    at a multiple of it, so the compiler sees aligned, contiguous tiles and loads them in wide
    vectors."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    row_ok = rows < N
    STEP: tl.constexpr = GROUPS * SPAN // 2  # bytes of a row per loop step
    x_row = x_ptr + m * stride_xm + tl.arange(0, 2 * STEP)[None, :]  # [1, 2 STEP]
    partial = tl.zeros((BLOCK_N, STEP), dtype=tl.float32)
    for kb in range(0, HALF_K, STEP):
        even, odd = _nf4_weights(packed_ptr, absmax_ptr, code_ptr, rows, row_ok, K, HALF_K, kb,
                                 BLOCKSIZE, SPAN, GROUPS, BLOCK_N, x_ptr.dtype.element_ty)
        x_even, x_odd = tl.split(tl.reshape(tl.load(x_row + 2 * kb), (1, STEP, 2)))
        partial += even.to(tl.float32) * x_even.to(tl.float32)
        partial += odd.to(tl.float32) * x_odd.to(tl.float32)
    y = tl.sum(partial, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _nf4_weights(packed_ptr, absmax_ptr, code_ptr, rows, row_ok, K, HALF_K, kb,
                 BLOCKSIZE: tl.constexpr, SPAN: tl.constexpr, GROUPS: tl.constexpr,
                 BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """The weights of `rows` from byte kb of each row on, GROUPS tiles of SPAN weights, each
    tile inside one quantization block: (even, odd) [BLOCK_N, GROUPS * SPAN / 2] in dtype,
    code[index] * absmax in fp32 rounded once."""
    HALF: tl.constexpr = SPAN // 2
    rows64 = rows.to(tl.int64)
    groups = tl.arange(0, GROUPS)
    in_step = (groups[:, None] * HALF + tl.arange(0, HALF)[None, :])[None, :, :]
    byte = tl.load(packed_ptr + rows64[:, None, None] * HALF_K + kb + in_step,
                   mask=row_ok[:, None, None], other=0).to(tl.int32)
    first = rows64[:, None] * K + 2 * kb + groups[None, :] * SPAN  # each tile's first weight
    absmax = tl.load(absmax_ptr + first // BLOCKSIZE, mask=row_ok[:, None], other=0.0)[:, :, None]
    even = (tl.load(code_ptr + (byte >> 4)) * absmax).to(dtype)
    odd = (tl.load(code_ptr + (byte & 0xF)) * absmax).to(dtype)
    return (tl.reshape(even, (BLOCK_N, GROUPS * HALF)),
            tl.reshape(odd, (BLOCK_N, GROUPS * HALF)))


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                     stride_ym, stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, VECTOR: tl.constexpr, HAS_BIAS: tl.constexpr,
                     UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     SCALE_K: tl.constexpr):
    """VECTOR: M = 1, products on the CUDA cores. SCALE_K > 0: scale [N, cdiv(K, SCALE_K)]
    (row stride stride_sn), a scale per row and block of SCALE_K columns; 0: one per row."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, m_ok = rows < N, ms < M
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + ms.to(tl.int64)[:, None] * stride_xm
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    partial = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < K)[None, :]
        w = tl.load(w_rows + ks[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
        if SCALE_K > 0:  # the step's tile dequantized as the reference rounds it
            s = tl.load(scale_ptr + rows.to(tl.int64) * stride_sn + k0 // SCALE_K,
                        mask=row_ok, other=0.0)
            w = (w.to(tl.float32) * s[:, None]).to(dtype)
        if VECTOR:
            partial += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc = _dot(acc, x, w.to(dtype), UPCAST, DOT_PRECISION)
    if VECTOR:
        acc += tl.sum(partial, axis=1)[None, :]
    if SCALE_K == 0:
        acc *= tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
    _store(acc, bias_ptr, y_ptr, rows, ms, row_ok, m_ok, stride_ym, HAS_BIAS)


@triton.jit
def _dot(acc, x, w, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + x @ w.T; UPCAST: in fp32 (the interpreter's tl.dot mishandles 16-bit floats)."""
    if UPCAST:
        x, w = x.to(tl.float32), w.to(tl.float32)
    return tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)


@triton.jit
def _store(acc, bias_ptr, y_ptr, rows, ms, row_ok, m_ok, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + ms.to(tl.int64)[:, None] * stride_ym + rows[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & row_ok[None, :])


def nf4_span(blocksize: int, in_features: int, tile: Tile = NF4_TILE) -> tuple[int, int] | None:
    """(SPAN, GROUPS) of nf4_gemv's loop for this shape: SPAN weights a tile (one absmax
    each), GROUPS (a power of two) tiles a step; None where in_features is not a multiple of
    32."""
    span = min(tile.block_k, blocksize)
    while in_features % span:
        span //= 2
    if span < 32:
        return None
    groups = max(1, tile.block_k // span)
    while (in_features // span) % groups:
        groups //= 2
    return span, groups


def nf4_gemv(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
             blocksize: int, out_features: int, bias: torch.Tensor | None = None,
             tile: Tile = NF4_TILE) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) with W [out_features, K] NF4: packed [N * K / 2] uint8 (two
    indices a byte, the first weight in the high nibble), absmax [N * K / blocksize] fp32,
    code [16] fp32. x's last dimension contiguous; y in x's dtype. Each row of x reads the
    weight again: meant for M = 1."""
    m, k = _check_x(x)
    loop = nf4_span(blocksize, k, tile)
    if loop is None:
        raise ValueError(f"nf4_gemv needs in_features a multiple of 32, got {k}")
    if packed.numel() * 2 != out_features * k or absmax.numel() * blocksize != 2 * packed.numel():
        raise ValueError(f"{packed.numel()} packed bytes and {absmax.numel()} absmaxes do not "
                         f"make a [{out_features}, {k}] weight of {blocksize}-blocks")
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    _nf4_gemv_kernel[_grid(m, out_features, 1, tile)](
        x, packed, absmax, code, bias if bias is not None else y, y, out_features, k, k // 2,
        x.stride(0), y.stride(0), BLOCKSIZE=blocksize, SPAN=loop[0], GROUPS=loop[1],
        BLOCK_N=tile.block_n, HAS_BIAS=bias is not None, num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return y


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None = None, tile: Tile | None = None,
             scale_k: int = 0) -> torch.Tensor:
    """x [M, K] @ (weight * scale).T (+ bias): weight [N, K] float8_e4m3fn with contiguous
    rows; scale fp32, [N] (a scale per row, scale_k 0) or [N, cdiv(K, scale_k)] (per row and
    block of scale_k columns, fp8_block_supported(scale_k)); x's last dimension contiguous; y
    in x's dtype."""
    m, k = _check_x(x)
    tile = tile or (FP8_VECTOR_TILE if m == 1 else FP8_TILE)
    n = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {k}] with contiguous rows, got "
                         f"{tuple(weight.shape)} strides {weight.stride()}")
    block_k = tile.block_k
    if scale_k:
        if not fp8_block_supported(scale_k):
            raise ValueError(f"scale blocks of a power of two of at least 16 columns, got "
                             f"{scale_k}")
        if tuple(scale.shape) != (n, cdiv(k, scale_k)) or scale.stride(1) != 1:
            raise ValueError(f"a scale per row and block: [{n}, {cdiv(k, scale_k)}], "
                             f"got {tuple(scale.shape)}")
        block_k = min(block_k, scale_k)
    elif scale.numel() != n:
        raise ValueError(f"one scale per output row: {n}, got {scale.numel()}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = _block_m(m)
    _fp8_gemv_kernel[_grid(m, n, block_m, tile)](
        x, weight, scale, bias if bias is not None else y, y, m, n, k, x.stride(0),
        weight.stride(0), y.stride(0), scale.stride(0) if scale_k else 0, BLOCK_M=block_m,
        BLOCK_N=tile.block_n, BLOCK_K=block_k, VECTOR=m == 1, HAS_BIAS=bias is not None,
        SCALE_K=scale_k, **_dot_args(x), num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
    return y


def fp8_block_supported(scale_k: int) -> bool:
    """Whether fp8_gemv takes scale blocks of scale_k columns (a loop step must fit in one)."""
    return scale_k >= 16 and scale_k & (scale_k - 1) == 0


def _check_x(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with a contiguous last dimension, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    return x.shape[0], x.shape[1]


def _block_m(m: int) -> int:
    """Rows of x per program: 1 for a single row (the VECTOR kernels), else tl.dot's minimum
    of 16 up to 64, m rounded up to a power of two."""
    return 1 if m == 1 else min(64, max(16, next_power_of_2(m)))


def _grid(m: int, n: int, block_m: int, tile: Tile) -> tuple[int, int]:
    return cdiv(n, tile.block_n), cdiv(m, block_m)


def _dot_args(x: torch.Tensor) -> dict:
    """On the GPU the products run in x's dtype (fp32 exactly, not as tf32); the interpreter
    (x on the CPU) multiplies in fp32."""
    upcast = not x.is_cuda
    exact = upcast or x.dtype == torch.float32
    return {"UPCAST": upcast, "DOT_PRECISION": "ieee" if exact else "tf32"}
