"""The experts' benchmark and tile sweep on the CPU (--smoke: tiny shapes, the interpreter):
each prints its table, and every relative error it checks (FP8 experts against their
dequantized weights included) is small."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args, "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=True)
    return done.stdout


@pytest.mark.parametrize("weights", ["model", "fp8"])
def test_bench_moe_checks_every_size(weights):
    lines = run("scripts/bench_moe.py", "--expert-weights", weights).splitlines()
    rows = [line.split() for line in lines[1:]]
    assert [r[0] for r in rows] == ["4", "16"]
    assert all(float(r[2]) < 1e-5 and float(r[6]) < 1e-5 for r in rows)  # base, with LoRA


def test_tune_moe_compares_each_bucket():
    out = run("scripts/tune_moe.py")
    assert out.count("shipped") >= 4
    assert "rows/expert in (0, 1]" in out and "best common" in out
