"""Timing shared by the kernel benchmarks."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import triton


def time_us(fn: Callable[[], object], device: str) -> tuple[float, float | None]:
    """(eager median, CUDA-graph median) in microseconds; CPU: median of 2 wall-clock runs."""
    if device != "cuda":
        times = []
        for _ in range(2):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times), None
    eager = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    try:
        graph = triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
    except RuntimeError:
        graph = None
    return eager, graph


def replace_fields(base, text: str):
    """"pdl=0,block_n=256" -> the dataclass instance `base` with those int fields changed (bool
    fields as 0/1)."""
    fields = {f.name: f.type for f in dataclasses.fields(base)}
    changes: dict[str, object] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"unknown field {key!r} of {type(base).__name__} ({list(fields)})")
        changes[key] = bool(int(value)) if fields[key] in ("bool", bool) else int(value)
    return dataclasses.replace(base, **changes)
