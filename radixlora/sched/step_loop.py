"""The one in-flight step loop: plan step N+1 from the Scheduler while step N runs, fold the
results in the order the steps were planned. The offline Engine runs it against a StepExecutor
in its own process; the scheduler process runs it against the worker over ZeroMQ."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from radixlora.sched.request import Req
from radixlora.sched.scheduler import BatchPlan, Scheduler
from radixlora.step_plan import StepMasks, StepPlan, StepResult, StepTotals, bytes_to_ids
from radixlora.structured import next_token_words


@dataclass
class Folded:
    """One step's results, folded in: requests that got a token (finished ones have a
    finish_reason), or, for a step that did not run, why."""

    plan: BatchPlan
    sampled: list[Req] = field(default_factory=list)
    error: str | None = None
    failed_adapters: dict[str, str] = field(default_factory=dict)
    invalid_adapters: list[str] = field(default_factory=list)  # StepResult.invalid_adapters
    masks: StepMasks | None = None  # the next step's late masks, for the worker

    @property
    def finished(self) -> list[Req]:
        return [r for r in self.sampled if r.finish_reason is not None]


RECENT_STEPS = 8192  # steps kept for /get_server_info's recent_steps (a few minutes of load)


class StepLoop:
    """With overlap scheduling up to two steps are in flight (the one running, the one planned
    behind it); without it, one."""

    def __init__(self, scheduler: Scheduler, overlap: bool):
        self.scheduler = scheduler
        self.max_in_flight = 2 if overlap else 1
        self.in_flight: deque[tuple[StepPlan, BatchPlan, float]] = deque()  # oldest first
        self.num_steps = 0
        self.num_overlapped = 0  # steps planned while the previous one was still running
        self.totals = {"decode": StepTotals(), "mixed": StepTotals()}
        self._plan_seconds: dict[int, float] = {}  # step -> its planning time, until folded
        self._last_fold = 0.0
        # (fold time.monotonic(), seconds as in `totals`, requests, tokens) of the last
        # RECENT_STEPS steps: a stream's long gaps matched against the steps that ran in them
        self.recent: deque[tuple[float, float, int, int]] = deque(maxlen=RECENT_STEPS)

    def can_plan(self) -> bool:
        sched = self.scheduler
        return len(self.in_flight) < self.max_in_flight and bool(sched.waiting or sched.running)

    def next_plan(self) -> StepPlan | None:
        """Plan the next step if the pipeline has room and there is work to plan."""
        if not self.can_plan():
            return None
        started = time.monotonic()
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        self.num_steps += 1
        self.num_overlapped += bool(self.in_flight)
        plan = batch.to_step_plan(self.num_steps)
        now = time.monotonic()
        self._plan_seconds[plan.step] = now - started
        self.in_flight.append((plan, batch, now))
        return plan

    def oldest_step_age(self) -> float:
        return time.monotonic() - self.in_flight[0][2] if self.in_flight else 0.0

    def fold(self, result: StepResult) -> Folded | None:
        """Fold the oldest step's result in; None for a result of any other step (dropped)."""
        self.scheduler.reads.note_host(result.host_added, result.host_dropped)
        if not self.in_flight or result.step != self.in_flight[0][0].step:
            return None
        plan, batch, planned_at = self.in_flight.popleft()
        self._count(plan, batch, planned_at)
        sched = self.scheduler
        sched.reads.note_reads(batch.made_at, result.unread_adapters)
        if result.error is not None or result.failed_adapters:
            sched.discard(batch)
            return Folded(batch, error=result.error, failed_adapters=result.failed_adapters,
                          invalid_adapters=result.invalid_adapters, masks=self._late_masks())
        sampled = [item.req for item in batch.items if item.sample and sched.is_live(item)]
        sched.process_results(batch, bytes_to_ids(result.token_ids).tolist(), result.logprobs,
                              result.top(), result.input_logprobs, result.input_top())
        return Folded(batch, sampled, masks=self._late_masks())

    def _late_masks(self) -> StepMasks | None:
        """The masks of the late_mask items of the step now oldest in flight, whose requests'
        newest tokens were just folded; a request no longer live gets a mask allowing every
        token (its result is dropped)."""
        if not self.in_flight:
            return None
        plan, batch, _ = self.in_flight[0]
        late = [item for item in batch.items if item.late_mask]
        if not late:
            return None
        live = [k for k, item in enumerate(late) if self.scheduler.is_live(item)]
        words = next_token_words([late[k].req.grammar for k in live],
                                 late[0].req.grammar.vocab_size)
        if len(live) < len(late):
            every = np.full((len(late), words.shape[1]), -1, np.int32)
            every[live] = words
            words = every
        return StepMasks(step=plan.step, words=words.tobytes())

    def _count(self, plan: StepPlan, batch: BatchPlan, planned_at: float) -> None:
        """The step's time (from the later of its planning and the previous fold to its fold:
        its device time while the pipeline is full) into the totals and the step costs."""
        now = time.monotonic()
        tokens, requests = len(plan.input_ids) // 4, len(plan.items)  # int32 ids, one per token
        totals = self.totals["decode" if tokens == requests else "mixed"]
        seconds = now - max(self._last_fold, planned_at)
        costs = self.scheduler.step_costs
        if costs is not None:
            costs.observe(batch.context_tokens, batch.decodes, batch.prefill_tokens, seconds)
        self.recent.append((now, seconds, requests, tokens))
        totals.steps += 1
        totals.seconds += seconds
        totals.plan_seconds += self._plan_seconds.pop(plan.step, 0.0)
        totals.tokens += tokens
        totals.requests += requests
        self._last_fold = now
