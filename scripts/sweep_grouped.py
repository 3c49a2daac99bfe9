"""Per-kernel times of the grouped SGMV kernels at target a's shape (one Llama-3-8B layer, 64
decode tokens, 64 distinct rank-16 adapters, bf16), and a sweep of their launch settings:
where bench_sgmv.py times the whole layer, this says which of the 8 launches costs what and
which settings move it.

    python scripts/sweep_grouped.py            # H200: CUDA-graph medians, JSON to $OUT
    python scripts/sweep_grouped.py --smoke    # CPU: tiny shapes under TRITON_INTERPRET=1

Each time is the median of a graph of 10 back-to-back launches of one kernel, divided by 10
(with PDL on, a launch overlaps the tail of the one before it, as in the layer). The expand
sweep runs on gate_up (the widest, 58.7 MB) and qkv (3 unequal slices), adding into y as apply
does; the shrink sweep on qkv and down (in_dim 14336).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

import torch  # noqa: E402
import triton  # noqa: E402
from bench_common import time_us  # noqa: E402
from bench_sgmv import (  # noqa: E402
    FULL,
    GROUP_TOKENS,
    SMOKE,
    SPARE_ROWS,
    build_meta,
    build_projections,
    scattered_rows,
    scenarios,
)

from kernels.sgmv_grouped import (  # noqa: E402
    BESIDE_GEMM,
    DEFAULT_TUNING,
    GroupedTuning,
    grouped_expand,
    grouped_shrink,
)

EXPAND_GRID = {"block_n": (64, 128, 256), "expand_stages": (2, 3, 4), "expand_warps": (2, 4)}
SHRINK_GRID = {"block_k": (64, 128, 256), "shrink_stages": (2, 3, 4), "shrink_warps": (2, 4)}
SMOKE_GRID = {"block_n": (16,), "expand_stages": (1, 2), "block_k": (16,), "shrink_warps": (2,)}


def per_launch_us(fn, device: str, repeats: int = 10) -> float:
    def burst() -> None:
        for _ in range(repeats):
            fn()

    if device != "cuda":
        return time_us(burst, device)[0] / repeats
    ms = triton.testing.do_bench_cudagraph(burst, rep=50, return_mode="median")
    return ms * 1e3 / repeats


class Layer:
    """Target a's projections, their group metadata, v and y buffers."""

    def __init__(self, cfg) -> None:
        sc = scenarios(cfg)[0]  # distinct adapters, one token each
        rows = scattered_rows(sc.num_adapters, sc.rank, torch.Generator().manual_seed(0))
        self.projs = {p.name: p for p in build_projections(
            cfg, sc.num_adapters * sc.rank + SPARE_ROWS, len(sc.sets))}  # fmt: skip
        meta = build_meta(sc, rows, cfg.device, GROUP_TOKENS)
        g = meta.groups
        self.index = (g.num_groups, g.group_indptr, g.token_ids, g.row_indptr, g.row_ids)
        self.scales, self.max_rows, self.device = g.row_scales, meta.max_rows, cfg.device
        self.v = {name: grouped_shrink(p.x, p.a_pool, *self.index, self.scales, self.max_rows)
                  for name, p in self.projs.items()}  # fmt: skip
        self.y = {name: torch.zeros_like(p.x[:, :1]).expand(-1, p.out_offsets[-1]).clone()
                  for name, p in self.projs.items()}  # fmt: skip

    def shrink_us(self, name: str, tuning: GroupedTuning) -> float:
        p = self.projs[name]
        return per_launch_us(lambda: grouped_shrink(
            p.x, p.a_pool, *self.index, self.scales, self.max_rows, tuning=tuning),
            self.device)  # fmt: skip

    def expand_us(self, name: str, tuning: GroupedTuning) -> float:
        p, v, y = self.projs[name], self.v[name], self.y[name]
        return per_launch_us(lambda: grouped_expand(
            v, p.b_pool, p.out_offsets, *self.index, y, tuning=tuning), self.device)  # fmt: skip

    def breakdown(self, tuning: GroupedTuning) -> dict[str, float]:
        out = {}
        for name in self.projs:
            out[f"{name}.shrink"] = self.shrink_us(name, tuning)
            out[f"{name}.expand"] = self.expand_us(name, tuning)
        return out


def grid_tunings(grid: dict[str, tuple], keys: tuple[str, ...]) -> list[dict]:
    axes = [(k, grid[k]) for k in keys if k in grid]
    return [dict(zip([k for k, _ in axes], values, strict=True))
            for values in itertools.product(*(v for _, v in axes))]  # fmt: skip


def tuned(changes: dict) -> GroupedTuning:
    return dataclasses.replace(DEFAULT_TUNING, **changes)


def label(changes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in changes.items()) or "default"


def sweep(layer: Layer, grid: dict, smoke: bool) -> dict[str, list[tuple[str, float]]]:
    expand_keys, shrink_keys = tuple(EXPAND_GRID), tuple(SHRINK_GRID)
    runs: dict[str, list[tuple[str, float]]] = {}
    for name in ("gate_up", "qkv"):
        runs[f"{name}.expand"] = [(label(c), layer.expand_us(name, tuned(c)))
                                  for c in grid_tunings(grid, expand_keys)]  # fmt: skip
    for name in ("qkv", "down") if not smoke else ("qkv",):
        runs[f"{name}.shrink"] = [(label(c), layer.shrink_us(name, tuned(c)))
                                  for c in grid_tunings(grid, shrink_keys)]  # fmt: skip
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    smoke = parser.parse_args().smoke
    layer = Layer(SMOKE if smoke else FULL)
    report: dict = {"breakdown": {}}
    for name, tuning in (("default", DEFAULT_TUNING),
                         ("run-11 settings (BESIDE_GEMM)", tuned(BESIDE_GEMM))):
        times = report["breakdown"][name] = layer.breakdown(tuning)
        cells = ", ".join(f"{k} {v:.1f}" for k, v in times.items())
        print(f"{name}: {cells}; sum {sum(times.values()):.1f} us", flush=True)
    report["sweep"] = sweep(layer, SMOKE_GRID if smoke else {**EXPAND_GRID, **SHRINK_GRID}, smoke)
    for kernel, rows in report["sweep"].items():
        best = sorted(rows, key=lambda r: r[1])
        print(f"{kernel}: best of {len(rows)}")
        for text, us in best[:5]:
            print(f"    {text:<48}{us:8.2f} us")
    if out := os.environ.get("OUT"):
        Path(out, "sweep_grouped.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
