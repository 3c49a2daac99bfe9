"""Where a decode step's device time goes: torch.profiler over CUDA-graph replays of the
Llama-3-8B-shaped engine (dummy bf16 weights), base only vs with LoRA, kernels grouped by name.

    python scripts/profile_decode.py            # on the H200; table per case, JSON to $OUT
    python scripts/profile_decode.py --smoke    # tiny shapes on the CPU (eager, no graphs)

Cases: batch 1 with one rank-16 adapter on all 7 projections (target b), and batch 32 over 8
such adapters (the c3 shape), each against the same batch on the base model. The engine runs a
few decode steps first so the step's graph is captured and its static buffers hold the batch;
then the profiled region replays that graph `--replays` times. Times are per replay.

A sweep then recaptures the LoRA graphs under other launch settings of the deferred side
branch's grouped kernels (and with all LoRA work on the compute stream instead of a side
stream) and reports the median replay time of each (CUDA events): kernel sums above overlap on
two streams, replay times do not.

    python scripts/profile_decode.py --no-profile --rounds 2 \
        --sweep "shrink_warps=4" "min_items_per_sm=4,stream=normal"

runs only the sweep, over the given variants (comma-separated settings of the side branch's
GroupedTuning; stream=normal|none picks the side stream), each round in turn, the default
first in each round."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import defaultdict
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
from torch.profiler import ProfilerActivity, profile

from radixlora.cuda_graph import GraphKey
from radixlora.kernels.sgmv_grouped import tuning_for_rows

CASES = (("bs1 one adapter", 1, 1), ("bs32 8 adapters", 32, 8))
# Changes to the side-branch launch settings (both cases are deferred-delta graphs, <= 32 tokens)
DEFAULT_SWEEP = ["stream=none", "stream=normal", "min_items_per_sm=4", "min_items_per_sm=2",
                 "min_items_per_sm=16", "shrink_warps=4", "block_k=64", "block_k=128",
                 "k_chunk=512", "programs_per_sm=2", "programs_per_sm=16", "block_n=128",
                 "block_n=512", "expand_warps=2", "expand_warps=8", "pdl=True"]  # fmt: skip


def kernel_family(name: str) -> str:
    """A short label per kernel kind (Triton kernels by function name, cuBLAS GEMMs as one)."""
    for key in ("grouped_shrink", "grouped_expand", "decode_split", "decode_merge", "extend",
                "rmsnorm", "rotary", "silu", "sample", "argmax", "softmax"):  # fmt: skip
        if key in name:
            return key
    if "gemm" in name.lower() or "gemv" in name.lower() or "sm90" in name:
        return "base GEMM (cuBLAS)"
    if "fill" in name.lower() or "memset" in name.lower():
        return "fill / memset"
    return name[:48]


def profile_graph(engine, batch: int, rows: int, replays: int) -> dict[str, float]:
    """Device microseconds per replay by kernel family of the graph (batch, batch, rows)."""
    graphs = engine.runner.graphs
    entry = graphs.graphs.get(GraphKey(batch, batch, rows)) if graphs is not None else None
    if entry is None:
        return {}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            entry.graph.replay()
        torch.cuda.synchronize()
    per_family: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_family[kernel_family(event.name)] += event.device_time_total / replays
    return dict(sorted(per_family.items(), key=lambda kv: -kv[1]))


def run_decode(engine, batch: int, specs, rng) -> None:
    submit_random(engine, batch, specs, 64, 8, rng)
    while engine.scheduler.has_work():
        engine.step()


def base_replay_ms(engine, batch: int, rng) -> float:
    run_decode(engine, batch, [None], rng)  # captures the base graph where no profile did
    return graph_replay_ms(engine, 0, batch)


def parse_variant(text: str) -> dict[str, object]:
    """Settings of one variant: "shrink_warps=8,stream=normal" -> {"shrink_warps": 8, ...}."""
    settings: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=")
        if key == "stream":
            settings[key] = value
        elif value in ("True", "False"):
            settings[key] = value == "True"
        else:
            settings[key] = int(value)
    return settings


def sweep(engine, names: list[str], rows: int, rng, variants: list[str], rounds: int):
    """Replay time of the LoRA graphs per side-branch launch setting, recaptured for each; the
    default leads every round, and the last round ends with it again, to show drift."""
    graphs, backend = engine.runner.graphs, engine.runner.lora_backend
    side = graphs.lora_streams
    streams = {
        "high": side,
        "none": {},
        "normal": {**side, True: torch.cuda.Stream(device=engine.runner.device)},
    }
    beside = tuning_for_rows(rows, beside_gemm=True)
    out: dict[str, dict[str, list[float]]] = {}
    order = [label for _ in range(rounds) for label in ["", *variants]] + [""]
    for label in order:
        settings = parse_variant(label)
        stream = streams[str(settings.pop("stream", "high"))]
        backend.side_tuning = dataclasses.replace(beside, **settings) if settings else None
        graphs.lora_streams = stream
        graphs.reset()
        times = out.setdefault(label or "default", {})
        for case, batch, n_adapters in CASES:
            run_decode(engine, batch, names[:n_adapters], rng)
            times.setdefault(case, []).append(graph_replay_ms(engine, rows, batch))
        print(f"{label or 'default':<48}"
              + "".join(f"{case}: {ms[-1]:.3f} ms  " for case, ms in times.items()))  # fmt: skip
    backend.side_tuning, graphs.lora_streams = None, side
    graphs.reset()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-profile", action="store_true", help="only the sweep")
    p.add_argument("--sweep", nargs="*", help="side-branch variants (default: one per setting)")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    shape = SMOKE if args.smoke else LLAMA3_8B
    engine = make_engine(model_dir(shape), args, kv_pages=4096, max_running=32, max_rank=64)
    cfg, dev, rng = engine.model_cfg, engine.runner.device, np.random.default_rng(0)
    names = [f"p{i}" for i in range(8)]
    for i, name in enumerate(names):
        engine.add_adapter(random_adapter(cfg, name, 16, ALL7, 500 + i, dev))
    rows_bucket = engine.runner.graphs.key_for([1], 16, True).rows if engine.runner.graphs else 0
    report: dict = {"kernels": {}}
    for label, batch, n_adapters in () if args.no_profile else CASES:
        for kind, specs, rows in (("base", [None], 0), ("LoRA", names[:n_adapters], rows_bucket)):
            run_decode(engine, batch, specs, rng)  # captures and leaves the batch in the buffers
            case = f"{label}, {kind}"
            kernels = report["kernels"][case] = profile_graph(engine, batch, rows, args.replays)
            print(f"{case}: {sum(kernels.values()):.1f} us of kernels per replay")
            for family, us in list(kernels.items())[:12]:
                print(f"    {family:<50}{us:10.1f}")
    if engine.runner.graphs is not None:
        report["base_replay_ms"] = {label: base_replay_ms(engine, batch, rng)
                                    for label, batch, _ in CASES}  # fmt: skip
        print("base graphs: " + "".join(f"{c}: {ms:.3f} ms  "
                                        for c, ms in report["base_replay_ms"].items()))  # fmt: skip
        variants = args.sweep if args.sweep is not None else DEFAULT_SWEEP
        report["lora_replay_ms"] = sweep(engine, names, rows_bucket, rng, variants, args.rounds)
    if out := os.environ.get("OUT"):
        Path(out, "profile_decode.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
