"""Where a decode step's device time goes: torch.profiler over CUDA-graph replays of the
Llama-3-8B-shaped engine (dummy bf16 weights), base only vs with LoRA, kernels grouped by name.

    python scripts/profile_decode.py            # on the H200; table per case, JSON to $OUT
    python scripts/profile_decode.py --smoke    # tiny shapes on the CPU (eager, no graphs)

Cases (`--cases`): bs1, batch 1 with one rank-16 adapter on all 7 projections (target b); bs32,
batch 32 over 8 such adapters (the c3 shape); c2, batch 256 with 512-token prompts over 64 such
adapters picked with Zipf popularity (target c2's decode step). Each runs against the same batch
on the base model. The engine runs a few decode steps first so the step's graph is captured and
its static buffers hold the batch; then the profiled region replays that graph `--replays`
times. Times are per replay.

A sweep then recaptures the LoRA graphs under other launch settings of the deferred side
branch's grouped kernels (and with all LoRA work on the compute stream instead of a side
stream) and reports the median replay time of each (CUDA events): kernel sums above overlap on
two streams, replay times do not.

    python scripts/profile_decode.py --no-profile --rounds 2 \
        --sweep "shrink_warps=4" "min_items_per_sm=4,stream=normal"

runs only the sweep, over the given variants (comma-separated settings of the side branch's
GroupedTuning, or with a "main." prefix of the larger graphs' grouped kernels; stream=normal|none
picks the side stream; defer_max=N sets LORA_DEFER_MAX_TOKENS), each round in turn, the default
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
    zipf_specs,
)
from torch.profiler import ProfilerActivity, profile

from radixlora import cuda_graph
from radixlora.cuda_graph import GraphKey
from radixlora.kernels.sgmv_grouped import tuning_for_rows


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    batch: int
    adapters: int  # the first n adapters, round-robin, or Zipf-picked when zipf
    prompt_len: int = 64
    new_tokens: int = 16  # enough to outlast the prefill of the whole batch
    zipf: bool = False

    def specs(self, names: list[str], rng) -> list[str]:
        if self.zipf:
            return zipf_specs(names[: self.adapters], self.batch, 1.0, rng)
        return names[: self.adapters]


DEFER_MAX_TOKENS = cuda_graph.LORA_DEFER_MAX_TOKENS
CASES = {
    "bs1": Case("bs1 one adapter", 1, 1),
    "bs32": Case("bs32 8 adapters", 32, 8),
    "c2": Case("bs256 zipf 64 adapters", 256, 64, prompt_len=512, new_tokens=64, zipf=True),
}
# Changes to the side-branch launch settings (bs1 and bs32 are deferred-delta graphs, <= 32 tokens)
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


def drain(engine) -> None:
    while engine.scheduler.has_work():
        engine.step()


def run_decode(engine, case: Case, specs, rng) -> None:
    """Run the case's batch until all its requests have decoded together a few steps, so the
    step's graph is captured and its static buffers hold the whole batch; the requests stay
    running (the next call drains them)."""
    drain(engine)
    submit_random(engine, case.batch, specs, case.prompt_len, case.new_tokens, rng)
    full_steps = 0
    while full_steps < 3:
        if not engine.scheduler.has_work():
            raise SystemExit(f"{case.label}: the requests finished before decoding together")
        running = engine.scheduler.running
        if (len(running) == case.batch and not engine.scheduler.waiting
                and all(r.remaining_prefill == 1 for r in running)):  # fmt: skip
            full_steps += 1
        engine.step()


def base_replay_ms(engine, case: Case, rng) -> float:
    run_decode(engine, case, [None], rng)  # captures the base graph where no profile did
    return graph_replay_ms(engine, 0, case.batch)


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


def sweep(engine, names: list[str], rows: int, rng, variants: list[str], rounds: int,
          cases: list[Case]):
    """Replay time of the LoRA graphs per launch setting, recaptured for each; the default leads
    every round, and the last round ends with it again, to show drift. A setting applies to the
    deferred side branch (graphs of <= 32 tokens), or with a "main." prefix to the grouped
    kernels of larger graphs; defer_max=N defers the deltas of graphs of up to N tokens."""
    graphs, backend = engine.runner.graphs, engine.runner.lora_backend
    side = graphs.lora_streams
    streams = {
        "high": side,
        "none": {},
        "normal": {**side, True: torch.cuda.Stream(device=engine.runner.device)},
    }
    out: dict[str, dict[str, list[float]]] = {}
    order = [label for _ in range(rounds) for label in ["", *variants]] + [""]
    for label in order:
        settings = parse_variant(label)
        stream = streams[str(settings.pop("stream", "high"))]
        cuda_graph.LORA_DEFER_MAX_TOKENS = settings.pop("defer_max", DEFER_MAX_TOKENS)
        main = {k.removeprefix("main."): v for k, v in settings.items() if k.startswith("main.")}
        settings = {k: v for k, v in settings.items() if not k.startswith("main.")}
        beside = tuning_for_rows(rows, beside_gemm=True)
        backend.side_tuning = dataclasses.replace(beside, **settings) if settings else None
        backend.tuning = dataclasses.replace(tuning_for_rows(rows), **main) if main else None
        graphs.lora_streams = stream
        drain(engine)
        graphs.reset()
        times = out.setdefault(label or "default", {})
        for case in cases:
            run_decode(engine, case, case.specs(names, rng), rng)
            times.setdefault(case.label, []).append(graph_replay_ms(engine, rows, case.batch))
        print(f"{label or 'default':<48}"
              + "".join(f"{case}: {ms[-1]:.3f} ms  " for case, ms in times.items()))  # fmt: skip
    backend.side_tuning, backend.tuning, graphs.lora_streams = None, None, side
    cuda_graph.LORA_DEFER_MAX_TOKENS = DEFER_MAX_TOKENS
    drain(engine)
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
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=["bs1", "bs32"])
    args = p.parse_args()
    shape = SMOKE if args.smoke else LLAMA3_8B
    cases = [CASES[name] for name in args.cases]
    batch = max(case.batch for case in cases)
    kv_tokens = batch * max(case.prompt_len + case.new_tokens + 16 for case in cases)
    engine = make_engine(model_dir(shape), args, kv_pages=max(4096, kv_tokens), max_running=batch,
                         max_batch_tokens=8192, max_rank=64, adapter_rows=2048,
                         max_adapter_sets_per_batch=128)
    cfg, dev, rng = engine.model_cfg, engine.runner.device, np.random.default_rng(0)
    names = [f"p{i}" for i in range(max(case.adapters for case in cases))]
    for i, name in enumerate(names):
        engine.add_adapter(random_adapter(cfg, name, 16, ALL7, 500 + i, dev))
    rows_bucket = engine.runner.graphs.key_for([1], 16, True).rows if engine.runner.graphs else 0
    report: dict = {"kernels": {}}
    for case in () if args.no_profile else cases:
        lora = case.specs(names, rng)
        for kind, specs, rows in (("base", [None], 0), ("LoRA", lora, rows_bucket)):
            # captures the graph and leaves the batch in its buffers
            run_decode(engine, case, specs, rng)
            label = f"{case.label}, {kind}"
            kernels = report["kernels"][label] = profile_graph(engine, case.batch, rows,
                                                               args.replays)
            print(f"{label}: {sum(kernels.values()):.1f} us of kernels per replay")
            for family, us in list(kernels.items())[:12]:
                print(f"    {family:<50}{us:10.1f}")
    if engine.runner.graphs is not None:
        report["base_replay_ms"] = {case.label: base_replay_ms(engine, case, rng)
                                    for case in cases}  # fmt: skip
        print("base graphs: " + "".join(f"{c}: {ms:.3f} ms  "
                                        for c, ms in report["base_replay_ms"].items()))  # fmt: skip
        variants = args.sweep if args.sweep is not None else DEFAULT_SWEEP
        report["lora_replay_ms"] = sweep(engine, names, rows_bucket, rng, variants, args.rounds,
                                         cases)
    if out := os.environ.get("OUT"):
        Path(out, "profile_decode.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
