"""The scheduler process: owns the Scheduler (waiting queue, KV pages, radix tree, adapter
residency) and turns each BatchPlan into a PlanMsg for the worker. With overlap scheduling (the
default) step N+1 is planned and sent while the worker runs step N, its decode inputs being
placeholders for step N's tokens; step N's results are folded in while step N+1 runs. Without
it, each step's results are folded in before the next step is planned."""

from __future__ import annotations

import logging
import math
import random
import time
from collections import deque
from pathlib import Path

import zmq

from radixlora.adapters import AdapterRegistry
from radixlora.config import ModelConfig
from radixlora.errors import AdapterError, AdapterNotFoundError, InvalidRequestError
from radixlora.lora.pool import AdapterPool
from radixlora.model.loader import base_version
from radixlora.request import (
    AdapterSet,
    Req,
    ReqStatus,
    build_requests,
    cache_namespace,
    check_logprob_start,
)
from radixlora.scheduler import BatchPlan, Scheduler
from radixlora.server.adapter_lifecycle import AdapterLifecycle
from radixlora.server.adapter_store import AdapterStore
from radixlora.server.args import ServerArgs
from radixlora.server.ipc import Inbox, Outbox, check_local, child_main, send_ready
from radixlora.server.messages import (
    AbortReq,
    AdapterEvent,
    AdapterLoad,
    AdminReq,
    Codec,
    GroupRows,
    InfoQuery,
    InfoReply,
    PlanItem,
    PlanMsg,
    ReqError,
    SchedulerInbox,
    SchedulerStats,
    StepResult,
    TokenBatch,
    TokenizedReq,
    TokenOut,
    bytes_to_ids,
    ids_to_bytes,
)
from radixlora.token_bucket import TokenBucket

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5
IDLE_POLL_MS = 100


class SchedulerService:
    """The process's logic without sockets: requests in, plans out, results in, tokens out."""

    def __init__(self, args: ServerArgs):
        self.config = args.engine_config()
        self.model_cfg = ModelConfig.from_dir(args.model)
        self.base_version = base_version(Path(args.model))
        self.scheduler = Scheduler(self.config, max_context=self.model_cfg.max_position)
        if args.max_swaps_per_s > 0:
            self.scheduler.swap_bucket = TokenBucket(args.max_swaps_per_s,
                                                     max(1, math.ceil(args.max_swaps_per_s)))
        self.adapters = AdapterRegistry(self.model_cfg, self.config.max_rank,
                                        self.config.max_stacked, self.config.adapter_rows,
                                        keep_weights=False)
        self.row_bytes = AdapterPool.bytes_per_row(self.model_cfg,
                                                   self.config.torch_dtype(self.model_cfg))
        for name, path in args.adapters.items():
            self.adapters.load(name, path)
        self.policy = args.adapter_failure_policy
        store = AdapterStore(Path(args.state_dir) / "adapters") if args.state_dir else None
        self.lifecycle = AdapterLifecycle(self.adapters, self.scheduler, store, self.model_cfg,
                                          self.config.max_rank, self._in_use)
        self.num_loads = 0
        self.load_seconds: list[float] = []
        self.rng = random.Random(self.config.seed)
        self.fallbacks: dict[str, str] = {}  # rid -> why it is served base-only
        self.reqs: dict[str, list[Req]] = {}
        self.owner: dict[Req, tuple[str, int]] = {}
        self.in_flight: deque[tuple[PlanMsg, BatchPlan, float]] = deque()  # oldest first
        self.max_in_flight = 2 if self.config.overlap_schedule else 1
        self.num_steps = 0
        self.num_overlapped = 0  # steps planned while the previous one was still running
        self.host_tier = (0, 0)  # (adapters, bytes) in the worker's host tier, last reported

    # ---- intake ------------------------------------------------------------------------------

    def add(self, msg: TokenizedReq) -> ReqError | None:
        if msg.rid in self.reqs:
            return ReqError(rid=msg.rid, message=f"request id {msg.rid!r} is already in use",
                            param="rid", code="duplicate_request_id", status=409)
        try:
            group = self._make_reqs(msg)
            for req in group:
                self.scheduler.check_admissible(req)
        except InvalidRequestError as e:
            return ReqError(rid=msg.rid, message=e.message, code=e.code, param=e.param)
        except AdapterError as e:
            status = 404 if isinstance(e, AdapterNotFoundError) else 400
            return ReqError(rid=msg.rid, message=str(e), code=e.code, param="model", status=status)
        self.reqs[msg.rid] = group
        for index, req in enumerate(group):
            self.owner[req] = (msg.rid, index)
            self.scheduler.add(req)
        return None

    def _make_reqs(self, msg: TokenizedReq) -> list[Req]:
        params = msg.params
        params.validate(self.model_cfg.vocab_size)
        choices = [(c.name, c.weight) for c in msg.adapters] if msg.adapters else None
        adapter_set, fallback = self._resolve(choices)
        namespace = cache_namespace(self.base_version, adapter_set, None)
        base_seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        ids = bytes_to_ids(msg.input_ids)
        check_logprob_start(msg.logprob_start, len(ids))
        reqs = build_requests(msg.rid, ids, params, adapter_set,
                              namespace, base_seed, frozenset(self.model_cfg.eos_token_ids),
                              share_prompt=self.scheduler.tree is not None)
        for req in reqs:
            req.logprob_start = msg.logprob_start
        if fallback:
            self.fallbacks[msg.rid] = fallback
        return reqs

    def _resolve(self, choices) -> tuple[AdapterSet, str]:
        """The adapter set, or with policy "base" and an unknown adapter, base-only and why."""
        try:
            return self.adapters.resolve(choices), ""
        except AdapterNotFoundError as e:
            if self.policy != "base":
                raise
            return AdapterSet(), f"adapter {e.name!r} is not available; served by the base model"

    def abort(self, msg: AbortReq) -> None:
        group = self.reqs.get(msg.rid)
        if group is None:
            log.debug("abort of unknown or finished request %s", msg.rid)
            return
        for index, req in enumerate(group):
            if msg.index is None or msg.index == index:
                self._drop(req)

    def _drop(self, req: Req) -> None:
        if req.status is not ReqStatus.FINISHED:
            self.scheduler.abort(req)
        rid, _ = self.owner.pop(req, (None, 0))
        group = self.reqs.get(rid)
        if group is not None and all(r not in self.owner for r in group):
            del self.reqs[rid]
            self.fallbacks.pop(rid, None)
            if self.lifecycle.retired:
                self.lifecycle.sweep()

    def _in_use(self, adapter_id: str) -> bool:
        loading = any(load.adapter_id == adapter_id
                      for msg, _, _ in self.in_flight for load in msg.adapter_loads)
        return loading or any(a.adapter_id == adapter_id for group in self.reqs.values()
                              for a in group[0].adapter_set.adapters)

    # ---- steps -------------------------------------------------------------------------------

    def can_plan(self) -> bool:
        sched = self.scheduler
        return len(self.in_flight) < self.max_in_flight and bool(sched.waiting or sched.running)

    def next_plan(self) -> PlanMsg | None:
        """Plan the next step if the pipeline has room."""
        if not self.can_plan():
            return None
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        self.num_steps += 1
        self.num_overlapped += bool(self.in_flight)
        msg = plan_to_msg(plan, self.num_steps)
        self.in_flight.append((msg, plan, time.monotonic()))
        return msg

    def oldest_step_age(self) -> float:
        return time.monotonic() - self.in_flight[0][2] if self.in_flight else 0.0

    def on_result(self, result: StepResult) -> tuple[TokenBatch | None, list[ReqError]]:
        if not self.in_flight or result.step != self.in_flight[0][0].step:
            log.warning("dropped a result for step %d, which is not the oldest in flight",
                        result.step)
            return None, []
        _, plan, _ = self.in_flight.popleft()
        if self.lifecycle.retired:
            self.lifecycle.sweep()
        if result.error is not None or result.failed_adapters:
            self.scheduler.discard(plan)
            if result.error is not None:
                return None, self._fail_step(plan, result.error)
            return None, self._fail_adapters(result.failed_adapters)
        top = None
        if result.top_ids is not None:
            top = [list(zip(i, lp)) for i, lp in zip(result.top_ids, result.top_logprobs)]
        self.num_loads += len(plan.adapter_loads)
        self.host_tier = (result.host_adapters, result.host_bytes)
        self.load_seconds += result.load_seconds
        tokens = bytes_to_ids(result.token_ids).tolist()
        sampled = [item.req for item in plan.items if item.sample and self.scheduler.is_live(item)]
        self.scheduler.process_results(plan, tokens, result.logprobs, top, result.input_logprobs)
        outputs = [out for req in sampled if (out := self._token_out(req))]
        return (TokenBatch(outputs=outputs) if outputs else None), []

    def _token_out(self, req: Req) -> TokenOut | None:
        owner = self.owner.get(req)
        if owner is None or req.finish_reason == "abort":
            return None
        fallback = self.fallbacks.get(owner[0])
        top = [req.top_logprobs[-1]] if req.params.logprobs else None
        out = TokenOut(
            rid=owner[0],
            index=owner[1],
            token_ids=ids_to_bytes(req.output_ids[-1:]),
            logprobs=req.output_logprobs[-1:],
            top=top,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=req.cached_tokens,
            fallback=fallback,
        )
        if req.logprob_start is not None and len(req.output_ids) == 1:  # with the first token
            out.input_logprobs = list(req.input_logprobs)
            out.input_ids = ids_to_bytes(req.prompt_ids[req.logprob_start :])
        if req.finish_reason is not None:
            self._drop(req)
        return out

    def _fail_step(self, plan: BatchPlan, reason: str) -> list[ReqError]:
        """The worker could not run the step: its requests fail, nothing else does."""
        log.error("step failed in the worker: %s", reason)
        owners = {self.owner[i.req][0] for i in plan.items if i.req in self.owner}
        return [self._fail(rid, f"the worker failed: {reason}", "worker_error", 500)
                for rid in owners]

    def _fail_adapters(self, failed: dict[str, str]) -> list[ReqError]:
        """Adapters the worker could not load: drop them and fail every request using them."""
        errors = []
        for adapter_id, reason in failed.items():
            names = self.adapters.drop(adapter_id)
            log.error("adapter %s (%s) failed to load and is dropped: %s", names, adapter_id[:12],
                      reason)
            users = [rid for rid, group in self.reqs.items()
                     if any(a.adapter_id == adapter_id for a in group[0].adapter_set.adapters)]
            errors += [self._fail(rid, f"adapter {names} failed to load: {reason}",
                                  "adapter_load_failed", 500) for rid in users]
            self.lifecycle.retire_id(adapter_id)  # its rows and snapshots go once unused
        return errors

    def _fail(self, rid: str, message: str, code: str, status: int) -> ReqError:
        self.abort(AbortReq(rid=rid))
        return ReqError(rid=rid, message=message, code=code, status=status)

    # ---- accounting --------------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        sched = self.scheduler
        tree = sched.tree
        hits = lookups = 0
        if tree is not None:
            for hit, lookup in tree.namespace_stats().values():
                hits, lookups = hits + hit, lookups + lookup
        return SchedulerStats(
            kv_capacity=sched.kv.capacity_tokens,
            kv_used=sched.kv.capacity_tokens - sched.kv.free_tokens(),
            kv_cached=tree.total_size() if tree is not None else 0,
            running=len(sched.running),
            waiting=len(sched.waiting),
            prompt_tokens=lookups,
            cached_tokens=hits,
            adapter_loads=self.num_loads,
            adapter_evictions=sched.residency.num_evictions,
            adapter_load_seconds=self._take_load_seconds(),
            resident_adapters=len(sched.residency.resident),
            resident_bytes=self.row_bytes * sum(len(e.rows)
                                                for e in sched.residency.resident.values()),
            swaps_waiting=sched.num_swap_deferred,
            host_adapters=self.host_tier[0],
            host_bytes=self.host_tier[1],
        )

    def _take_load_seconds(self) -> list[float]:
        out, self.load_seconds = self.load_seconds, []
        return out

    def info(self, flush_cache: bool = False) -> dict:
        sched = self.scheduler
        if flush_cache:
            sched.flush_cache()
        tree = sched.tree
        residency = sched.residency
        return {
            "kv_capacity_tokens": sched.kv.capacity_tokens,
            "kv_free_tokens": sched.kv.free_tokens(),
            "kv_cached_tokens": tree.total_size() if tree is not None else 0,
            "kv_protected_tokens": tree.protected_size() if tree is not None else 0,
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "open_requests": len(self.reqs),
            "steps": self.num_steps,
            "overlapped_steps": self.num_overlapped,
            "retractions": sched.num_retractions,
            "adapter_rows_total": residency.rows.num_rows,
            "adapter_rows_free": residency.rows.num_free(),
            "adapter_refs": {aid: e.refs for aid, e in residency.resident.items()},
            "adapter_pinned": sorted(residency.pinned),
            "adapter_retired": sorted(self.lifecycle.retired),
            "adapter_loads": self.num_loads,
            "adapter_evictions": residency.num_evictions,
            "adapter_event_seq": self.lifecycle.last_seq,
            "adapters": [
                {"name": n, "adapter_id": a.adapter_id, "path": a.path, "rank": a.rank}
                for n, a in self.adapters.by_name.items()
            ],
        }


def plan_to_msg(plan: BatchPlan, step: int) -> PlanMsg:
    keys = list(plan.lora_rows)
    index = {key: i for i, key in enumerate(keys)}
    items = [
        PlanItem(
            rid=item.req.rid,
            extend_ids=ids_to_bytes(item.extend_ids),
            start=item.start,
            kv_slots=ids_to_bytes(item.req.kv_slots[: item.start + len(item.extend_ids)]),
            sample=item.sample,
            params=item.req.params,
            seed=item.req.seed,
            out_index=item.out_index,
            lora_key=index[item.req.adapter_set.key],
            score_from=item.score_from,
            score_ids=None if item.score_ids is None else ids_to_bytes(item.score_ids),
        )
        for item in plan.items
    ]
    loads = [
        AdapterLoad(adapter_id=a.adapter_id, name=a.name, path=a.path, rows=ids_to_bytes(rows))
        for a, rows in plan.adapter_loads
    ]
    lora_rows = [
        {g: GroupRows([int(r) for r in rows], [float(s) for s in scales])
         for g, (rows, scales) in plan.lora_rows[key].items()}
        for key in keys
    ]
    return PlanMsg(step=step, items=items, adapter_loads=loads, lora_rows=lora_rows)


class SchedulerLoop:
    def __init__(self, args: ServerArgs, ctx: zmq.Context, service: SchedulerService):
        self.args = args
        self.service = service
        self.inbox = Inbox(ctx, args.endpoints.scheduler, SchedulerInbox)
        self.to_worker = Outbox(ctx, args.endpoints.worker)
        self.to_tokenizer = Outbox(ctx, args.endpoints.tokenizer)
        self.to_api = Outbox(ctx, args.endpoints.api)
        self.events = subscribe(ctx, args.endpoints.registry) if args.adapter_dir else None
        self.event_codec = Codec(AdapterEvent)
        self.poller = zmq.Poller()
        for sock in (self.inbox.sock, self.events):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)
        self.next_stats = 0.0

    def run(self) -> None:
        stalled = False  # nothing could be planned: wait for a result, a request or the timer
        while True:
            busy = self.service.can_plan() and not stalled
            ready = dict(self.poller.poll(0 if busy else IDLE_POLL_MS))
            if self.events is not None and self.events in ready:
                self.take_events()
            if self.inbox.sock in ready:
                for msg in self.inbox.recv_nowait():
                    self.handle(msg)
            plan = self.service.next_plan()
            if plan is not None:
                self.to_worker.send(plan)
            stalled = plan is None
            self.maybe_send_stats()
            self.check_worker_alive()

    def check_worker_alive(self) -> None:
        """A step that never returns means a hung worker: exit, so the launcher reports it and
        shuts the service down instead of leaving every request waiting forever."""
        service = self.service
        waited = service.oldest_step_age()
        if waited > self.args.step_timeout_s:
            log.error("worker step %d has run %.1f s (limit %.1f s): the worker is hung",
                      service.in_flight[0][0].step, waited, self.args.step_timeout_s)
            raise SystemExit(3)

    def take_events(self) -> None:
        while True:
            try:
                raw = self.events.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = self.event_codec.decode(raw)
            if event is not None:
                self.service.lifecycle.on_event(event)

    def handle(self, msg) -> None:
        service = self.service
        if isinstance(msg, TokenizedReq):
            error = service.add(msg)
            if error is not None:
                self.to_tokenizer.send(error)
        elif isinstance(msg, AbortReq):
            service.abort(msg)
        elif isinstance(msg, StepResult):
            batch, errors = service.on_result(msg)
            for m in ([batch] if batch else []) + errors:
                self.to_tokenizer.send(m)
        elif isinstance(msg, InfoQuery):
            self.to_api.send(InfoReply(qid=msg.qid, info=service.info(msg.flush_cache)))
        elif isinstance(msg, AdminReq):
            self.to_api.send(service.lifecycle.admin(msg))

    def maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now >= self.next_stats:
            self.next_stats = now + STATS_INTERVAL_S
            self.to_api.send(self.service.stats())


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    check_local(endpoint)
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def run(args: ServerArgs, ctx: zmq.Context) -> None:
    service = SchedulerService(args)
    loop = SchedulerLoop(args, ctx, service)
    info = {"adapters": service.info()["adapters"]}
    send_ready(ctx, args, "scheduler", info)
    loop.run()


if __name__ == "__main__":
    child_main("scheduler", run)
