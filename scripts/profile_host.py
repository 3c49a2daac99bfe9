"""Where a decode step's host time goes at the c3 shape: 32 requests over 8 rank-16 adapters
(or base only), prompt 256, 64 new tokens, on the Llama-3-8B-shaped engine (dummy bf16 weights)
with overlap scheduling and CUDA graphs, as bench_engine.py runs it.

    python scripts/profile_host.py            # on the H200; table per case, JSON to $OUT
    python scripts/profile_host.py --smoke    # tiny shapes on the CPU

A decode step is host-bound when its wall time exceeds the graph replay (the device time):
then the host, not the GPU, sets the pace. Per case this reports the mean decode-step wall time,
the share of it spent blocked on the device (ModelRunner.finish: waiting for the previous
step's tokens), the graph replay time of the same batch, and the functions with the most own
time per step (cProfile over the decode-only steps of a third round: profiling slows the host,
so those times are relative, not the step's)."""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from bench_engine import (
    ALL7,
    LLAMA3_8B,
    SMOKE,
    graph_replay_ms,
    make_engine,
    model_dir,
    random_adapter,
    submit_random,
)

TOP = 25


def timed_finish(runner, blocked: list[float]):
    finish = runner.finish

    def wrapper(step):
        start = time.perf_counter()
        out = finish(step)
        blocked.append(time.perf_counter() - start)
        return out

    return wrapper


def run_round(engine, specs, n: int, prompt_len: int, new_tokens: int, rng,
              prof: cProfile.Profile | None = None) -> list[tuple[float, float]]:
    """(wall s, s blocked on the device) of each call that launches a decode-only step and
    folds one (the first decode call waits for the prefill); prof, if given, profiles them."""
    blocked, steps = [], []
    engine.runner.finish = timed_finish(engine.runner, blocked)
    submit_random(engine, n, specs, prompt_len, new_tokens, rng)
    launched_decode = False  # a call folds the step the previous call launched (overlap)
    while engine.scheduler.has_work():
        sched = engine.scheduler
        decode = all(r.remaining_prefill == 1 for r in sched.running) and not sched.waiting
        blocked.clear()
        start = time.perf_counter()
        if decode and launched_decode and prof is not None:
            prof.enable()
        engine.step()
        if prof is not None:
            prof.disable()
        if decode and launched_decode:
            steps.append((time.perf_counter() - start, sum(blocked)))
        launched_decode = decode
    del engine.runner.finish
    return steps


def run_case(engine, specs, n: int, prompt_len: int, new_tokens: int, rng) -> dict:
    """A warm-up round (graphs, adapters), a timed round, then a profiled one (cProfile slows
    the host, so its times are not the reported ones)."""
    run_round(engine, specs, n, prompt_len, new_tokens, rng)
    steps = run_round(engine, specs, n, prompt_len, new_tokens, rng)
    prof = cProfile.Profile()
    profiled = run_round(engine, specs, n, prompt_len, new_tokens, rng, prof)
    own = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: kv[1][2], reverse=True)[:TOP]
    return {
        "decode_steps": len(steps),
        "mean_step_ms": 1e3 * statistics.fmean(w for w, _ in steps),
        "mean_blocked_ms": 1e3 * statistics.fmean(b for _, b in steps),
        "top_own_ms_per_step_profiled": [
            (f"{Path(file).name}:{line}({func})", 1e3 * tottime / len(profiled))
            for (file, line, func), (_, _, tottime, _, _) in own
        ],
    }


def device_timeline(engine, specs, n: int, prompt_len: int, new_tokens: int, rng) -> dict:
    """torch.profiler over the decode steps of one round: how much of the steps' wall time the
    device is busy (union of kernel and copy intervals), and the longest idle gaps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = run_round(engine, specs, n, prompt_len, new_tokens, rng)
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in device_events)
    per_name: dict[str, float] = {}
    for e in device_events:
        per_name[e.name[:60]] = per_name.get(e.name[:60], 0.0) + e.time_range.elapsed_us()
    top = sorted(per_name.items(), key=lambda kv: kv[1], reverse=True)[:40]
    if not spans:
        return {"busy_share": float("nan"), "idle_ms": float("nan"), "largest_gaps_ms": [],
                "top_device_ms": []}
    busy, gaps, end = 0.0, [], None
    for start, stop in spans:
        if end is not None and start > end:
            gaps.append(start - end)
        if end is None or start > end:
            busy += stop - start
        elif stop > end:
            busy += stop - end
        end = stop if end is None else max(end, stop)
    window = spans[-1][1] - spans[0][0]
    return {"busy_share": busy / window, "window_ms": window / 1e3, "idle_ms": sum(gaps) / 1e3,
            "steps": len(steps), "largest_gaps_ms": sorted(gaps, reverse=True)[:10],
            "device_events": len(device_events),
            "device_ms_total": sum(per_name.values()) / 1e3,
            "top_device_ms": [(name, us / 1e3) for name, us in top]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    shape, scale = (SMOKE, 8) if args.smoke else (LLAMA3_8B, 1)
    engine = make_engine(model_dir(shape), args, kv_pages=20_000, max_running=32,
                         max_batch_tokens=8192, adapter_rows=1024, max_rank=64)  # fmt: skip
    names = [f"a{i}" for i in range(8)]
    for i, name in enumerate(names):
        engine.add_adapter(random_adapter(engine.model_cfg, name, 16, ALL7, i,
                                          engine.runner.device))  # fmt: skip
    rng, results = np.random.default_rng(0), {}
    for case, specs, rows in (("base only", [None], 0), ("8 adapters", names, 32)):
        res = run_case(engine, specs, 32, 256 // scale, 64 // scale, rng)
        if engine.runner.graphs is not None:
            res["graph_replay_ms"] = graph_replay_ms(engine, rows, 32)
        if engine.runner.graphs is not None:
            res["timeline"] = device_timeline(engine, specs, 32, 256 // scale, 64 // scale, rng)
            gaps = [round(g / 1e3, 2) for g in res["timeline"]["largest_gaps_ms"]]
            print(f"{case}: device busy {res['timeline']['busy_share']:.1%} of the round; "
                  f"largest idle gaps (ms) {gaps}; {res['timeline']['device_events']} device "
                  f"events, {res['timeline']['device_ms_total']:.1f} ms in all; by name:")
            for name, ms in res["timeline"]["top_device_ms"]:
                print(f"    {name:<60} {ms:9.2f}")
        results[case] = res
        print(f"{case}: decode step {res['mean_step_ms']:.3f} ms, blocked on the device "
              f"{res['mean_blocked_ms']:.3f} ms, graph replay "
              f"{res.get('graph_replay_ms', float('nan')):.3f} ms")  # fmt: skip
        for name, ms in res["top_own_ms_per_step_profiled"]:
            print(f"    {name[:70]:<70} {ms:7.3f}")
    if out_dir := os.environ.get("OUT"):
        Path(out_dir, "profile_host.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
