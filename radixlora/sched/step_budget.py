"""The step budget: while streams decode, every step is one inter-token gap of each of them, so a
step's prefill tokens are capped to keep the step within --itl-target-ms; with no stream decoding,
prefill takes the whole --max-batch-tokens (big chunks, the fastest way through a prompt).

The cap comes from the steps the loop has measured, never from constants: a step's seconds are
fitted as base + per_context * context tokens + per_decode * decoding requests + per_prefill *
prefill tokens (least squares over the last WINDOW steps; context tokens are the KV the batch's
attention reads). Until MIN_STEPS steps are in, or while the fit says nothing about prefill cost,
nothing is capped."""

from __future__ import annotations

from collections import deque

import numpy as np

WINDOW = 512  # steps the fit is taken over
MIN_STEPS = 32
# a step's prefill floor while streams decode: a prompt always moves, however tight the target
MIN_PREFILL = 256


class StepCosts:
    """Measured steps and the linear cost model fitted to them."""

    def __init__(self, window: int = WINDOW):
        self.samples: deque[tuple[float, float, float, float, float]] = deque(maxlen=window)
        self._coef: np.ndarray | None = None
        self._fitted = True  # nothing new since the last fit

    def observe(self, context: int, decodes: int, prefill: int, seconds: float) -> None:
        self.samples.append((1.0, context, decodes, prefill, seconds))
        self._fitted = False

    def coefficients(self) -> np.ndarray | None:
        """(base, per_context, per_decode, per_prefill) seconds, or None while the steps seen
        do not pin the cost of a prefill token (too few, or prefill never varied)."""
        if not self._fitted:
            self._fitted, self._coef = True, self._fit()
        return self._coef

    def _fit(self) -> np.ndarray | None:
        if len(self.samples) < MIN_STEPS:
            return None
        data = np.asarray(self.samples)
        features, seconds = data[:, :4], data[:, 4]
        if np.ptp(features[:, 3]) == 0:
            return None
        coef, *_ = np.linalg.lstsq(features, seconds, rcond=None)
        return coef if coef[3] > 0 else None

    def prefill_budget(self, context: int, decodes: int, target_s: float, ceiling: int) -> int:
        """Prefill tokens a step beside `decodes` decoding requests reading `context` KV tokens
        may take to last at most target_s: within [MIN_PREFILL, ceiling]."""
        coef = self.coefficients()
        if coef is None:
            return ceiling
        base, per_context, per_decode, per_prefill = coef
        room = target_s - base - per_context * context - per_decode * decodes
        return int(min(ceiling, max(MIN_PREFILL, room / per_prefill)))
