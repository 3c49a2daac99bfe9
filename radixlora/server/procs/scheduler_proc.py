"""The scheduler process: owns the Scheduler (waiting queue, KV pages, radix tree, adapter
residency) and drives the StepLoop against the worker: each step's StepPlan goes to the worker
over ZeroMQ and its StepResult comes back. With overlap scheduling (the default) step N+1 is
planned and sent while the worker runs step N, its decode inputs being placeholders for step
N's tokens; step N's results are folded in while step N+1 runs."""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import zmq

from radixlora.errors import AdapterError, AdapterNotFoundError, InvalidRequestError
from radixlora.lora.layout import bytes_per_row, load_bytes, pool_layouts
from radixlora.lora.registration import HashCache
from radixlora.model.checkpoint_files import base_version
from radixlora.sched.adapter_registry import AdapterRegistry
from radixlora.sched.grammar_compiler import GrammarCompiler
from radixlora.sched.intake import Intake
from radixlora.sched.prompt_limits import check_prompt_ids
from radixlora.sched.request import Req, ReqStatus
from radixlora.sched.scheduler import NON_FINITE_LOGITS, BatchPlan, Scheduler
from radixlora.sched.step_loop import StepLoop
from radixlora.sched.token_bucket import SwapCap
from radixlora.server.args import ServerArgs
from radixlora.server.ipc import (
    Heartbeats,
    Inbox,
    Outbox,
    child_main,
    failure_error,
    log_failure,
    send_ready,
    serve_forever,
    subscribe,
)
from radixlora.server.messages import (
    AbortReq,
    AdapterEvent,
    AdapterWanted,
    AdminReply,
    AdminReq,
    Codec,
    InfoQuery,
    InfoReply,
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
from radixlora.server.procs.adapter_lifecycle import AdapterLifecycle
from radixlora.server.procs.adapter_store import SNAPSHOTS, AdapterStore, pack_target
from radixlora.step_plan import AdapterLoad, StepMasks, StepPlan
from radixlora.structured import Matcher

log = logging.getLogger(__spec__.name)  # the module's name also when run with -m

STATS_INTERVAL_S = 0.5
WARM_SCAN_S = 0.5  # how often plans look for registered adapters to read ahead
WARM_PER_PLAN = 256
IDLE_POLL_MS = 100
COMPILE_POLL_MS = 2  # while grammars compile: how soon one that finished is seen
# A turn's work (after its poll) this long held up every result waiting behind it: the
# streams of those steps got their tokens that much later
SLOW_TURN_S = 0.1
MAX_QUEUED_ADMIN = 8  # admin calls waiting for earlier ones (a load's read) before a 429
HOLD_TIMEOUT_S = 60.0  # a request for a listed adapter waits this long for its validation
EXPIRY_CHECK_S = 0.1


class SchedulerService:
    """The process's logic without sockets: requests in, plans out, results in, tokens out."""

    def __init__(self, args: ServerArgs):
        self.model_name = args.model_name
        self.config = args.engine_config()
        self.model_cfg = args.served_model(self.config)
        self.scheduler = Scheduler(self.config, self.config.max_context(self.model_cfg),
                                   self.model_cfg.lora_groups)
        self.pool_dtype = self.config.lora_pool_dtype(self.model_cfg)
        self.row_bytes = bytes_per_row(self.model_cfg, self.pool_dtype)
        if args.max_swaps_per_s > 0:
            self.scheduler.swap_cap = SwapCap(args.max_swaps_per_s, self._swap_cost)
        self.adapters = AdapterRegistry(self.model_cfg, self.config.max_rank,
                                        self.config.max_stacked, self.config.adapter_rows,
                                        keep_weights=False, reserved=frozenset({args.model_name}))
        self.adapters.load_all(args.adapters, cache=HashCache())
        store = None
        if args.state_dir:
            layouts = pool_layouts(self.model_cfg, self.config.lora_pool_dtype(self.model_cfg),
                                   args.tensor_parallel_size)
            state_dir = Path(args.state_dir)
            store = AdapterStore(state_dir / SNAPSHOTS, pack_target(state_dir, layouts))
        self.lifecycle = AdapterLifecycle(self.adapters, self.scheduler, store,
                                          args.served_model(self.config, confined=True),
                                          self.config.max_rank, self._in_use,
                                          allowed_roots=args.allowed_adapter_roots,
                                          start_names=frozenset(args.adapters))
        base = base_version(Path(args.model), self.config.load_format)
        self.intake = Intake(self.model_cfg, base, self.adapters, self.scheduler,
                             self.config.seed,
                             fallback_to_base=args.adapter_failure_policy == "base",
                             grammars=GrammarCompiler.for_model(
                                 args.tokenizer_dir, self.model_cfg, self.config))
        self.loop = StepLoop(self.scheduler, self.config.overlap_schedule)
        self.late_masks: StepMasks | None = None  # from the last fold, for the worker
        self.num_loads = 0
        self.num_load_failures = 0
        self.sent_names: list[str] | None = None  # registered names in the last stats sent
        self.load_seconds: list[float] = []
        self.fallbacks: dict[str, str] = {}  # rid -> why it is served base-only
        self.reqs: dict[str, list[Req]] = {}
        self.owner: dict[Req, tuple[str, int]] = {}
        self.host_tier = (0, 0)  # (adapters, bytes) in the worker's host tier, last reported
        self.warm_sent: set[str] = set()  # adapter ids sent as host_reads
        self.warm_bytes = 0  # their packed bytes
        self.warm_scan_at = 0.0
        # requests for --adapter-dir names listed but not validated yet, by name, with the
        # time they give up; and the names to ask the registry for (AdapterWanted)
        self.held: dict[str, list[tuple[TokenizedReq, float]]] = {}
        self.held_rids: set[str] = set()
        self.wanted: list[str] = []
        # requests waiting for their grammar: rid -> (request, the compile's future)
        self.compiling: dict[str, tuple[TokenizedReq, Future]] = {}

    def _not_served(self, e: AdapterNotFoundError, listed: int = 20) -> str:
        """What a request for an unknown name gets told: what is served instead."""
        names = sorted(self.adapters.by_name)
        shown = ", ".join(names[:listed]) + (f" and {len(names) - listed} more"
                                             if len(names) > listed else "")
        rejected = self.lifecycle.rejected.get(e.name)
        why = f"; it was rejected: {rejected}" if rejected else ""
        return (f"{e.name!r} is neither the base model {self.model_name!r} nor a served "
                f"adapter{why} (adapters: {shown or 'none'}; GET /v1/models lists them)")

    def _swap_cost(self, adapter) -> float:
        """Full-size swaps one load of `adapter` is (SwapCap): its packed bytes over those of an
        adapter of the largest allowed rank on every module group."""
        load = load_bytes(self.model_cfg, self.pool_dtype, adapter.group_ranks)
        return load / (self.config.max_rank * self.row_bytes)

    # ---- intake ------------------------------------------------------------------------------

    def add(self, msg: TokenizedReq, grammar: Matcher | None = None) -> ReqError | None:
        """Queue a request; one with a grammar waits in `compiling` for it first (its compile
        runs on the compiler's threads, never on this loop)."""
        if msg.rid in self.reqs or msg.rid in self.held_rids or (
                grammar is None and msg.rid in self.compiling):
            return ReqError(rid=msg.rid, message=f"request id {msg.rid!r} is already in use",
                            param="rid", code="duplicate_request_id", status=409)
        try:
            if msg.params.structure is not None and grammar is None:
                self.compiling[msg.rid] = (msg, self.intake.submit(msg.params.structure))
                return None
            group, fallback = self.intake.requests(msg.rid, bytes_to_ids(msg.input_ids),
                                                   msg.params, msg.adapters, msg.logprob_start,
                                                   grammar=grammar)
        except InvalidRequestError as e:
            return ReqError(rid=msg.rid, message=e.message, code=e.code, param=e.param)
        except AdapterNotFoundError as e:
            if e.name in self.lifecycle.listed:
                return self._hold(msg, e.name)
            return ReqError(rid=msg.rid, message=self._not_served(e), code=e.code,
                            param=msg.adapter_param, status=404)
        except AdapterError as e:
            return ReqError(rid=msg.rid, message=str(e), code=e.code, param=msg.adapter_param,
                            status=400)
        if fallback:
            self.fallbacks[msg.rid] = fallback
        self.reqs[msg.rid] = group
        for index, req in enumerate(group):
            self.owner[req] = (msg.rid, index)
            self.scheduler.add(req)
        return None

    def take_compiled(self) -> list[ReqError]:
        """Queue the requests whose grammar compiled; answer those whose grammar did not."""
        errors = []
        for rid, (msg, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[rid]
            failed = future.exception()  # the compiler raises InvalidRequestErrors only
            error = (self.add(msg, grammar=future.result()) if failed is None else
                     ReqError(rid=rid, message=failed.message, code=failed.code,
                              param=failed.param))
            if error is not None:
                errors.append(error)
        return errors

    def _hold(self, msg: TokenizedReq, name: str) -> None:
        """Hold a request for a listed adapter until the registry's outcome for it; the
        registry is asked to examine that adapter next."""
        if name not in self.held:
            self.wanted.append(name)
        self.held.setdefault(name, []).append((msg, time.monotonic() + HOLD_TIMEOUT_S))
        self.held_rids.add(msg.rid)

    def on_adapter_event(self, event: AdapterEvent) -> list[ReqError]:
        """Apply a registry event; the requests held for its adapter are added now (or
        answered: it was rejected or removed)."""
        self.lifecycle.on_event(event)
        if event.kind == "listed":  # a restarted registry: ask it again
            self.wanted.extend(n for n in self.held if n in self.lifecycle.listed)
        if event.name in self.lifecycle.listed:
            return []
        errors = []
        for msg, _ in self.held.pop(event.name, []):
            self.held_rids.discard(msg.rid)
            error = self.add(msg)
            if error is not None:
                errors.append(error)
        return errors

    def expire_held(self, now: float) -> list[ReqError]:
        """Fail the held requests whose adapter is still not validated after HOLD_TIMEOUT_S."""
        errors = []
        for name, waiting in list(self.held.items()):
            for msg, deadline in [w for w in waiting if w[1] <= now]:
                waiting.remove((msg, deadline))
                self.held_rids.discard(msg.rid)
                errors.append(ReqError(
                    rid=msg.rid, code="adapter_not_ready", param=msg.adapter_param,
                    status=503, message=f"adapter {name!r} is listed but still not validated "
                                        f"after {HOLD_TIMEOUT_S:g} s; retry later"))
            if not waiting:
                del self.held[name]
        return errors

    def take_wanted(self) -> list[str]:
        wanted, self.wanted = self.wanted, []
        return wanted

    def abort(self, msg: AbortReq) -> None:
        if self.compiling.pop(msg.rid, None) is not None:
            return
        if msg.rid in self.held_rids:
            self._unhold(msg.rid)
            return
        group = self.reqs.get(msg.rid)
        if group is None:
            log.debug("abort of unknown or finished request %s", msg.rid)
            return
        for index, req in enumerate(group):
            if msg.index is None or msg.index == index:
                self._drop(req)

    def _unhold(self, rid: str) -> None:
        self.held_rids.discard(rid)
        for name, waiting in list(self.held.items()):
            waiting[:] = [w for w in waiting if w[0].rid != rid]
            if not waiting:
                del self.held[name]

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
                      for plan, _, _ in self.loop.in_flight for load in plan.adapter_loads)
        return loading or any(a.adapter_id == adapter_id for group in self.reqs.values()
                              for a in group[0].adapter_set.adapters)

    # ---- steps -------------------------------------------------------------------------------

    def next_plan(self) -> StepPlan | None:
        plan = self.loop.next_plan()
        if plan is not None and time.monotonic() >= self.warm_scan_at:
            plan.host_reads = self._host_reads()
        return plan

    def _host_reads(self) -> list[AdapterLoad]:
        """Registered adapters not sent for reading into the worker's host tier yet, in
        registration order, while their packed bytes fit its budget (StepPlan.host_reads): with
        every adapter in host memory, a load into the pool is one host-to-device copy."""
        self.warm_scan_at = time.monotonic() + WARM_SCAN_S
        budget = self.config.host_adapter_bytes or 0
        dtype = self.config.lora_pool_dtype(self.model_cfg)
        reads = []
        for adapter in self.adapters.by_name.values():
            if len(reads) >= WARM_PER_PLAN:
                break
            if adapter.adapter_id in self.warm_sent:
                continue
            size = load_bytes(self.model_cfg, dtype, adapter.group_ranks)
            if self.warm_bytes + size > budget:
                break
            self.warm_sent.add(adapter.adapter_id)
            self.warm_bytes += size
            reads.append(AdapterLoad(adapter_id=adapter.adapter_id, name=adapter.name,
                                     path=adapter.path, rows=b""))
        return reads

    def on_result(self, result: StepResult) -> tuple[TokenBatch | None, list[ReqError]]:
        folded = self.loop.fold(result)
        self.late_masks = None if folded is None else folded.masks
        if folded is None:
            log.warning("dropped a result for step %d, which is not the oldest in flight",
                        result.step)
            return None, []
        if self.lifecycle.retired:
            self.lifecycle.sweep()
        if folded.error is not None:
            return None, self._fail_step(folded.plan, folded.error)
        if folded.failed_adapters:
            return None, self._fail_adapters(folded.failed_adapters, folded.invalid_adapters)
        self.num_loads += len(folded.plan.adapter_loads) + len(folded.plan.prefetch_loads)
        self.host_tier = (result.host_adapters, result.host_bytes)
        self.load_seconds += result.load_seconds
        bad = [req for req in folded.sampled if req.finish_reason == NON_FINITE_LOGITS]
        errors = [self._fail_non_finite(req) for req in bad if req in self.owner]
        outputs = [out for req in folded.sampled
                   if req not in bad and (out := self._token_out(req))]
        return (TokenBatch(outputs=outputs) if outputs else None), errors

    def _fail_non_finite(self, req: Req) -> ReqError:
        label = req.adapter_set.label
        log.error("request %s on %s: non-finite logits", self.owner[req][0], label)
        return self._fail(self.owner[req][0], f"the model's logits for this request are not "
                          f"finite (NaN or infinite) on {label}: its adapter's weights are "
                          "likely at fault", NON_FINITE_LOGITS, 500)

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
        if len(req.output_ids) == 1 and req.scheduled_at is not None:
            out.scheduled_at = req.scheduled_at
        if len(req.output_ids) == 1:
            out.base_mismatch = "; ".join(f"{a.name}: {a.base_mismatch}"
                                          for a in req.adapter_set.adapters if a.base_mismatch)
        if req.logprob_start is not None and len(req.output_ids) == 1:  # with the first token
            out.input_logprobs = list(req.input_logprobs)
            out.input_ids = ids_to_bytes(req.prompt_ids[req.logprob_start :])
            out.input_top = list(req.input_top)
        if req.finish_reason is not None:
            self._drop(req)
        return out

    def _fail_step(self, plan: BatchPlan, reason: str) -> list[ReqError]:
        """The worker could not run the step: its requests fail, nothing else does."""
        log.error("step failed in the worker: %s", reason)
        owners = {self.owner[i.req][0] for i in plan.items if i.req in self.owner}
        return [self._fail(rid, f"the worker failed: {reason}", "worker_error", 500)
                for rid in owners]

    def _fail_adapters(self, failed: dict[str, str], invalid: list[str]) -> list[ReqError]:
        """Adapters the worker could not load: drop them and fail every request using them
        (a 400 where the adapter's content is at fault, and its names count as rejected)."""
        errors = []
        self.num_load_failures += len(failed)
        for adapter_id, reason in failed.items():
            names = self.adapters.drop(adapter_id)
            log.error("adapter %s (%s) failed to load and is dropped: %s", names, adapter_id[:12],
                      reason)
            code, status = (("invalid_adapter", 400) if adapter_id in invalid
                            else ("adapter_load_failed", 500))
            if adapter_id in invalid:
                self.lifecycle.rejected.update(dict.fromkeys(names, reason))
            users = [rid for rid, group in self.reqs.items()
                     if any(a.adapter_id == adapter_id for a in group[0].adapter_set.adapters)]
            errors += [self._fail(rid, f"adapter {names} failed to load: {reason}", code, status)
                       for rid in users]
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
            resident_bytes=sum(self._resident_bytes().values()),
            swaps_waiting=sched.num_swap_deferred,
            host_adapters=self.host_tier[0],
            host_bytes=self.host_tier[1],
            adapter_load_failures=self.num_load_failures,
            max_loras=self.config.max_loras,
            running_adapters=adapter_names(sched.running),
            waiting_adapters=adapter_names(sched.waiting),
            running_per_adapter=adapter_counts(sched.running),
            waiting_per_adapter=adapter_counts(sched.waiting),
            resident_rows=self._resident_rows(),
            resident_adapter_bytes=self._resident_bytes(),
            registered=self._changed_names(),
            step_totals=self.loop.totals,
        )

    def _resident_bytes(self) -> dict[str, int]:
        """Device bytes per adapter name: its rows in the groups it adapts (as _resident_rows,
        versions add up)."""
        out: dict[str, int] = {}
        for entry in self.scheduler.residency.resident.values():
            adapter = entry.adapter
            nbytes = load_bytes(self.model_cfg, self.pool_dtype, adapter.group_ranks)
            out[adapter.name] = out.get(adapter.name, 0) + nbytes
        return out

    def _resident_rows(self) -> dict[str, int]:
        """Pool rows per adapter name (versions of one name, an old one still finishing its
        requests, add up)."""
        rows: dict[str, int] = {}
        for entry in self.scheduler.residency.resident.values():
            name = entry.adapter.name
            rows[name] = rows.get(name, 0) + len(entry.rows)
        return rows

    def _changed_names(self) -> list[str] | None:
        """The registered names if they changed since the last stats (the api keeps the last
        list it got: stats travel in order on one socket and none is dropped), else None."""
        names = sorted(self.adapters.by_name)
        if names == self.sent_names:
            return None
        self.sent_names = names
        return names

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
            "steps": self.loop.num_steps,
            "overlapped_steps": self.loop.num_overlapped,
            "recent_steps": [list(step) for step in self.loop.recent],
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
                {"name": n, "adapter_id": a.adapter_id, "path": a.path, "rank": a.rank,
                 "dora": bool(a.dora_groups)}
                for n, a in self.adapters.by_name.items()
            ],
        }


class SchedulerLoop:
    def __init__(self, args: ServerArgs, ctx: zmq.Context, service: SchedulerService):
        self.args = args
        self.service = service
        self.to_worker = Outbox(ctx, args.endpoints.worker)
        self.to_tokenizer = Outbox(ctx, args.endpoints.tokenizer)
        self.to_api = Outbox(ctx, args.endpoints.api)
        self.inbox = Inbox(ctx, args.endpoints.scheduler, SchedulerInbox,
                           reject=self.to_tokenizer.send)
        self.heart = Heartbeats(ctx, args, "scheduler")
        self.events = subscribe(ctx, args.endpoints.registry) if args.adapter_dir else None
        self.to_registry = Outbox(ctx, args.endpoints.registry_wants) if args.adapter_dir else None
        self.event_codec = Codec(AdapterEvent)
        self.poller = zmq.Poller()
        for sock in (self.inbox.sock, self.events):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)
        self.next_stats = 0.0
        self.next_expiry_check = 0.0
        self.stalled = False  # nothing could be planned: wait for a result, a request or the timer
        # admin calls in arrival order, each with its load's read (a future) or None; applied
        # on the loop from the head as their reads end, so the loop never reads an adapter
        self.admin_queue: collections.deque[tuple[AdminReq, Future | None]] = collections.deque()
        self.admin_reads = ThreadPoolExecutor(1, thread_name_prefix="admin-read")

    def turn(self) -> int:
        """Take what came (results, requests, adapter events), plan the next step if one can
        be planned; waits only when nothing could be planned last turn."""
        busy = self.service.loop.can_plan() and not self.stalled
        idle_ms = COMPILE_POLL_MS if self.service.compiling else IDLE_POLL_MS
        ready = dict(self.poller.poll(0 if busy else idle_ms))
        started, received = time.perf_counter(), 0
        if self.events is not None and self.events in ready:
            self.take_events()
        if self.inbox.sock in ready:
            for msg in self.inbox.recv_nowait():
                self.handle(msg)
                received += 1
        if self.admin_queue:
            self.apply_admin()
        if self.service.held or self.service.wanted:
            self.tend_held()
        if self.service.compiling:
            for error in self.service.take_compiled():
                self.to_tokenizer.send(error)
        planning = time.perf_counter()
        plan = self.service.next_plan()
        if plan is not None:
            self.to_worker.send(plan)
        self.stalled = plan is None
        self.maybe_send_stats()
        self.check_worker_alive()
        ended = time.perf_counter()
        if ended - started >= SLOW_TURN_S:
            log.warning("a scheduler turn took %.0f ms (%d messages taken in %.0f ms, the "
                        "next step planned in %.0f ms)", (ended - started) * 1e3, received,
                        (planning - started) * 1e3, (ended - planning) * 1e3)
        return self.service.loop.num_steps

    def check_worker_alive(self) -> None:
        """A step that never returns means a hung worker: exit, so the launcher reports it and
        shuts the service down instead of leaving every request waiting forever."""
        loop = self.service.loop
        waited = loop.oldest_step_age()
        if waited > self.args.step_timeout_s:
            log.error("worker step %d has run %.1f s (limit %.1f s): the worker is hung",
                      loop.in_flight[0][0].step, waited, self.args.step_timeout_s)
            raise SystemExit(3)

    def take_events(self) -> None:
        while True:
            try:
                raw = self.events.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = self.event_codec.decode(raw)
            if event is None:
                continue
            try:
                for error in self.service.on_adapter_event(event):
                    self.to_tokenizer.send(error)
            except Exception:  # noqa: BLE001 - one adapter event never stops the scheduler
                log_failure("scheduler", event)

    def tend_held(self) -> None:
        """Ask the registry for the adapters held requests wait for; fail those waiting too
        long."""
        for name in self.service.take_wanted():
            try:
                self.to_registry.send(AdapterWanted(name=name), zmq.NOBLOCK)
            except zmq.Again:  # the registry is down: its requests wait or expire
                log.warning("the registry did not take the request for adapter %r", name)
        now = time.monotonic()
        if now >= self.next_expiry_check:
            self.next_expiry_check = now + EXPIRY_CHECK_S
            for error in self.service.expire_held(now):
                self.to_tokenizer.send(error)

    def handle(self, msg) -> None:
        """dispatch(), with a failure answered (a request) or logged, never raised."""
        try:
            self.dispatch(msg)
        except Exception:  # noqa: BLE001 - one message never stops the process
            log_failure("scheduler", msg)
            if isinstance(msg, TokenizedReq):
                self.to_tokenizer.send(failure_error(msg))
            elif isinstance(msg, AdminReq):
                self.to_api.send(AdminReply(qid=msg.qid, status=500, code="internal_error",
                                            message=f"{msg.op} of {msg.name!r} failed"))

    def dispatch(self, msg) -> None:
        service = self.service
        if isinstance(msg, TokenizedReq):
            error = self.check_ids(msg) or service.add(msg)
            if error is not None:
                self.to_tokenizer.send(error)
        elif isinstance(msg, AbortReq):
            service.abort(msg)
        elif isinstance(msg, StepResult):
            batch, errors = service.on_result(msg)
            if service.late_masks is not None:  # the worker waits for them to sample
                self.to_worker.send(service.late_masks)
                service.late_masks = None
            for m in ([batch] if batch else []) + errors:
                self.to_tokenizer.send(m)
        elif isinstance(msg, InfoQuery):
            self.to_api.send(InfoReply(qid=msg.qid, info=service.info(msg.flush_cache)))
        elif isinstance(msg, AdminReq):
            self.queue_admin(msg)

    def queue_admin(self, req: AdminReq) -> None:
        """Queue an admin call behind the earlier ones; a load's files are read and validated
        on a thread. Beyond MAX_QUEUED_ADMIN calls waiting, a 429 at once."""
        if len(self.admin_queue) >= MAX_QUEUED_ADMIN:
            self.to_api.send(AdminReply(qid=req.qid, status=429, code="admin_queue_full",
                                        message=f"{len(self.admin_queue)} admin calls are "
                                                "waiting; retry once they are done"))
            return
        read = None
        if req.op == "load":
            read = self.admin_reads.submit(self.service.lifecycle.read_load, req.name, req.path)
        self.admin_queue.append((req, read))
        self.apply_admin()

    def apply_admin(self) -> None:
        """Apply the queued admin calls from the head while their reads have ended."""
        lifecycle = self.service.lifecycle
        while self.admin_queue and (self.admin_queue[0][1] is None
                                    or self.admin_queue[0][1].done()):
            req, read = self.admin_queue.popleft()
            try:
                reply = lifecycle.admin(req, None if read is None else read.result)
            except Exception:  # noqa: BLE001 - one admin call never stops the process
                log_failure("scheduler", req)
                reply = AdminReply(qid=req.qid, status=500, code="internal_error",
                                   message=f"{req.op} of {req.name!r} failed")
            self.to_api.send(reply)

    def check_ids(self, msg: TokenizedReq) -> ReqError | None:
        """The prompt's ids are in the vocabulary (the worker would fail the whole step)."""
        try:
            check_prompt_ids(bytes_to_ids(msg.input_ids), self.service.model_cfg.vocab_size)
        except InvalidRequestError as e:
            return ReqError(rid=msg.rid, message=e.message, code=e.code, param=e.param)
        return None

    def maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now >= self.next_stats:
            self.next_stats = now + STATS_INTERVAL_S
            self.to_api.send(self.service.stats())


def adapter_names(reqs) -> list[str]:
    """The distinct adapter names of reqs, sorted (a stack gives each of its names)."""
    return sorted({a.name for req in reqs for a in req.adapter_set.adapters})


def adapter_counts(reqs) -> dict[str, int]:
    """Requests per adapter name (a stack counts for each of its names)."""
    return dict(collections.Counter(a.name for req in reqs for a in req.adapter_set.adapters))


def run(args: ServerArgs, ctx: zmq.Context) -> None:
    service = SchedulerService(args)
    loop = SchedulerLoop(args, ctx, service)
    info = {"adapters": service.info()["adapters"]}
    send_ready(ctx, args, "scheduler", info)
    serve_forever(loop.heart, loop.turn)


if __name__ == "__main__":
    child_main("scheduler", run)
