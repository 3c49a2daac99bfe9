"""Nothing an adapter file does stalls serving: adapters that declare 4 GiB in their
safetensors header (sparse files, so the test stays cheap) are loaded through the admin API
and dropped into --adapter-dir while streams run, on a server whose watchdog kills a process
that misses its heartbeat for 4 s."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx

from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.server_harness import running_server, sparse_adapter

KEY = "stall-admin-key"
STREAM_TOKENS = 48
STREAMS = 2
# A pause this long would be a stall (the 4 GiB read alone takes seconds); below it, a loaded
# 2-core machine's scheduling noise
PAUSE_FLOOR_S = 0.5
# scheduler and registry peak RSS: far below the 4 GiB each huge adapter declares
RSS_BOUND = 1536 << 20


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


def test_huge_adapter_files_neither_pause_streams_nor_kill_processes(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    watched, allowed = tmp_path / "watched", tmp_path / "allowed"
    watched.mkdir()
    allowed.mkdir()
    good = build_tiny_adapter(model, tmp_path / "good", rank=4, seed=3)
    with running_server(model, {}, tmp_path / "server.log", "--adapter-dir", str(watched),
                        "--adapter-quiet", "0.2", "--enable-admin", "--admin-api-key", KEY,
                        "--allowed-adapter-root", str(allowed),
                        "--watchdog-timeout", "4") as server:
        base = next(m["id"] for m in server.http.get("/v1/models").json()["data"]
                    if m.get("parent") is None)
        pids = server.info()["pids"]
        stream_gaps(server.url, base)  # compiled and warm
        with streaming(server.url, base) as baseline:
            time.sleep(3.0)
        with streaming(server.url, base) as during:
            admin = {"authorization": f"Bearer {KEY}"}
            huge = sparse_adapter(allowed / "huge", good, gib=4)
            resp = server.http.post("/v1/load_lora_adapter", headers=admin,
                                    json={"lora_name": "huge", "lora_path": str(huge)})
            assert resp.status_code == 400 and "shape" in resp.json()["error"]["message"]
            sparse_adapter(watched / "huge_dir", good, gib=4)
            time.sleep(1.0)
            shutil.copytree(good, watched / ".good.tmp")  # staged, then renamed in
            os.rename(watched / ".good.tmp", watched / "good")
            deadline = time.monotonic() + 30
            while "good" not in {m["id"] for m in server.http.get("/v1/models").json()["data"]}:
                assert time.monotonic() < deadline, "the good adapter was never published"
                time.sleep(0.1)
            time.sleep(4.5)  # longer than the watchdog's timeout
        health = server.http.get("/health").json()
        assert health["status"] == "ok" and "huge_dir" in health["adapters_rejected"], health
        assert server.info()["pids"] == pids  # no process was killed and restarted
        assert len(baseline) > STREAMS * STREAM_TOKENS and len(during) > 4 * STREAM_TOKENS
        assert max(during) <= max(2 * max(baseline), PAUSE_FLOOR_S), (max(during), max(baseline))
        for name in ("scheduler", "registry"):
            assert peak_rss(pids[name]) < RSS_BOUND, (name, peak_rss(pids[name]))
