"""The one in-flight step loop: plan step N+1 from the Scheduler while step N runs, fold the
results in the order the steps were planned. The offline Engine runs it against a StepExecutor
in its own process; the scheduler process runs it against the worker over ZeroMQ."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from radixlora.request import Req
from radixlora.scheduler import BatchPlan, Scheduler
from radixlora.step_plan import StepPlan, StepResult, bytes_to_ids


@dataclass
class Folded:
    """One step's results, folded in: requests that got a token (finished ones have a
    finish_reason), or, for a step that did not run, why."""

    plan: BatchPlan
    sampled: list[Req] = field(default_factory=list)
    error: str | None = None
    failed_adapters: dict[str, str] = field(default_factory=dict)

    @property
    def finished(self) -> list[Req]:
        return [r for r in self.sampled if r.finish_reason is not None]


class StepLoop:
    """With overlap scheduling up to two steps are in flight (the one running, the one planned
    behind it); without it, one."""

    def __init__(self, scheduler: Scheduler, overlap: bool):
        self.scheduler = scheduler
        self.max_in_flight = 2 if overlap else 1
        self.in_flight: deque[tuple[StepPlan, BatchPlan, float]] = deque()  # oldest first
        self.num_steps = 0
        self.num_overlapped = 0  # steps planned while the previous one was still running

    def can_plan(self) -> bool:
        sched = self.scheduler
        return len(self.in_flight) < self.max_in_flight and bool(sched.waiting or sched.running)

    def next_plan(self) -> StepPlan | None:
        """Plan the next step if the pipeline has room and there is work to plan."""
        if not self.can_plan():
            return None
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        self.num_steps += 1
        self.num_overlapped += bool(self.in_flight)
        plan = batch.to_step_plan(self.num_steps)
        self.in_flight.append((plan, batch, time.monotonic()))
        return plan

    def oldest_step_age(self) -> float:
        return time.monotonic() - self.in_flight[0][2] if self.in_flight else 0.0

    def fold(self, result: StepResult) -> Folded | None:
        """Fold the oldest step's result in; None for a result of any other step (dropped)."""
        if not self.in_flight or result.step != self.in_flight[0][0].step:
            return None
        _, batch, _ = self.in_flight.popleft()
        sched = self.scheduler
        sched.note_reads(batch, result.unread_adapters)
        if result.error is not None or result.failed_adapters:
            sched.discard(batch)
            return Folded(batch, error=result.error, failed_adapters=result.failed_adapters)
        sampled = [item.req for item in batch.items if item.sample and sched.is_live(item)]
        sched.process_results(batch, bytes_to_ids(result.token_ids).tolist(), result.logprobs,
                              result.top(), result.input_logprobs)
        return Folded(batch, sampled)
