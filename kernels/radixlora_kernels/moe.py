"""Mixture-of-experts MLP: each token's rows (token * top_k + j, one per chosen expert) grouped by
expert and padded to whole blocks (moe_align), then one grouped GEMM launch per projection over
the blocks of every expert, each block reading its expert's weight (no per-expert loop). The
routing weights scale the down projection's rows; the caller sums a token's top_k rows.

Expert weights are stacked as transformers 5 keeps them: gate_up [E, 2I, H] ([gate | up] rows),
down [E, H, I], in the model's dtype or as Fp8Experts (e4m3 with float32 scales per row and block
of columns, as FP8 checkpoints store them: the GEMM casts each tile exactly to the activations'
dtype and scales its partial product). Every shape is static for a given token count, so a
decode step's experts run inside a CUDA graph."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .activation import silu_and_mul
from .triton_compat import cdiv, next_power_of_2, tl, triton


@dataclass(frozen=True)
class Fp8Experts:
    """Stacked expert weights in FP8: weight [E, N, K] float8_e4m3fn, scale [E, N,
    cdiv(K, scale_k)] float32, one per row and block of scale_k columns (scale_k = K: per
    row)."""

    weight: torch.Tensor
    scale: torch.Tensor
    scale_k: int

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def __getitem__(self, expert: int) -> torch.Tensor:
        """One expert's weight dequantized, float32 [N, K]."""
        w, s = self.weight[expert].float(), self.scale[expert]
        return (s.repeat_interleave(self.scale_k, dim=1)[:, :w.shape[1]] * w)


def moe_experts_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    gate_up, down, lora=None) -> torch.Tensor:
    """Pure-torch reference (the CPU path): transformers' expert loop over the tokens' rows
    (token * top_k + j, one per chosen expert). x [T, H], topk_ids and topk_weights [T, k]; the
    routed sum [T, H] in x's dtype. gate_up, down: tensors or Fp8Experts (dequantized per
    expert); lora: the layer's expert LoRA hook (moe_experts)."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    scale = topk_weights.reshape(-1, 1)
    h = x.new_empty(flat.shape[0], gate_up.shape[1])
    y = x.new_empty(flat.shape[0], down.shape[1])
    for expert in flat.unique().tolist():
        rows = torch.where(flat == expert)[0]
        h[rows] = F.linear(x[rows // top_k], gate_up[expert].to(x.dtype))
    if lora is not None:
        lora("experts_gate_up", x, top_k, topk_ids, h)
    g, u = h.chunk(2, dim=-1)
    h = F.silu(g) * u
    for expert in flat.unique().tolist():
        rows = torch.where(flat == expert)[0]
        y[rows] = (F.linear(h[rows], down[expert].to(h.dtype)) * scale[rows]).to(y.dtype)
    if lora is not None:
        lora("experts_down", h, 1, topk_ids, y, scale.reshape(-1).float())
    return y.view(tokens, top_k, -1).sum(dim=1)


# rows up to which moe_align runs one program; above, its atomics take longer than a torch sort
# (an H200 at 128 experts, against the torch ops moe_align had before: 53 against 126 us at
# 8,192 rows, 322 against 134 us at 65,536)
ALIGN_ONE_PROGRAM_MAX_ROWS = 16384


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_rows, block_expert, num_padded) for the M = T * k rows of topk_ids [T, k]: the rows
    grouped by expert, each expert's run padded to a multiple of block_m with the sentinel M;
    block_expert[b] the expert of block b; num_padded [1] the rows in use. No host sync, sized
    by M alone: at most one partial block per expert in use. Up to ALIGN_ONE_PROGRAM_MAX_ROWS
    rows one Triton program, whose rows of one expert come in no fixed order (each row's
    product is its own); above, torch ops."""
    flat = topk_ids.reshape(-1)
    m, device = flat.numel(), flat.device
    if m > ALIGN_ONE_PROGRAM_MAX_ROWS:
        return _align_by_sort(flat, num_experts, block_m)
    num_blocks = cdiv(m + min(num_experts, m) * (block_m - 1), block_m)
    sorted_rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    # zeroed: a GEMM after an alignment that did not run (the compile cache's dry run launches
    # no variant it has not loaded) then does nothing
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    scratch = torch.empty(3, num_experts, dtype=torch.int32, device=device)
    _align[(1,)](flat, scratch, sorted_rows, block_expert, num_padded, m, num_experts,
                 num_blocks, BLOCK_M=block_m, BLOCK_E=next_power_of_2(num_experts),
                 SEARCH_STEPS=num_experts.bit_length(), CHUNK=1024, num_warps=8)
    return sorted_rows, block_expert, num_padded


def _align_by_sort(flat: torch.Tensor, num_experts: int, block_m: int):
    """moe_align in torch ops (align_blocks keyed by expert); each block's expert is its first
    row's."""
    sorted_rows, num_padded = align_blocks(flat, block_m, num_experts)
    first = sorted_rows[::block_m].clamp(max=flat.numel() - 1)
    return sorted_rows, flat[first].to(torch.int32), num_padded.to(torch.int32)


def align_blocks(keys: torch.Tensor, block_m: int,
                 max_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_rows, num_padded) for rows keyed by keys [M] (< 0: the row is left out, and
    at most max_keys distinct keys otherwise): the rows sorted by key, each key's run padded
    to a multiple of block_m with the sentinel M, so every block holds rows of one key and
    starts with a real row; num_padded [1] the rows in use. Tensor ops only, sized by M alone
    (no host sync): at most one partial block per key."""
    m, device = keys.numel(), keys.device
    keys = torch.where(keys < 0, torch.iinfo(torch.int64).max, keys.to(torch.int64))
    order = torch.argsort(keys, stable=True)
    by_key = keys[order]
    used = by_key != torch.iinfo(torch.int64).max
    new_run = torch.ones(m, dtype=torch.bool, device=device)
    new_run[1:] = by_key[1:] != by_key[:-1]
    run = new_run.cumsum(0) - 1
    counts = torch.zeros(m, dtype=torch.int64, device=device).index_add_(0, run, used.long())
    rank = torch.arange(m, device=device) - (counts.cumsum(0) - counts)[run]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    num_blocks = cdiv(m + min(max_keys, m) * (block_m - 1), block_m)
    dest = torch.where(used, (padded_end - padded)[run] + rank, num_blocks * block_m)
    sorted_rows = torch.full((num_blocks * block_m + 1,), m, dtype=torch.int32, device=device)
    sorted_rows[dest] = order.to(torch.int32)
    return sorted_rows[:-1], padded_end[-1:] if m else padded_end.new_zeros(1)


# the row and block counts follow each step's tokens: unspecialized, so a step of an odd count
# compiles no variant the warm-up did not (Triton specializes integers on 1 and 16 | n)
@triton.jit(do_not_specialize=["M", "NUM_BLOCKS"])
def _align(ids_ptr, scratch_ptr, rows_ptr, block_expert_ptr, num_padded_ptr,
           M, NUM_EXPERTS, NUM_BLOCKS, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
           SEARCH_STEPS: tl.constexpr, CHUNK: tl.constexpr):
    """moe_align in one program: count the rows per expert (scratch row 0), pad, find each
    block's expert by binary search of the padded ends (row 2), place each row at its expert's
    next free slot (row 1, the cursors). Barriers order the phases' global writes."""
    experts = tl.arange(0, BLOCK_E)
    real_expert = experts < NUM_EXPERTS
    chunk = tl.arange(0, CHUNK)
    counts_ptr, cursor_ptr, end_ptr = (scratch_ptr, scratch_ptr + NUM_EXPERTS,
                                       scratch_ptr + 2 * NUM_EXPERTS)
    tl.store(counts_ptr + experts, 0, mask=real_expert)
    for start in range(0, NUM_BLOCKS * BLOCK_M, CHUNK):
        tl.store(rows_ptr + start + chunk, M, mask=start + chunk < NUM_BLOCKS * BLOCK_M)
    tl.debug_barrier()
    for start in range(0, M, CHUNK):
        valid = start + chunk < M
        ids = tl.load(ids_ptr + start + chunk, mask=valid, other=0)
        tl.atomic_add(counts_ptr + ids, 1, mask=valid)
    tl.debug_barrier()
    # read through the atomics' own path: a plain load may hit a stale line of this SM's L1
    counts = tl.where(real_expert, tl.atomic_add(counts_ptr + experts, 0, mask=real_expert), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + experts, end - padded, mask=real_expert)
    tl.store(end_ptr + experts, end, mask=real_expert)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    tl.debug_barrier()
    for start in range(0, NUM_BLOCKS, CHUNK):
        blocks = start + chunk
        first_row = blocks * BLOCK_M
        lo = tl.zeros([CHUNK], dtype=tl.int32)
        hi = tl.zeros([CHUNK], dtype=tl.int32) + NUM_EXPERTS
        for _ in tl.static_range(SEARCH_STEPS):
            open_ = lo < hi
            mid = (lo + hi) // 2
            past = tl.load(end_ptr + mid, mask=open_, other=0) <= first_row
            lo = tl.where(open_ & past, mid + 1, lo)
            hi = tl.where(open_ & ~past, mid, hi)
        tl.store(block_expert_ptr + blocks, tl.minimum(lo, NUM_EXPERTS - 1),
                 mask=blocks < NUM_BLOCKS)
    for start in range(0, M, CHUNK):
        valid = start + chunk < M
        ids = tl.load(ids_ptr + start + chunk, mask=valid, other=0)
        dest = tl.atomic_add(cursor_ptr + ids, 1, mask=valid)
        tl.store(rows_ptr + dest, start + chunk, mask=valid)


@triton.jit(do_not_specialize=["num_rows"])  # a step's rows: see _align
def _grouped_gemm(
    a_ptr, w_ptr, c_ptr, rows_ptr, block_expert_ptr, num_padded_ptr, scale_ptr, ws_ptr,
    num_rows, N, K, stride_am, stride_we, stride_wn, stride_cm, stride_wse, stride_wsn,
    ROWS_PER_A: tl.constexpr, SCALE: tl.constexpr, W_SCALED: tl.constexpr,
    SCALE_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """c[row] = a[row // ROWS_PER_A] @ w[expert].T (times scale[row] with SCALE) for the rows of
    one block of one expert. W_SCALED: w is FP8, each tile cast to a's dtype and its product
    scaled by ws[expert, n, k0 // SCALE_K] (a step lies in one scale block: moe_experts)."""
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
        if W_SCALED:
            ws = tl.load(ws_ptr + expert * stride_wse + offs_n * stride_wsn + k0 // SCALE_K,
                         mask=offs_n < N, other=0.0)
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION) * ws[None, :]
        else:
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


# (most rows an expert gets on average, config), first match; the best common configs of
# scripts/tune_moe.py on an H200 at Qwen3-30B-A3B's shape (docs/perf-log.md, run 43)
CONFIGS = (
    (1, GemmConfig(16, 128, 256, 4, 3)),
    (4, GemmConfig(16, 128, 128, 4, 2)),
    (16, GemmConfig(32, 128, 128, 4, 3)),
    (64, GemmConfig(64, 128, 64, 4, 3)),
    (float("inf"), GemmConfig(128, 128, 64, 8, 3)),
)


def gemm_config(num_rows: int, num_experts: int) -> GemmConfig:
    """The tiles for num_rows rows over num_experts experts: blocks of about the rows an expert
    gets (a decode step's few rows per expert waste little of a small block; a prefill's many
    fill large ones)."""
    per_expert = num_rows / min(num_experts, num_rows)
    return next(config for most, config in CONFIGS if per_expert <= most)


def grouped_gemm(a: torch.Tensor, w, aligned, num_rows: int, rows_per_a: int,
                 config: GemmConfig, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[num_rows, N]: row r is a[r // rows_per_a] @ w[expert of r].T (times scale[r]); w [E, N, K]
    contiguous or Fp8Experts, aligned = moe_align(...) with config.block_m."""
    sorted_rows, block_expert, num_padded = aligned
    fp8 = isinstance(w, Fp8Experts)
    weight = w.weight if fp8 else w
    experts, n, k = weight.shape
    block_k = fp8_block_k(config.block_k, w.scale_k, k) if fp8 else config.block_k
    block_k = smem_block_k(block_k, config, a.element_size(), weight.element_size(),
                           shared_memory_limit(a.device))
    out = torch.empty(num_rows, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), cdiv(n, config.block_n))
    ws = w.scale if fp8 else out
    _grouped_gemm[grid](
        a, weight, out, sorted_rows, block_expert, num_padded,
        scale if scale is not None else out, ws, num_rows, n, k,
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
        ws.stride(0) if fp8 else 0, ws.stride(1) if fp8 else 0,
        ROWS_PER_A=rows_per_a, SCALE=scale is not None, W_SCALED=fp8,
        SCALE_K=w.scale_k if fp8 else 1,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def smem_block_k(block_k: int, config: GemmConfig, a_bytes: int, w_bytes: int,
                 limit: int | None) -> int:
    """The widest reduction step up to block_k whose pipelined tiles fit `limit` bytes of shared
    memory: num_stages - 1 buffers of A's block_m x block_k and W's block_k x block_n. The tuned
    tiles fit 2-byte inputs; fp32 ones need half the step."""
    per_k = (config.block_m * a_bytes + config.block_n * w_bytes) * max(config.num_stages - 1, 1)
    while limit is not None and block_k > 16 and block_k * per_k > limit:
        block_k //= 2
    return block_k


@functools.cache
def shared_memory_limit(device: torch.device) -> int | None:
    """Bytes of shared memory one program may use on device; None off CUDA (no limit)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)


def fp8_block_k(block_k: int, scale_k: int, k: int) -> int:
    """A reduction step no wider than block_k that never straddles two scale blocks."""
    if scale_k >= k or scale_k % block_k == 0:
        return block_k
    step = math.gcd(block_k, scale_k)
    if step < 16:
        raise ValueError(f"FP8 expert scales per {scale_k} columns: no reduction step of at "
                         "least 16 columns fits their blocks")
    return step


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                gate_up, down, lora=None) -> torch.Tensor:
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
