"""Adapter load latency into the paged device pool, Llama-3-8B shape (bf16 pool), ranks 8/16/64
on all 7 projections: from disk (safetensors read + validate + pool write), from host memory
(the pool write alone: what a cached adapter costs today), and the pinned-memory copy of the
same bytes as the achievable floor.

    python scripts/bench_adapter_load.py            # on the H200; JSON to $OUT if set
    python scripts/bench_adapter_load.py --smoke    # tiny shapes on the CPU"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import ALL7, LLAMA3_8B, SMOKE  # noqa: E402

from radixlora.config import ModelConfig  # noqa: E402
from radixlora.lora.adapter import load_adapter  # noqa: E402
from radixlora.lora.layout import bytes_per_row
from radixlora.worker.adapter_pool import AdapterPool  # noqa: E402


def write_adapter(cfg: ModelConfig, path: Path, rank: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(rank)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in ALL7:
            in_dim, out_dim = cfg.module_shape(module)
            block = "self_attn" if module[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen).bfloat16()
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen).bfloat16()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(ALL7)}))
    return path


def timed(fn, device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    cfg = ModelConfig.from_hf(SMOKE if args.smoke else LLAMA3_8B)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    pool = AdapterPool(cfg, 128, torch.bfloat16, device)
    rows = torch.arange(64).numpy().astype("int32")
    root = Path(tempfile.mkdtemp(prefix="bench-load-"))
    results = []
    for rank in (8, 16, 64):
        path = write_adapter(cfg, root / f"r{rank}", rank)
        adapter = load_adapter(f"r{rank}", path, cfg, max_rank=64)
        nbytes = bytes_per_row(cfg, torch.bfloat16) * rank
        disk = timed(lambda p=path, r=rank: pool.write(load_adapter(f"r{r}", p, cfg, 64),
                                                       rows[:r]), device, 3)
        host = timed(lambda a=adapter, r=rank: pool.write(a, rows[:r]), device, 5)
        pinned = torch.empty(nbytes // 2, dtype=torch.bfloat16,
                             pin_memory=device.type == "cuda")
        dst = torch.empty_like(pinned, device=device)
        copy = timed(lambda s=pinned, d=dst: d.copy_(s, non_blocking=True), device, 10)
        results.append({"rank": rank, "MB": nbytes / 1e6, "disk_ms": 1e3 * disk,
                        "host_ms": 1e3 * host, "pinned_copy_ms": 1e3 * copy,
                        "host_GBps": nbytes / host / 1e9, "pinned_GBps": nbytes / copy / 1e9})
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_adapter_load.json").write_text(json.dumps(results, indent=2))
    print(f"{'rank':>4} {'MB':>7} {'disk ms':>9} {'host ms':>9} {'host GB/s':>10} "
          f"{'pinned copy ms':>15} {'pinned GB/s':>12}")
    for r in results:
        print(f"{r['rank']:>4} {r['MB']:>7.1f} {r['disk_ms']:>9.1f} {r['host_ms']:>9.1f} "
              f"{r['host_GBps']:>10.2f} {r['pinned_copy_ms']:>15.2f} {r['pinned_GBps']:>12.1f}")


if __name__ == "__main__":
    main()
