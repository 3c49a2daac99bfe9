"""Executes StepPlans on a ModelRunner and answers StepResults: the worker side of the step
loop, shared by the offline Engine (in process) and the worker process (over ZeroMQ).

Adapter loads are written into the pool before the step that needs them; where their rows
come from (the host tier, a packed file, a packing process, the adapter's files) and the
prefetch loads that never make a step wait are radixlora.worker.adapter_reader's."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from radixlora.lora.packer import ProcessPacker
from radixlora.step_plan import (
    StepMasks,
    StepPlan,
    StepResult,
    ids_to_bytes,
)
from radixlora.worker.adapter_reader import AdapterReader, AdapterSource
from radixlora.worker.model_runner import AdaptersRefused, LaunchedStep, ModelRunner

log = logging.getLogger(__name__)

@dataclass
class InFlight:
    """A step launched on the device (or answered at once: `result`)."""

    step: int
    launched: LaunchedStep | None = None
    result: StepResult | None = None
    load_seconds: list[float] = field(default_factory=list)

    def ready(self) -> bool:
        return self.result is not None or self.launched.ready()

    def awaiting(self) -> bool:
        """Whether its sampling waits for late masks (StepExecutor.give_masks)."""
        return self.result is None and self.launched.awaiting is not None


class StepExecutor:
    """Steps are launched as they are submitted, each behind the one still running on the
    device, and their results collected in submission order."""

    def __init__(self, runner: ModelRunner, source: AdapterSource,
                 snapshot_roots: tuple[Path, ...] = (), packer: ProcessPacker | None = None):
        """snapshot_roots: the server's snapshot stores, whose adapters' packed files are
        read (radixlora.server.procs.adapter_store.snapshot_roots); packer: packs the other
        adapters in processes (else `source` is read and packed here)."""
        self.runner = runner
        self.in_flight: deque[InFlight] = deque()  # oldest first
        self.reader = AdapterReader(runner, source, snapshot_roots, packer)

    def execute(self, plan: StepPlan) -> StepResult:
        if any(i.late_mask for i in plan.items):
            raise ValueError("a plan with late masks cannot be executed at once")
        return self.finish(self.launch(plan))

    def submit(self, plan: StepPlan) -> None:
        self.in_flight.append(self.launch(plan))

    def collect(self, keep: int, done_too: bool = False) -> list[StepResult]:
        """Results of the oldest steps, in order: of all but the newest `keep` steps, and with
        done_too of any further step that has already completed; never past a step that
        waits for its late masks."""
        results = []
        while self.in_flight and not self.in_flight[0].awaiting() and (
                len(self.in_flight) > keep or done_too and self.in_flight[0].ready()):
            results.append(self.finish(self.in_flight.popleft()))
        return results

    def give_masks(self, msg: StepMasks) -> None:
        """Sample the step that waits for these late masks; masks for a step that waits for
        none (it failed at launch) are dropped."""
        flight = next((f for f in self.in_flight if f.step == msg.step and f.awaiting()), None)
        if flight is None:
            log.debug("late masks for step %d, which waits for none", msg.step)
            return
        try:
            self.runner.sample_late(flight.launched, msg.words)
        except Exception as e:
            if self.runner.tp is not None:  # the ranks are out of step: end this one
                raise
            log.exception("step %d failed", msg.step)
            self.runner.failed()
            flight.result = StepResult(step=msg.step, error=f"{type(e).__name__}: {e}",
                                       unread_adapters=self.reader.unread())

    def launch(self, plan: StepPlan) -> InFlight:
        """Queue a step on the device; a step that cannot run is answered at once (so is one
        that arrives while an earlier step still waits for its late masks: its placeholders
        would read tokens not sampled yet)."""
        started = time.perf_counter()
        ready = []
        if any(f.awaiting() for f in self.in_flight):
            return self.unrun(StepResult(step=plan.step, error="a plan arrived before the "
                                         "late masks of the step before it"))
        try:
            self.reader.warm(plan.host_reads)
            prefetch = self.reader.claim(plan)
            loads, failed = self.reader.resolve(plan.adapter_loads)
            owed, owed_failed = self.reader.settle_owed(plan)
            loads += owed
            failed.update(owed_failed)
            load_s = (time.perf_counter() - started) / len(loads) if loads else 0.0
            ready = self.reader.ready_prefetch(prefetch)
            elsewhere = self._failed_elsewhere(plan, failed)
            if failed or elsewhere:
                self.runner.adapter_pool.write_all(loads)
                return self.unrun(StepResult(step=plan.step, failed_adapters=failed,
                                             error=elsewhere))
            launched = self.runner.launch(plan, loads)
        except AdaptersRefused as e:
            return self.unrun(StepResult(step=plan.step, failed_adapters=e.reasons,
                                         invalid_adapters=list(e.reasons)))
        except Exception as e:
            if self.runner.tp is not None:  # the ranks are out of step: end this one
                raise
            log.exception("step %d failed", plan.step)
            return self.unrun(StepResult(step=plan.step, error=f"{type(e).__name__}: {e}"))
        finally:  # the scheduler counts them resident whether the step runs or not
            self.runner.adapter_pool.prefetch(ready)  # behind the step's loads and event
        return InFlight(plan.step, launched, load_seconds=[load_s] * len(loads))

    def _failed_elsewhere(self, plan: StepPlan, failed: dict[str, str]) -> str | None:
        """Tensor parallel: a step runs on every rank or on none (one running it alone would
        wait in its collectives for the others). Adapter reads are what can fail on one rank
        alone, so before a step that loads or reads adapter rows the ranks agree (one small
        all-reduce); the reason when another rank's load failed and this one's did not."""
        tp = self.runner.tp
        if tp is None or not (plan.adapter_loads or any(plan.adapter_sets)):
            return None
        if not tp.any_rank(bool(failed)) or failed:
            return None
        return "an adapter failed to load on another tensor-parallel rank"

    def unrun(self, result: StepResult) -> InFlight:
        """A step answered without running: the next step's placeholders have no tokens."""
        self.runner.failed()
        result.unread_adapters = self.reader.unread()
        return InFlight(result.step, result=result)

    def finish(self, step: InFlight) -> StepResult:
        if step.result is not None:
            return step.result
        try:
            out = self.runner.finish(step.launched)
        except Exception as e:  # the step after it was launched already and keeps its inputs
            log.exception("step %d failed", step.step)
            added, dropped = self.runner.adapter_pool.host.drain_changes()
            return StepResult(step=step.step, error=f"{type(e).__name__}: {e}",
                              unread_adapters=self.reader.unread(), host_added=added,
                              host_dropped=dropped)
        top_ids = top_lp = None
        if out.top_logprobs is not None:
            top_ids = [[i for i, _ in row] for row in out.top_logprobs]
            top_lp = [[lp for _, lp in row] for row in out.top_logprobs]
        input_top_ids = input_top_lp = None
        if out.input_top is not None:
            input_top_ids = [[[i for i, _ in row] for row in rows] for rows in out.input_top]
            input_top_lp = [[[lp for _, lp in row] for row in rows] for rows in out.input_top]
        host = self.runner.adapter_pool.host
        added, dropped = host.drain_changes()
        return StepResult(
            step=step.step,
            token_ids=ids_to_bytes(out.token_ids),
            logprobs=out.logprobs,
            top_ids=top_ids,
            top_logprobs=top_lp,
            load_seconds=step.load_seconds,
            input_logprobs=out.input_logprobs,
            input_top_ids=input_top_ids,
            input_top_logprobs=input_top_lp,
            host_adapters=len(host),
            host_bytes=host.nbytes,
            unread_adapters=self.reader.unread(),
            host_added=added,
            host_dropped=dropped,
        )

