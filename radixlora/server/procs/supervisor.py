"""The launcher's child processes: who they are (ChildSpec), starting them with their args,
watching their heartbeats, restarting the optional one, relaying their stderr, stopping them,
and the private directories they share. `radixlora serve` (launcher.py) drives it."""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path

import msgspec

from radixlora.server.args import ServerArgs
from radixlora.server.ipc import Inbox
from radixlora.server.messages import Heartbeat, Ready, Sized
from radixlora.topology import TP_RANK_ENV, node_ranks, worker_rank_name
from radixlora.worker import compile_cache

log = logging.getLogger(__name__)

CHILDREN = ("tokenizer", "scheduler", "worker")
FIRST = "worker"  # sizes the pools; the others start with its sizes
OPTIONAL = ("registry",)  # restarted when it dies; serving goes on without it
RESTART_DELAY_S = (0.5, 30.0)  # first and largest delay before restarting an optional child
RESTART_RESET_S = 60.0  # a child up this long starts again from the first delay
STOP_TIMEOUT_S = 5.0
WORKDIR_PREFIX = "radixlora-"
WORKDIR_NAME = re.compile(r"radixlora-(\d+)-\w+")  # radixlora-<launcher pid>-<random>
CANNOT_START = " process cannot start: "  # a child's start-up failure line (ipc.child_main)
EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*")
RELAY_DRAIN_S = 2.0  # how long a failed start-up waits for the dead child's last lines


class StartupError(Exception):
    pass


@dataclass(frozen=True)
class ChildSpec:
    """One child process: its kind (it runs `radixlora.server.<kind>_proc`), its data-parallel
    replica (None when the server has one) and its tensor-parallel rank (worker ranks > 0)."""

    kind: str
    replica: int | None = None
    rank: int = 0

    @property
    def name(self) -> str:
        """How logs, errors and /server_info name it: worker, worker-tp1, scheduler-dp0."""
        if self.rank:
            return worker_rank_name(self.rank)
        return self.kind if self.replica is None else f"{self.kind}-dp{self.replica}"

    @property
    def sizes_pools(self) -> bool:
        """Whether it measures the pool sizes the others start with (a replica's rank 0)."""
        return self.kind == FIRST and self.rank == 0

    def env(self) -> dict[str, str]:
        """Its environment beside the launcher's: a worker rank's rank; a replica's worker
        drives device `replica` on CUDA (of CUDA_VISIBLE_DEVICES when set)."""
        env = {TP_RANK_ENV: str(self.rank)} if self.rank else {}
        if self.replica is not None and self.kind == FIRST:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(self.replica + 1)]
            env["CUDA_VISIBLE_DEVICES"] = (devices[self.replica] if self.replica < len(devices)
                                           else "")
        return env


def proc_kind(proc: str) -> str:
    """The kind of child a message's `proc` (messages.ProcName: worker-tp<r> for a rank) names."""
    return proc.partition("-")[0]


def core_specs(replicas: int) -> tuple[ChildSpec, ...]:
    """The tokenizer, then each replica's scheduler and worker (no replica when alone)."""
    if replicas == 1:
        return tuple(ChildSpec(kind) for kind in CHILDREN)
    return (ChildSpec("tokenizer"),) + tuple(ChildSpec(kind, i) for i in range(replicas)
                                             for kind in ("scheduler", FIRST))


class Children:
    """The child processes; each runs `python -m radixlora.server.<kind>_proc` and reads its
    ServerArgs as JSON from its stdin (a command line is readable by any local user; the args
    hold the keys). Each must send a heartbeat at least every watchdog_timeout_s once it is
    ready (before that, ready_timeout_s). All start at once, but only the worker gets its args
    at once: the others import meanwhile and get theirs from start_rest, with the pool sizes
    the worker measured, as soon as it has (Sized), so they start while it warms up."""

    def __init__(self, args: ServerArgs):
        self.args = args
        head = args.node_rank == 0
        ranks = tuple(ChildSpec(FIRST, rank=r) for r in node_ranks(args.tensor_parallel_size,
                                                                   args.nnodes, args.node_rank)
                      if r > 0)
        optional = tuple(ChildSpec(kind) for kind in OPTIONAL) if args.adapter_dir and head else ()
        core = (core_specs(args.data_parallel_size) if head else ()) + ranks
        self.specs = {spec.name: spec for spec in core + optional}
        # any dead: the server stops; a node > 0 runs only its worker ranks
        self.core = tuple(spec.name for spec in core)
        self.workers = tuple(spec.name for spec in core if spec.sizes_pools)
        self.names = tuple(self.specs)
        cache = args.engine.get("compile_cache_dir")
        self.bytecode = compile_cache.bytecode_env(
            Path(cache).expanduser() if cache else compile_cache.default_cache_dir())
        self.sized: dict[str, ServerArgs] = {}  # replica children: their replica's sized args
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}  # kept up to date (the api shows it)
        self.started: dict[str, float] = {}
        self.ready_at: dict[str, float] = {}  # child -> when its Ready came (monotonic)
        self.restart_delay: dict[str, float] = {}
        self.deadline: dict[str, float] = {}  # no heartbeat by then: the child is dead
        self.progress: dict[str, int] = {}
        self.silent: dict[str, str] = {}  # child killed for its silence -> why
        self.relays: dict[str, StderrRelay] = {}
        self.starting = threading.Event()  # set: start-up causes are held back (start_failure)
        self.starting.set()
        for spec in self.specs.values():  # the worker ranks meet at start: all get args at once
            self.spawn(spec.name, send_args=spec.kind == FIRST)

    def spawn(self, name: str, send_args: bool = True) -> None:
        spec = self.specs[name]
        cmd = [sys.executable, "-m", f"radixlora.server.procs.{spec.kind}_proc"]
        env = child_env() | self.bytecode | spec.env()
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
        replica = self.specs[name].replica
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
        for name, spec in self.specs.items():
            if spec.replica is not None:
                worker = sized[ChildSpec(FIRST, spec.replica).name].info
                self.sized[name] = sized_args(replica_args(args, spec.replica), worker)
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
            if pid == msg.pid and self.specs[name].kind == proc_kind(msg.proc):
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
                               f"{timeout_s:.0f} s (--ready-timeout)")
        if inbox.poll(100):
            for msg in inbox.recv_nowait():
                children.on_beat(msg)
                name = children.name_of(msg)
                if isinstance(msg, (Ready, Sized)) and name is not None:
                    seen[type(msg)][name] = msg
                if isinstance(msg, Ready) and name is not None:
                    children.ready_at[name] = time.monotonic()
                    log.info("%s process ready (pid %d)", name, msg.pid)
    return seen[kind]


def replica_args(args: ServerArgs, replica: int) -> ServerArgs:
    """Replica `replica`'s view: its scheduler, worker and api endpoints, its own state."""
    state = os.path.join(args.state_dir, f"dp{replica}") if args.state_dir else ""
    if state:
        os.makedirs(state, mode=0o700, exist_ok=True)
    return msgspec.structs.replace(args, endpoints=args.endpoints.replica(replica),
                                   state_dir=state, dp_rank=replica)


def sized_args(args: ServerArgs, worker_info: dict) -> ServerArgs:
    """args with the pool and batch sizes the worker resolved."""
    return msgspec.structs.replace(args, engine={**args.engine, **worker_info["engine"]})
