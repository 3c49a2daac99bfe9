"""ZeroMQ plumbing shared by the processes: an inbox (PULL, bound) that drops bytes which are
not a valid message, outboxes (PUSH, connected), the start-up of a child process (its ServerArgs
read from an inherited pipe, its stdin: never from the command line, which any local user can
read), its heartbeat to the launcher, and the main loop every child runs (serve_forever)."""

from __future__ import annotations

import atexit
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import msgspec
import zmq

from radixlora.errors import RadixLoraError
from radixlora.server.args import ServerArgs
from radixlora.server.messages import Codec, Heartbeat, Message, Ready, ReqError, Sized

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 1.0
HEARTBEAT_S = 1.0


def check_local(endpoint: str) -> None:
    """Only ipc:// or loopback tcp: nothing is ever reachable from another machine."""
    if endpoint.startswith("ipc://") or endpoint.startswith("tcp://127.0.0.1:"):
        return
    raise ValueError(f"refusing ZeroMQ endpoint {endpoint!r}: use ipc:// or tcp://127.0.0.1")


def subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A SUB socket for every message of `endpoint` (the registry's events), unbounded."""
    check_local(endpoint)
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


class Inbox:
    """A bound PULL socket decoding one inbox union; garbage is logged and skipped."""

    def __init__(self, ctx: zmq.Context, endpoint: str, inbox_type, reject=None):
        """reject(ReqError): answers a request-carrying message that fails validation."""
        check_local(endpoint)
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.codec = Codec(inbox_type)
        self.reject = reject

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.sock.poll(timeout_ms))

    def recv(self):
        """Blocking receive of the next valid message."""
        while True:
            msg = self.codec.decode(self.sock.recv(), self.reject)
            if msg is not None:
                return msg

    def recv_nowait(self) -> list:
        """Every valid message already queued."""
        out = []
        while True:
            try:
                raw = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = self.codec.decode(raw, self.reject)
            if msg is not None:
                out.append(msg)

    def recv_within(self, timeout_ms: int) -> list:
        """Every valid message that arrives within timeout_ms (at least one, unless none)."""
        return self.recv_nowait() if self.poll(timeout_ms) else []


class Outbox:
    """A connected PUSH socket."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        check_local(endpoint)
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(endpoint)
        self.encoder = msgspec.msgpack.Encoder()

    def send(self, msg: Message, flags: int = 0) -> None:
        self.sock.send(self.encoder.encode(msg), flags)


LOG_FORMAT = "%(asctime)s [{proc}] %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str, proc: str) -> None:
    """The one log format of every process (uvicorn's loggers propagate to it, and Python
    warnings go through it): time, [process], level, logger: message."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT.format(proc=proc),
                        stream=sys.stderr, force=True)
    logging.captureWarnings(True)


def die_with_parent(parent_pid: int) -> None:
    """Exit when the launcher goes, however it goes (SIGKILL included): no orphans."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    if parent_pid:
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def read_args() -> ServerArgs:
    """ServerArgs from stdin, a pipe only the launcher writes; stdin is then /dev/null."""
    raw = sys.stdin.buffer.read()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return ServerArgs.from_json(raw)


def child_main(proc: str, run, torch_threads: int | None = 1) -> None:
    """Entry point of a child: `python -m radixlora.server.X`, ServerArgs as JSON on stdin.
    torch_threads: the child's intra-op threads (None: torch is not imported here, so it keeps
    its default of one per core if the child imports it). Only the worker computes; the
    scheduler's and registry's few tensor operations (adapter validation) run one per thread or
    process, and a pool of a thread per core in each of them would contend with the worker's
    compiles and with each other (run 33: 8 adapters took 70 s to validate). The tokenizer
    needs no torch."""
    args = read_args()
    if torch_threads is not None:
        import torch  # here: the api process imports this module and never needs torch

        torch.set_num_threads(torch_threads)
    replica = args.data_parallel_size > 1 and proc in ("scheduler", "worker")
    setup_logging(args.log_level, f"{proc}-dp{args.dp_rank}" if replica else proc)
    die_with_parent(args.launcher_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides when children stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context()
    try:
        run(args, ctx)
    except SystemExit:
        raise
    except RadixLoraError as e:
        log.error("%s process cannot start: %s", proc, e)
        sys.exit(1)
    except BaseException:
        log.exception("%s process failed", proc)
        sys.exit(1)
    finally:
        ctx.destroy(linger=0)


def send_ready(ctx: zmq.Context, args: ServerArgs, proc: str, info: dict | None = None,
               kind: type[Ready | Sized] = Ready) -> None:
    out = Outbox(ctx, args.endpoints.launcher)
    out.send(kind(proc=proc, pid=os.getpid(), info=info or {}))
    out.sock.close(linger=1000)


class Heartbeats:
    """A child's heartbeat to the launcher: beat() from the main loop as often as it likes,
    sent at most every HEARTBEAT_S; never blocks (a launcher that stopped reading loses
    beats, not the child's loop)."""

    def __init__(self, ctx: zmq.Context, args: ServerArgs, proc: str):
        check_local(args.endpoints.launcher)
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 4)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(args.endpoints.launcher)
        self.encoder = msgspec.msgpack.Encoder()
        self.proc = proc
        self.pid = os.getpid()
        self.interval = min(HEARTBEAT_S, args.watchdog_timeout_s / 4)
        self.next_at = 0.0

    def beat(self, progress: int = 0) -> None:
        now = time.monotonic()
        if now < self.next_at:
            return
        self.next_at = now + self.interval
        msg = Heartbeat(proc=self.proc, pid=self.pid, progress=progress)
        try:
            self.sock.send(self.encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            log.debug("heartbeat not sent: the launcher is not reading")


def freeze_start_up_heap() -> None:
    """Move what the process built to start (modules, the model, tokenizers, compiled kernels,
    all of it kept until exit) out of the garbage collector's generations, so that a full
    collection while serving, a pause of every stream the process feeds, scans only what
    serving allocated. At exit they are unfrozen, so the interpreter's last collection frees
    them as before (native extensions such as Triton's report objects still alive then as
    leaks)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def serve_forever(heart: Heartbeats, turn: Callable[[], int]) -> NoReturn:
    """The main loop of every child process: a turn (wait, at most the process's own poll
    interval, for what it serves, and handle it), then a heartbeat carrying the progress count
    the turn returns. A turn that never ends silences the process, and the launcher's watchdog
    reports it."""
    freeze_start_up_heap()
    while True:
        heart.beat(turn())


def log_failure(proc: str, msg) -> None:
    """One message's handler raised: the process goes on (the message is lost)."""
    rid = getattr(msg, "rid", None)
    log.exception("%s: handling %s%s failed; the message is dropped", proc, type(msg).__name__,
                  f" of request {rid}" if rid is not None else "")


def failure_error(msg) -> ReqError | None:
    """The ReqError to answer when a request-carrying message's handler failed."""
    rid = getattr(msg, "rid", None)
    if not isinstance(rid, str):
        return None
    return ReqError(rid=rid, message="internal error while handling the request",
                    code="internal_error", status=500)
