"""Flags shared by the commands that build an Engine (`radixlora serve`, `radixlora batch`): the
EngineConfig overrides, --adapter NAME=PATH, and the bundled demo as the default model."""

from __future__ import annotations

import argparse
from pathlib import Path

ENGINE_FLAGS = ("kv_pages", "page_size", "adapter_rows", "host_adapter_bytes", "max_rank",
                "max_stacked", "max_running", "max_batch_tokens", "device", "dtype")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """--kv-pages, --max-running, ...: EngineConfig overrides (default: the config's)."""
    for flag in ENGINE_FLAGS:
        kind = str if flag in ("device", "dtype") else int
        p.add_argument("--" + flag.replace("_", "-"), type=kind, default=None)
    p.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_false",
                   default=None, help="fold each step's results in before planning the next")


def engine_overrides(args: argparse.Namespace) -> dict:
    flags = (*ENGINE_FLAGS, "overlap_schedule")
    return {k: getattr(args, k) for k in flags if getattr(args, k) is not None}


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
