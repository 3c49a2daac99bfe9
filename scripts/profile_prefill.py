"""Where the c3 shape's prefill goes: 32 prompts of 256 tokens in one 8192-token step on the
Llama-3-8B-shaped engine (dummy bf16 weights), base only vs over 8 rank-16 adapters on all 7
projections, as bench_engine.py's c3 runs it.

    python scripts/profile_prefill.py            # on the H200; table per case, JSON to $OUT
    python scripts/profile_prefill.py --smoke    # tiny shapes on the CPU

Per case: the wall time (median of 3 unprofiled runs, each from submit to the sampled token)
and the engine steps it took (the prefill step, plus the step that sees the requests finish),
then torch.profiler's device time per kernel family over one more run, and the throughput of
the base GEMMs (2 x the weight matrices' parameters x tokens over their summed time)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from bench_engine import ALL7, LLAMA3_8B, SMOKE, make_engine, model_dir, random_adapter
from profile_decode import kernel_family
from torch.profiler import ProfilerActivity, profile

from radixlora import SamplingParams

REQUESTS, PROMPT = 32, 256


def prefill(engine, specs, rng, prompt_len: int) -> tuple[float, int]:
    """Seconds and engine steps from submitting the prompts to their one sampled token each."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    vocab = engine.model_cfg.vocab_size
    for i in range(REQUESTS):
        prompt, salt = rng.integers(3, vocab, prompt_len).tolist(), str(rng.integers(1 << 30))
        engine.submit(prompt, params, adapters=specs[i % len(specs)], cache_salt=salt)
    _sync(engine)
    start, steps = time.perf_counter(), 0
    while engine.scheduler.has_work():
        engine.step()
        steps += 1
    _sync(engine)
    return time.perf_counter() - start, steps


def _sync(engine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def profile_case(engine, specs, rng, prompt_len: int) -> dict:
    prefill(engine, specs, rng, prompt_len)  # compiles kernels, loads the adapters
    runs = [prefill(engine, specs, rng, prompt_len) for _ in range(3)]
    wall = statistics.median(seconds for seconds, _ in runs)
    activities = [ProfilerActivity.CPU]
    if engine.runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        prefill(engine, specs, rng, prompt_len)
    per_family: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_family[kernel_family(event.name)] += event.device_time_total / 1e3
    return {"wall_ms": 1e3 * wall, "steps": max(steps for _, steps in runs),
            "device_ms": dict(sorted(per_family.items(), key=lambda kv: -kv[1]))}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    shape = SMOKE if args.smoke else LLAMA3_8B
    prompt_len = PROMPT // 8 if args.smoke else PROMPT
    tokens = REQUESTS * prompt_len  # one step: the KV pool (page size 1) must hold them all
    engine = make_engine(model_dir(shape), args, kv_pages=2 * tokens, max_running=REQUESTS,
                         max_batch_tokens=tokens, max_rank=64)  # fmt: skip
    cfg, dev, rng = engine.model_cfg, engine.runner.device, np.random.default_rng(0)
    names = [f"p{i}" for i in range(8)]
    for i, name in enumerate(names):
        engine.add_adapter(random_adapter(cfg, name, 16, ALL7, 500 + i, dev))
    matrix_params = sum(t.numel() for n, t in engine.runner.model.named_parameters()
                        if t.dim() == 2 and "embed" not in n and "lm_head" not in n)  # fmt: skip
    tflop = 2 * matrix_params * tokens / 1e12
    report = {}
    for case, specs in (("base", [None]), ("8 adapters", names)):
        r = report[case] = profile_case(engine, specs, rng, prompt_len)
        gemm_ms = r["device_ms"].get("base GEMM (cuBLAS)", 0.0)
        r["gemm_tflop_per_s"] = tflop / (gemm_ms / 1e3) if gemm_ms else None
        kernels_ms = sum(r["device_ms"].values())
        print(f"{case}: {r['steps']} steps, {r['wall_ms']:.1f} ms; kernels {kernels_ms:.1f} ms, "
              f"base GEMMs {gemm_ms:.1f} ms for {tflop:.1f} TFLOP")  # fmt: skip
        for family, ms in list(r["device_ms"].items())[:14]:
            print(f"    {family:<50}{ms:10.2f}")
    if out := os.environ.get("OUT"):
        Path(out, "profile_prefill.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
