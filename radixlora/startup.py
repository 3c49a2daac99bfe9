"""Where the time to ready went: the start-up phases the worker (or the offline Engine) times,
and the one line the start-up log ends with."""

from __future__ import annotations

import os
from pathlib import Path

# in the order they happen. A server's: `launch` the launcher's own start until it spawns the
# worker, `imports` the worker's start until it begins loading, the worker's phases (`adapters`
# its read of start-up adapters), `processes` the wait for the other processes after the
# worker, `pipeline` the warm-up request through every process.
PHASES = ("launch", "imports", "weights", "compile", "sizing", "graphs", "warm-up", "adapters",
          "processes", "pipeline")


def process_age_s() -> float | None:
    """Seconds since this process started (its imports included), from /proc; None where
    there is no /proc."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def phase_line(total_s: float, phases: dict[str, float]) -> str:
    """`ready in T s: weights a s, ..., other r s` (other: what no phase names)."""
    parts = [f"{name} {phases[name]:.1f} s" for name in PHASES if name in phases]
    other = total_s - sum(phases.get(name, 0.0) for name in PHASES)
    return f"ready in {total_s:.1f} s: {', '.join([*parts, f'other {max(other, 0.0):.1f} s'])}"
