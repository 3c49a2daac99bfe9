"""Where the c3 shape's prefill goes: 32 prompts of 256 tokens in one 8192-token step on the
Llama-3-8B-shaped engine (dummy bf16 weights), base only vs over 8 rank-16 adapters on all 7
projections, as bench_engine.py's c3 runs it.

    python scripts/profile_prefill.py            # on the H200; table per case, JSON to $OUT
    python scripts/profile_prefill.py --smoke    # tiny shapes on the CPU

Per case: the wall time (median of 3 unprofiled runs, each from submit to the sampled token)
and the engine steps it took (the prefill step, plus the step that sees the requests finish),
then torch.profiler's device time per kernel family over one more run, and the throughput of
the base GEMMs (2 x the weight matrices' parameters x tokens over their summed time).

    python scripts/profile_prefill.py --sweep-expand

times instead the per-request SGMV expand alone at that step's shape (32 segments of 256 tokens,
rank 16 over 8 adapters, each module group's widths, y = v @ B in bf16, store only as the
engine's prefill runs it) under each launch setting of EXPAND_SWEEP (CUDA-graph medians)."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_common import time_us  # noqa: E402
from bench_engine import (  # noqa: E402
    ALL7,
    LLAMA3_8B,
    SMOKE,
    make_engine,
    model_dir,
    random_adapter,
    submit_random,
)
from profile_decode import kernel_family  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from radixlora.config import ModelConfig  # noqa: E402
from radixlora.kernels.sgmv_expand import sgmv_expand  # noqa: E402
from radixlora.lora.adapter import MODULE_GROUPS  # noqa: E402

REQUESTS, PROMPT, RANK, ADAPTERS = 32, 256, 16, 8
EXPAND_SWEEP = [
    {"block_t": t, "block_n": n, "num_warps": w}
    for t, n, w in itertools.product((32, 64, 128), (64, 128, 256), (4, 8))
]


def prefill(engine, specs, rng, prompt_len: int) -> tuple[float, int]:
    """Seconds and engine steps from submitting the prompts to their one sampled token each."""
    submit_random(engine, REQUESTS, specs, prompt_len, 1, rng)
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


def sweep_expand(cfg: ModelConfig, device: torch.device, prompt_len: int, settings) -> dict:
    """Microseconds of one sgmv_expand per (module group, launch setting); "default" first."""
    tokens, i32 = REQUESTS * prompt_len, dict(dtype=torch.int32, device=device)
    seg_indptr = torch.arange(0, tokens + 1, prompt_len, **i32)
    row_indptr = torch.arange(0, REQUESTS * RANK + 1, RANK, **i32)
    row_ids = torch.cat([torch.arange(RANK, **i32) + (i % ADAPTERS) * RANK
                         for i in range(REQUESTS)])  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict[str, dict[str, float]] = {}
    for group, modules in MODULE_GROUPS.items():
        offsets = [0, *itertools.accumulate(cfg.module_shape(m)[1] for m in modules)]
        b_pool = torch.randn(ADAPTERS * RANK, offsets[-1], dtype=dtype, device=device) * 0.01
        v = torch.randn(len(modules), tokens, RANK, device=device)
        y = torch.zeros(tokens, offsets[-1], dtype=dtype, device=device)
        times = out[group] = {}
        for setting in [{}, *settings]:
            run = functools.partial(sgmv_expand, v, b_pool, offsets, seg_indptr, row_indptr,
                                    row_ids, y, max_seg_len=prompt_len, accumulate=False,
                                    **setting)  # fmt: skip
            eager, graph = time_us(run, device.type)
            label = ",".join(f"{k}={x}" for k, x in setting.items()) or "default"
            times[label] = graph if graph is not None else eager
        best = sorted(times.items(), key=lambda kv: kv[1])[:4]
        print(f"{group}: default {times['default']:.1f} us; best "
              + ", ".join(f"{label} {us:.1f}" for label, us in best))  # fmt: skip
    totals = {label: sum(out[g][label] for g in out) for label in out[next(iter(out))]}
    fastest = sorted(totals, key=totals.get)[:6]
    for label in fastest if "default" in fastest else [*fastest, "default"]:
        print(f"    all groups {label:<40}{totals[label]:10.1f} us")
    return {"per_group_us": out, "total_us": totals}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sweep-expand", action="store_true")
    args = p.parse_args()
    shape = SMOKE if args.smoke else LLAMA3_8B
    prompt_len = PROMPT // 8 if args.smoke else PROMPT
    if args.sweep_expand:
        cfg = ModelConfig.from_dir(model_dir(shape))
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        report = sweep_expand(
            cfg, device, prompt_len, EXPAND_SWEEP[:2] if args.smoke else EXPAND_SWEEP
        )
        if out := os.environ.get("OUT"):
            Path(out, "sweep_expand.json").write_text(json.dumps(report, indent=2))
        return
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
