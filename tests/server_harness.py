"""Start `radixlora serve` in a subprocess on the tiny random model and talk to it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from radixlora.engine import Engine
from radixlora.server.args import ServerArgs
from radixlora.server.procs.supervisor import sized_args
from radixlora.worker.sizing import SIZED_FIELDS, cpu_config
from scripts.checkpoints import build_tiny_adapter, build_tiny_model

MODEL_NAME = "tiny"
ENGINE_FLAGS = ["--kv-pages", "600", "--max-running", "16", "--adapter-rows", "64"]
# /get_server_info needs the admin key, so test servers run with admin on. The key is in this
# process's environment as in an operator's shell (docs snippets read it there).
ADMIN_KEY = os.environ.setdefault("RADIXLORA_ADMIN_API_KEY", "harness-admin-key")


def build_checkpoints(root: Path) -> tuple[Path, dict[str, Path]]:
    model = build_tiny_model(root / MODEL_NAME)
    adapters = {
        "support": build_tiny_adapter(model, root / "support", rank=8, seed=1),
        "legal": build_tiny_adapter(model, root / "legal", rank=4, seed=2),
    }
    return model, adapters


def sized(args: ServerArgs) -> ServerArgs:
    """args as the launcher hands them to the tokenizer, scheduler and registry processes: with
    the pool and batch sizes the worker resolved (on the CPU, the fixed defaults)."""
    config = cpu_config(args.engine_config())
    return sized_args(args, {"engine": {k: getattr(config, k) for k in SIZED_FIELDS}})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path | None, adapters: dict[str, Path], log_path: Path,
                 *extra: str, admin: bool = True):
        """model None: `radixlora serve` without --model (the bundled demo); admin: add
        --enable-admin (the key: --admin-api-key in extra, else ADMIN_KEY)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "radixlora.cli", "serve", "--port", str(self.port),
               "--log-level", "warning", *ENGINE_FLAGS, *extra]
        if admin and "--enable-admin" not in extra:
            cmd.append("--enable-admin")
        self.admin_key = (extra[extra.index("--admin-api-key") + 1]
                          if "--admin-api-key" in extra else ADMIN_KEY)
        if model is not None:
            cmd += ["--model", str(model)]
        for name, path in adapters.items():
            cmd += ["--adapter", f"{name}={path}"]
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 (lives as long as the server)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready in {timeout_s} s:\n{self.logs()}")

    def logs(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def info(self) -> dict:
        headers = {"authorization": f"Bearer {self.admin_key}"}
        return self.http.get("/get_server_info", headers=headers).json()

    def child_pids(self) -> list[int]:
        return [pid for name, pid in self.info()["pids"].items() if name != "api"]

    def wait_idle(self, timeout_s: float = 10) -> dict:
        """Scheduler info once nothing runs, waits or holds a tree lock."""
        deadline = time.monotonic() + timeout_s
        while True:
            sched = self.info()["scheduler"]
            idle = (sched["running"] == 0 and sched["waiting"] == 0
                    and sched["open_requests"] == 0 and sched["kv_protected_tokens"] == 0)
            if idle or time.monotonic() > deadline:
                return sched
            time.sleep(0.05)

    def stop(self) -> int:
        terminate(self.proc, 30)
        self.http.close()
        self.log.close()
        return self.proc.returncode


def terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if `proc` has not exited within timeout_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_health_503(server, timeout_s: float) -> None:
    """Poll /health until it answers 503 (a core child died) or the server stops answering;
    fail with the server's logs if it answers anything else for `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if server.http.get("/health", timeout=1).status_code == 503:
                return
        except httpx.TransportError:
            break
        time.sleep(0.05)
    raise AssertionError(f"/health never answered 503:\n{server.logs()}")


def assert_all_kv_free(sched: dict) -> None:
    assert sched["running"] == 0 and sched["waiting"] == 0 and sched["open_requests"] == 0
    assert sched["kv_protected_tokens"] == 0
    assert sched["kv_free_tokens"] + sched["kv_cached_tokens"] == sched["kv_capacity_tokens"]
    assert all(refs == 0 for refs in sched["adapter_refs"].values())


@contextlib.contextmanager
def running_server(model: Path | None, adapters: dict[str, Path], log_path: Path, *extra: str,
                   admin: bool = True):
    """A ready server for the duration of the block; it must then drain and exit 0."""
    proc = ServerProcess(model, adapters, log_path, *extra, admin=admin)
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, proc.logs()


def engine_like_server(model: Path, adapters: dict[str, Path]) -> Engine:
    """The offline Engine configured as ENGINE_FLAGS configure the test servers."""
    return Engine(model, adapters=adapters, kv_pages=600, max_running=16, adapter_rows=64)


def sparse_adapter(path: Path, config_from: Path, gib: int) -> Path:
    """An adapter whose safetensors header declares `gib` GiB of a wrongly shaped lora_A, the
    data a sparse hole: costless on disk, as big as it says to whoever reads it."""
    path.mkdir()
    shutil.copy(config_from / "adapter_config.json", path / "adapter_config.json")
    elems = (gib << 30) // 4
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    header = json.dumps({
        key.format("A"): {"dtype": "F32", "shape": [4, elems // 4],
                          "data_offsets": [0, elems * 4]},
        key.format("B"): {"dtype": "F32", "shape": [1, 4],
                          "data_offsets": [elems * 4, elems * 4 + 16]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path / "adapter_model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + elems * 4 + 16)
    return path


def batch_ended(core) -> None:
    """Start validating a registry's directory at start and wait for that batch to end
    (RegistryCore.admit never waits for it: the loop turns meanwhile)."""
    core.validate_ahead()
    while core.ahead is not None and not core.ahead.done():
        time.sleep(0.01)


def registry_turn(core, now: float = 0.0) -> None:
    """A registry loop turn once the batch validating the directory at start has ended."""
    batch_ended(core)
    core.admit(now)


STREAM_TOKENS = 48
STREAMS = 2


def stream_gaps(url: str, model: str) -> list[float]:
    """Seconds between the chunks of one streamed completion."""
    body = {"model": model, "prompt": "Stalls", "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    arrivals = []
    with httpx.Client(base_url=url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                assert json.loads(line[6:])["choices"]
                arrivals.append(time.monotonic())
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


@contextlib.contextmanager
def streaming(url: str, model: str):
    """STREAMS streams, each a new completion as the last ends, for the duration of the block;
    yields the list their chunk gaps are added to."""
    gaps: list[float] = []
    done = threading.Event()

    def stream_until_done():
        while not done.is_set():
            gaps.extend(stream_gaps(url, model))

    threads = [threading.Thread(target=stream_until_done) for _ in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        yield gaps
    finally:
        done.set()
        for t in threads:
            t.join()


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def current_rss(pid: int) -> int:
    """The process's resident set now (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")
