"""One mixture-of-experts layer's experts (radixlora_kernels.moe: alignment, two grouped GEMM
launches, the gated activation, the weighted sum) at Qwen3-30B-A3B's shape (128 experts of 768
channels, hidden 2048, 8 per token, bf16), replayed in a CUDA graph, for 1 to 8,192 tokens with
random routing. Each size is first checked against the torch expert loop (relative error of
the largest output), then timed against two floors: the bytes of the experts its tokens touch
(expected number under uniform routing) at --peak-bw, and its FLOPs at --peak-flops.

    python scripts/bench_moe.py                 # H100 floors (3.35 TB/s, 700 TFLOP/s)
    python scripts/bench_moe.py --peak-bw 4.24e12 --peak-flops 800e12   # H200
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
    sizes = [4, 16] if args.smoke else [int(t) for t in args.tokens.split(",")]
    print(f"{'tokens':>7} {'us':>8} {'rel err':>8} {'bytes floor us':>15} {'flops floor us':>15}")
    for tokens in sizes:
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        logits = torch.randn(tokens, experts, generator=g, device=device)
        weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
        ref = moe_experts_ref(x, ids, weights, gate_up, down).float()
        out = moe_experts(x, ids, weights, gate_up, down).float()
        err = ((out - ref).abs().max() / ref.abs().max()).item()
        seconds = float("nan") if args.smoke else graph_seconds(
            moe_experts, x, ids, weights, gate_up, down)
        touched = experts * (1 - (1 - top_k / experts) ** tokens)
        weight_bytes = touched * 3 * hidden * inter * torch.finfo(dtype).bits // 8
        flops = 2 * tokens * top_k * 3 * hidden * inter
        print(f"{tokens:>7} {seconds * 1e6:>8.0f} {err:>8.3g} "
              f"{weight_bytes / args.peak_bw * 1e6:>15.0f} {flops / args.peak_flops * 1e6:>15.0f}")


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
