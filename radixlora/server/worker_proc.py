"""The worker process: owns the ModelRunner (weights, KV pool, adapter pool) and executes the
scheduler's PlanMsgs. Adapters are read from disk by path the first time a plan loads them and
must hash to the adapter id the scheduler validated; otherwise the step does not run and the
scheduler fails only the requests that use that adapter. Read adapters are kept packed in the
adapter pool's host tier (AdapterPool.host, --host-adapter-bytes) for later loads."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from radixlora.config import ModelConfig
from radixlora.errors import AdapterError
from radixlora.lora.adapter import load_adapter
from radixlora.lora.host_cache import PackedAdapter
from radixlora.model_runner import LaunchedStep, ModelRunner
from radixlora.sampling import SamplingParams
from radixlora.scheduler import BatchPlan, ScheduledReq
from radixlora.server.args import ServerArgs
from radixlora.server.ipc import Inbox, Outbox, child_main, send_ready
from radixlora.server.messages import (
    AdapterLoad,
    PlanMsg,
    StepResult,
    WorkerInbox,
    bytes_to_ids,
    ids_to_bytes,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterSetKey:
    key: int


@dataclass
class InFlight:
    """A step the worker launched (or answered at once: `result`)."""

    step: int
    launched: LaunchedStep | None = None
    result: StepResult | None = None
    load_seconds: list[float] = field(default_factory=list)

    def ready(self) -> bool:
        return self.result is not None or self.launched.ready()


@dataclass
class PlannedReq:
    """The part of a Req that ModelRunner reads, rebuilt from a PlanItem."""

    kv_slots: np.ndarray
    params: SamplingParams
    seed: int
    adapter_set: AdapterSetKey


class WorkerService:
    def __init__(self, args: ServerArgs):
        self.config = args.engine_config()
        self.model_cfg = ModelConfig.from_dir(args.model)
        self.runner = ModelRunner(Path(args.model), self.model_cfg, self.config)

    def execute(self, msg: PlanMsg) -> StepResult:
        return self.finish(self.launch(msg))

    def launch(self, msg: PlanMsg) -> InFlight:
        """Queue a step on the device; a step that cannot run is answered at once."""
        started = time.perf_counter()
        loads, failed = self._resolve_loads(msg.adapter_loads)
        if failed:
            self.runner.failed()
            return InFlight(msg.step, result=StepResult(step=msg.step, failed_adapters=failed))
        load_s = (time.perf_counter() - started) / len(loads) if loads else 0.0
        try:
            launched = self.runner.launch(to_batch_plan(msg, loads))
        except Exception as e:
            return self._error(msg.step, e)
        return InFlight(msg.step, launched, load_seconds=[load_s] * len(loads))

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
        return StepResult(
            step=step.step,
            token_ids=ids_to_bytes(out.token_ids),
            logprobs=out.logprobs,
            top_ids=top_ids,
            top_logprobs=top_lp,
            load_seconds=step.load_seconds,
            input_logprobs=out.input_logprobs,
            host_adapters=len(self.runner.adapter_pool.host),
            host_bytes=self.runner.adapter_pool.host.nbytes,
        )

    def _error(self, step: int, e: Exception) -> InFlight:
        """A step that could not be launched: the next one has no tokens to read."""
        log.exception("step %d failed", step)
        self.runner.failed()
        return InFlight(step, result=StepResult(step=step, error=f"{type(e).__name__}: {e}"))

    def _resolve_loads(self, loads: list[AdapterLoad]):
        resolved, failed = [], {}
        for load in loads:
            try:
                resolved.append((self._host_adapter(load), bytes_to_ids(load.rows)))
            except AdapterError as e:
                log.error("adapter %s: %s", load.name, e)
                failed[load.adapter_id] = str(e)
        return resolved, failed

    def _host_adapter(self, load: AdapterLoad) -> PackedAdapter:
        """The adapter from the host tier, else read from its snapshot and checked to hash to
        the id the scheduler validated, then packed into the host tier."""
        pool = self.runner.adapter_pool
        packed = pool.host.get(load.adapter_id)
        if packed is not None:
            return packed
        adapter = load_adapter(load.name, load.path, self.model_cfg, self.config.max_rank)
        if adapter.adapter_id != load.adapter_id:
            raise AdapterError(
                load.name, "its files changed on disk after validation (content hash differs)"
            )
        return pool.host.put(pool.pack(adapter))


def to_batch_plan(msg: PlanMsg, loads: list[tuple[PackedAdapter, np.ndarray]]) -> BatchPlan:
    items = [
        ScheduledReq(
            PlannedReq(
                kv_slots=bytes_to_ids(item.kv_slots),
                params=item.params,
                seed=item.seed,
                adapter_set=AdapterSetKey(item.lora_key),
            ),
            extend_ids=bytes_to_ids(item.extend_ids),
            start=item.start,
            sample=item.sample,
            out_index=item.out_index,
            score_from=item.score_from,
            score_ids=None if item.score_ids is None else bytes_to_ids(item.score_ids),
        )
        for item in msg.items
    ]
    lora_rows = {
        i: {g: (r.rows, r.scales) for g, r in groups.items()}
        for i, groups in enumerate(msg.lora_rows)
    }
    return BatchPlan(items, adapter_loads=loads, lora_rows=lora_rows)


def run(args: ServerArgs, ctx: zmq.Context) -> None:
    service = WorkerService(args)
    inbox = Inbox(ctx, args.endpoints.worker, WorkerInbox)
    to_scheduler = Outbox(ctx, args.endpoints.scheduler)
    send_ready(ctx, args, "worker", {"device": str(service.runner.device)})
    serve(service, inbox, to_scheduler)


def serve(service: WorkerService, inbox: Inbox, to_scheduler: Outbox) -> None:
    """Launch each plan as soon as it arrives, behind the step still running on the device,
    and answer steps in order as they complete: the scheduler plans step N+1 (with placeholders
    for step N's tokens) while step N runs, so the device never waits for the host."""
    in_flight: deque[InFlight] = deque()
    while True:
        if not in_flight:
            in_flight.append(service.launch(inbox.recv()))
        for msg in inbox.recv_nowait():
            in_flight.append(service.launch(msg))
        if in_flight[0].ready() or len(in_flight) > 1:
            to_scheduler.send(service.finish(in_flight.popleft()))


if __name__ == "__main__":
    child_main("worker", run)
