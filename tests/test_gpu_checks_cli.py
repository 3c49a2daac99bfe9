"""scripts/gpu_checks.py's flags on a machine without a GPU: --help prints them and runs
nothing; a family it does not know is refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def gpu_checks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/gpu_checks.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_help_prints_the_flags_and_runs_nothing():
    done = gpu_checks("--help")
    assert done.returncode == 0
    assert "--only-families" in done.stdout and "--fp8-block" in done.stdout


def test_an_unknown_family_is_refused_by_name():
    done = gpu_checks("--only-families=qwen3,llama4")
    assert done.returncode == 2 and "unknown families ['llama4']" in done.stderr
