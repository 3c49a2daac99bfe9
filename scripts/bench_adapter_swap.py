"""Adapter swaps under traffic, through the offline Engine on a
Llama-3-8B-shaped model with dummy bf16 weights and random rank-16 adapters on all 7
projections, with no swap cap (the Engine has none):

(a) while `background` requests decode (half base, half one resident adapter), 50 one-token
    requests arrive, `--swaps-per-step` per step, each on its own adapter. Swap round: those
    adapters are not resident (each arrival is a swap). Resident round: the same arrivals with
    the adapters already resident (no swap). Reported: the wall time from the start of the step
    in which the first adapter became resident to the end of the step after which the last one
    was, and P50/P99 inter-token latency of the background requests over the arrival window of
    each round (targets: 50 swaps <= 1 s, P99 ITL of the swap round <= 1.2x the resident round).
(b) oversubscription: steady arrivals, each on an adapter drawn uniformly from 4N, with a
    device pool of N adapters' rows vs one holding all 4N: median TTFT (target <= 2x). Two
    loads: "light", whose running requests use fewer than N distinct adapters at a time (each
    arrival usually needs a swap, but the pool can hold every adapter in use: this measures
    swapping), and "heavy", whose running requests need more than N distinct adapters at once
    (more than the pool can hold: requests must wait for rows, so TTFT measures queueing).

Adapters are packed into the host tier (pinned) before timing; reading and validating them
from disk happens once per version and is measured by scripts/bench_adapter_load.py. A
warm-up round runs first (kernel compilation, CUDA graph capture).

    python scripts/bench_adapter_swap.py          # on the H200; JSON to $OUT or --json PATH
    python scripts/bench_adapter_swap.py --tiny   # scripts/checkpoints.py TINY_CONFIG on the CPU

Timing: wall clock around engine.step(). With overlap scheduling a step launches the next plan
(its adapter loads queued on the pool's load stream, which the forward waits on) and then waits
for the previous step's sampled tokens."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import ALL7, LLAMA3_8B, make_engine, model_dir, random_adapter  # noqa: E402
from checkpoints import TINY_CONFIG  # noqa: E402

from radixlora import Engine, SamplingParams  # noqa: E402
from radixlora.config import EngineConfig, ModelConfig  # noqa: E402
from radixlora.lora.adapter import LoraAdapter  # noqa: E402
from radixlora.sched.request import Req  # noqa: E402

RANK = 16
SWAPS = 50
ITL_TARGET = 1.2
SWAP_TARGET_S = 1.0
TTFT_TARGET = 2.0


@dataclass(frozen=True)
class Workload:
    background: int  # decoding requests in (a)
    prompt_len: int
    pool_adapters: int  # N in (b): the small pool holds N adapters
    arrival_steps: int  # (b)
    light: tuple[int, int]  # (b) arrivals per step, new tokens per request
    heavy: tuple[int, int]
    max_running: int
    kv_pages: int
    host_adapter_bytes: int


FULL = Workload(background=32, prompt_len=128, pool_adapters=16, arrival_steps=200,
                light=(1, 8), heavy=(2, 16), max_running=256, kv_pages=200_000,
                host_adapter_bytes=8 << 30)
TINY = Workload(background=4, prompt_len=16, pool_adapters=4, arrival_steps=40,
                light=(1, 2), heavy=(1, 8), max_running=64, kv_pages=20_000,
                host_adapter_bytes=1 << 30)


def build_engine(path: Path, args, work: Workload, adapter_rows: int,
                 adapters: list[LoraAdapter]) -> Engine:
    engine = make_engine(path, args, kv_pages=work.kv_pages, max_running=work.max_running,
                         max_batch_tokens=8192, adapter_rows=adapter_rows, max_rank=RANK,
                         max_adapter_sets_per_batch=128,
                         host_adapter_bytes=work.host_adapter_bytes)
    for adapter in adapters:
        engine.add_adapter(adapter)
        engine.runner.adapter_pool.packed(adapter)
    if engine.runner.graphs is not None:
        engine.runner.graphs.capture_decode()
    return engine


def submit(engine: Engine, rng, prompt_len: int, tokens: int, adapter: str | None) -> Req:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = rng.integers(3, engine.model_cfg.vocab_size, prompt_len).tolist()
    return engine.submit(prompt, params, adapters=adapter,
                         cache_salt=str(rng.integers(1 << 62)))[0]


def timed_step(engine: Engine) -> tuple[float, float]:
    start = time.perf_counter()
    engine.step()
    return start, time.perf_counter()


def drain(engine: Engine) -> None:
    while engine.scheduler.has_work():
        engine.step()


def swap_round(engine: Engine, work: Workload, swap_names: list[str], per_step: int,
               seed: int) -> dict:
    """Background decode with one-token arrivals on `swap_names`; ITL over the arrival window,
    and when the arrivals' adapters became resident."""
    rng = np.random.default_rng(seed)
    residency = engine.scheduler.residency
    ids = [engine.adapters[n].adapter_id for n in swap_names]
    window_steps = -(-len(swap_names) // per_step) + 2
    background = [submit(engine, rng, work.prompt_len, window_steps + 8,
                         None if i % 2 else "bg") for i in range(work.background)]
    while not all(len(r.output_ids) >= 2 for r in background):  # prefills done, decoding
        engine.step()
    queue, arrivals, itl = list(swap_names), [], []
    first_load = last_load = None
    while queue or not all(r.output_ids for r in arrivals):
        for name in queue[:per_step]:
            arrivals.append(submit(engine, rng, work.prompt_len, 1, name))
        queue = queue[per_step:]
        before = sum(residency.is_resident(i) for i in ids)
        start, end = timed_step(engine)
        itl.append(end - start)
        after = sum(residency.is_resident(i) for i in ids)
        if after > before and first_load is None:
            first_load = start
        if after == len(ids) and last_load is None and after > before:
            last_load = end
    drain(engine)
    swap_s = None if first_load is None else last_load - first_load
    return {"swap_wall_s": swap_s, "steps": len(itl),
            "itl_p50_ms": 1e3 * float(np.percentile(itl, 50)),
            "itl_p99_ms": 1e3 * float(np.percentile(itl, 99))}


def evict(engine: Engine, names: list[str]) -> None:
    for name in names:
        if not engine.scheduler.residency.evict(engine.adapters[name].adapter_id):
            raise RuntimeError(f"adapter {name} is still referenced")


def bench_swaps(engine: Engine, work: Workload, names: list[str], per_step: int) -> dict:
    swap_round(engine, work, names, per_step, seed=1)  # warm-up
    evict(engine, names)
    swapped = swap_round(engine, work, names, per_step, seed=2)
    resident = swap_round(engine, work, names, per_step, seed=3)  # no prefix-cache hits
    return {"swap": swapped, "resident": resident}


def steady_ttft(engine: Engine, work: Workload, load: tuple[int, int], names: list[str],
                seed: int) -> dict:
    """Median TTFT of steady arrivals (per step, new tokens each) on adapters drawn uniformly
    from `names`, and the most distinct adapters running at once."""
    arrivals_per_step, new_tokens = load
    rng = np.random.default_rng(seed)
    active = 0
    evictions_before = engine.scheduler.residency.num_evictions
    pending: list[tuple[Req, float]] = []
    ttft: list[float] = []
    step = 0
    while step < work.arrival_steps or engine.scheduler.has_work():
        if step < work.arrival_steps:
            for _ in range(arrivals_per_step):
                name = names[int(rng.integers(len(names)))]
                req = submit(engine, rng, work.prompt_len, new_tokens, name)
                pending.append((req, time.perf_counter()))
        engine.step()
        active = max(active, len({r.adapter_set.key for r in engine.scheduler.running}))
        now = time.perf_counter()
        ttft += [now - t for req, t in pending if req.output_ids]
        pending = [(req, t) for req, t in pending if not req.output_ids]
        step += 1
    return {"ttft_p50_ms": 1e3 * float(np.median(ttft)), "requests": len(ttft),
            "evictions": engine.scheduler.residency.num_evictions - evictions_before,
            "max_active_adapters": active}


def bench_oversubscription(engine: Engine, work: Workload, names: list[str]) -> dict:
    steady_ttft(engine, work, work.heavy, names, seed=4)  # warm-up of this traffic's shapes
    return {kind: steady_ttft(engine, work, getattr(work, kind), names, seed=5)
            for kind in ("light", "heavy")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tiny", action="store_true", help="tiny random model shape, CPU")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--swaps-per-step", type=int, default=1)
    p.add_argument("--json", default=None, help="write the results here (default: $OUT)")
    args = p.parse_args()
    if args.tiny and args.device == "auto":
        args.device = "cpu"
    work = TINY if args.tiny else FULL
    path = model_dir(TINY_CONFIG if args.tiny else LLAMA3_8B)
    cfg = ModelConfig.from_dir(path)
    dev = torch.device(EngineConfig(device=args.device).resolved_device())
    distinct = max(SWAPS, 4 * work.pool_adapters)
    pool = [random_adapter(cfg, f"a{i}", RANK, ALL7, 100 + i, dev) for i in range(distinct)]
    bg = random_adapter(cfg, "bg", RANK, ALL7, 1, dev)
    results: dict = {"workload": asdict(work), "rank": RANK, "swaps": SWAPS,
                     "swaps_per_step": args.swaps_per_step, "device": str(dev)}
    engine = build_engine(path, args, work, RANK * (distinct + 1), [bg, *pool])
    results["a"] = bench_swaps(engine, work, [a.name for a in pool[:SWAPS]],
                               args.swaps_per_step)
    oversub = [a.name for a in pool[: 4 * work.pool_adapters]]
    results["b_all_fit"] = bench_oversubscription(engine, work, oversub)
    del engine
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    small = build_engine(path, args, work, RANK * work.pool_adapters, pool)
    results["b_oversubscribed"] = bench_oversubscription(small, work, oversub)
    report(results, args.json or (os.environ.get("OUT") and
                                  str(Path(os.environ["OUT"], "bench_adapter_swap.json"))))


def report(r: dict, json_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(r, indent=2))
    swap, resident = r["a"]["swap"], r["a"]["resident"]
    itl_ratio = swap["itl_p99_ms"] / resident["itl_p99_ms"]
    n = r["workload"]["pool_adapters"]
    rows = [
        (f"(a) {r['swaps']} swaps, wall s", swap["swap_wall_s"], f"<= {SWAP_TARGET_S}",
         swap["swap_wall_s"] is not None and swap["swap_wall_s"] <= SWAP_TARGET_S),
        ("(a) ITL P50 ms, resident / swap", f"{resident['itl_p50_ms']:.2f} / "
         f"{swap['itl_p50_ms']:.2f}", "", None),
        ("(a) ITL P99 ms, resident / swap", f"{resident['itl_p99_ms']:.2f} / "
         f"{swap['itl_p99_ms']:.2f}", "", None),
        ("(a) ITL P99 swap / resident", itl_ratio, f"<= {ITL_TARGET}", itl_ratio <= ITL_TARGET),
    ]
    for kind in ("light", "heavy"):
        fit, over = r["b_all_fit"][kind], r["b_oversubscribed"][kind]
        ratio = over["ttft_p50_ms"] / fit["ttft_p50_ms"]
        rows += [
            (f"(b) {kind}: TTFT P50 ms, pool {4 * n} / {n}",
             f"{fit['ttft_p50_ms']:.1f} / {over['ttft_p50_ms']:.1f}", "", None),
            (f"(b) {kind}: TTFT ratio", ratio, f"<= {TTFT_TARGET}", ratio <= TTFT_TARGET),
            (f"(b) {kind}: max adapters running, evictions",
             f"{over['max_active_adapters']}, {over['evictions']}", "", None),
        ]
    print(f"device {r['device']}; rank {r['rank']} on all 7 projections; "
          f"{r['swaps_per_step']} swap(s) per step")
    print(f"{'':<40}{'value':>16}{'target':>10}{'met':>6}")
    for name, value, target, met in rows:
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        verdict = "" if met is None else ("yes" if met else "no")
        print(f"{name:<40}{shown:>16}{target:>10}{verdict:>6}")


if __name__ == "__main__":
    main()
