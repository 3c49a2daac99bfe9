"""Process faults of `radixlora serve`: a SIGKILLed worker (health 503, launcher exits non-zero,
no orphans), SIGTERM with streams in flight (they complete, new requests get 503, exit 0), and a
start-up that cannot succeed (non-zero exit, a clear message)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server_harness import (
    MODEL_NAME,
    ServerProcess,
    alive,
    build_checkpoints,
    wait_health_503,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("faults"))


def _start(checkpoints, tmp_path) -> ServerProcess:
    model, adapters = checkpoints
    server = ServerProcess(model, adapters, tmp_path / "log")
    server.wait_ready()
    return server


def _wait_gone(pids: list[int], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), [p for p in pids if alive(p)]


def test_sigkill_worker(checkpoints, tmp_path):
    server = _start(checkpoints, tmp_path)
    pids = server.info()["pids"]
    children = [pid for name, pid in pids.items() if name != "api"]
    server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                              "max_tokens": 2})
    in_flight = {}

    def long_request():
        body = {"model": "support", "prompt": "hi", "max_tokens": 500, "ignore_eos": True}
        try:
            in_flight["status"] = server.http.post("/v1/completions", json=body).status_code
        except httpx.TransportError as e:
            in_flight["status"] = type(e).__name__

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.3)
    os_kill(pids["worker"])
    wait_health_503(server, 5)
    t.join(10)
    assert in_flight["status"] in (503, "RemoteProtocolError", "ReadError")  # not left hanging
    assert server.proc.wait(15) != 0
    _wait_gone(children)
    server.stop()
    assert "worker process" in server.logs()


def test_hung_worker_stops_the_service(checkpoints, tmp_path):
    model, adapters = checkpoints
    server = ServerProcess(model, adapters, tmp_path / "log", "--step-timeout", "2")
    server.wait_ready()
    pids = server.info()["pids"]
    children = [pid for name, pid in pids.items() if name != "api"]
    os.kill(pids["worker"], signal.SIGSTOP)  # hung: alive, never answers
    status = {}

    def request():
        try:
            body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}
            status["code"] = server.http.post("/v1/completions", json=body).status_code
        except httpx.TransportError as e:
            status["code"] = type(e).__name__

    t = threading.Thread(target=request)
    t.start()
    assert server.proc.wait(30) != 0
    t.join(10)
    assert status["code"] in (503, "RemoteProtocolError", "ReadError")
    _wait_gone(children)
    server.stop()
    assert "hung" in server.logs()


def os_kill(pid: int) -> None:
    import os

    os.kill(pid, signal.SIGKILL)


def test_sigterm_drains_streams(checkpoints, tmp_path):
    server = _start(checkpoints, tmp_path)
    children = server.child_pids()
    results: list[tuple[int, str | None, int]] = []
    started = threading.Barrier(3)

    def stream(adapter: str) -> None:
        body = {"model": adapter, "prompt": "A radix", "max_tokens": 60, "ignore_eos": True,
                "stream": True, "temperature": 0}
        chunks, finish = 0, None
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream(
                "POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 1:
                        started.wait()
                    finish = httpx.Response(200, content=line[6:]).json()["choices"][0][
                        "finish_reason"] or finish
            results.append((resp.status_code, finish, chunks))

    threads = [threading.Thread(target=stream, args=(a,)) for a in ("support", "legal")]
    for t in threads:
        t.start()
    started.wait()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    try:
        refused = server.http.post("/v1/completions",
                                   json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503
        assert server.http.get("/health").status_code == 503
    except httpx.TransportError:
        pass  # already stopped listening: also refuses new work
    for t in threads:
        t.join(60)
    assert sorted(results) == [(200, "length", 60), (200, "length", 60)]
    assert server.proc.wait(30) == 0, server.logs()
    _wait_gone(children)
    server.stop()


def test_startup_failure_exits_nonzero(checkpoints, tmp_path):
    model, _ = checkpoints
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    cmd = [sys.executable, "-m", "radixlora.cli", "serve", "--model", str(model),
           "--adapter", f"broken={broken}", "--port", "1", "--log-level", "warning"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "radixlora serve: error: adapter 'broken'" in proc.stderr  # refused before start
    assert "Traceback" not in proc.stderr
