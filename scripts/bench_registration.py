"""Registration of many adapters at start-up (radixlora.lora.registration): N PEFT adapter
directories (default 1000, rank 8 on q/k/v/o of a Llama-3-8B-shaped model, bf16: 13.6 MB
each; `--tiny`: scripts/checkpoints.py TINY_CONFIG) are written to a directory, then
registered four ways, each reported in ms per adapter:

  serial        load_adapter one after another (what start-up did before)
  threads       with weights (each dropped once counted): files read and hashed on threads,
                validated in order (the Engine and the worker's host-tier prefetch)
  cold          load_adapters without weights, empty hash cache (the scheduler and the
                registry: processes from 1 GiB of cold adapters and 4 workers on)
  warm          the same again with the cache the cold round wrote (a restart): configs and
                safetensors headers only

Every round must give the serial round's ids. The files were just written, so they are in the
page cache: this measures CPU work, not the disk.

    python scripts/bench_registration.py                  # 1000 adapters, ~14 GB on disk
    python scripts/bench_registration.py --num 50         # JSON to $OUT if set
    python scripts/bench_registration.py --tiny --num 300"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoints import TINY_CONFIG  # noqa: E402

from radixlora.config import ModelConfig  # noqa: E402
from radixlora.lora.adapter import load_adapter  # noqa: E402
from radixlora.lora.registration import (  # noqa: E402
    HashCache,
    default_workers,
    iter_adapters,
    load_adapters,
)

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False, eos_token_id=128001, torch_dtype="bfloat16")
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
MAX_RANK = 64


def write_adapters(root: Path, shape: dict, num: int, rank: int) -> tuple[ModelConfig, dict]:
    """A model config and `num` adapters of distinct content (one tensor scaled per index)."""
    (root / "model").mkdir(parents=True)
    (root / "model" / "config.json").write_text(json.dumps(shape))
    model = ModelConfig.from_dir(root / "model")
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(model.num_layers):
        for module in QKVO:
            in_dim, out_dim = model.module_shape(module)
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, in_dim, generator=gen)
                                               / in_dim**0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (0.01 * torch.randn(out_dim, rank,
                                                                  generator=gen)).bfloat16()
    config = json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                         "target_modules": list(QKVO), "bias": "none"})
    first = next(iter(tensors))
    items = {}
    for i in range(num):
        path = root / f"adapter-{i:04d}"
        path.mkdir()
        save_file({**tensors, first: tensors[first] * (1 + i / num)},
                  str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(config)
        items[path.name] = path
    return model, items


def timed(fn) -> tuple[float, dict]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num", type=int, default=1000)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-registration-", dir=args.dir))
    try:
        run(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(root: Path, args) -> None:
    shape = dict(TINY_CONFIG) if args.tiny else LLAMA3_8B
    seconds, (model, items) = timed(lambda: write_adapters(root, shape, args.num, args.rank))
    size = (next(iter(items.values())) / "adapter_model.safetensors").stat().st_size
    print(f"wrote {args.num} adapters of {size / 1e6:.1f} MB in {seconds:.1f} s; "
          f"{args.workers} workers, {torch.get_num_threads()} torch threads")
    cache_path = root / "cache" / "adapter_hashes.json"
    def ids(outcomes) -> dict[str, str]:
        return {name: adapter.adapter_id for name, adapter in outcomes}

    rounds = {
        "serial": lambda: {n: load_adapter(n, p, model, MAX_RANK).adapter_id
                           for n, p in items.items()},
        "threads": lambda: ids(iter_adapters(items, model, MAX_RANK, workers=args.workers)),
        "cold": lambda: ids(load_adapters(items, model, MAX_RANK, workers=args.workers,
                                          keep_weights=False,
                                          cache=HashCache(cache_path)).items()),
        "warm": lambda: ids(load_adapters(items, model, MAX_RANK, workers=args.workers,
                                          keep_weights=False,
                                          cache=HashCache(cache_path)).items()),
    }
    results = {"num": args.num, "adapter_mb": size / 1e6, "workers": args.workers}
    expected = None
    for label, fn in rounds.items():
        seconds, got = timed(fn)
        expected = expected or got
        assert got == expected, f"{label}: ids differ from the serial round"
        results[f"{label}_ms_per_adapter"] = 1e3 * seconds / args.num
        print(f"{label:8s} {seconds:7.2f} s  {1e3 * seconds / args.num:7.1f} ms/adapter")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_registration.json").write_text(json.dumps(results,
                                                                                indent=2))


if __name__ == "__main__":
    main()
