"""Executes StepPlans on a ModelRunner and answers StepResults: the worker side of the step
loop, shared by the offline Engine (in process) and the worker process (over ZeroMQ).

An adapter load takes the adapter's packed rows from the pool's host tier, else from the
executor's adapter source (the Engine's registered versions; the worker reads the files and
checks they still hash to the version the scheduler validated), packing them into the tier.
A plan whose loads fail does not run: its result names the failed adapters, and the scheduler
fails only the requests that use them."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from radixlora.errors import AdapterError
from radixlora.lora.adapter import LoraAdapter
from radixlora.lora.host_cache import PackedAdapter
from radixlora.model_runner import LaunchedStep, ModelRunner
from radixlora.step_plan import AdapterLoad, StepPlan, StepResult, bytes_to_ids, ids_to_bytes

log = logging.getLogger(__name__)

AdapterSource = Callable[[AdapterLoad], LoraAdapter]


@dataclass
class InFlight:
    """A step launched on the device (or answered at once: `result`)."""

    step: int
    launched: LaunchedStep | None = None
    result: StepResult | None = None
    load_seconds: list[float] = field(default_factory=list)

    def ready(self) -> bool:
        return self.result is not None or self.launched.ready()


class StepExecutor:
    """Steps are launched as they are submitted, each behind the one still running on the
    device, and their results collected in submission order."""

    def __init__(self, runner: ModelRunner, source: AdapterSource):
        self.runner = runner
        self.source = source
        self.in_flight: deque[InFlight] = deque()  # oldest first

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def submit(self, plan: StepPlan) -> None:
        self.in_flight.append(self.launch(plan))

    def collect(self, keep: int, done_too: bool = False) -> list[StepResult]:
        """Results of the oldest steps, in order: of all but the newest `keep` steps, and with
        done_too of any further step that has already completed."""
        results = []
        while self.in_flight and (len(self.in_flight) > keep
                                  or done_too and self.in_flight[0].ready()):
            results.append(self.finish(self.in_flight.popleft()))
        return results

    def launch(self, plan: StepPlan) -> InFlight:
        """Queue a step on the device; a step that cannot run is answered at once."""
        started = time.perf_counter()
        try:
            loads, failed = self._resolve_loads(plan.adapter_loads)
            load_s = (time.perf_counter() - started) / len(loads) if loads else 0.0
            if failed:
                return self.unrun(StepResult(step=plan.step, failed_adapters=failed))
            launched = self.runner.launch(plan, loads)
        except Exception as e:
            log.exception("step %d failed", plan.step)
            return self.unrun(StepResult(step=plan.step, error=f"{type(e).__name__}: {e}"))
        return InFlight(plan.step, launched, load_seconds=[load_s] * len(loads))

    def unrun(self, result: StepResult) -> InFlight:
        """A step answered without running: the next step's placeholders have no tokens."""
        self.runner.failed()
        return InFlight(result.step, result=result)

    def finish(self, step: InFlight) -> StepResult:
        if step.result is not None:
            return step.result
        try:
            out = self.runner.finish(step.launched)
        except Exception as e:  # the step after it was launched already and keeps its inputs
            log.exception("step %d failed", step.step)
            return StepResult(step=step.step, error=f"{type(e).__name__}: {e}")
        top_ids = top_lp = None
        if out.top_logprobs is not None:
            top_ids = [[i for i, _ in row] for row in out.top_logprobs]
            top_lp = [[lp for _, lp in row] for row in out.top_logprobs]
        host = self.runner.adapter_pool.host
        return StepResult(
            step=step.step,
            token_ids=ids_to_bytes(out.token_ids),
            logprobs=out.logprobs,
            top_ids=top_ids,
            top_logprobs=top_lp,
            load_seconds=step.load_seconds,
            input_logprobs=out.input_logprobs,
            host_adapters=len(host),
            host_bytes=host.nbytes,
        )

    def _resolve_loads(self, loads: list[AdapterLoad]):
        resolved, failed = [], {}
        for load in loads:
            try:
                resolved.append((self._packed(load), bytes_to_ids(load.rows)))
            except AdapterError as e:
                log.error("adapter %s: %s", load.name, e)
                failed[load.adapter_id] = str(e)
        return resolved, failed

    def _packed(self, load: AdapterLoad) -> PackedAdapter:
        pool = self.runner.adapter_pool
        packed = pool.host.get(load.adapter_id)
        if packed is not None:
            return packed
        adapter = self.source(load)
        if adapter.adapter_id != load.adapter_id:
            raise AdapterError(
                load.name, "its files changed on disk after validation (content hash differs)"
            )
        return pool.host.put(pool.pack(adapter))
