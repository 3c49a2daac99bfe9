"""Prefix-cache benchmark: a long shared system prompt followed by short questions across many
adapters. Prints TTFT on a cache miss vs a hit, the hit rate per adapter set, and tokens/s.

    python scripts/bench_prefix_cache.py                 # tiny random model, 10 adapters, CPU
    python scripts/bench_prefix_cache.py --model DIR --adapter a=DIR ... --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from checkpoints import build_tiny_adapter, build_tiny_model

from radixlora import Engine, SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="HF model dir (default: a tiny random model)")
    p.add_argument("--adapter", action="append", default=[], help="NAME=PATH, repeatable")
    p.add_argument("--num-adapters", type=int, default=10, help="tiny adapters to build")
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--questions", type=int, default=4, help="questions per adapter")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json", default=None, help="write results here")
    return p.parse_args()


def setup(args) -> tuple[Path, dict[str, Path]]:
    if args.model:
        return Path(args.model), dict(a.split("=", 1) for a in args.adapter)
    root = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    model = build_tiny_model(root / "model")
    return model, {f"ad{i}": build_tiny_adapter(model, root / f"ad{i}", rank=8 + 8 * (i % 3),
                                                seed=i) for i in range(args.num_adapters)}


def ttft(engine: Engine, prompt: list[int], params: SamplingParams, adapter: str):
    """Seconds to the first token, and the request's cached prefix length."""
    start = time.perf_counter()
    req = engine.submit(prompt, params, adapters=adapter)[0]
    while not req.output_ids:
        engine.step()
    first = time.perf_counter() - start
    while engine.scheduler.has_work():
        engine.step()
    return first, req.cached_tokens


def main() -> None:
    args = parse_args()
    model, adapters = setup(args)
    engine = Engine(model, adapters=adapters, device=args.device, dtype=args.dtype,
                    kv_pages=max(4096, 2 * len(adapters) * (args.system_tokens + 64)),
                    max_batch_tokens=max(2048, args.system_tokens + 64))
    vocab = engine.model_cfg.vocab_size
    rng = np.random.default_rng(0)
    system = rng.integers(3, vocab, args.system_tokens).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ttft(engine, system + [5], params, next(iter(adapters)))  # warm-up
    engine.scheduler.flush_cache()
    miss, hit = [], []
    for name in adapters:
        for _ in range(args.questions):
            question = rng.integers(3, vocab, args.question_tokens).tolist()
            seconds, cached = ttft(engine, system + question, params, name)
            (hit if cached else miss).append(seconds)
    prompts = [system + rng.integers(3, vocab, args.question_tokens).tolist() for _ in adapters]
    start = time.perf_counter()
    outs = engine.generate(prompts, params, adapters=list(adapters))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = {str(dict(ns)["adapters"][0][0][:8]) if dict(ns)["adapters"] else "base":
             round(h / max(lookups, 1), 3)
             for ns, (h, lookups) in engine.scheduler.tree.namespace_stats().items()}
    result = {
        "device": str(engine.runner.device), "dtype": str(engine.runner.dtype),
        "adapters": len(adapters), "system_tokens": args.system_tokens,
        "ttft_miss_ms_median": 1e3 * statistics.median(miss),
        "ttft_hit_ms_median": 1e3 * statistics.median(hit),
        "speedup": statistics.median(miss) / statistics.median(hit),
        "hit_rate_per_adapter_set": stats,
        "batch_output_tokens_per_s": tokens / elapsed,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(json.dumps(result["hit_rate_per_adapter_set"]))
    print(f"{'metric':<28}{'value':>12}")
    for key in ("ttft_miss_ms_median", "ttft_hit_ms_median", "speedup",
                "batch_output_tokens_per_s"):
        print(f"{key:<28}{result[key]:>12.2f}")


if __name__ == "__main__":
    main()
