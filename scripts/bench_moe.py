"""One mixture-of-experts layer's experts (radixlora_kernels.moe: alignment, two grouped GEMM
launches, the gated activation, the weighted sum) at Qwen3-30B-A3B's shape (128 experts of 768
channels, hidden 2048, 8 per token, bf16), replayed in a CUDA graph, for 1 to 8,192 tokens with
random routing. Each size is first checked against the torch expert loop (relative error of
the largest output), then timed against two floors: the bytes of the experts its tokens touch
(expected number under uniform routing) at --peak-bw, and its FLOPs at --peak-flops. Then the
same with LoRA on the experts (radixlora_kernels.moe_lora, checked against the torch loop with
the torch LoRA reference): each token on one of --adapters rank-8 expert adapters, against the
bytes of the distinct (expert, adapter) pairs its rows read (the pair's rank rows of A and B,
both projections) at --peak-bw; and "idle", the hook on a batch with no token on an expert
adapter (what a pool with expert rows adds to a CUDA graph's step without expert adapters).

    python scripts/bench_moe.py                 # H100 floors (3.35 TB/s, 700 TFLOP/s)
    python scripts/bench_moe.py --peak-bw 4.24e12 --peak-flops 800e12   # H200
    python scripts/bench_moe.py --expert-weights fp8   # FP8 experts, 128 x 128 block scales
    python scripts/bench_moe.py --smoke         # tiny shapes on the CPU (interpreter)
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,64,256,1024,8192")
    p.add_argument("--peak-bw", type=float, default=3.35e12)
    p.add_argument("--peak-flops", type=float, default=700e12)
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lora-kernels", choices=("auto", "per-row", "blocked"), default="auto",
                   help="the expert LoRA kernels (auto: as the server picks them by row count)")
    p.add_argument("--expert-weights", choices=("model", "fp8"), default="model",
                   help="fp8: the experts in e4m3 with 128 x 128 block scales (Fp8Experts), "
                        "checked against the same weights dequantized")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from radixlora_kernels.moe import moe_experts, moe_experts_ref

    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    experts, hidden, inter, top_k = (8, 32, 16, 2) if args.smoke else (128, 2048, 768, 8)
    g = torch.Generator(device=device).manual_seed(0)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device=device) * 0.02).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g, device=device) * 0.02).to(dtype)
    if args.expert_weights == "fp8":
        gate_up, down = (fp8_experts(w, 16 if args.smoke else 128) for w in (gate_up, down))
    sizes = [4, 16] if args.smoke else [int(t) for t in args.tokens.split(",")]
    pools = expert_pools(args.adapters * args.rank, experts, hidden, inter, dtype, device, g)
    print(f"{'tokens':>7} {'us':>8} {'rel err':>8} {'bytes floor us':>15} {'flops floor us':>15}"
          f" {'LoRA us':>8} {'rel err':>8} {'LoRA bytes floor us':>20} {'idle us':>8}")
    for tokens in sizes:
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        logits = torch.randn(tokens, experts, generator=g, device=device)
        weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
        ref = moe_experts_ref(x, ids, weights, *dense(gate_up, down, dtype)).float()
        out = moe_experts(x, ids, weights, gate_up, down).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        seconds = float("nan") if args.smoke else graph_seconds(
            moe_experts, x, ids, weights, gate_up, down)
        touched = experts * (1 - (1 - top_k / experts) ** tokens)
        weight_bytes = touched * 3 * hidden * inter * (
            1 if args.expert_weights == "fp8" else torch.finfo(dtype).bits // 8)
        flops = 2 * tokens * top_k * 3 * hidden * inter
        blocked = {"auto": None, "per-row": False, "blocked": True}[args.lora_kernels]
        hook = lora_hook(tokens, args.adapters, args.rank, pools, device, blocked)
        torch_hook = lora_hook(tokens, args.adapters, args.rank, pools, device, "torch")
        ref = moe_experts_ref(x, ids, weights, *dense(gate_up, down, dtype), torch_hook).float()
        out = moe_experts(x, ids, weights, gate_up, down, hook).float()
        lora_err = ((out - ref).abs().max() / ref.abs().max()).item()
        lora_seconds = float("nan") if args.smoke else graph_seconds(
            moe_experts, x, ids, weights, gate_up, down, hook)
        # each distinct (expert, adapter) pair's rank rows: gate_up's A (hidden) and B
        # (2 x inter), down's A (inter) and B (hidden)
        adapter = torch.arange(tokens, device=device)[:, None] % args.adapters
        pairs = torch.unique(ids * args.adapters + adapter).numel()
        lora_bytes = (pairs * args.rank * (2 * hidden + 3 * inter)
                      * torch.finfo(dtype).bits // 8)
        idle = lora_hook(tokens, args.adapters, args.rank, pools, device, blocked, idle=True)
        idle_seconds = float("nan") if args.smoke else graph_seconds(
            moe_experts, x, ids, weights, gate_up, down, idle)
        print(f"{tokens:>7} {seconds * 1e6:>8.0f} {err:>8.3g} "
              f"{weight_bytes / args.peak_bw * 1e6:>15.0f} {flops / args.peak_flops * 1e6:>15.0f}"
              f" {lora_seconds * 1e6:>8.0f} {lora_err:>8.3g} "
              f"{(weight_bytes + lora_bytes) / args.peak_bw * 1e6:>20.0f}"
              f" {idle_seconds * 1e6:>8.0f}")


def fp8_experts(w, block: int):
    """w [E, N, K] as Fp8Experts: e4m3 with a scale per block x block (absmax / 448), repeated
    over each block's rows as the loader keeps them."""
    import torch

    from radixlora_kernels.moe import Fp8Experts

    e, n, k = w.shape
    tiles = w.float().view(e, n // block, block, k // block, block)
    scale = tiles.abs().amax(dim=(2, 4), keepdim=True).clamp(min=1e-12) / 448
    w8 = (tiles / scale).to(torch.float8_e4m3fn).view(e, n, k)
    rows = scale.view(e, n // block, 1, k // block).expand(e, n // block, block, k // block)
    return Fp8Experts(w8, rows.reshape(e, n, k // block).contiguous(), block)


def dense(gate_up, down, dtype):
    """The experts as the torch loop's reference takes them: FP8 ones dequantized to dtype."""
    import torch

    from radixlora_kernels.moe import Fp8Experts

    return tuple(torch.stack([w[e] for e in range(w.shape[0])]).to(dtype)
                 if isinstance(w, Fp8Experts) else w for w in (gate_up, down))


def expert_pools(rows: int, experts: int, hidden: int, inter: int, dtype, device, g):
    """Random expert LoRA pools of `rows` rank rows: group -> (A [1, rows, E * in], B
    [rows, E * out]), as radixlora.worker.adapter_pool lays them out."""
    import torch

    def pool(in_dim: int, out_dim: int):
        a = torch.randn(1, rows, experts * in_dim, generator=g, device=device) * 0.02
        b = torch.randn(rows, experts * out_dim, generator=g, device=device) * 0.02
        return a.to(dtype), b.to(dtype)

    return {"experts_gate_up": pool(hidden, 2 * inter), "experts_down": pool(inter, hidden)}


def lora_hook(tokens: int, adapters: int, rank: int, pools, device, blocked,
              idle: bool = False):
    """The expert LoRA hook of a batch whose token t is on adapter t % adapters (rows
    [a * rank, (a + 1) * rank)), as the worker's LoraContext.experts builds it. blocked:
    expert_lora's choice of kernels (None: by row count), or "torch" for the torch reference
    (expert_lora_ref); idle: no token's adapter adapts the experts (a CUDA graph's hook on a
    step without expert adapters)."""
    import dataclasses

    import torch

    from radixlora_kernels.lora_ops import LoraBatchMeta
    from radixlora_kernels.moe_lora import expert_lora, expert_lora_ref, token_rows

    seg_rows = [list(range(t % adapters * rank, (t % adapters + 1) * rank))
                for t in range(tokens)]
    meta = LoraBatchMeta.from_segments([1] * tokens, seg_rows, [[1.0] * rank] * tokens, device)
    rows = token_rows(meta)
    if idle:
        rows = dataclasses.replace(rows, count=torch.zeros_like(rows.count))

    def hook(group, a, rows_per_a, topk_ids, y, out_scale=None):
        a_pool, b_pool = pools[group]
        if blocked == "torch":
            expert_lora_ref(a, rows_per_a, topk_ids, a_pool, b_pool, rows, y, out_scale)
        else:
            expert_lora(a, rows_per_a, topk_ids, a_pool, b_pool, rows, y, out_scale,
                        blocked=blocked)

    return hook


def graph_seconds(fn, *inputs, replays: int = 20) -> float:
    """Mean seconds of one replay of a CUDA graph of fn(*inputs) (compiled and warmed
    first)."""
    import torch

    fn(*inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*inputs)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays


if __name__ == "__main__":
    main()
