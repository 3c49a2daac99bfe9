"""DoRA against LoRA at decode: a batch of 64 requests over 64 distinct rank-16 adapters on every
projection of the Llama-3-8B shape (random bf16 weights, load_format="dummy"), once over LoRA
adapters and once over DoRA twins of them (the same A and B, plus magnitude vectors).

    python scripts/bench_dora.py            # the H200; a table, JSON to $OUT
    python scripts/bench_dora.py --smoke    # tiny shapes on the CPU, checks the script runs

Reported: the median decode step at batch 64 (wall clock around engine.step(), overlap
scheduling, as bench_engine.py times it), the device time of that step's CUDA graph replayed
alone (median of 50), and the time to write one adapter into the device pool from the host tier
(median of 16 writes, synchronised; a DoRA write also computes its scales from the base
weights)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from bench_engine import (
    ALL7,
    LLAMA3_8B,
    SMOKE,
    decode_step_ms,
    graph_replay_ms,
    make_engine,
    model_dir,
    random_adapter,
)

from radixlora.config import MODULE_GROUPS
from radixlora.lora.adapter import LoraAdapter
from radixlora.lora.header import dora_groups
from radixlora.lora.layout import group_dims
from radixlora.worker.cuda_graph import row_bucket
from radixlora.worker.dora import DoraBase

BATCH, RANK, PROMPT, NEW = 64, 16, 128, 64


def base_norms(base: DoraBase, cfg) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module) -> the norms of the base weight's rows."""
    norms = {}
    for group in cfg.lora_groups:
        modules = MODULE_GROUPS[group]
        rows = base.row_squares(group).sqrt().cpu()  # [layers, out_total]
        offsets = group_dims(cfg, group)[1]
        for i, module in enumerate(modules):
            for layer in range(cfg.num_layers):
                norms[(layer, module)] = rows[layer, offsets[i]:offsets[i + 1]]
    return norms


def dora_twin(adapter: LoraAdapter, norms: dict, seed: int) -> LoraAdapter:
    """The adapter with a magnitude vector on each module: its base rows' norms times
    1 + N(0, 0.05^2), so that g stays near 1 as in a trained DoRA."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = {key: norms[key] * (1 + 0.05 * torch.randn(norms[key].shape, generator=gen))
                  for key in adapter.weights}
    return dataclasses.replace(adapter, name=adapter.name + "-dora",
                               content_hash=adapter.content_hash + "-dora",
                               dora_groups=dora_groups(magnitudes), magnitudes=magnitudes)


def write_ms(engine, adapters: list[LoraAdapter]) -> float:
    pool = engine.runner.adapter_pool
    n = min(pool.group_rows.values())
    rows = np.arange(n - adapters[0].pool_rows, n, dtype=np.int32)
    times = []
    for adapter in adapters[:16]:
        packed = pool.packed(adapter)
        if pool.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        pool.write(packed, rows)
        pool.wait_loads()
        if pool.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    shape = SMOKE if args.smoke else LLAMA3_8B
    batch, new = (8, 8) if args.smoke else (BATCH, NEW)
    engine = make_engine(model_dir(shape), args, kv_pages=20_000, max_running=256,
                         adapter_rows=2048, max_rank=64)
    if engine.runner.graphs is not None:
        engine.runner.graphs.capture_decode()
    cfg, dev = engine.model_cfg, engine.runner.device
    norms = base_norms(DoraBase(engine.runner.model, engine.runner.dtype), cfg)
    lora = [random_adapter(cfg, f"l{i}", RANK, ALL7, 500 + i, dev) for i in range(batch)]
    dora = [dora_twin(a, norms, i) for i, a in enumerate(lora)]
    for adapter in lora + dora:
        engine.add_adapter(adapter)
        engine.runner.adapter_pool.packed(adapter)  # in the host tier
    rng = np.random.default_rng(0)
    results = {"batch": batch, "rank": RANK, "prompt_len": PROMPT, "new_tokens": new}
    for kind, adapters in (("lora", lora), ("dora", dora)):
        names = [a.name for a in adapters]
        decode_step_ms(engine, batch, names, 32, 8, rng)  # loads, compiles, captures
        results[f"{kind}_decode_step_ms"] = decode_step_ms(engine, batch, names, PROMPT, new, rng)
        rows = row_bucket(engine.runner.graphs.row_buckets, RANK) if engine.runner.graphs else 0
        results[f"{kind}_graph_replay_ms"] = graph_replay_ms(engine, rows, batch,
                                                             dora=kind == "dora")
    for kind, adapters in (("lora", lora), ("dora", dora)):
        results[f"{kind}_pool_write_ms"] = write_ms(engine, adapters)
    results["decode_dora_over_lora"] = (results["dora_decode_step_ms"]
                                        / results["lora_decode_step_ms"])
    results["replay_dora_over_lora"] = (results["dora_graph_replay_ms"]
                                        / results["lora_graph_replay_ms"])
    for key, value in results.items():
        print(f"{key:28s} {value:.3f}" if isinstance(value, float) else f"{key:28s} {value}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_dora.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
