"""`radixlora serve`: start the tokenizer, scheduler and worker processes, wait until each has
acknowledged, then serve HTTP from this process (which is also the api process). A child that
dies turns /health to 503 and makes the launcher exit non-zero after stopping the others;
SIGTERM/SIGINT drain: new requests get 503, in-flight ones finish, exit 0. The registry process
(with --adapter-dir) is not needed to serve: if it dies, /health says "degraded" (HTTP 200) and
the launcher restarts it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import msgspec
import uvicorn
import uvloop
import zmq

from radixlora.config import ModelConfig
from radixlora.server.api import Api
from radixlora.server.args import Endpoints, ServerArgs
from radixlora.server.bridge import Health, ProcessBridge
from radixlora.server.gateway import ClientGateway
from radixlora.server.ipc import Inbox
from radixlora.server.messages import LauncherInbox, Ready
from radixlora.server.metrics import Metrics

log = logging.getLogger(__name__)

CHILDREN = ("tokenizer", "scheduler", "worker")
OPTIONAL = ("registry",)  # restarted when it dies; serving goes on without it
WATCH_INTERVAL_S = 0.2
RESTART_DELAY_S = (0.5, 30.0)  # first and largest delay before restarting an optional child
RESTART_RESET_S = 60.0  # a child up this long starts again from the first delay
DEAD_GRACE_S = 1.0
STOP_TIMEOUT_S = 5.0


class StartupError(Exception):
    pass


class Children:
    """The child processes; each runs `python -m radixlora.server.<name>_proc ARGS_JSON`."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.names = CHILDREN + (OPTIONAL if args.adapter_dir else ())
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}  # kept up to date (the api shows it)
        self.started: dict[str, float] = {}
        self.restart_delay: dict[str, float] = {}
        for name in self.names:
            self.spawn(name)

    def spawn(self, name: str) -> None:
        cmd = [sys.executable, "-m", f"radixlora.server.{name}_proc", self.args.to_json()]
        self.procs[name] = subprocess.Popen(cmd, start_new_session=True)
        self.pids[name] = self.procs[name].pid
        self.started[name] = time.monotonic()

    def next_restart_delay(self, name: str) -> float:
        """Exponential backoff for a child that keeps dying; reset once it stayed up."""
        first, largest = RESTART_DELAY_S
        previous = self.restart_delay.get(name)
        up_s = time.monotonic() - self.started.get(name, 0.0)
        delay = first if previous is None or up_s > RESTART_RESET_S else min(2 * previous, largest)
        self.restart_delay[name] = delay
        return delay

    def exit_reason(self, name: str) -> str | None:
        proc = self.procs[name]
        code = proc.poll()
        if code is None:
            return None
        return f"the {name} process (pid {proc.pid}) exited with code {code}"

    def first_dead(self, names=CHILDREN) -> str | None:
        for name in names:
            reason = self.exit_reason(name)
            if reason is not None:
                return reason
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


def wait_ready(inbox: Inbox, children: Children, timeout_s: float) -> dict[str, Ready]:
    ready: dict[str, Ready] = {}
    deadline = time.monotonic() + timeout_s
    while len(ready) < len(children.names):
        dead = children.first_dead(children.names)
        if dead is not None:
            raise StartupError(f"{dead} before it was ready")
        if time.monotonic() > deadline:
            missing = sorted(set(children.names) - set(ready))
            raise StartupError(f"no ready acknowledgement from {missing} in {timeout_s:.0f} s")
        if inbox.poll(100):
            for msg in inbox.recv_nowait():
                ready[msg.proc] = msg
                log.info("%s process ready (pid %d)", msg.proc, msg.pid)
    return ready


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
        self.workdir = tempfile.mkdtemp(prefix="radixlora-")
        os.chmod(self.workdir, 0o700)
        client = (f"tcp://127.0.0.1:{args.zmq_client_port}"
                  if args.zmq_client_port is not None else None)
        state_dir = os.path.join(self.workdir, "state")
        os.mkdir(state_dir)
        self.args = msgspec.structs.replace(
            args, endpoints=Endpoints.in_dir(self.workdir, client), launcher_pid=os.getpid(),
            state_dir=state_dir,
        )
        self.exit_code = 0
        self.server: DrainingServer | None = None
        self.runtime: ProcessBridge | None = None
        self.restart_at: dict[str, float] = {}  # dead optional child -> when to restart it

    def run(self) -> int:
        ctx = zmq.Context()
        inbox = Inbox(ctx, self.args.endpoints.launcher, LauncherInbox)
        children = Children(self.args)
        try:
            ready = wait_ready(inbox, children, self.args.ready_timeout_s)
            inbox.sock.close()
            return uvloop.run(self.serve(children, ready))
        except StartupError as e:
            log.error("start-up failed: %s", e)
            return 1
        finally:
            log.info("stopping the child processes")
            children.stop()
            ctx.destroy(linger=0)
            shutil.rmtree(self.workdir, ignore_errors=True)
            log.info("stopped")

    async def serve(self, children: Children, ready: dict[str, Ready]) -> int:
        args = self.args
        vocab_size = ModelConfig.from_dir(args.model).vocab_size
        metrics = Metrics()
        self.runtime = runtime = ProcessBridge(args, metrics)
        api = Api(args, runtime, metrics, vocab_size, children.pids)
        gateway = ClientGateway(runtime, args.endpoints.client, vocab_size)
        config = uvicorn.Config(api.app(), host=args.host, port=args.port, loop="none",
                                lifespan="off", log_level=args.log_level, access_log=False,
                                timeout_graceful_shutdown=5)
        self.server = DrainingServer(config, self.begin_drain)
        jobs = (runtime.pump(), runtime.pump_events(), gateway.serve(), self.watch(children),
                self.announce())
        tasks = [asyncio.create_task(c) for c in jobs]
        runtime.health = Health.OK
        try:
            await self.server.serve()
        finally:
            for task in tasks:
                task.cancel()
            runtime.close()
        return self.exit_code

    async def announce(self) -> None:
        while not self.server.started:
            await asyncio.sleep(0.05)
        log.info("radixlora ready: http://%s:%d (model %s, adapters %s; zmq clients: %s)",
                 self.args.host, self.args.port, self.args.model_name,
                 sorted(self.args.adapters) or "none", self.args.endpoints.client)

    async def watch(self, children: Children) -> None:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            dead = children.first_dead()
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
            log.warning("drain timeout: %d requests still in flight", len(self.runtime.generations))
        self.server.should_exit = True


def serve(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s [api] %(levelname)s %(name)s: %(message)s")
    return Launcher(args).run()
