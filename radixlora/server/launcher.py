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
(as each does once rank 0 is gone), 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import uvicorn
import uvloop
import zmq

from radixlora import compile_cache
from radixlora.adapters import AdapterChoice
from radixlora.config import ModelConfig
from radixlora.distributed import TP_RANK_ENV, node_ranks, worker_rank_name
from radixlora.sampling import SamplingParams
from radixlora.server.api import Api
from radixlora.server.args import Endpoints, ServerArgs
from radixlora.server.bridge import Health, ProcessBridge, ReqFailed
from radixlora.server.gateway import ClientGateway
from radixlora.server.ipc import Inbox, setup_logging, subscribe
from radixlora.server.messages import GenerateReq, Heartbeat, LauncherInbox, Ready, Sized
from radixlora.server.metrics import Metrics
from radixlora.server.tracing import Tracer
from radixlora.startup import phase_line, process_age_s

log = logging.getLogger(__name__)

CHILDREN = ("tokenizer", "scheduler", "worker")
FIRST = "worker"  # sizes the pools; the others start with its sizes
OPTIONAL = ("registry",)  # restarted when it dies; serving goes on without it
WATCH_INTERVAL_S = 0.2
RESTART_DELAY_S = (0.5, 30.0)  # first and largest delay before restarting an optional child
RESTART_RESET_S = 60.0  # a child up this long starts again from the first delay
DEAD_GRACE_S = 1.0
STOP_TIMEOUT_S = 5.0
WARM_PROMPT_TOKENS = 64
WARM_NEW_TOKENS = 8
WORKDIR_PREFIX = "radixlora-"
WORKDIR_NAME = re.compile(r"radixlora-(\d+)-\w+")  # radixlora-<launcher pid>-<random>
CANNOT_START = " process cannot start: "  # a child's start-up failure line (ipc.child_main)
EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*")
RELAY_DRAIN_S = 2.0  # how long a failed start-up waits for the dead child's last lines
TP_RENDEZVOUS = "tp-rendezvous"  # the ranks' file store in the private directory (one node)


class StartupError(Exception):
    pass


class Children:
    """The child processes; each runs `python -m radixlora.server.<name>_proc` and reads its
    ServerArgs as JSON from its stdin (a command line is readable by any local user; the args
    hold the keys). Each must send a heartbeat at least every watchdog_timeout_s once it is
    ready (before that, ready_timeout_s). All start at once, but only the worker gets its args
    at once: the others import meanwhile and get theirs from start_rest, with the pool sizes
    the worker measured, as soon as it has (Sized), so they start while it warms up."""

    def __init__(self, args: ServerArgs):
        self.args = args
        head = args.node_rank == 0
        ranks = tuple(worker_rank_name(r) for r in node_ranks(args.tensor_parallel_size,
                                                              args.nnodes, args.node_rank)
                      if r > 0)
        # any dead: the server stops; a node > 0 runs only its worker ranks
        self.core = (core_children(args.data_parallel_size) if head else ()) + ranks
        self.workers = tuple(n for n in self.core  # those that size the pools (not TP ranks)
                             if n.split("-")[0] == FIRST and n not in ranks)
        self.names = self.core + (OPTIONAL if args.adapter_dir and head else ())
        cache = args.engine.get("compile_cache_dir")
        self.bytecode = compile_cache.bytecode_env(
            Path(cache).expanduser() if cache else compile_cache.default_cache_dir())
        self.sized: dict[str, ServerArgs] = {}  # replica children: their replica's sized args
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}  # kept up to date (the api shows it)
        self.started: dict[str, float] = {}
        self.restart_delay: dict[str, float] = {}
        self.deadline: dict[str, float] = {}  # no heartbeat by then: the child is dead
        self.progress: dict[str, int] = {}
        self.silent: dict[str, str] = {}  # child killed for its silence -> why
        self.relays: dict[str, StderrRelay] = {}
        self.starting = threading.Event()  # set: start-up causes are held back (start_failure)
        self.starting.set()
        for name in self.names:  # the worker ranks meet at start: all get their args at once
            self.spawn(name, send_args=name in self.workers or name in ranks)

    def spawn(self, name: str, send_args: bool = True) -> None:
        module, rank = name.split("-")[0], name.partition("-tp")[2]
        cmd = [sys.executable, "-m", f"radixlora.server.{module}_proc"]
        env = (child_env() | self.bytecode | ({TP_RANK_ENV: rank} if rank else {})
               | replica_env(name))
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, env=env)
        self.relays[name] = StderrRelay(proc.stderr, self.starting)
        self.procs[name] = proc
        self.pids[name] = proc.pid
        self.started[name] = time.monotonic()
        self.deadline[name] = self.started[name] + self.args.ready_timeout_s
        self.progress.pop(name, None)
        self.silent.pop(name, None)
        if send_args:
            self.send_args(name)

    def args_of(self, name: str) -> ServerArgs:
        """A replica child's args name its replica's endpoints (and, once sized, its worker's
        sizes); the others get the service's."""
        replica = replica_of(name)
        if replica is None:
            return self.args
        return self.sized.get(name) or replica_args(self.args, replica)

    def send_args(self, name: str) -> None:
        stdin = self.procs[name].stdin
        with contextlib.suppress(BrokenPipeError):  # died at once: the watch reports it
            stdin.write(self.args_of(name).to_json().encode())
        with contextlib.suppress(BrokenPipeError):
            stdin.close()

    def start_rest(self, args: ServerArgs, sized: dict[str, Sized]) -> None:
        """Hand every child still waiting for its args these (the sized ones): a replica's
        children those of its own worker."""
        self.args = args
        for name in self.names:
            replica = replica_of(name)
            if replica is not None:
                worker = sized[f"{FIRST}-dp{replica}"].info
                self.sized[name] = sized_args(replica_args(args, replica), worker)
        for name in self.names:
            if not self.procs[name].stdin.closed:
                self.send_args(name)

    def on_beat(self, msg: Ready | Sized | Heartbeat) -> None:
        """A Ready, Sized or Heartbeat from the current process of that name (not a replaced
        one)."""
        name = self.name_of(msg)
        if name is None:
            return
        self.deadline[name] = time.monotonic() + self.args.watchdog_timeout_s
        if isinstance(msg, Heartbeat):
            self.progress[name] = msg.progress

    def name_of(self, msg: Ready | Sized | Heartbeat) -> str | None:
        """The child that sent msg, by its pid (replicas' children share their proc names);
        None for a process that is no longer the child of that name."""
        for name, pid in self.pids.items():
            if pid == msg.pid and name.split("-")[0] == msg.proc.split("-")[0]:
                return name
        return None

    def kill_silent(self, names) -> None:
        """Kill every running child past its heartbeat deadline (stopped or stuck: SIGKILL is
        the one signal a stopped process cannot ignore); exit_reason then says why."""
        now = time.monotonic()
        for name in names:
            proc = self.procs[name]
            if proc.poll() is None and now > self.deadline[name] and name not in self.silent:
                self.silent[name] = (
                    f"the {name} process (pid {proc.pid}) sent no heartbeat for "
                    f"{self.args.watchdog_timeout_s:g} s (progress {self.progress.get(name, 0)})"
                    f" and was killed")
                proc.kill()

    def next_restart_delay(self, name: str) -> float:
        """Exponential backoff for a child that keeps dying; reset once it stayed up."""
        first, largest = RESTART_DELAY_S
        previous = self.restart_delay.get(name)
        up_s = time.monotonic() - self.started.get(name, 0.0)
        delay = first if previous is None or up_s > RESTART_RESET_S else min(2 * previous, largest)
        self.restart_delay[name] = delay
        return delay

    def start_failure(self, name: str) -> str:
        """Why `name` died before it was ready: the cause it logged (held back from the log, so
        that it is printed once, last), else its exit status."""
        relay = self.relays[name]
        relay.done.wait(RELAY_DRAIN_S)
        reason = self.exit_reason(name) or f"the {name} process failed"
        if relay.cause:
            return f"the {name} process cannot start: {relay.cause}"
        if relay.last_error:
            return f"{reason} before it was ready: {relay.last_error}"
        return f"{reason} before it was ready"

    def exit_reason(self, name: str) -> str | None:
        proc = self.procs[name]
        code = proc.poll()
        if code is None:
            return None
        exited = f"the {name} process (pid {proc.pid}) exited with code {code}"
        return self.silent.get(name, exited)

    def first_dead(self, names=CHILDREN) -> str | None:
        name = self.first_dead_name(names)
        return None if name is None else self.exit_reason(name)

    def first_dead_name(self, names=CHILDREN) -> str | None:
        for name in names:
            if self.procs[name].poll() is not None:
                return name
        return None

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        deadline = time.monotonic() + RELAY_DRAIN_S
        for relay in self.relays.values():  # their last lines before ours
            relay.done.wait(max(0.0, deadline - time.monotonic()))


class StderrRelay:
    """Copies a child's stderr to ours on a thread, as it comes: whole lines, and a progress
    bar's redraws (ending in a carriage return) at once. While `holding` is set (the start-up),
    the child's one-line start-up failure (`... process cannot start: CAUSE`) is kept back as
    `cause` for the launcher's last line; `last_error` is the last line that names an exception
    (a traceback's last line)."""

    def __init__(self, stream, holding: threading.Event):
        self.stream = stream
        self.holding = holding
        self.cause: str | None = None
        self.last_error: str | None = None
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="stderr-relay").start()

    def _run(self) -> None:
        pending = b""
        try:
            while chunk := os.read(self.stream.fileno(), 65536):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._line(line.decode(errors="replace"))
                cut = pending.rfind(b"\r")  # a progress bar redraws without a newline
                if cut >= 0:
                    self._write(pending[: cut + 1].decode(errors="replace"))
                    pending = pending[cut + 1 :]
            if pending:
                self._line(pending.decode(errors="replace"))
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError):
                self.stream.close()
            self.done.set()

    def _line(self, text: str) -> None:
        cut = text.rfind("\r")
        if cut >= 0:  # a progress bar's last redraw, then the line
            self._write(text[: cut + 1])
            text = text[cut + 1 :]
        marker = text.find(CANNOT_START)
        if marker >= 0 and self.holding.is_set():
            self.cause = text[marker + len(CANNOT_START):]
            return
        if EXCEPTION_LINE.match(text):
            self.last_error = text
        self._write(text + "\n")

    @staticmethod
    def _write(text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(text)
            sys.stderr.flush()


def child_env() -> dict[str, str]:
    """The launcher's environment without the keys: the children get them in ServerArgs."""
    return {k: v for k, v in os.environ.items()
            if not (k.startswith("RADIXLORA_") and "KEY" in k)}


def make_workdir() -> str:
    """The private 0700 temporary directory, named after this launcher's pid; first removes
    those of this user's launchers that are gone (killed before they could clean up)."""
    remove_stale_workdirs(tempfile.gettempdir())
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
    os.chmod(workdir, 0o700)
    return workdir


def make_state_dir(workdir: str, root: str | None) -> str:
    """The server's state directory (adapter snapshots, registry state): a new private one in
    `root` (--state-dir, which other nodes may read), else in the private directory."""
    if root is None:
        state_dir = os.path.join(workdir, "state")
        os.mkdir(state_dir)
        return state_dir
    prefix = f"{WORKDIR_PREFIX}state-{socket.gethostname()}-{os.getpid()}-"
    state_dir = tempfile.mkdtemp(prefix=prefix, dir=root)
    os.chmod(state_dir, 0o700)
    return state_dir


def remove_stale_workdirs(tmp: str) -> list[str]:
    """Remove radixlora-<pid>-* directories of this user whose pid is no live process."""
    removed = []
    with contextlib.suppress(OSError), os.scandir(tmp) as entries:
        for entry in entries:
            match = WORKDIR_NAME.fullmatch(entry.name)
            if match is None or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            if pid_alive(int(match.group(1))):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            log.info("removed %s, left behind by launcher pid %s", entry.path, match.group(1))
            removed.append(entry.path)
    return removed


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def wait_for(inbox: Inbox, children: Children, timeout_s: float, names: tuple[str, ...],
             kind: type[Ready | Sized], seen: dict[type, dict]) -> dict:
    """The `kind` messages (Ready, or the worker's Sized) of every child in names. Every Ready
    and Sized that arrives meanwhile is kept in seen[type][name], whichever is awaited: they
    come over different sockets, so in any order."""
    deadline = time.monotonic() + timeout_s
    while not set(names) <= set(seen[kind]):
        dead = children.first_dead_name(children.names)
        if dead is not None:
            raise StartupError(children.start_failure(dead))
        if time.monotonic() > deadline:
            missing = sorted(set(names) - set(seen[kind]))
            raise StartupError(f"no {kind.__name__.lower()} acknowledgement from {missing} in "
                               f"{timeout_s:.0f} s")
        if inbox.poll(100):
            for msg in inbox.recv_nowait():
                children.on_beat(msg)
                name = children.name_of(msg)
                if isinstance(msg, (Ready, Sized)) and name is not None:
                    seen[type(msg)][name] = msg
                if isinstance(msg, Ready) and name is not None:
                    log.info("%s process ready (pid %d)", name, msg.pid)
    return seen[kind]


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
            children = self.start_children()
            started = time.monotonic()
            seen: dict[type, dict] = {Sized: {}, Ready: {}}
            if self.head:
                self.size_pools(children, seen, started)
            ready = wait_for(self.inbox, children, self.args.ready_timeout_s, children.names,
                             Ready, seen)
            children.starting.clear()
            log.info("every process ready in %.1f s", time.monotonic() - started)
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
        worker = ready[children.workers[0]].info
        self.phases = worker.get("phases") or {}
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
        log.info("pipeline warm-up in %.2f s", time.monotonic() - started)

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


def core_children(replicas: int) -> tuple[str, ...]:
    """The tokenizer, then each replica's scheduler and worker (unsuffixed when alone)."""
    if replicas == 1:
        return CHILDREN
    return ("tokenizer",) + tuple(f"{proc}-dp{i}" for i in range(replicas)
                                  for proc in ("scheduler", FIRST))


def replica_of(name: str) -> int | None:
    _, marker, replica = name.partition("-dp")
    return int(replica) if marker else None


def replica_args(args: ServerArgs, replica: int) -> ServerArgs:
    """Replica `replica`'s view: its scheduler, worker and api endpoints, its own state."""
    state = os.path.join(args.state_dir, f"dp{replica}") if args.state_dir else ""
    if state:
        os.makedirs(state, mode=0o700, exist_ok=True)
    return msgspec.structs.replace(args, endpoints=args.endpoints.replica(replica),
                                   state_dir=state, dp_rank=replica)


def replica_env(name: str) -> dict[str, str]:
    """A replica's worker drives device `replica` on CUDA: of CUDA_VISIBLE_DEVICES when set."""
    replica = replica_of(name)
    if replica is None or not name.startswith(FIRST):
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(replica + 1)]
    return {"CUDA_VISIBLE_DEVICES": devices[replica] if replica < len(devices) else ""}


def sized_args(args: ServerArgs, worker_info: dict) -> ServerArgs:
    """args with the pool and batch sizes the worker resolved."""
    return msgspec.structs.replace(args, engine={**args.engine, **worker_info["engine"]})


def stop_starting(*_) -> None:
    raise StartupError("stopped by SIGTERM while starting")


def serve(args: ServerArgs) -> int:
    setup_logging(args.log_level, "api" if args.node_rank == 0 else f"node{args.node_rank}")
    return Launcher(args).run()
