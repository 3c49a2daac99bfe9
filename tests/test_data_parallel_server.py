"""`radixlora serve --data-parallel-size 2` on the CPU, one server per router policy: the
outputs equal the offline Engine's (so a single replica's) through the official openai client;
a 10-adapter workload with shared prefixes hits the replicas' radix caches more under the
cache-aware router than under round-robin (measured from the replicas' own counters); a burst
on one adapter and prefix spreads over both replicas, neither holding more than it can run;
admin loads and hot-swapped adapters reach every replica, an abort the replica that holds the
request, SIGTERM drains both, and a killed replica worker stops the server like any core
child."""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from radixlora.sampling_params import SamplingParams
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.server_harness import (
    MODEL_NAME,
    ServerProcess,
    assert_all_kv_free,
    engine_like_server,
    running_server,
)

NUM_ADAPTERS = 10
PER_ADAPTER = 4
PREFIX_TOKENS = 32
SUFFIX_TOKENS = 8
MAX_RUNNING = 16  # the harness's --max-running, per replica
BURST = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("dp")
    model = build_tiny_model(root / MODEL_NAME)
    adapters = {f"a{i}": build_tiny_adapter(model, root / "adapters" / f"a{i}",
                                            rank=4 if i % 2 else 8, seed=100 + i)
                for i in range(NUM_ADAPTERS)}
    return model, adapters


def serve(checkpoints, log: Path, policy: str, *extra: str):
    model, adapters = checkpoints
    root = str(next(iter(adapters.values())).parent)
    return running_server(model, adapters, log, "--data-parallel-size", "2",
                          "--router-policy", policy, "--allowed-adapter-root", root, *extra)


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def shared_prefix_workload(seed: int = 0) -> list[tuple[str, list[int]]]:
    """PER_ADAPTER prompts per adapter: the adapter's PREFIX_TOKENS-token system prompt, then
    SUFFIX_TOKENS of their own (starting with a token no other prompt of the adapter starts
    its suffix with); in a random order."""
    rng = random.Random(seed)
    work = []
    for a in range(NUM_ADAPTERS):
        system = [rng.randrange(1, 500) for _ in range(PREFIX_TOKENS)]
        firsts = rng.sample(range(1, 500), PER_ADAPTER)
        for first in firsts:
            suffix = [first] + [rng.randrange(1, 500) for _ in range(SUFFIX_TOKENS - 1)]
            work.append((f"a{a}", system + suffix))
    rng.shuffle(work)
    return work


def expected_hits(work, policy: str) -> int:
    """Prompts that find their system prompt cached when each runs alone, in order: under
    cache_aware an adapter stays on the replica it was first sent to, so only its first prompt
    misses; round_robin sends prompt k to replica k % 2, missing once per (adapter, replica)."""
    seen: set[tuple[str, int]] = set()
    hits = 0
    for k, (adapter, _) in enumerate(work):
        key = (adapter, 0 if policy == "cache_aware" else k % 2)
        hits += key in seen
        seen.add(key)
    return hits


def radix_counters(server) -> dict[str, dict[str, int]]:
    """Each replica's radix hit and looked-up tokens from its own stats (sent every 0.5 s),
    once two reads 0.6 s apart agree."""
    last = None
    while True:
        now = server.info()["router"]["radix"]
        if now == last:
            return now
        last = now
        time.sleep(0.6)


def run_alone(client, work) -> list[int]:
    """Each prompt after the previous one finished; the cached tokens each response reports."""
    cached = []
    for adapter, ids in work:
        out = client.completions.create(model=adapter, prompt=ids, max_tokens=2, temperature=0)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    return cached


def measure_hit_rate(server, work, policy: str) -> float:
    cached = run_alone(client_of(server), work)
    counters = radix_counters(server)
    hits = sum(c["cached_tokens"] for c in counters.values())
    lookups = sum(c["prompt_tokens"] for c in counters.values())
    assert hits == sum(cached) == expected_hits(work, policy) * PREFIX_TOKENS
    return hits / lookups


def test_cache_aware_router(checkpoints, tmp_path):
    work = shared_prefix_workload()
    with serve(checkpoints, tmp_path / "log", "cache_aware") as server:
        hit_rate = measure_hit_rate(server, work, "cache_aware")
        # 30 of the 40 prompts hit their 32-token system prompt (each adapter misses once); a
        # prompt of 40 tokens looks up 39 (the last is computed), so 960 of 1560 tokens hit
        assert expected_hits(work, "cache_aware") == 30
        assert hit_rate == pytest.approx(30 * PREFIX_TOKENS / (40 * 39), abs=1e-9)
        check_outputs_equal_engine(server, checkpoints)
        check_burst_spreads(server)
        check_admin_reaches_every_replica(server, checkpoints)
        check_abort_reaches_its_replica(server)


def test_round_robin_router_then_a_dead_replica(checkpoints, tmp_path):
    work = shared_prefix_workload()
    model, adapters = checkpoints
    watched = tmp_path / "watched"
    watched.mkdir()
    server = ServerProcess(model, adapters, tmp_path / "log", "--data-parallel-size", "2",
                           "--router-policy", "round_robin", "--adapter-dir", str(watched),
                           "--adapter-quiet", "0.1")
    try:
        server.wait_ready()
        hit_rate = measure_hit_rate(server, work, "round_robin")
        # in this order round-robin sends 9 of the 10 adapters to both replicas: 21 hits where
        # the router has 30 (hit rate 0.431 against 0.615)
        assert expected_hits(work, "round_robin") == 21
        assert hit_rate == pytest.approx(21 * PREFIX_TOKENS / (40 * 39), abs=1e-9)
        shutil.copytree(adapters["a4"], watched / "hot")
        wait_on_every_replica(server, "hot")
        pids = server.info()["pids"]
        os.kill(pids["worker-dp1"], signal.SIGKILL)
        assert wait_status(server) == 503
        assert server.proc.wait(30) == 1
        assert "worker-dp1 process" in server.logs()
    finally:
        server.stop()


def wait_on_every_replica(server, name: str, timeout_s: float = 20) -> None:
    """The registry's event for a hot-swapped adapter reaches every replica's scheduler."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = server.info()["scheduler"]["replicas"]
        if all(name in {a["name"] for a in r["adapters"]} for r in replicas):
            return
        assert time.monotonic() < deadline, replicas
        time.sleep(0.1)


def wait_status(server, timeout_s: float = 10) -> int:
    deadline = time.monotonic() + timeout_s
    status = 200
    while status == 200 and time.monotonic() < deadline:
        try:
            status = server.http.get("/health").status_code
        except httpx.TransportError:
            status = 0
        time.sleep(0.05)
    return status


# ---- checks on the cache-aware server ----------------------------------------------------------


def check_outputs_equal_engine(server, checkpoints) -> None:
    """Greedy outputs of the base, single adapters and a stack equal a one-device Engine's,
    on whichever replica the router picks (both serve some of them)."""
    engine = engine_like_server(*checkpoints)
    client = client_of(server)
    prompt = "A radix cache shares prefix KV"
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    stack = [{"name": "a1", "weight": 1.0}, {"name": "a2", "weight": 0.5}]
    cases = [(MODEL_NAME, None, None)] + [(f"a{i}", None, f"a{i}") for i in range(6)]
    cases.append((MODEL_NAME, stack, [("a1", 1.0), ("a2", 0.5)]))
    before = decisions_per_replica(server)
    for model, adapters, spec in cases:
        want = engine.generate(prompt, params, adapters=spec)[0].outputs[0].text
        extra = {"ignore_eos": True} | ({"adapters": adapters} if adapters else {})
        got = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                        temperature=0, extra_body=extra)
        assert got.choices[0].text == want, model
    after = decisions_per_replica(server)
    assert all(after[r] > before[r] for r in ("0", "1")), (before, after)


def decisions_per_replica(server) -> dict[str, int]:
    """Requests routed to each replica so far (the router reports every 0.5 s)."""
    time.sleep(0.6)
    counts = {"0": 0, "1": 0}
    for key, n in server.info()["router"]["decisions"].items():
        counts[key.partition(":")[0]] += n
    return counts


def check_burst_spreads(server) -> None:
    """BURST concurrent requests on one adapter and one prefix: the cache-aware choice alone
    would queue them all on one replica; the load bound spreads them, so both replicas run
    some and neither ever holds more than it can run at once (MAX_RUNNING)."""
    prefix = list(range(100, 100 + PREFIX_TOKENS))
    bodies = [{"model": "a0", "prompt": prefix + [300 + k], "max_tokens": 32, "ignore_eos": True}
              for k in range(BURST)]
    before = decisions_per_replica(server)
    peaks, stop = {"0": 0, "1": 0}, threading.Event()
    sampler = threading.Thread(target=sample_peaks, args=(server, peaks, stop))
    sampler.start()
    with ThreadPoolExecutor(BURST) as pool:
        statuses = list(pool.map(lambda b: server.http.post("/v1/completions", json=b)
                                 .status_code, bodies))
    stop.set()
    sampler.join()
    assert statuses == [200] * BURST
    after = decisions_per_replica(server)
    shares = [after[r] - before[r] for r in ("0", "1")]
    assert sum(shares) == BURST and min(shares) >= BURST // 4, shares
    assert 0 < max(peaks.values()) <= MAX_RUNNING and min(peaks.values()) > 0, peaks
    reasons = {key.partition(":")[2] for key in server.info()["router"]["decisions"]}
    assert "balance" in reasons


def sample_peaks(server, peaks: dict[str, int], stop: threading.Event) -> None:
    """The most requests (running + waiting) each replica's scheduler held at once."""
    while not stop.is_set():
        for r, info in enumerate(server.info()["scheduler"]["replicas"]):
            peaks[str(r)] = max(peaks[str(r)], info["running"] + info["waiting"])


def check_admin_reaches_every_replica(server, checkpoints) -> None:
    _, adapters = checkpoints
    headers = {"authorization": f"Bearer {server.admin_key}"}
    body = {"lora_name": "late", "lora_path": str(adapters["a3"])}
    assert server.http.post("/v1/load_lora_adapter", json=body,
                            headers=headers).status_code == 200
    replicas = server.info()["scheduler"]["replicas"]
    assert all("late" in {a["name"] for a in r["adapters"]} for r in replicas)
    ids = {a["name"]: a["adapter_id"] for a in server.info()["scheduler"]["adapters"]}
    assert ids["late"] == ids["a3"]  # the same content on both replicas
    models = {m.id for m in client_of(server).models.list().data}
    assert {"late", "a3", MODEL_NAME} <= models
    assert server.http.post("/v1/unload_lora_adapter", json={"lora_name": "late"},
                            headers=headers).status_code == 200
    replicas = server.info()["scheduler"]["replicas"]
    assert not any("late" in {a["name"] for a in r["adapters"]} for r in replicas)


def check_abort_reaches_its_replica(server) -> None:
    """A stream dropped after its first chunk: the replica that runs it frees everything."""
    body = {"model": "a5", "prompt": "A radix cache", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        next(response.iter_lines())
    server.wait_idle()
    for replica in server.info()["scheduler"]["replicas"]:
        assert_all_kv_free(replica)
