"""Prometheus metrics: adapter labels bounded to the registered names (everything else is
"other"), the scheduler's cumulative totals as counters, per-adapter pool memory and
radixlora_lora_requests_info (vLLM's lora_requests_info); units on Metrics, then the demo
server's /metrics while requests run."""

from __future__ import annotations

import re
import threading
import time

import httpx

from radixlora.sampling_params import SamplingParams
from radixlora.sched.adapter_choice import AdapterChoice
from radixlora.server.http.bridge import Generation
from radixlora.server.http.metrics import Metrics
from radixlora.server.messages import (
    AdapterEvent,
    GenerateReq,
    SampleOutput,
    SchedulerStats,
    ids_to_bytes,
)
from radixlora.step_plan import StepTotals
from tests.server_harness import running_server

SERIES = re.compile(r"^([a-z_:]+)(\{[^}]*\})? ", re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')


def stats(**fields) -> SchedulerStats:
    base = dict(kv_capacity=1000, kv_used=0, kv_cached=0, running=0, waiting=0,
                prompt_tokens=0, cached_tokens=0)
    return SchedulerStats(**{**base, **fields})


def generation(rid: str, *names: str, weight: float = 1.0) -> Generation:
    choices = [AdapterChoice(n, weight) for n in names] or None
    req = GenerateReq(rid=rid, params=SamplingParams(max_tokens=2), prompt="x", adapters=choices)
    return Generation(req, "ignored")


def value(metrics: Metrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_adapter_labels_are_registered_names_or_one_bucket():
    metrics = Metrics()
    metrics.on_stats(stats(registered=["upper", "reverse", "a+b*2"]))
    for rid, names, weight in [("1", ("upper",), 1.0), ("2", ("upper",), 0.5), ("3", (), 1.0),
                               ("4", ("nope",), 1.0), ("5", ("nope-2",), 1.0),
                               ("6", ("upper", "reverse"), 1.0), ("7", ("upper", "nope"), 1.0),
                               ("8", ("a+b*2",), 1.0)]:
        metrics.on_submit(generation(rid, *names, weight=weight))
    counts = {labels["adapter"]: v for name, labels, v in samples(metrics)
              if name == "radixlora_requests_total"}
    assert counts == {"upper": 2, "base": 1, "other": 3, "stack": 1, "a+b*2": 1}


def test_outputs_use_the_same_label_and_unchanged_registration_keeps_the_names():
    metrics = Metrics()
    metrics.on_stats(stats(registered=["upper"]))
    metrics.on_stats(stats())  # registered None: unchanged
    gen = generation("r", "upper")
    gen.first_token_at = gen.created + 0.01
    out = SampleOutput(rid="r", index=0, text="a", token_ids=ids_to_bytes([7]), logprobs=[],
                       token_texts=None, top=None, finish_reason="stop", matched_stop=None,
                       prompt_tokens=5, cached_tokens=2)
    metrics.on_output(gen, out, 1, first=True)
    assert value(metrics, "radixlora_prompt_tokens_total", adapter="upper") == 5
    assert value(metrics, "radixlora_time_to_first_token_seconds_count", adapter="upper") == 1
    assert value(metrics, "radixlora_requests_finished_total", adapter="upper",
                 finish_reason="stop") == 1
    metrics.on_stats(stats(registered=[]))
    metrics.on_submit(generation("s", "upper"))
    assert value(metrics, "radixlora_requests_total", adapter="other") == 1


def test_registry_events_register_names_before_the_scheduler_reports_them():
    metrics = Metrics()
    metrics.on_stats(stats(registered=[]))
    metrics.on_adapter_event(AdapterEvent(seq=1, kind="added", name="fresh"))
    metrics.on_submit(generation("1", "fresh"))
    assert value(metrics, "radixlora_requests_total", adapter="fresh") == 1
    metrics.on_adapter_event(AdapterEvent(seq=2, kind="removed", name="fresh"))
    metrics.on_submit(generation("2", "fresh"))
    assert value(metrics, "radixlora_requests_total", adapter="other") == 1


def test_cumulative_totals_become_counters_across_a_restarted_count():
    metrics = Metrics()
    for loads, evictions, failures in [(3, 1, 0), (5, 1, 1), (5, 4, 1), (2, 0, 0)]:
        metrics.on_stats(stats(adapter_loads=loads, adapter_evictions=evictions,
                               adapter_load_failures=failures))
    assert value(metrics, "radixlora_adapter_loads_total") == 5 + 2
    assert value(metrics, "radixlora_adapter_evictions_total") == 4
    assert value(metrics, "radixlora_adapter_load_failures_total") == 1
    text = metrics.render().decode()
    for name in ("adapter_loads", "adapter_evictions", "adapter_load_failures"):
        assert re.search(rf"^# TYPE radixlora_{name}(_total)? counter$", text, re.M), name


def test_step_totals_become_counters_by_kind():
    metrics = Metrics()
    for steps in (2, 5):
        metrics.on_stats(stats(step_totals={
            "decode": StepTotals(steps, 0.01 * steps, 0.001 * steps, 8 * steps, 8 * steps),
            "mixed": StepTotals(1, 0.05, 0.002, 300, 9)}))
    assert value(metrics, "radixlora_steps_total", kind="decode") == 5
    assert value(metrics, "radixlora_step_seconds_total", kind="decode") == 0.05
    assert value(metrics, "radixlora_step_tokens_total", kind="mixed") == 300
    assert value(metrics, "radixlora_step_requests_total", kind="mixed") == 9
    assert value(metrics, "radixlora_step_plan_seconds_total", kind="mixed") == 0.002


def test_resident_memory_per_adapter_follows_the_pool():
    metrics = Metrics()
    metrics.on_stats(stats(registered=["upper", "reverse"],
                           resident_rows={"upper": 8, "reverse": 4, "gone": 2, "gone2": 1},
                           resident_adapter_bytes={"upper": 800, "reverse": 400, "gone": 200,
                                                   "gone2": 100}))
    assert value(metrics, "radixlora_adapter_resident_rows", adapter="upper") == 8
    assert value(metrics, "radixlora_adapter_resident_bytes", adapter="reverse") == 400
    assert value(metrics, "radixlora_adapter_resident_rows", adapter="other") == 3
    metrics.on_stats(stats(resident_rows={"reverse": 4}, resident_adapter_bytes={"reverse": 400}))
    rows = {labels["adapter"] for name, labels, _ in samples(metrics)
            if name == "radixlora_adapter_resident_rows"}
    assert rows == {"reverse"}


def test_lora_requests_info_keeps_one_series_valued_at_report_time():
    metrics = Metrics()
    before = time.time()
    metrics.on_stats(stats(max_loras=4, running_adapters=["reverse", "upper"],
                           waiting_adapters=["digits"]))
    metrics.on_stats(stats(max_loras=4, running_adapters=["digits"]))
    info = [(labels, v) for name, labels, v in samples(metrics)
            if name == "radixlora_lora_requests_info"]
    assert [labels for labels, _ in info] == [
        {"running_lora_adapters": "digits", "waiting_lora_adapters": "", "max_lora": "4"}]
    assert before <= info[0][1] <= time.time()


def samples(metrics: Metrics):
    for family in metrics.registry.collect():
        for s in family.samples:
            yield s.name, s.labels, s.value


# ---- the demo server -----------------------------------------------------------------------------


def series(text: str) -> set[tuple[str, str]]:
    return {(m[1], m[2] or "") for m in SERIES.finditer(text)}


def adapter_labels(text: str) -> set[str]:
    return {v for _, labels in series(text) for k, v in LABEL.findall(labels) if k == "adapter"}


def lora_info(text: str) -> dict[str, str] | None:
    for name, labels in series(text):
        if name == "radixlora_lora_requests_info":
            return dict(LABEL.findall(labels))
    return None


def complete(http: httpx.Client, model: str, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": model, "prompt": "input: a cat\noutput:\n", "max_tokens": max_tokens,
            "temperature": 0, **extra}
    return http.post("/v1/completions", json=body)


def test_demo_server_metrics(tmp_path):
    with running_server(None, {}, tmp_path / "server.log", "--max-running", "1") as proc:
        http = proc.http
        assert complete(http, "nope").status_code == 404
        assert complete(http, "upper").status_code == 200
        time.sleep(0.6)  # a stats report after the load
        before = http.get("/metrics").text
        assert adapter_labels(before) == {"upper", "other"}
        for i in range(10):  # unknown names, alone and stacked: no new series
            assert complete(http, f"unknown-{i}").status_code == 404
            body = {"adapters": [{"name": "upper", "weight": 1}, {"name": f"x{i}", "weight": 1}]}
            assert complete(http, "radixlora-demo", **body).status_code == 404
        after = http.get("/metrics").text
        assert series(after) == series(before)
        assert "unknown-" not in after and "x1" not in after
        for name in ("adapter_loads", "adapter_evictions", "adapter_load_failures"):
            assert re.search(rf"^# TYPE radixlora_{name}(_total)? counter$", after, re.M)
        assert re.search(r"^radixlora_adapter_loads_total [1-9]", after, re.M), after
        assert re.search(r'^radixlora_adapter_resident_bytes\{adapter="upper"\} [1-9]', after,
                         re.M)

        # --max-running 1: upper runs, then reverse and digits are sent and wait
        seen, threads, statuses = [], [], []

        def send(model: str) -> None:
            with httpx.Client(base_url=proc.url, timeout=60) as own:
                statuses.append(complete(own, model, max_tokens=200, ignore_eos=True).status_code)

        def start(model: str) -> None:
            threads.append(threading.Thread(target=send, args=(model,)))
            threads[-1].start()

        start("upper")
        deadline = time.monotonic() + 10
        while (seen[-1:] or [None])[0] != {"running_lora_adapters": "upper",
                                           "waiting_lora_adapters": "", "max_lora": "32"}:
            assert time.monotonic() < deadline, seen[-3:]
            seen.append(lora_info(http.get("/metrics").text))
        start("reverse")
        start("digits")
        while any(t.is_alive() for t in threads):
            seen.append(lora_info(http.get("/metrics").text))
            time.sleep(0.05)
        for thread in threads:
            thread.join()
        idle = lora_info(http.get("/metrics").text)
    assert statuses == [200, 200, 200]
    waits = [(s["running_lora_adapters"], s["waiting_lora_adapters"]) for s in seen
             if s and s["waiting_lora_adapters"]]
    assert ("upper", "digits,reverse") in waits or ("reverse", "digits") in waits or (
        "digits", "reverse") in waits, seen
    assert idle is not None and idle["max_lora"] == "32"
