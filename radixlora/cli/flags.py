"""Flags shared by the commands that build an Engine (`radixlora serve`, `radixlora batch`): the
EngineConfig overrides, --adapter NAME=PATH, and the bundled demo as the default model."""

from __future__ import annotations

import argparse
from pathlib import Path

# EngineConfig field -> (type, its flags: ours first, then vLLM's and SGLang's spellings, help)
ENGINE_FLAGS = {
    "gpu_memory_utilization": (float, ("--gpu-memory-utilization", "--mem-fraction-static"),
                               "share of the GPU's memory for weights, KV and adapter pools, "
                               "activations and graphs (default 0.90)"),
    "kv_pages": (int, ("--kv-pages",), "KV pool pages (default: sized from GPU memory; 4096 "
                                       "on the CPU)"),
    "page_size": (int, ("--page-size",), "tokens per KV page (default 1)"),
    "max_loras": (int, ("--max-loras",), "adapters of --max-lora-rank the adapter pool holds at "
                                         "once (default 32)"),
    "max_rank": (int, ("--max-lora-rank", "--max-rank"), "largest adapter rank accepted "
                                                         "(default 64)"),
    "adapter_rows": (int, ("--adapter-rows",), "adapter pool rank rows (default: --max-loras x "
                                               "--max-lora-rank; 512 on the CPU)"),
    "host_adapter_bytes": (int, ("--host-adapter-bytes",), "host tier of packed adapters "
                                                           "(default: 25% of available host "
                                                           "memory)"),
    "max_stacked": (int, ("--max-stacked",), "adapters one request may stack (default 8)"),
    "max_running": (int, ("--max-running", "--max-num-seqs", "--max-running-requests"),
                    "requests decoding at once (default 256 on a GPU, 64 on the CPU)"),
    "max_batch_tokens": (int, ("--max-batch-tokens", "--max-num-batched-tokens",
                               "--chunked-prefill-size"),
                         "prompt tokens per step, longer prompts are chunked (default by GPU "
                         "memory: 8192 on an 80-141 GB GPU; 2048 on the CPU)"),
    "context_length": (int, ("--context-length", "--max-model-len"),
                       "prompt + output tokens per request (default: the model's)"),
    "device": (str, ("--device",), "cuda or cpu (default: cuda when available)"),
    "dtype": (str, ("--dtype",), "auto, bfloat16, float16 or float32"),
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """EngineConfig overrides (default: the config's, sized on the device)."""
    for field, (kind, flags, help_text) in ENGINE_FLAGS.items():
        p.add_argument(*flags, dest=field, type=kind, default=None, help=help_text)
    p.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_false",
                   default=None, help="fold each step's results in before planning the next")
    p.add_argument("--disable-cuda-graph", "--enforce-eager", dest="cuda_graph",
                   action="store_false", default=None, help="run every step eagerly")


def engine_overrides(args: argparse.Namespace) -> dict:
    fields = (*ENGINE_FLAGS, "overlap_schedule", "cuda_graph")
    return {k: getattr(args, k) for k in fields if getattr(args, k) is not None}


def adapter_pairs(values: list[str]) -> dict[str, str]:
    pairs = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--adapter expects NAME=PATH, got {value!r}")
        pairs[name] = path
    return pairs


def model_and_adapters(args: argparse.Namespace) -> tuple[str | Path, dict[str, str], str | None]:
    """(model directory, adapters by name, served model name) of --model, --adapter and
    --served-model-name; without --model, the bundled demo model and its adapters."""
    adapters = adapter_pairs(args.adapter)
    model, served_name = args.model, args.served_model_name
    if model is None:  # the bundled demo: a small trained model and one adapter per task
        from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

        model, served_name = DEMO_MODEL_DIR, served_name or "radixlora-demo"
        for name, path in DEMO_ADAPTERS.items():
            adapters.setdefault(name, str(path))
    return model, adapters, served_name
