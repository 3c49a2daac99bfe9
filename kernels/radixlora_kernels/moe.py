"""Mixture-of-experts MLP: each token's rows (token * top_k + j, one per chosen expert) grouped by
expert and padded to whole blocks (moe_align), then one grouped GEMM launch per projection over
the blocks of every expert, each block reading its expert's weight (no per-expert loop). The
routing weights scale the down projection's rows; the caller sums a token's top_k rows.

Expert weights are stacked as transformers 5 keeps them: gate_up [E, 2I, H] ([gate | up] rows),
down [E, H, I]. Every shape is static for a given token count, so a decode step's experts run
inside a CUDA graph."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .activation import silu_and_mul
from .triton_compat import tl, triton


def moe_experts_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, lora=None) -> torch.Tensor:
    """Pure-torch reference (the CPU path): transformers' expert loop over the tokens' rows
    (token * top_k + j, one per chosen expert). x [T, H], topk_ids and topk_weights [T, k]; the
    routed sum [T, H] in x's dtype. lora: the layer's expert LoRA hook (moe_experts)."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    scale = topk_weights.reshape(-1, 1)
    h = x.new_empty(flat.shape[0], gate_up.shape[1])
    y = x.new_empty(flat.shape[0], down.shape[1])
    for expert in flat.unique().tolist():
        rows = torch.where(flat == expert)[0]
        h[rows] = F.linear(x[rows // top_k], gate_up[expert])
    if lora is not None:
        lora("experts_gate_up", x, top_k, topk_ids, h)
    g, u = h.chunk(2, dim=-1)
    h = F.silu(g) * u
    for expert in flat.unique().tolist():
        rows = torch.where(flat == expert)[0]
        y[rows] = (F.linear(h[rows], down[expert]) * scale[rows]).to(y.dtype)
    if lora is not None:
        lora("experts_down", h, 1, topk_ids, y, scale.reshape(-1).float())
    return y.view(tokens, top_k, -1).sum(dim=1)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_rows, block_expert, num_padded) for the M = T * k rows of topk_ids [T, k]: the rows
    sorted by expert, each expert's run padded to a multiple of block_m with the sentinel M;
    block_expert[b] the expert of block b; num_padded [1] the rows in use. Tensor ops only,
    sized by M alone (no host sync): at most one partial block per expert in use."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    m, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    rank = torch.arange(m, device=device) - (counts.cumsum(0) - counts)[by_expert]
    dest = (padded_end - padded)[by_expert] + rank
    num_blocks = triton.cdiv(m + min(num_experts, m) * (block_m - 1), block_m)
    sorted_rows = torch.full((num_blocks * block_m,), m, dtype=torch.int32, device=device)
    sorted_rows[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_rows, block_expert.to(torch.int32), padded_end[-1:]


@triton.jit
def _grouped_gemm(
    a_ptr, w_ptr, c_ptr, rows_ptr, block_expert_ptr, num_padded_ptr, scale_ptr,
    num_rows, N, K, stride_am, stride_we, stride_wn, stride_cm,
    ROWS_PER_A: tl.constexpr, SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[row] = a[row // ROWS_PER_A] @ w[expert].T (times scale[row] with SCALE) for the rows of
    one block of one expert."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    a_rows = (rows // ROWS_PER_A).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + kk[None, :],
                    mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + kk[:, None],
                    mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    if SCALE:
        acc *= tl.load(scale_ptr + rows, mask=valid, other=0.0)[:, None]
    c = c_ptr + rows[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


class GemmConfig(NamedTuple):
    """One launch's tiles: rows per block (the alignment's block size), output columns and
    reduction steps per program, and Triton's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (most rows an expert gets on average, config), first match; tuned on an H100 at
# Qwen3-30B-A3B's and Mixtral's shapes (scripts/tune_moe.py)
CONFIGS = (
    (16, GemmConfig(16, 64, 32, 4, 3)),
    (32, GemmConfig(32, 64, 32, 4, 3)),
    (float("inf"), GemmConfig(64, 64, 32, 4, 3)),
)


def gemm_config(num_rows: int, num_experts: int) -> GemmConfig:
    """The tiles for num_rows rows over num_experts experts: blocks of about the rows an expert
    gets (a decode step's few rows per expert waste little of a small block; a prefill's many
    fill large ones)."""
    per_expert = num_rows / min(num_experts, num_rows)
    return next(config for most, config in CONFIGS if per_expert <= most)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, aligned, num_rows: int, rows_per_a: int,
                 config: GemmConfig, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[num_rows, N]: row r is a[r // rows_per_a] @ w[expert of r].T (times scale[r]); w [E, N, K]
    contiguous, aligned = moe_align(...) with config.block_m."""
    sorted_rows, block_expert, num_padded = aligned
    experts, n, k = w.shape
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), triton.cdiv(n, config.block_n))
    _grouped_gemm[grid](
        a, w, out, sorted_rows, block_expert, num_padded,
        scale if scale is not None else out, num_rows, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_A=rows_per_a, SCALE=scale is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, lora=None) -> torch.Tensor:
    """moe_experts_ref with two grouped GEMM launches: gate_up over the tokens' rows, the gated
    activation, down scaled by the routing weights; a token's rows summed. lora, if given, is
    called as lora(group, a, rows_per_a, topk_ids, y, out_scale=None) after each GEMM to add
    the rows' expert LoRA deltas into y (radixlora_kernels.moe_lora): group experts_gate_up
    with a = x, experts_down with a = the activation and the routing weights as out_scale."""
    tokens, top_k = topk_ids.shape
    rows = tokens * top_k
    config = gemm_config(rows, gate_up.shape[0])
    aligned = moe_align(topk_ids, gate_up.shape[0], config.block_m)
    x = x.contiguous()
    h = grouped_gemm(x, gate_up, aligned, rows, top_k, config)
    if lora is not None:
        lora("experts_gate_up", x, top_k, topk_ids, h)
    h = silu_and_mul(h)
    scale = topk_weights.reshape(-1).to(torch.float32).contiguous()
    y = grouped_gemm(h, down, aligned, rows, 1, config, scale)
    if lora is not None:
        lora("experts_down", h, 1, topk_ids, y, scale)
    return y.view(tokens, top_k, -1).sum(dim=1, dtype=torch.float32).to(x.dtype)
