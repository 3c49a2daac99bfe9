"""The api's operator log: the periodic stats line (StatsLog, with a fake clock) and the
--log-requests lines, then both from a real demo server."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time

import numpy as np
import pytest

from radixlora.sampling_params import SamplingParams
from radixlora.server.args import Endpoints, ServerArgs
from radixlora.server.http.bridge import Health, ProcessBridge, ReqFailed
from radixlora.server.http.stats_log import Snapshot, StatsLog, request_line
from radixlora.server.messages import (
    GenerateReq,
    OutputBatch,
    ReqError,
    SampleOutput,
    SchedulerStats,
    ids_to_bytes,
)
from tests.server_harness import running_server

STATS_LINE = re.compile(r"stats: running \d+, waiting \d+, .* generation ([\d.]+) tok/s")
REQUEST_LINE = re.compile(
    r"request (\S+) adapter=(\S+) prompt=(\d+) cached=(\d+) generated=(\d+) finish=(\S+) "
    r"ttft=([\d.]+)ms total=([\d.]+)ms"
)


def scheduler_stats(**fields) -> SchedulerStats:
    base = dict(kv_capacity=1000, kv_used=0, kv_cached=0, running=0, waiting=0,
                prompt_tokens=0, cached_tokens=0)
    return SchedulerStats(**{**base, **fields})


def snapshot(**fields) -> Snapshot:
    base = dict(running=0, waiting=0, kv_used=0, kv_capacity=1000, kv_cached=0,
                lookup_tokens=0, hit_tokens=0, prompt_tokens=0, generation_tokens=0,
                resident_adapters=0, adapter_loads=0, adapter_evictions=0)
    return Snapshot(**{**base, **fields})


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_line_has_every_field_with_rates_from_deltas():
    previous = snapshot(lookup_tokens=1000, hit_tokens=100, prompt_tokens=4000,
                        generation_tokens=10_000)
    current = snapshot(running=12, waiting=3, kv_used=412, kv_cached=8123, lookup_tokens=2000,
                       hit_tokens=730, prompt_tokens=4000 + 25617, generation_tokens=19_451,
                       resident_adapters=8, adapter_loads=120, adapter_evictions=40,
                       host_adapters=33)
    assert StatsLog.line(previous, current, 5.0) == (
        "stats: running 12, waiting 3, KV 41.2% (cached 8123 tok), radix hit 63.0%, "
        "prompt 5123.4 tok/s, generation 1890.2 tok/s, "
        "adapters 8 resident / 120 loads / 40 evictions / 33 in host memory"
    )
    held = dataclasses.replace(current, swaps_waiting=5)
    assert StatsLog.line(previous, held, 5.0, slowest_load_s=0.8123).endswith(
        "33 in host memory, slowest load 812 ms, 5 held by the swap cap")


def test_the_slowest_load_is_that_of_the_interval():
    clock = FakeClock()
    stats_log = StatsLog(5.0, clock)
    stats_log.on_stats(scheduler_stats())
    clock.now += 1
    stats_log.on_stats(scheduler_stats(running=1, adapter_load_seconds=[0.7, 0.002]))
    clock.now += 1
    stats_log.on_stats(scheduler_stats(running=1, adapter_load_seconds=[0.3]))
    clock.now += 4
    assert "slowest load 700 ms" in stats_log.on_stats(scheduler_stats(running=1))
    clock.now += 6
    assert "slowest load" not in stats_log.on_stats(scheduler_stats(running=1))


def test_idle_is_no_line():
    same = snapshot(kv_cached=500, prompt_tokens=10, generation_tokens=99, adapter_loads=3)
    assert StatsLog.line(same, same, 5.0) is None


@pytest.mark.parametrize("busy", [dict(running=1), dict(waiting=2), dict(generation_tokens=1),
                                  dict(prompt_tokens=7)])
def test_any_load_or_token_since_the_last_line_is_busy(busy):
    assert StatsLog.line(snapshot(), snapshot(**busy), 1.0) is not None


def test_hit_rate_without_lookups_is_na():
    line = StatsLog.line(snapshot(lookup_tokens=50, hit_tokens=5),
                         snapshot(running=1, lookup_tokens=50, hit_tokens=5), 1.0)
    assert "radix hit n/a" in line


def test_hit_rate_after_a_cache_flush_counts_from_zero():
    line = StatsLog.line(snapshot(lookup_tokens=900, hit_tokens=800),
                         snapshot(running=1, lookup_tokens=200, hit_tokens=50), 1.0)
    assert "radix hit 25.0%" in line


def test_percentages_round_to_one_decimal():
    line = StatsLog.line(snapshot(), snapshot(running=1, kv_used=1, kv_capacity=3,
                                              lookup_tokens=3, hit_tokens=2), 1.0)
    assert "KV 33.3%" in line and "radix hit 66.7%" in line


def test_stats_log_waits_the_interval_and_counts_tokens_since_the_last_line(caplog):
    clock = FakeClock()
    stats_log = StatsLog(5.0, clock)
    assert stats_log.on_stats(scheduler_stats()) is None  # the baseline
    stats_log.count(prompt_tokens=100, generation_tokens=50)
    clock.now += 2.5
    assert stats_log.on_stats(scheduler_stats(running=1)) is None  # inside the interval
    clock.now += 2.5
    stats_log.count(prompt_tokens=0, generation_tokens=50)
    with caplog.at_level(logging.INFO, logger="radixlora.server.http.stats_log"):
        line = stats_log.on_stats(scheduler_stats(running=1))
    assert "prompt 20.0 tok/s, generation 20.0 tok/s" in line
    assert caplog.messages == [line]
    clock.now += 5.0
    assert "generation 0.0 tok/s" in stats_log.on_stats(scheduler_stats(running=1))
    clock.now += 5.0
    assert stats_log.on_stats(scheduler_stats()) is None  # idle


def test_interval_zero_is_off():
    clock = FakeClock()
    stats_log = StatsLog(0.0, clock)
    for _ in range(3):
        stats_log.count(prompt_tokens=10, generation_tokens=10)
        clock.now += 10.0
        assert stats_log.on_stats(scheduler_stats(running=1)) is None


def test_negative_stats_interval_is_rejected():
    with pytest.raises(ValueError, match="--stats-interval"):
        ServerArgs(model="m", stats_interval_s=-1.0)


def test_request_line():
    assert request_line("cmpl-abc-0", "sql", 512, 256, 64, "length", 0.0351, 0.812) == (
        "request cmpl-abc-0 adapter=sql prompt=512 cached=256 generated=64 finish=length "
        "ttft=35.1ms total=812.0ms"
    )
    assert request_line("r", "base", 9, 0, 0, "error:drain_timeout", None, 1.5, 503) == (
        "request r adapter=base prompt=9 cached=0 generated=0 finish=error:drain_timeout "
        "ttft=- total=1500.0ms status=503"
    )


def output(rid: str, tokens: int, finish: str | None) -> SampleOutput:
    return SampleOutput(rid=rid, index=0, text="secret", token_ids=ids_to_bytes(np.arange(tokens)),
                        logprobs=[], token_texts=None, top=None, finish_reason=finish,
                        matched_stop=None, prompt_tokens=9, cached_tokens=4)


def end_three_ways(bridge: ProcessBridge, reqs: list[GenerateReq]) -> None:
    """Submit reqs "done", "gone" and "failed" (in that order) and end them: "done" finishes
    after 5 tokens, "gone" is aborted after 1 (twice), "failed" gets a 503 error. Closes the
    bridge."""
    bridge.health = Health.OK
    try:
        gens = [bridge.submit([req], "sql")[0] for req in reqs]
        bridge._route(OutputBatch(outputs=[output("done", 3, None), output("gone", 1, None)]))
        bridge._route(OutputBatch(outputs=[output("done", 2, "length")]))
        bridge.abort("gone")
        bridge.abort("gone")
        bridge._route(ReqError(rid="failed", message="m", code="drain_timeout", status=503))
        with pytest.raises(ReqFailed):
            asyncio.run(bridge.collect(gens[2:]))
    finally:
        bridge.close()


def test_bridge_logs_each_request_once_finished_aborted_or_failed(tmp_path, caplog):
    args = ServerArgs(model="m", endpoints=Endpoints.in_dir(tmp_path), log_requests=True)
    reqs = [GenerateReq(rid=rid, params=SamplingParams(), prompt="secret")
            for rid in ("done", "gone", "failed")]
    with caplog.at_level(logging.INFO, logger="radixlora.server.http.stats_log"):
        end_three_ways(ProcessBridge(args), reqs)
    lines = [re.sub(r"ttft=\S+ total=\S+", "T", m) for m in caplog.messages]
    assert lines == [
        "request done adapter=sql prompt=9 cached=4 generated=5 finish=length T",
        "request gone adapter=sql prompt=9 cached=4 generated=1 finish=abort T",
        "request failed adapter=sql prompt=0 cached=0 generated=0 finish=error:drain_timeout T "
        "status=503",
    ]


def test_demo_server_logs_stats_and_each_request(tmp_path):
    log_path = tmp_path / "server.log"
    flags = ("--log-level", "info", "--log-requests", "--stats-interval", "0.5")
    with running_server(None, {}, log_path, *flags) as proc:
        usages = {}
        for model in ("radixlora-demo", "radixlora-demo:upper", "radixlora-demo"):
            body = {"model": model, "prompt": "input: a cat\noutput:\n", "max_tokens": 32,
                    "temperature": 0}
            reply = proc.http.post("/v1/completions", json=body).json()
            usages[f"{reply['id']}-0"] = (model, reply["usage"])
        logs = wait_for_stats_with_generation(log_path)
    requests = {m[1]: m for m in REQUEST_LINE.finditer(logs)}
    assert set(requests) == set(usages)
    for rid, (model, usage) in usages.items():
        adapter, prompt, cached, generated, finish = requests[rid].group(2, 3, 4, 5, 6)
        assert adapter == ("upper" if model.endswith(":upper") else "base")
        assert (int(prompt), int(cached), int(generated)) == (
            usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
            usage["completion_tokens"])
        assert finish in ("stop", "length")
    assert "input: a cat" not in logs


def wait_for_stats_with_generation(log_path, timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        logs = log_path.read_text(errors="replace")
        rates = [float(m[1]) for m in STATS_LINE.finditer(logs)]
        if any(rates) or time.monotonic() > deadline:
            assert any(rates), logs[-3000:]
            return logs
        time.sleep(0.1)


def test_demo_server_without_flags_logs_neither(tmp_path):
    log_path = tmp_path / "server.log"
    with running_server(None, {}, log_path, "--log-level", "info",
                        "--stats-interval", "0") as proc:
        body = {"model": "radixlora-demo", "prompt": "input: a cat\noutput:\n", "max_tokens": 8}
        assert proc.http.post("/v1/completions", json=body).status_code == 200
        time.sleep(1.2)
    logs = log_path.read_text(errors="replace")
    assert "stats: " not in logs and "request cmpl-" not in logs

