"""FP8 (e4m3) bases in the formats vLLM serves: compressed-tensors "float-quantized" checkpoints
and quant_method "fp8" ones, with a weight scale per tensor, per output channel or per block
(`weight_block_size` [rows, columns], as Qwen's and DeepSeek's FP8 checkpoints store their
`weight_scale_inv`; compressed-tensors' "block" strategy) and dynamic activation scales.

A weight is stored as float8_e4m3fn W8 with float32 scales s (one per output row; a tensor's one
scale is repeated over its rows, which is exact), and means W = W8 * s. On CUDA devices of
compute capability 8.9 or more, `Fp8Linear` quantizes each token of x to e4m3 with its own scale
(absmax / 448) and multiplies in FP8 through torch._scaled_mm with both scale vectors (W8A8, as
vLLM does); elsewhere it dequantizes W to x's dtype and runs the dense GEMM (the reference).
Block scales are kept per row and block of columns (each block's scale repeated over its rows,
which is exact and lets fused projections and tensor-parallel shards slice them as rows). Their
decode batches run fp8_gemv with those scales; larger batches dequantize W and run the dense
GEMM, since _scaled_mm takes no block scales here.
On CUDA the activations are quantized by one Triton kernel (a program per token), not by the
nine elementwise and reduction launches of the torch spelling: at decode those launches cost
more than the FP8 GEMM's weight read. Decode batches (up to FP8_MAX_M tokens) skip the activation
quantization: kernels/quant_gemv.fp8_gemv reads W8 once, casts it exactly to x's dtype and
scales the row sums (W8A16), where _scaled_mm runs at 2-3x its read floor."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from radixlora_kernels.quant_gemv import FP8_MAX_M, fp8_block_supported, fp8_gemv
from radixlora_kernels.triton_compat import next_power_of_2, tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MAX_QUANT_BLOCK = 4096  # activations per step of the quantization kernel's loops
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def fp8_scheme(qc: dict) -> None:
    """Refuse an FP8 quantization_config radixlora cannot serve: static activation scales, a
    block size that is not two positive integers, or compressed-tensors groups that are not
    8-bit floats."""
    fp8_block(qc)
    if qc.get("quant_method") == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("fp8 checkpoints with static activation scales are not supported")
        return
    for name, group in (qc.get("config_groups") or {}).items():
        weights, acts = group.get("weights") or {}, group.get("input_activations")
        if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
            raise ValueError(f"compressed-tensors group {name}: 8-bit float weights only")
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors group {name}: weight strategy "
                             f"{weights.get('strategy')!r} (tensor, channel or block only)")
        if acts is not None and not acts.get("dynamic", False):
            raise ValueError(f"compressed-tensors group {name}: static activation scales are "
                             "not supported")


def fp8_block(qc: dict) -> tuple[int, int] | None:
    """The (rows, columns) of an FP8 quantization_config's weight scale blocks, None for scales
    per tensor or per channel."""
    if qc.get("quant_method") == "fp8":
        block = qc.get("weight_block_size")
    else:
        groups = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        blocks = [w.get("block_structure") for w in groups if w.get("strategy") == "block"]
        if blocks and (len(blocks) < len(groups) or any(b != blocks[0] for b in blocks)):
            raise ValueError("compressed-tensors groups with different weight strategies")
        if blocks and blocks[0] is None:
            raise ValueError("compressed-tensors weight strategy 'block' without a "
                             "block_structure")
        block = blocks[0] if blocks else None
    if not block:
        return None
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"weight block size {block!r}: expected [rows, columns], two positive "
                         "integers")
    return block[0], block[1]


def scaled_mm_supported(device: torch.device) -> bool:
    """FP8 tensor-core GEMMs: CUDA devices of compute capability 8.9 (Ada) or more."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, its float32 scale per token [T, 1]): x = x8 * scale, scale = absmax / 448."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@triton.jit
def _quantize_per_token_kernel(x_ptr, q_ptr, scale_ptr, in_dim, stride_xt, stride_qt,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_xt, q_ptr + row * stride_qt
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, in_dim, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < in_dim, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)
    tl.store(scale_ptr + row, scale)
    for k in range(0, in_dim, BLOCK):
        offs = k + tl.arange(0, BLOCK)
        mask = offs < in_dim
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(q_row + offs, _round_to_e4m3(q).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(v):
    """v (|v| <= 448) rounded to the nearest e4m3 value (ties to even) and kept in fp32, as
    torch rounds; the cast that follows is then exact on the GPU and in the interpreter,
    whose own cast truncates. Normal values keep 3 mantissa bits; below 2**-6 the values are
    the multiples of 2**-9 (the rounding of |v| * 512 + 2**23 in fp32 is that of rint)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
    sub = sub * tl.where(bits < 0, -1.0, 1.0)  # -0.0 for a negative v that rounds to zero
    return tl.where(tl.abs(v) >= 0.015625, normal, sub)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token_ref in one Triton launch, bit for bit: x [T, K] (last dim
    contiguous) -> (x8 [T, K] e4m3, scale [T, 1] float32)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, K] with contiguous rows, got {tuple(x.shape)} strides "
                         f"{x.stride()}")
    x8 = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0] == 0:
        return x8, scale
    block = min(MAX_QUANT_BLOCK, next_power_of_2(max(x.shape[1], 16)))
    _quantize_per_token_kernel[(x.shape[0],)](x, x8, scale, x.shape[1], x.stride(0),
                                              x8.stride(0), BLOCK=block)
    return x8, scale


def fp8_linear_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """x @ (weight * weight_scale[:, None]).T + bias with x quantized per token to e4m3 and the
    product in FP8 (torch._scaled_mm, fp32 accumulation, scales applied in its epilogue).
    weight [out, in] row-major: weight.t() is the column-major operand _scaled_mm wants, a
    view (no copy per call)."""
    x8, x_scale = quantize_per_token(x) if x.is_cuda else quantize_per_token_ref(x)
    y = torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                         out_dtype=x.dtype)
    return y if bias is None else y + bias


class Fp8Linear(nn.Module):
    """A projection with an e4m3 weight [out, in] and float32 scales: one per output row, or
    with `block` (a checkpoint's [rows, columns] scale blocks) one per row and block of
    block[1] columns, [out, cdiv(in, block[1])] (a fused projection's parts concatenated along
    the rows, each with its own scales)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 block: tuple[int, int] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = block
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        scales = (out_features,) if block is None else (
            out_features, -(-in_features // block[1]))
        self.register_buffer("weight_scale", torch.empty(scales, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.use_scaled_mm = False  # FP8 kernels; set once the device is known (attach_fp8_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T + bias, by the path forward takes."""
        small = x.dim() == 2 and x.shape[0] <= FP8_MAX_M
        if self.use_scaled_mm and self.block is None:
            if small:
                return fp8_gemv(x, self.weight, self.weight_scale, bias)
            return fp8_linear_w8a8(x, self.weight, self.weight_scale, bias)
        if self.use_scaled_mm and small and fp8_block_supported(self.block[1]):
            return fp8_gemv(x, self.weight, self.weight_scale, bias, scale_k=self.block[1])
        return F.linear(x, self.dequantized(x.dtype), bias)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """W8 * s in float32, rounded once to `dtype` (the reference)."""
        if self.block is None:
            return (self.weight.float() * self.weight_scale.view(-1, 1)).to(dtype)
        return scale_by_blocks(self.weight, self.weight_scale, self.block[1]).to(dtype)

    def load_rows(self, rows: tuple[int, int], weight: torch.Tensor, scale: torch.Tensor) -> None:
        """One part (rows [start, end)): its e4m3 weight and its scale (one, or one per row;
        with blocks, one per row and block of columns: row_block_scales)."""
        n = rows[1] - rows[0]
        if weight.dtype != FP8 or tuple(weight.shape) != (n, self.in_features):
            raise ValueError(f"expected a float8_e4m3fn [{n}, {self.in_features}] weight, got "
                             f"{weight.dtype} {tuple(weight.shape)}")
        if self.block is not None:
            want = (n, self.weight_scale.shape[1])
            if tuple(scale.shape) != want:
                raise ValueError(f"expected block scales {list(want)} per row, got "
                                 f"{list(scale.shape)}")
        elif scale.numel() not in (1, n):
            raise ValueError(f"a weight scale per tensor or per row, got {scale.numel()} values")
        else:
            scale = scale.float().reshape(-1).expand(n)
        self.weight[rows[0] : rows[1]].copy_(weight)
        self.weight_scale[rows[0] : rows[1]].copy_(scale.float())


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None) -> torch.Tensor:
    """W8 * scale in float32, for a checkpoint's scale per tensor, per row, or per block of
    `block` [rows, columns]."""
    rows, columns = weight.shape
    if block is not None:
        return scale_by_blocks(weight, row_block_scales(scale, rows, block, columns), block[1])
    if scale.numel() not in (1, rows):
        raise ValueError(f"a weight scale per tensor or per row, got {scale.numel()} values")
    return weight.float() * scale.float().reshape(-1, 1)


def scale_by_blocks(weight: torch.Tensor, scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """W8 * s in float32 for scales [rows, cdiv(columns, block_k)] per row and block of columns:
    over whole blocks a view, so no scale is spread over every weight."""
    rows, columns = weight.shape
    if columns % block_k == 0:
        blocks = weight.view(rows, -1, block_k).float() * scales[:, :, None]
        return blocks.view(rows, columns)
    return weight.float() * scales.repeat_interleave(block_k, dim=1)[:, :columns]


def row_block_scales(scale: torch.Tensor, rows: int, block: tuple[int, int],
                     in_features: int) -> torch.Tensor:
    """A checkpoint's block scales [cdiv(rows, block[0]), cdiv(in_features, block[1])] as
    Fp8Linear keeps them: one per row and block of columns, [rows, cdiv(in_features, block[1])]
    (each block's scale repeated over its rows)."""
    want = (-(-rows // block[0]), -(-in_features // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"expected block scales {list(want)} for [{rows}, {in_features}] in "
                         f"blocks of {list(block)}, got {list(scale.shape)}")
    return scale.float().repeat_interleave(block[0], dim=0)[:rows]


def quantize_fp8(weight: torch.Tensor,
                 absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8, s) of a dense weight [out, in]: s = absmax of each row / 448 (float32), W8 = W / s
    rounded to e4m3. `absmax`: the rows' absolute maxima when `weight` holds only some of each
    row's columns (a row-parallel shard)."""
    if absmax is None:
        absmax = weight.abs().amax(dim=1).float()
    scale = (absmax / FP8_MAX).clamp(min=1e-12)
    return (weight.float() / scale[:, None]).to(FP8), scale


@torch.no_grad()
def swap_projections(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Replace every projection of `model`'s decoder layers by make(that projection)."""
    for layer in model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                linear = getattr(block, name, None)
                if linear is not None:
                    setattr(block, name, make(linear))
    return model


def fp8_projections(model: nn.Module,
                    absmax: Callable[[nn.Linear], torch.Tensor] | None = None) -> nn.Module:
    """Every dense projection of a loaded model quantized to FP8 (--quantization fp8), its rows
    scaled by absmax(projection) if given, else by its weight's own rows' absolute maxima."""
    return swap_projections(model, lambda linear: _fp8_from_linear(
        linear, None if absmax is None else absmax(linear)))


def _fp8_from_linear(linear: nn.Linear, absmax: torch.Tensor | None) -> Fp8Linear:
    weight = linear.weight.detach()
    with torch.device(weight.device):
        out = Fp8Linear(linear.in_features, linear.out_features, linear.bias is not None,
                        weight.dtype)
    out.load_rows((0, linear.out_features), *quantize_fp8(weight, absmax))
    if linear.bias is not None:
        out.bias.data.copy_(linear.bias.detach())
    return out


def fp8_modules(model: nn.Module, block: tuple[int, int] | None = None) -> nn.Module:
    """Swap every projection of `model` (on the meta device, after its dtype is set) for an
    empty Fp8Linear of the same shape (with `block`: of block scales)."""
    dtype = model.embed_tokens.weight.dtype
    return swap_projections(model, lambda linear: Fp8Linear(
        linear.in_features, linear.out_features, linear.bias is not None, dtype, block))


def fp8_experts_supported(device: torch.device) -> bool:
    """Stacked experts kept in FP8 (fp8_experts): the grouped GEMM casts e4m3 tiles in Triton,
    which needs compute capability 8.9 or more; the CPU's torch loop dequantizes per expert."""
    return device.type == "cpu" or scaled_mm_supported(device)


def fp8_experts(model: nn.Module, block: tuple[int, int] | None = None) -> nn.Module:
    """Every MoE layer's stacked experts of `model` (on the meta device) as empty e4m3 weights
    with float32 scales per row ([E, N, 1]), or with `block` per row and block of block[1]
    columns ([E, N, cdiv(K, block[1])]): gate_up_scale and down_scale beside the weights."""
    for layer in model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        for name in ("gate_up_proj", "down_proj"):
            shape = getattr(experts, name).shape
            delattr(experts, name)
            experts.register_buffer(name, torch.empty(shape, dtype=FP8))
            columns = 1 if block is None else -(-shape[2] // block[1])
            experts.register_buffer(name.replace("proj", "scale"),
                                    torch.empty(*shape[:2], columns, dtype=torch.float32))
        experts.fp8_block = 0 if block is None else block[1]
    return model


def attach_fp8_path(model: nn.Module, device) -> None:
    """FP8 GEMMs where the device has them (a model in float32 keeps the reference)."""
    fast = scaled_mm_supported(torch.device(device)) and model.embed_tokens.weight.dtype in (
        torch.bfloat16, torch.float16)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.use_scaled_mm = fast
