"""What a decode graph's LoRA branch costs on the critical path: the kernel timeline of CUDA-graph
replays (torch.profiler trace) of the Llama-3-8B-shaped engine (dummy bf16 weights), base only vs
with LoRA, for profile_decode.py's cases.

    python scripts/profile_chain.py --cases bs1 bs32      # on a CUDA machine

The kernels that are not LoRA kernels (GEMMs, norms, attention, sampling) run one after another:
they are the step's chain. Per replay this reports the chain's busy time, its idle gaps labelled
by the kernels around them ("(LoRA)" when a LoRA kernel ended inside the gap, so the chain was
waiting for the side branch), and the summed time of each kernel family. Comparing a case's
base and LoRA graphs splits the LoRA cost into slower chain kernels (the GEMMs sharing SMs with
the side branch), waits for the branch, and launch gaps. It also lists each kernel's launch
resources (grid, block, registers per thread, shared memory), which say whether a side-branch
program can share an SM with a GEMM's thread block. Medians over the replays after the first
two; JSON to $OUT."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from bench_engine import ALL7, LLAMA3_8B, make_engine, model_dir, random_adapter
from profile_decode import CASES, kernel_family, run_decode
from torch.profiler import ProfilerActivity, profile

from radixlora.cuda_graph import GraphKey

LORA_FAMILIES = ("grouped_shrink", "grouped_expand")


def replay_timelines(engine, batch: int, rows: int, replays: int) -> list[list[dict]]:
    """Kernel events (name, ts, dur in us) of each replay of graph (batch, batch, rows)."""
    entry = engine.runner.graphs.graphs[GraphKey(batch, batch, rows)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            entry.graph.replay()
            torch.cuda.synchronize()  # the host gap between replays splits the timeline
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp, "trace.json")
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    timelines, current = [], [kernels[0]]
    for e in kernels[1:]:
        if e["ts"] - max(k["ts"] + k["dur"] for k in current) > 100:
            timelines.append(current)
            current = []
        current.append(e)
    timelines.append(current)
    if len(timelines) != replays:
        print(f"note: the trace splits into {len(timelines)} replays, not {replays}")
    return timelines


def family(name: str) -> str:
    label = kernel_family(name)
    return "GEMM" if label.startswith("base GEMM") else label[:28]


def chain_of(timeline: list[dict]) -> dict:
    """Span, chain busy time, chain gaps by label and kernel time by family of one replay."""
    chain = [e for e in timeline if family(e["name"]) not in LORA_FAMILIES]
    lora_ends = [e["ts"] + e["dur"] for e in timeline if family(e["name"]) in LORA_FAMILIES]
    gaps: dict[str, float] = defaultdict(float)
    busy, last = chain[0]["dur"], chain[0]
    end = last["ts"] + last["dur"]
    for e in chain[1:]:
        gap = e["ts"] - end
        if gap > 0:
            waited = any(end < t <= e["ts"] + 0.5 for t in lora_ends)
            label = f"{family(last['name'])} -> {family(e['name'])}"
            gaps[label + (" (LoRA)" if waited else "")] += gap
        busy += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        if e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    kernels: dict[str, float] = defaultdict(float)
    for e in timeline:
        kernels[family(e["name"])] += e["dur"]
    span = max(e["ts"] + e["dur"] for e in timeline) - timeline[0]["ts"]
    return {"span": span, "chain_busy": busy, "gaps": gaps, "kernels": kernels}


RESOURCE_ARGS = ("grid", "block", "registers per thread", "shared memory", "blocks per SM")


def resources(timeline: list[dict]) -> dict[str, dict]:
    """Launch resources of each distinct kernel of one replay (CUPTI's fields in the trace):
    whether a side-branch kernel can share an SM with a GEMM's thread block depends on them."""
    out = {}
    for e in timeline:
        args = e.get("args", {})
        out.setdefault(e["name"][:90], {key: args.get(key) for key in RESOURCE_ARGS})
    return out


def summarize(timelines: list[list[dict]]) -> dict:
    chains = [chain_of(t) for t in timelines[2:]]

    def median_of(key: str) -> dict[str, float]:
        labels = {label for c in chains for label in c[key]}
        medians = {label: statistics.median(c[key].get(label, 0.0) for c in chains)
                   for label in labels}  # fmt: skip
        return dict(sorted(medians.items(), key=lambda kv: -kv[1]))

    gaps = median_of("gaps")
    return {"span_us": statistics.median(c["span"] for c in chains),
            "chain_busy_us": statistics.median(c["chain_busy"] for c in chains),
            "chain_gaps_us": statistics.median(sum(c["gaps"].values()) for c in chains),
            "gaps_us": gaps, "kernels_us": median_of("kernels"),
            "resources": resources(timelines[-1])}  # fmt: skip


def print_summary(label: str, s: dict) -> None:
    print(f"{label}: span {s['span_us']:.1f} us, chain busy {s['chain_busy_us']:.1f} us, "
          f"chain gaps {s['chain_gaps_us']:.1f} us")  # fmt: skip
    for gap, us in list(s["gaps_us"].items())[:10]:
        print(f"    gap {gap:<60}{us:9.1f}")
    for kernel, us in list(s["kernels_us"].items())[:10]:
        print(f"    kernels {kernel:<56}{us:9.1f}")
    for name, res in s["resources"].items():
        print(f"    launch {name[:60]:<60} " + " ".join(f"{k}={v}" for k, v in res.items()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", choices=list(CASES), default=["bs1", "bs32"])
    p.add_argument("--replays", type=int, default=12)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    if args.replays < 3:
        p.error("--replays must be at least 3 (the first two are dropped)")
    if not torch.cuda.is_available():
        sys.exit("profile_chain.py times CUDA graphs: it needs a CUDA device")
    cases = [CASES[name] for name in args.cases]
    batch = max(case.batch for case in cases)
    kv_tokens = batch * max(case.prompt_len + case.new_tokens + 16 for case in cases)
    engine = make_engine(model_dir(LLAMA3_8B), args, kv_pages=max(4096, kv_tokens),
                         max_running=batch, max_batch_tokens=8192, max_rank=64,
                         adapter_rows=2048, max_adapter_sets_per_batch=128)  # fmt: skip
    cfg, dev, rng = engine.model_cfg, engine.runner.device, np.random.default_rng(0)
    names = [f"p{i}" for i in range(max(case.adapters for case in cases))]
    for i, name in enumerate(names):
        engine.add_adapter(random_adapter(cfg, name, 16, ALL7, 500 + i, dev))
    rows = engine.runner.graphs.key_for([1], 16, True).rows
    report = {}
    for case in cases:
        for kind, specs, graph_rows in (("base", [None], 0), ("LoRA", case.specs(names, rng),
                                                                rows)):  # fmt: skip
            run_decode(engine, case, specs, rng)  # captures the graph, fills its buffers
            label = f"{case.label}, {kind}"
            timelines = replay_timelines(engine, case.batch, graph_rows, args.replays)
            report[label] = summarize(timelines)
            print_summary(label, report[label])
    if out := os.environ.get("OUT"):
        Path(out, "profile_chain.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
