"""The burst benchmark on the CPU (--smoke: tiny shapes): its synthetic steps (decode-only ones
and many-adapter ones included) and a burst run and print their lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_burst_smoke_runs_the_steps_and_a_burst(tmp_path):
    done = subprocess.run(
        [sys.executable, "scripts/bench_burst.py", "--smoke", "--parts", "steps,burst"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "OUT": str(tmp_path)})
    steps = [line.split()[1:3] for line in done.stdout.splitlines()
             if line.strip().startswith("step ")]
    assert {("decode", "64"), ("decode", "1024"), ("prefill", "8192")} <= set(map(tuple, steps))
    assert "step decode 176, 100 adapters" in done.stdout  # LoRA on rows of its own per set
    assert "burst [adapters 0, max_running default]: 24 requests" in done.stdout
    assert (tmp_path / "bench_burst.json").exists()
