"""The api process's operator log lines: a periodic stats line while the server is busy
(`--stats-interval`) and one line per finished request (`--log-requests`). Neither ever holds
prompt or output text."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixlora.server.messages import SchedulerStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """The scheduler's last SchedulerStats plus the api's cumulative token counts."""

    running: int
    waiting: int
    kv_used: int
    kv_capacity: int
    kv_cached: int
    lookup_tokens: int  # cumulative radix lookups; restart from 0 when the cache is flushed
    hit_tokens: int
    prompt_tokens: int  # cumulative, counted by the api at each request's first output
    generation_tokens: int  # cumulative
    resident_adapters: int
    adapter_loads: int  # cumulative
    adapter_evictions: int  # cumulative
    host_adapters: int = 0  # in the worker's host tier
    swaps_waiting: int = 0  # requests the swap cap held back at the last step

    @classmethod
    def of(cls, stats: SchedulerStats, prompt_tokens: int, generation_tokens: int) -> Snapshot:
        return cls(
            running=stats.running,
            waiting=stats.waiting,
            kv_used=stats.kv_used,
            kv_capacity=stats.kv_capacity,
            kv_cached=stats.kv_cached,
            lookup_tokens=stats.prompt_tokens,
            hit_tokens=stats.cached_tokens,
            prompt_tokens=prompt_tokens,
            generation_tokens=generation_tokens,
            resident_adapters=stats.resident_adapters,
            adapter_loads=stats.adapter_loads,
            adapter_evictions=stats.adapter_evictions,
            host_adapters=stats.host_adapters,
            swaps_waiting=stats.swaps_waiting,
        )


class StatsLog:
    """Logs `line(previous, current, elapsed)` at most every interval_s, on the arrival of a
    SchedulerStats (every 0.5 s); interval_s 0 turns it off."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.last: Snapshot | None = None
        self.last_at = 0.0
        self.slowest_load_s: float | None = None  # since the last line

    def count(self, prompt_tokens: int, generation_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens

    def on_stats(self, stats: SchedulerStats) -> str | None:
        """The line logged for this SchedulerStats, if any."""
        if self.interval_s <= 0:
            return None
        if stats.adapter_load_seconds:
            self.slowest_load_s = max(self.slowest_load_s or 0.0, *stats.adapter_load_seconds)
        now = self.clock()
        if self.last is not None and now - self.last_at < self.interval_s:
            return None
        current = Snapshot.of(stats, self.prompt_tokens, self.generation_tokens)
        text = None
        if self.last is not None:
            text = self.line(self.last, current, now - self.last_at, self.slowest_load_s)
        self.last, self.last_at, self.slowest_load_s = current, now, None
        if text is not None:
            log.info("%s", text)
        return text

    @staticmethod
    def line(previous: Snapshot, current: Snapshot, elapsed_s: float,
             slowest_load_s: float | None = None) -> str | None:
        """The stats line over the interval from previous to current; None when idle. The
        slowest adapter load (the step waited that long for it: a disk read when its adapter
        was not in the host tier) and the requests the swap cap holds back show when there are
        any."""
        prompt = current.prompt_tokens - previous.prompt_tokens
        generated = current.generation_tokens - previous.generation_tokens
        if not (current.running or current.waiting or prompt or generated):
            return None
        elapsed_s = max(elapsed_s, 1e-9)
        kv = 100.0 * current.kv_used / max(current.kv_capacity, 1)
        return (
            f"stats: running {current.running}, waiting {current.waiting}, "
            f"KV {kv:.1f}% (cached {current.kv_cached} tok), "
            f"radix hit {_hit_rate(previous, current)}, "
            f"prompt {prompt / elapsed_s:.1f} tok/s, generation {generated / elapsed_s:.1f} tok/s, "
            f"adapters {current.resident_adapters} resident / {current.adapter_loads} loads / "
            f"{current.adapter_evictions} evictions / {current.host_adapters} in host memory"
            + (f", slowest load {1000 * slowest_load_s:.0f} ms" if slowest_load_s else "")
            + (f", {current.swaps_waiting} held by the swap cap" if current.swaps_waiting else "")
        )


def _hit_rate(previous: Snapshot, current: Snapshot) -> str:
    """Radix hits / lookups over the interval ("n/a" with no lookups in it)."""
    lookups = _increase(previous.lookup_tokens, current.lookup_tokens)
    if lookups == 0:
        return "n/a"
    restarted = current.lookup_tokens < previous.lookup_tokens
    hits = current.hit_tokens if restarted else current.hit_tokens - previous.hit_tokens
    return f"{100.0 * hits / lookups:.1f}%"


def _increase(previous: int, current: int) -> int:
    """A cumulative counter's increase; a counter that went down was restarted from 0."""
    return current if current < previous else current - previous


def request_line(rid: str, adapter: str, prompt_tokens: int, cached_tokens: int,
                 generated_tokens: int, finish: str, ttft_s: float | None, total_s: float,
                 status: int | None = None) -> str:
    """One finished (or aborted, or failed: with its HTTP status) request, by its counts and
    times only."""
    ttft = "-" if ttft_s is None else f"{1000.0 * ttft_s:.1f}ms"
    line = (
        f"request {rid} adapter={adapter} prompt={prompt_tokens} cached={cached_tokens} "
        f"generated={generated_tokens} finish={finish} ttft={ttft} total={1000.0 * total_s:.1f}ms"
    )
    return line if status is None else f"{line} status={status}"
