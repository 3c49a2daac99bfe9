"""Tile sweep of the experts' grouped GEMM (radixlora_kernels.moe.grouped_gemm) on this GPU: for
each model shape, token count and projection (gate_up, down), random routing, every candidate
tile timed in a CUDA graph (bench_moe.graph_seconds) after checking it against the shipped
config's output. Two stages per case: tiles (rows, columns, reduction step) at 4 warps and 3
stages, then warps and stages for the best few tiles. Prints each case's shipped and best
times beside its bytes and FLOPs floors; then, per bucket of rows per expert (what
moe.CONFIGS is keyed on), each case's three best configs timed in all of the bucket's cases and
the one with the smallest geometric mean of time over each case's best.

    python scripts/tune_moe.py                       # Qwen3-30B-A3B and Mixtral shapes
    python scripts/tune_moe.py --shapes qwen3-30b-a3b --tokens 1,256 --out tune.json
    python scripts/tune_moe.py --smoke               # tiny shapes on the CPU (interpreter)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

SHAPES = {  # experts, hidden, intermediate, top_k
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral": (8, 4096, 14336, 2),
    "smoke": (4, 32, 16, 2),
}
TOKENS = {"qwen3-30b-a3b": (1, 16, 64, 256, 1024, 4096, 8192),
          "mixtral": (1, 64, 1024, 4096), "smoke": (2, 8)}
SHARED_MEMORY = 220 * 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral")
    p.add_argument("--tokens", default=None, help="token counts (default: per shape)")
    p.add_argument("--peak-bw", type=float, default=3.35e12)
    p.add_argument("--peak-flops", type=float, default=700e12)
    p.add_argument("--finalists", type=int, default=3, help="tiles whose warps and stages vary")
    p.add_argument("--budget-s", type=float, default=480, help="stop sweeping after this long")
    p.add_argument("--out", default=None, help="write every case's timings here (JSON)")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.shapes = "smoke"
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_moe import graph_seconds

    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    timer = wall_seconds if args.smoke else graph_seconds
    deadline = time.monotonic() + args.budget_s
    cases = []
    for shape in args.shapes.split(","):
        experts, hidden, inter, top_k = SHAPES[shape]
        g = torch.Generator(device=device).manual_seed(0)
        weights = {"gate_up": (torch.randn(experts, 2 * inter, hidden, generator=g,
                                           device=device) * 0.02).to(dtype),
                   "down": (torch.randn(experts, hidden, inter, generator=g,
                                        device=device) * 0.02).to(dtype)}
        tokens_list = ([int(t) for t in args.tokens.split(",")] if args.tokens
                       else TOKENS[shape])
        for tokens in tokens_list:
            if time.monotonic() > deadline:
                print(f"budget spent: {shape} from {tokens} tokens not swept")
                break
            logits = torch.randn(tokens, experts, generator=g, device=device)
            topk_w, ids = torch.softmax(logits, -1).topk(top_k, -1)
            for proj, w in weights.items():
                case = Case(shape, tokens, proj, w, ids, topk_w, g, timer)
                case.sweep(args.finalists)
                touched = experts * (1 - (1 - top_k / experts) ** tokens)
                n, k = w.shape[1:]
                case.floor = max(touched * n * k * dtype.itemsize / args.peak_bw,
                                 2 * case.rows * n * k / args.peak_flops)
                case.report()
                cases.append(case)
    print("configs compared across each bucket's cases:")
    for lo, hi in BUCKETS:
        bucket = [c for c in cases if lo < c.per_expert <= hi]
        if bucket:
            compare(lo, hi, bucket)
    if args.out:
        Path(args.out).write_text(json.dumps([c.summary() for c in cases], indent=1))


class Case:
    """One shape, token count and projection: its inputs, the shipped config's output as the
    check, and the seconds of every config timed."""

    def __init__(self, shape, tokens, proj, w, ids, topk_w, g, timer):
        import torch

        from radixlora_kernels.moe import gemm_config

        self.shape, self.tokens, self.proj, self.w, self.ids, self.timer = (
            shape, tokens, proj, w, ids, timer)
        self.experts, top_k = w.shape[0], ids.shape[1]
        self.rows = tokens * top_k
        self.per_expert = self.rows / min(self.experts, self.rows)
        self.a = torch.randn(tokens if proj == "gate_up" else self.rows, w.shape[2],
                             generator=g, device=w.device).to(w.dtype)
        self.rows_per_a = top_k if proj == "gate_up" else 1
        self.scale = None if proj == "gate_up" else topk_w.reshape(-1).float().contiguous()
        self.aligned = {}
        self.shipped = gemm_config(self.rows, self.experts)
        self.expect = self.run(self.shipped)().float()
        self.times = {}
        self.floor = float("nan")

    def run(self, config):
        from radixlora_kernels.moe import grouped_gemm, moe_align

        if config.block_m not in self.aligned:
            self.aligned[config.block_m] = moe_align(self.ids, self.experts, config.block_m)
        aligned = self.aligned[config.block_m]
        return lambda: grouped_gemm(self.a, self.w, aligned, self.rows, self.rows_per_a,
                                    config, self.scale)

    def measure(self, config) -> float:
        if config not in self.times:
            self.times[config] = math.inf
            fn = self.run(config)
            try:
                out = fn().float()
            except Exception as e:  # a tile this GPU cannot run (shared memory, registers)
                print(f"{self.shape} {self.tokens} {self.proj} {tuple(config)}: "
                      f"{type(e).__name__}: {str(e)[:120]}")
                return math.inf
            err = ((out - self.expect).abs().max() / self.expect.abs().max()).item()
            if not err < 2e-2:
                print(f"{self.shape} {self.tokens} {self.proj} {tuple(config)}: "
                      f"WRONG, rel err {err:.3g}")
                return math.inf
            self.times[config] = self.timer(fn)
        return self.times[config]

    def sweep(self, finalists: int) -> None:
        from radixlora_kernels.moe import GemmConfig

        self.measure(self.shipped)
        for tile in tiles(self.per_expert, self.w.device.type == "cpu"):
            self.measure(GemmConfig(*tile, 4, 3))
        for c in sorted(self.times, key=self.times.get)[:finalists]:
            for warps, stages in itertools.product((4, 8), (2, 3, 4, 5)):
                config = c._replace(num_warps=warps, num_stages=stages)
                if fits(config, self.w.dtype.itemsize):
                    self.measure(config)

    def best(self):
        return min(self.times, key=self.times.get)

    def report(self) -> None:
        best = self.best()
        print(f"{self.shape:>14} {self.tokens:>6} {self.proj:>8} rows/expert "
              f"{self.per_expert:>7.1f}: shipped {self.times[self.shipped] * 1e6:>7.0f} us "
              f"{tuple(self.shipped)}, best {self.times[best] * 1e6:>7.0f} us {tuple(best)}, "
              f"floor {self.floor * 1e6:>6.0f} us", flush=True)

    def summary(self) -> dict:
        return {"shape": self.shape, "tokens": self.tokens, "proj": self.proj,
                "per_expert": self.per_expert, "floor_s": self.floor,
                "shipped": list(self.shipped),
                "times": [[list(c), t] for c, t in self.times.items()]}


BUCKETS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, 256), (256, math.inf))


def compare(lo, hi, bucket) -> None:
    """Each case's three best configs timed in every case of the bucket; the one with the
    smallest geometric mean of time over each case's best, against the shipped configs'."""
    candidates = {c for case in bucket for c in sorted(case.times, key=case.times.get)[:3]}
    for case in bucket:
        for config in candidates:
            case.measure(config)

    def mean_ratio(pick) -> float:
        return math.exp(sum(math.log(case.times[pick(case)] / case.times[case.best()])
                            for case in bucket) / len(bucket))

    best = min(candidates, key=lambda c: mean_ratio(lambda case: c))
    print(f"rows/expert in ({lo}, {hi}]: {len(bucket)} cases; shipped "
          f"{mean_ratio(lambda case: case.shipped):.3f}x the cases' best; best common "
          f"{tuple(best)} {mean_ratio(lambda case: best):.3f}x", flush=True)


def tiles(per_expert: float, smoke: bool):
    """(block_m, block_n, block_k) candidates: blocks no taller than twice an expert's rows
    (at least 16), within shared memory at 3 stages."""
    if smoke:
        yield from ((16, 16, 16), (16, 32, 16))
        return
    tallest = max(16, 2 ** math.ceil(math.log2(max(per_expert, 1) * 2)))
    for bm, bn, bk in itertools.product((16, 32, 64, 128), (32, 64, 128, 256), (32, 64, 128, 256)):
        if bm <= tallest and bm * bn <= 128 * 256 and (bm * bk + bk * bn) * 2 * 3 <= SHARED_MEMORY:
            yield bm, bn, bk


def wall_seconds(fn) -> float:
    """One call's seconds (the interpreter's smoke run, where no graph exists)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fits(config, itemsize: int) -> bool:
    return ((config.block_m * config.block_k + config.block_k * config.block_n) * itemsize
            * config.num_stages <= SHARED_MEMORY)



if __name__ == "__main__":
    main()
