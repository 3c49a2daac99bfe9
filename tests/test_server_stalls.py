"""Nothing an adapter file does stalls serving: adapters that declare 4 GiB in their
safetensors header (sparse files, so the test stays cheap) are loaded through the admin API
and dropped into --adapter-dir while streams run, on a server whose watchdog kills a process
that misses its heartbeat for 4 s."""

from __future__ import annotations

import gc
import os
import shutil
import time

from radixlora.server.ipc import freeze_start_up_heap
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.server_harness import (
    STREAM_TOKENS,
    STREAMS,
    peak_rss,
    running_server,
    sparse_adapter,
    stream_gaps,
    streaming,
)

KEY = "stall-admin-key"
# A pause this long would be a stall (the 4 GiB read alone takes seconds); below it, a loaded
# 2-core machine's scheduling noise
PAUSE_FLOOR_S = 0.5
# scheduler and registry peak RSS: far below the 4 GiB each huge adapter declares
RSS_BOUND = 1536 << 20


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


def test_a_full_collection_while_serving_scans_only_what_serving_allocated():
    """Every process freezes its start-up heap before serving (freeze_start_up_heap, called by
    serve_forever and the api before it accepts clients): what start-up built leaves the
    collector's generations, so a full collection no longer walks it."""
    start_up = [[] for _ in range(10_000)]
    try:
        freeze_start_up_heap()
        assert gc.get_freeze_count() >= len(start_up)
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(o) in tracked for o in start_up)
        serving = [[] for _ in range(10)]
        tracked = {id(o) for o in gc.get_objects()}
        assert all(id(o) in tracked for o in serving)  # what serving allocates is collected
    finally:
        gc.unfreeze()
