"""The api process's bridge to the other processes: submits GenerateReqs, routes SampleOutputs
back to per-request queues, answers info queries, tracks health. Outgoing sockets are plain
PUSH sockets with no high-water mark, so a send never blocks the event loop.

With data-parallel replicas each replica's scheduler answers on its own inbox, so its stats
and replies are told apart by the socket they arrive on; info queries and admin calls go to
every replica and their answers are merged (`merge_infos`, `merge_stats`)."""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from radixlora.errors import InvalidRequestError
from radixlora.server.args import ServerArgs
from radixlora.server.http.stats_log import StatsLog, request_line
from radixlora.server.http.stats_log import log as ops_log
from radixlora.server.http.tracing import Tracer
from radixlora.server.ipc import check_local, subscribe
from radixlora.server.messages import (
    AbortReq,
    AdapterEvent,
    AdminReply,
    AdminReq,
    ApiInbox,
    Codec,
    GenerateReq,
    InfoQuery,
    InfoReply,
    OutputBatch,
    ReqError,
    RouterStats,
    SampleOutput,
    SchedulerStats,
    bytes_to_id_list,
)
from radixlora.step_plan import StepTotals

# Samples (prompts x n) one request may queue: n=128 of one prompt, or 64 prompts x 4; more
# would let one client fill the waiting queue ahead of every other.
MAX_SAMPLES_PER_REQUEST = 256

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 10.0
# An admin load reads and validates the adapter (up to 8 GiB) off the scheduler's loop, which
# answers once it is done: its real outcome, never a timeout for a load that then takes effect.
ADMIN_TIMEOUT_S = 600.0
EXPIRE_GRACE_S = 2.0  # after a drain timeout, time for handlers to answer their 503s


class Health(enum.Enum):
    STARTING = "starting"
    OK = "ok"
    DRAINING = "draining"
    DEAD = "dead"


class ServiceUnavailable(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass
class Sample:
    """Everything generated for one sample, accumulated from its SampleOutputs."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    top: list[list[tuple[int, float, str]]] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    input_logprobs: list[float] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    input_texts: list[str] = field(default_factory=list)
    input_top: list[list[tuple[int, float, str]]] = field(default_factory=list)
    prompt_text: str | None = None  # an echoed token-id prompt's text

    def add(self, out: SampleOutput, ids: list[int]) -> None:
        if out.prompt_text is not None:
            self.prompt_text = out.prompt_text
        self.input_logprobs += out.input_logprobs
        self.input_top += out.input_top or []
        self.input_ids += bytes_to_id_list(out.input_ids)
        self.input_texts += out.input_texts or []
        self.text += out.text
        self.token_ids += ids
        self.logprobs += out.logprobs
        self.token_texts += out.token_texts or []
        self.top += out.top or []
        self.finish_reason = out.finish_reason
        self.matched_stop = out.matched_stop


@dataclass
class Generation:
    """One prompt in flight: its queue of events and what has arrived so far."""

    req: GenerateReq
    adapter_label: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    samples: dict[int, Sample] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    scheduled_at: float | None = None  # the scheduler's first admission (time.monotonic())
    fallback: str | None = None  # served base-only (policy "base"), and why
    base_mismatch: str = ""  # adapters served on another weight format (--qlora-mismatch serve)
    owner: str = ""  # who submitted it (a hash of its API key): only they may abort it
    ended: bool = False  # its log line and span are written (once: finished, failed or aborted)

    @property
    def n(self) -> int:
        return self.req.params.n

    @property
    def logprob_entries(self) -> int:
        """Logprobs (each with its top alternatives) its samples hold so far."""
        tokens = sum(len(s.logprobs) + len(s.input_logprobs) for s in self.samples.values())
        return tokens * (1 + (self.req.params.logprobs or 0))

    @property
    def finished(self) -> bool:
        done = [s for s in self.samples.values() if s.finish_reason is not None]
        return len(done) >= self.n

    @property
    def finish_reasons(self) -> str:
        reasons = [s.finish_reason for _, s in sorted(self.samples.items())]
        return ",".join(dict.fromkeys(r for r in reasons if r is not None))


class ProcessBridge:
    def __init__(self, args: ServerArgs, metrics=None, tracer: Tracer | None = None,
                 event_sub: zmq.Socket | None = None):
        self.args = args
        self.metrics = metrics
        self.tracer = tracer or Tracer(args.model_name)
        self.adapter_ids: dict[str, str] = {}  # name -> content hash, for the spans
        self.ctx = zmq.asyncio.Context()
        self.sync_ctx = zmq.Context()
        endpoints = args.endpoints
        self.inbox = self._bind_inbox(endpoints.api)
        # replica i's scheduler answers on replica_inboxes[i] (the main inbox when alone)
        self.replica_inboxes = [self._bind_inbox(e) for e in endpoints.replica_apis]
        self.to_tokenizer = self._outbox(endpoints.tokenizer)
        self.to_schedulers = [self._outbox(e) for e in endpoints.scheduler_list]
        self.codec = Codec(ApiInbox)
        self.encoder = msgspec.msgpack.Encoder()
        self.generations: dict[str, Generation] = {}
        self.info_waiters: dict[int, asyncio.Future] = {}
        self.qids = itertools.count(1)
        self.stats: SchedulerStats | None = None  # every replica's, merged
        self.replica_stats: dict[int, SchedulerStats] = {}
        self.replica_names: dict[int, list[str]] = {}  # the names each replica last sent
        self.router_stats: RouterStats | None = None
        self.stats_log = StatsLog(args.stats_interval_s)
        self.health = Health.STARTING
        self.dead_reason: str | None = None
        self.degraded_reason: str | None = None  # the registry is down; serving goes on
        # the registry's events: on `event_sub` when the launcher subscribed before the
        # registry started (see subscribe_registry), else subscribed here
        if event_sub is not None:
            self.event_sub = zmq.asyncio.Socket.from_socket(event_sub)
        else:
            self.event_sub = subscribe(self.ctx, endpoints.registry) if args.adapter_dir else None
        self.event_codec = Codec(AdapterEvent)
        self.recent_events: collections.deque[AdapterEvent] = collections.deque(maxlen=256)
        # --adapter-dir names whose latest version the registry rejected -> the reason label
        self.rejected: dict[str, str] = {}
        # --adapter-dir names listed at start, not removed or rejected since: those the
        # scheduler does not serve yet are listed as validating (the api can see a name's
        # "added" event before the scheduler does)
        self.listed: set[str] = set()
        self.closed = False

    def _bind_inbox(self, endpoint: str) -> zmq.asyncio.Socket:
        check_local(endpoint)
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)
        return sock

    def _outbox(self, endpoint: str) -> zmq.Socket:
        check_local(endpoint)
        sock = self.sync_ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    # ---- requests ----------------------------------------------------------------------------

    def check_accepting(self) -> None:
        if self.health is Health.OK:
            return
        if self.health is Health.DRAINING:
            raise ServiceUnavailable("the server is shutting down and accepts no new requests")
        raise ServiceUnavailable(self.dead_reason or f"the server is {self.health.value}")

    def submit(
        self, reqs: list[GenerateReq], adapter_label: str, owner: str = ""
    ) -> list[Generation]:
        """Submit the prompts of one client request; their events share one queue."""
        self.check_accepting()
        samples = sum(r.params.n for r in reqs)
        if samples > MAX_SAMPLES_PER_REQUEST:
            raise InvalidRequestError(
                f"one request asks for {samples} samples (prompts x n); at most "
                f"{MAX_SAMPLES_PER_REQUEST}: split it into several requests", param="n")
        rids = [r.rid for r in reqs]
        for rid in rids:
            if rid in self.generations or rids.count(rid) > 1:
                raise DuplicateRequestId(rid)
        queue: asyncio.Queue = asyncio.Queue()
        reqs = [msgspec.structs.replace(r, request_prompts=len(reqs)) for r in reqs]
        gens = [Generation(req, adapter_label, queue, owner=owner) for req in reqs]
        for gen in gens:
            self.generations[gen.req.rid] = gen
            self.to_tokenizer.send(self.encoder.encode(gen.req))
            if self.metrics is not None:
                self.metrics.on_submit(gen)
        return gens

    def abort(self, rid: str) -> bool:
        gen = self.generations.pop(rid, None)
        if gen is None:
            return False
        if not self.closed:  # a handler cancelled at exit, after close()
            self.to_tokenizer.send(self.encoder.encode(AbortReq(rid=rid)))
        if self.metrics is not None:
            self.metrics.on_abort(gen)
        self._ended(gen, "abort")
        return True

    def cancel(self, rid: str, owner: str | None = None) -> bool:
        """Abort on behalf of another caller (/abort_request; `owner` None: any request, else
        only that owner's): the request's own client gets its samples back with
        finish_reason "abort"."""
        gen = self.generations.get(rid)
        if gen is None or owner not in (None, gen.owner):
            return False
        self.abort(rid)
        for index in range(gen.n):
            sample = gen.samples.setdefault(index, Sample(index))
            if sample.finish_reason is None:
                out = SampleOutput(rid=rid, index=index, text="", token_ids=b"", logprobs=[],
                                   token_texts=None, top=None, finish_reason="abort",
                                   matched_stop=None, prompt_tokens=gen.prompt_tokens,
                                   cached_tokens=gen.cached_tokens)
                sample.add(out, [])
                gen.queue.put_nowait(out)
        return True

    async def events(self, gens: list[Generation]) -> AsyncIterator[tuple[int, SampleOutput]]:
        """(prompt index, SampleOutput) until every sample of every prompt finished; raises
        ReqFailed on the first error. Leaving early (cancelled, client gone) aborts the rest."""
        position = {gen.req.rid: p for p, gen in enumerate(gens)}
        queue = gens[0].queue
        # counted off the events handed out, not the pump's state: the pump may already have
        # queued a sample's last event while earlier ones are still waiting here
        unfinished = sum(gen.n for gen in gens)
        try:
            while unfinished:
                event = await queue.get()
                if isinstance(event, ReqError):
                    if self.metrics is not None:
                        self.metrics.on_error(event.code)
                    self._ended(gens[position[event.rid]], f"error:{event.code}", event.status,
                                event.code)
                    raise ReqFailed(event)
                unfinished -= event.finish_reason is not None
                yield position[event.rid], event
        finally:
            for gen in gens:
                if gen.finished:
                    self.generations.pop(gen.req.rid, None)
                else:
                    self.abort(gen.req.rid)

    async def collect(self, gens: list[Generation]) -> list[Generation]:
        async for _ in self.events(gens):
            pass
        return gens

    # ---- inbox -------------------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        return len(self.to_schedulers)

    async def pump(self) -> None:
        """Forever: route every message of every inbox (garbage is logged and dropped)."""
        inboxes = [(self.inbox, 0)] + [(s, r) for r, s in enumerate(self.replica_inboxes)]
        await asyncio.gather(*(self._pump(sock, replica) for sock, replica in inboxes))

    async def _pump(self, sock: zmq.asyncio.Socket, replica: int) -> None:
        while True:
            msg = self.codec.decode(await sock.recv())
            if msg is None:
                continue
            try:
                self._route(msg, replica)
            except Exception:
                log.exception("failed to route %s", type(msg).__name__)

    async def pump_events(self) -> None:
        """Forever: the registry's AdapterEvents (for metrics, /health and server info)."""
        if self.event_sub is None:
            return
        while True:
            event = self.event_codec.decode(await self.event_sub.recv())
            if event is None:
                continue
            if event.kind == "hello":
                if self.degraded_reason is not None:
                    log.info("the registry is back (event seq %d)", event.seq)
                self.degraded_reason = None
            if event.kind in ("added", "updated") and event.adapter_id:
                self.adapter_ids[event.name] = event.adapter_id
            elif event.kind == "removed":
                self.adapter_ids.pop(event.name, None)
            self.listed.update(event.names)
            if event.kind not in ("added", "updated"):
                self.listed.discard(event.name)
            if event.kind == "rejected":
                self.rejected[event.name] = event.reason
            elif event.kind in ("added", "updated", "removed"):
                self.rejected.pop(event.name, None)
            self.recent_events.append(event)
            if self.metrics is not None:
                self.metrics.on_adapter_event(event)

    def mark_degraded(self, reason: str) -> None:
        self.degraded_reason = reason

    def _route(self, msg, replica: int = 0) -> None:
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                self._on_output(out)
        elif isinstance(msg, ReqError):
            gen = self.generations.get(msg.rid)
            if gen is not None:
                gen.queue.put_nowait(msg)
        elif isinstance(msg, SchedulerStats):
            self._on_stats(msg, replica)
        elif isinstance(msg, RouterStats):
            self.router_stats = msg
            if self.metrics is not None:
                self.metrics.on_router_stats(msg)
        elif isinstance(msg, (InfoReply, AdminReply)):
            if isinstance(msg, InfoReply) and "adapters" in msg.info:
                self.adapter_ids = {a["name"]: a["adapter_id"] for a in msg.info["adapters"]}
            waiter = self.info_waiters.pop(msg.qid, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg.info if isinstance(msg, InfoReply) else msg)

    def _on_stats(self, msg: SchedulerStats, replica: int) -> None:
        """One replica's stats: kept, then every replica's merged into the service's."""
        self.replica_stats[replica] = msg
        if msg.registered is not None:
            self.replica_names[replica] = msg.registered
        merged = msg
        if self.num_replicas > 1:
            merged = merge_stats(self.replica_stats, msg.adapter_load_seconds,
                                 self.replica_names)
        self.stats = merged
        if self.metrics is not None:
            self.metrics.on_stats(merged)
            if self.num_replicas > 1:
                self.metrics.on_replica_stats(replica, msg)
        self.stats_log.on_stats(merged)

    def _on_output(self, out: SampleOutput) -> None:
        gen = self.generations.get(out.rid)
        if gen is None:
            return  # aborted
        ids = bytes_to_id_list(out.token_ids)
        sample = gen.samples.setdefault(out.index, Sample(out.index))
        sample.add(out, ids)
        if out.index == 0:
            gen.prompt_tokens, gen.cached_tokens = out.prompt_tokens, out.cached_tokens
        if out.fallback:
            gen.fallback = out.fallback
        if out.base_mismatch:
            gen.base_mismatch = out.base_mismatch
        first = gen.first_token_at is None
        if first:
            gen.first_token_at = time.monotonic()
        if out.scheduled_at and gen.scheduled_at is None:
            gen.scheduled_at = out.scheduled_at
        self.stats_log.count(out.prompt_tokens if first else 0, len(ids))
        if self.metrics is not None:
            self.metrics.on_output(gen, out, len(ids), first)
        if gen.finished:
            self._ended(gen, gen.finish_reasons)
        gen.queue.put_nowait(out)

    def _ended(self, gen: Generation, finish: str, status: int | None = None,
               error: str | None = None) -> None:
        """gen finished, failed or was aborted: its --log-requests line and its span, once."""
        if gen.ended:
            return
        gen.ended = True
        self.tracer.record(gen, finish, self.adapter_ids, error)
        if not self.args.log_requests:
            return
        now = time.monotonic()
        ttft = None if gen.first_token_at is None else gen.first_token_at - gen.created
        generated = sum(len(s.token_ids) for s in gen.samples.values())
        ops_log.info("%s", request_line(gen.req.rid, gen.adapter_label, gen.prompt_tokens,
                                        gen.cached_tokens, generated, finish, ttft,
                                        now - gen.created, status))

    # ---- control -----------------------------------------------------------------------------

    async def query_info(self, flush_cache: bool = False) -> dict:
        """The scheduler's info; with replicas, theirs merged (`merge_infos`)."""
        infos = await self._ask_all(lambda qid: InfoQuery(qid=qid, flush_cache=flush_cache))
        return infos[0] if len(infos) == 1 else merge_infos(infos)

    async def admin(self, op: str, name: str, path: str = "", replace: bool = False
                    ) -> AdminReply:
        """Ask every replica's scheduler to load / unload / pin / unpin an adapter. A load
        that fails on some replica is unloaded from the others, so they keep one adapter set."""
        replies = await self._ask_all(
            lambda qid: AdminReq(qid=qid, op=op, name=name, path=path, replace=replace),
            ADMIN_TIMEOUT_S)
        failed = [(r, reply) for r, reply in enumerate(replies) if reply.status != 200]
        if failed and op == "load" and len(replies) > 1:
            for replica, reply in enumerate(replies):
                if reply.status == 200:
                    await self._ask(lambda qid: AdminReq(qid=qid, op="unload", name=name),
                                    replica)
        if self.tracer.enabled and op in ("load", "unload"):
            await self.query_info()  # the adapters' content hashes for the spans
        if not failed:
            return replies[0]
        replica, reply = failed[0]
        if len(replies) > 1:
            reply = msgspec.structs.replace(reply, message=f"replica {replica}: {reply.message}")
        return reply

    async def _ask_all(self, make_msg, timeout_s: float = INFO_TIMEOUT_S) -> list:
        """make_msg(qid) to every replica's scheduler at once; their replies in replica order."""
        return list(await asyncio.gather(*(self._ask(make_msg, replica, timeout_s)
                                           for replica in range(self.num_replicas))))

    async def _ask(self, make_msg, replica: int = 0, timeout_s: float = INFO_TIMEOUT_S):
        """Send replica's scheduler the query make_msg(qid) and wait for its reply."""
        if self.health is Health.DEAD:
            raise ServiceUnavailable(self.dead_reason or "a server process died")
        qid = next(self.qids)
        waiter = asyncio.get_running_loop().create_future()
        self.info_waiters[qid] = waiter
        self.to_schedulers[replica].send(self.encoder.encode(make_msg(qid)))
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError as e:
            raise ServiceUnavailable("the scheduler did not answer in time") from e
        finally:
            self.info_waiters.pop(qid, None)

    def mark_dead(self, reason: str) -> None:
        """A child died: fail everything in flight at once."""
        self.health = Health.DEAD
        self.dead_reason = reason
        self._fail_all(reason, "server_error")
        for waiter in self.info_waiters.values():  # queries and admin calls waiting on it
            if not waiter.done():
                waiter.set_exception(ServiceUnavailable(reason))

    async def expire(self, grace_s: float = EXPIRE_GRACE_S) -> None:
        """The drain timed out: every request still in flight fails with a 503 (an error event
        on a stream); wait up to grace_s for their handlers to answer."""
        log.warning("drain timeout: failing %d requests still in flight", len(self.generations))
        self._fail_all("the server is shutting down (drain timeout)", "drain_timeout")
        deadline = time.monotonic() + grace_s
        while self.generations and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def _fail_all(self, reason: str, code: str) -> None:
        for gen in list(self.generations.values()):
            gen.queue.put_nowait(ReqError(rid=gen.req.rid, message=reason, code=code, status=503))

    def close(self) -> None:
        self.closed = True
        self.ctx.destroy(linger=0)
        self.sync_ctx.destroy(linger=0)


STATS_SUMS = ("kv_capacity", "kv_used", "kv_cached", "running", "waiting", "prompt_tokens",
              "cached_tokens", "adapter_loads", "adapter_evictions", "resident_adapters",
              "resident_bytes", "host_adapters", "host_bytes", "swaps_waiting",
              "adapter_load_failures", "max_loras")


def merge_stats(stats: dict[int, SchedulerStats], load_seconds: list[float],
                names: dict[int, list[str]]) -> SchedulerStats:
    """The replicas' latest stats as one service's: counts and totals summed (so max_loras is
    the adapters the service holds at once), adapter lists united, resident rows summed per
    name, as are the requests per adapter; `load_seconds` are the latencies new in the report
    that triggered the merge."""
    every = list(stats.values())
    return SchedulerStats(
        **{f: sum(getattr(s, f) for s in every) for f in STATS_SUMS},
        adapter_load_seconds=load_seconds,
        running_adapters=sorted({a for s in every for a in s.running_adapters}),
        waiting_adapters=sorted({a for s in every for a in s.waiting_adapters}),
        resident_rows=add_up([s.resident_rows for s in every]),
        running_per_adapter=add_up([s.running_per_adapter for s in every]),
        waiting_per_adapter=add_up([s.waiting_per_adapter for s in every]),
        resident_adapter_bytes=add_up([s.resident_adapter_bytes for s in every]),
        registered=sorted({a for listed in names.values() for a in listed}),
        step_totals=add_totals([s.step_totals for s in every]),
    )


def add_totals(totals: list[dict[str, StepTotals]]) -> dict[str, StepTotals]:
    """The replicas' step totals, field by field per kind of step."""
    out: dict[str, StepTotals] = {}
    for each in totals:
        for kind, t in each.items():
            sum_ = out.setdefault(kind, StepTotals())
            for f in StepTotals.__struct_fields__:
                setattr(sum_, f, getattr(sum_, f) + getattr(t, f))
    return out


def add_up(counts: list[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for each in counts:
        for name, count in each.items():
            total[name] = total.get(name, 0) + count
    return total


INFO_MINIMUM = ("adapter_event_seq",)  # the replica furthest behind


def merge_infos(infos: list[dict]) -> dict:
    """The replicas' scheduler infos as one: numbers summed (the event sequence: the lowest),
    adapter refs summed per id, listed names united, adapters united by name; each replica's
    own info under "replicas"."""
    merged: dict = {}
    for key, first in infos[0].items():
        values = [info[key] for info in infos]
        if key in INFO_MINIMUM:
            merged[key] = min(values)
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            merged[key] = sum(values)
        elif key == "adapters":
            merged[key] = unite_by_name(values)
        elif key == "recent_steps":  # every replica's, in time order
            merged[key] = sorted(step for v in values for step in v)
        elif isinstance(first, dict):
            merged[key] = {k: sum(v.get(k, 0) for v in values) for v in values for k in v}
        elif isinstance(first, list):
            merged[key] = sorted({item for v in values for item in v})
        else:
            merged[key] = first
    merged["replicas"] = infos
    return merged


def unite_by_name(lists: list[list[dict]]) -> list[dict]:
    """Entries of every list, one per name (the first replica's), in first-seen order."""
    by_name: dict[str, dict] = {}
    for entries in lists:
        for entry in entries:
            by_name.setdefault(entry["name"], entry)
    return list(by_name.values())


class ReqFailed(Exception):
    def __init__(self, error: ReqError):
        super().__init__(error.message)
        self.error = error


class DuplicateRequestId(Exception):
    def __init__(self, rid: str):
        super().__init__(f"request id {rid!r} is already in use")
        self.rid = rid
