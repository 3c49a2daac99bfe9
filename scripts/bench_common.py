"""Timing shared by the kernel benchmarks."""

from __future__ import annotations

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
