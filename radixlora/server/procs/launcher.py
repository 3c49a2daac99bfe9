"""`radixlora serve`: start the tokenizer, scheduler and worker processes, wait until each has
acknowledged, then serve HTTP from this process (which is also the api process). A child that
dies, or sends no heartbeat for --watchdog-timeout (it is then killed), turns /health to 503
and makes the launcher exit non-zero after stopping the others; SIGTERM/SIGINT drain: new
requests get 503, in-flight ones finish, exit 0. The registry process (with --adapter-dir) is
not needed to serve: if it dies or falls silent, /health says "degraded" (HTTP 200) and the
launcher restarts it. The private temporary directory is named after the launcher's pid, so a
later launcher removes it if this one was killed before it could. With --data-parallel-size N
each replica is a scheduler-dp<i> and a worker-dp<i> (on CUDA, device i), any of them a core
child; the tokenizer routes between them. With --nnodes N the tensor-parallel ranks span N
hosts: node 0 runs everything above with its share of the ranks, every other node
(--node-rank R) only its ranks, which meet node 0's at --dist-init-addr and run what rank 0
broadcasts; that node's launcher watches them like core children and exits 1 when one dies
(as each does once rank 0 is gone), 0 on SIGTERM. The children themselves (who each is,
starting, watching, stopping) are supervisor.py's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import threading
import time

import msgspec
import numpy as np
import uvicorn
import uvloop
import zmq

from radixlora.config import ModelConfig
from radixlora.sampling_params import SamplingParams
from radixlora.sched.adapter_choice import AdapterChoice
from radixlora.server.args import Endpoints, ServerArgs
from radixlora.server.http.api import Api
from radixlora.server.http.bridge import Health, ProcessBridge, ReqFailed
from radixlora.server.http.gateway import ClientGateway
from radixlora.server.http.metrics import Metrics
from radixlora.server.http.tracing import Tracer
from radixlora.server.ipc import Inbox, freeze_start_up_heap, setup_logging, subscribe
from radixlora.server.messages import GenerateReq, LauncherInbox, Ready, Sized
from radixlora.server.procs.supervisor import (
    OPTIONAL,
    Children,
    StartupError,
    make_state_dir,
    make_workdir,
    sized_args,
    wait_for,
)
from radixlora.startup import phase_line, process_age_s
from radixlora.topology import node_ranks

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
DEAD_GRACE_S = 1.0
WARM_PROMPT_TOKENS = 64
WARM_NEW_TOKENS = 8
TP_RENDEZVOUS = "tp-rendezvous"  # the ranks' file store in the private directory (one node)


class DrainingServer(uvicorn.Server):
    """uvicorn with our own SIGTERM/SIGINT handling: drain first, then stop."""

    def __init__(self, config: uvicorn.Config, on_signal):
        super().__init__(config)
        self.on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


class Launcher:
    def __init__(self, args: ServerArgs):
        self.workdir = make_workdir()
        client = (f"tcp://127.0.0.1:{args.zmq_client_port}"
                  if args.zmq_client_port is not None else None)
        state_dir = make_state_dir(self.workdir, args.state_root if args.node_rank == 0 else None)
        self.args = msgspec.structs.replace(
            args, endpoints=Endpoints.in_dir(self.workdir, client, args.data_parallel_size),
            launcher_pid=os.getpid(),
            state_dir=state_dir,
            dist_init_method=(f"tcp://{args.dist_init_addr}" if args.dist_init_addr
                              else f"file://{os.path.join(self.workdir, TP_RENDEZVOUS)}"),
        )
        self.exit_code = 0
        self.phases: dict[str, float] = {}  # start-up phase -> seconds (startup.phase_line)
        self.server: DrainingServer | None = None
        self.runtime: ProcessBridge | None = None
        self.restart_at: dict[str, float] = {}  # dead optional child -> when to restart it
        self.registry_events: zmq.Socket | None = None

    def run(self) -> int:
        ctx = zmq.Context()
        children = None
        failure = None
        previous = signal.signal(signal.SIGTERM, stop_starting)
        try:
            self.inbox = Inbox(ctx, self.args.endpoints.launcher, LauncherInbox)
            # subscribed before the registry starts, so that it need not wait for the api
            # (which serves only once every process is ready) to publish what it validated
            if self.args.adapter_dir and self.head:
                self.registry_events = subscribe(ctx, self.args.endpoints.registry)
            launch = process_age_s()
            children = self.start_children()
            started = time.monotonic()
            seen: dict[type, dict] = {Sized: {}, Ready: {}}
            if self.head:
                self.size_pools(children, seen, started)
            ready = wait_for(self.inbox, children, self.args.ready_timeout_s, children.names,
                             Ready, seen)
            children.starting.clear()
            log.info("every process ready in %.1f s", time.monotonic() - started)
            self.phases = launch_phases(launch, children)
            if not self.head:
                return self.follow_head(children, previous)
            signal.signal(signal.SIGTERM, previous)
            return uvloop.run(self.serve(children, ready))
        except StartupError as e:
            failure = e
            return 1
        finally:
            level = logging.DEBUG if failure is not None else logging.INFO
            log.log(level, "stopping the child processes")
            if children is not None:
                children.stop()
            ctx.destroy(linger=0)
            shutil.rmtree(self.workdir, ignore_errors=True)
            shutil.rmtree(self.args.state_dir, ignore_errors=True)
            log.log(level, "stopped")
            if failure is not None:
                log.error("start-up failed: %s", failure)

    @property
    def head(self) -> bool:
        return self.args.node_rank == 0

    def start_children(self) -> Children:
        args = self.args
        if self.head:
            if args.nnodes > 1 and args.state_root is None and (args.adapter_dir
                                                                 or args.enable_admin):
                log.warning("--nnodes %d without --state-dir: adapters loaded while serving are "
                            "kept on this host only, so the other nodes' ranks fail to load "
                            "them; give a --state-dir every node mounts at the same path",
                            args.nnodes)
            log.info("starting the worker process: it loads the model and sizes the pools")
            if args.nnodes > 1:
                log.info("ranks %d-%d run on nodes 1-%d, whose ranks must join at %s within "
                         "%.0f s", args.tensor_parallel_size // args.nnodes,
                         args.tensor_parallel_size - 1, args.nnodes - 1, args.dist_init_addr,
                         args.ready_timeout_s)
        else:
            ranks = node_ranks(args.tensor_parallel_size, args.nnodes, args.node_rank)
            log.info("node %d of %d: starting worker ranks %d-%d of %d; they meet node 0's at "
                     "%s", args.node_rank, args.nnodes, ranks[0], ranks[-1],
                     args.tensor_parallel_size, args.dist_init_addr)
        return Children(args)

    def size_pools(self, children: Children, seen: dict[type, dict], started: float) -> None:
        """Wait for the worker's pool sizes, then hand them to the other children, which start
        while the worker warms up."""
        sized = wait_for(self.inbox, children, self.args.ready_timeout_s, children.workers,
                         Sized, seen)
        self.args = sized_args(self.args, sized[children.workers[0]].info)
        rest = [name for name in children.names if name not in children.workers]
        log.info("pools sized in %.1f s; starting the %s processes while the worker warms "
                 "up", time.monotonic() - started, ", ".join(rest))
        children.start_rest(self.args, sized)

    def follow_head(self, children: Children, previous_sigterm) -> int:
        """A node > 0 once its ranks are ready: watch them until SIGTERM/SIGINT (exit 0) or
        until one dies or falls silent (exit 1). They follow node 0's rank 0, so the head
        stopping ends them too (their collectives fail)."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        log.info("node %d ready: its worker ranks follow node 0", self.args.node_rank)
        while not stop.wait(WATCH_INTERVAL_S):
            for msg in self.inbox.recv_nowait():
                children.on_beat(msg)
            children.kill_silent(children.names)
            dead = children.first_dead(children.core)
            if dead is not None:
                log.error("%s; stopping node %d", dead, self.args.node_rank)
                return 1
        signal.signal(signal.SIGTERM, previous_sigterm)
        return 0

    async def serve(self, children: Children, ready: dict[str, Ready]) -> int:
        args = self.args
        vocab_size = ModelConfig.from_dir(args.model).vocab_size
        metrics = Metrics(args.vllm_metric_names)
        tracer = Tracer.for_endpoint(args.otlp_traces_endpoint, args.model_name)
        self.runtime = runtime = ProcessBridge(args, metrics, event_sub=self.registry_events)
        if "registry" in ready:
            runtime.listed.update(ready["registry"].info.get("listed", ()))
        worker = ready[children.workers[0]].info
        self.phases.update(worker.get("phases") or {})
        api = Api(args, runtime, metrics, vocab_size, children.pids, worker.get("sizing"))
        gateway = ClientGateway(runtime, args.endpoints.client, vocab_size,
                                key=args.zmq_client_key or args.api_key or None)
        config = uvicorn.Config(api.app(), host=args.host, port=args.port, loop="none",
                                lifespan="off", log_level=args.log_level, access_log=False,
                                log_config=None,
                                timeout_graceful_shutdown=5)
        self.server = DrainingServer(config, self.begin_drain)
        jobs = [runtime.pump(), runtime.pump_events(), self.watch(children)]
        tasks = [asyncio.create_task(c) for c in jobs]
        runtime.health = Health.OK  # nobody can reach it before the server and gateway start
        try:
            if worker["device"].startswith("cuda"):
                log.info("warming the pipeline: a prefill and decode through every process")
                await self.warm_pipeline(runtime)
            if tracer.enabled:  # after the warm-up: its requests are not traced
                runtime.tracer = tracer
                await runtime.query_info()  # the adapters' content hashes for the spans
            tasks += [asyncio.create_task(c) for c in (gateway.serve(), self.announce())]
            freeze_start_up_heap()
            await self.server.serve()
        finally:
            for task in tasks:
                task.cancel()
            runtime.close()
            tracer.shutdown()
        return self.exit_code

    async def warm_pipeline(self, runtime: ProcessBridge) -> None:
        """One prefill and decode through every process, base and on the first adapter, before
        clients can connect (the worker compiled and captured everything already; this warms
        the tokenizer, the scheduler and the paths between them)."""
        started = time.monotonic()
        ids = np.ones(WARM_PROMPT_TOKENS, dtype="<i4").tobytes()
        params = SamplingParams(max_tokens=WARM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        choices = [None] + [[AdapterChoice(name)] for name in sorted(self.args.adapters)[:1]]
        replicas = range(self.args.data_parallel_size)
        reqs = [GenerateReq(rid=f"warm-up-{r}-{k}", params=params, input_ids=ids, adapters=choice,
                            data_parallel_rank=r if len(replicas) > 1 else None)
                for r in replicas for k, choice in enumerate(choices)]
        try:
            await asyncio.wait_for(runtime.collect(runtime.submit(reqs, "warm-up")),
                                   self.args.ready_timeout_s)
        except (ReqFailed, asyncio.TimeoutError) as e:
            raise StartupError(f"the warm-up request failed: {e}") from e
        self.phases["pipeline"] = time.monotonic() - started
        log.info("pipeline warm-up in %.2f s", self.phases["pipeline"])

    async def announce(self) -> None:
        while not self.server.started:
            await asyncio.sleep(0.05)
        log.info("radixlora ready: http://%s:%d (model %s, adapters %s; zmq clients: %s)",
                 self.args.host, self.args.port, self.args.model_name,
                 sorted(self.args.adapters) or "none", self.args.endpoints.client)
        age = process_age_s()
        if age is not None:
            log.info(phase_line(age, self.phases))

    async def watch(self, children: Children) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for msg in self.inbox.recv_nowait():
                children.on_beat(msg)
            children.kill_silent(children.names)
            dead = children.first_dead(children.core)
            if dead is not None:
                break
            for name in OPTIONAL:
                if name in children.names:
                    self.restart_if_dead(children, name)
        log.error("%s; stopping the server", dead)
        self.runtime.mark_dead(dead)
        await asyncio.sleep(DEAD_GRACE_S)
        self.exit_code = 1
        self.server.should_exit = True

    def restart_if_dead(self, children: Children, name: str) -> None:
        """Restart a dead optional child after its backoff delay, without pausing the watch
        over the others."""
        reason = children.exit_reason(name)
        if reason is None:
            return
        now = time.monotonic()
        if name not in self.restart_at:
            delay = children.next_restart_delay(name)
            log.error("%s; serving continues (degraded), restarting it in %.1f s", reason, delay)
            self.runtime.mark_degraded(reason)
            self.restart_at[name] = now + delay
        elif now >= self.restart_at[name]:
            del self.restart_at[name]
            children.spawn(name)

    def begin_drain(self) -> None:
        runtime = self.runtime
        if runtime.health is Health.DRAINING:
            log.warning("second signal: stopping without waiting for in-flight requests")
            self.server.should_exit = True
            return
        if runtime.health is Health.OK:
            runtime.health = Health.DRAINING
            log.info("draining: %d requests in flight", len(runtime.generations))
            asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        deadline = time.monotonic() + self.args.drain_timeout_s
        while self.runtime.generations and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.runtime.generations:
            await self.runtime.expire()
        self.server.should_exit = True


def launch_phases(launch: float | None, children: Children) -> dict[str, float]:
    """The launcher's start-up phases: `launch` (its own start until it spawned the children)
    and `processes` (the wait for the last process after the first worker was ready)."""
    phases = {"launch": launch} if launch is not None else {}
    worker = children.ready_at.get(children.workers[0]) if children.workers else None
    if worker is not None:
        phases["processes"] = max(0.0, max(children.ready_at.values()) - worker)
    return phases


def stop_starting(*_) -> None:
    raise StartupError("stopped by SIGTERM while starting")


def serve(args: ServerArgs) -> int:
    setup_logging(args.log_level, "api" if args.node_rank == 0 else f"node{args.node_rank}")
    return Launcher(args).run()
