"""A token bucket: `rate` tokens per second, at most `burst` saved up."""

from __future__ import annotations

import math
import time


class TokenBucket:
    def __init__(self, rate: float, burst: int, now: float | None = None):
        if rate < 0 or burst < 1:
            raise ValueError(f"token bucket needs rate >= 0 and burst >= 1, got {rate}, {burst}")
        self.rate = rate  # 0 means unlimited
        self.burst = burst
        self.tokens = float(burst)
        self.stamp = time.monotonic() if now is None else now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def available(self, now: float) -> int:
        if self.rate == 0:
            return 1 << 30
        self._refill(now)
        return math.floor(self.tokens + 1e-9)

    def take(self, now: float, n: int = 1) -> None:
        if self.rate == 0:
            return
        self._refill(now)
        self.tokens -= n

    def wait_s(self, now: float) -> float:
        """Seconds until one token is available."""
        if self.rate == 0:
            return 0.0
        self._refill(now)
        return max(0.0, (1 - self.tokens) / self.rate)
