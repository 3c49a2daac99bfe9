"""A token bucket: `rate` tokens per second, at most `burst` saved up; the swap cap built on it."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


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
        return math.floor(self.level(now) + 1e-9)

    def level(self, now: float) -> float:
        """The tokens saved up now (fractional; negative after taking more than there were)."""
        if self.rate == 0:
            return float(1 << 30)
        self._refill(now)
        return self.tokens

    def take(self, now: float, n: float = 1) -> None:
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


class SwapCap:
    """The hard cap on adapter loads into the device pool: `rate` full-size swaps per second
    (at most `rate`, at least one, saved up), loads over it wait in the queue. A load costs
    `cost(adapter)` swaps: the bytes it moves over the host link over those of a full-size
    adapter (the largest allowed rank on every module group), so that a storm of large loads is
    held to `rate` per second while small adapters, which move a fraction of the bytes, pass
    proportionally more often."""

    def __init__(self, rate: float, cost: Callable[[object], float], burst: int | None = None):
        self.bucket = TokenBucket(rate, burst or max(1, math.ceil(rate)))
        self.cost = cost

    def allows(self, cost: float) -> bool:
        """Whether loads of `cost` swaps may start now (a cost above the burst waits only for a
        full bucket, so it cannot starve)."""
        return self.bucket.level(time.monotonic()) + 1e-9 >= min(cost, self.bucket.burst)

    def take(self, cost: float) -> None:
        self.bucket.take(time.monotonic(), cost)
