"""How the api merges data-parallel replicas' reports (stats, info) and what /metrics shows of
them: service-wide sums and unions, replica-labelled gauges, the router's decisions, and the
per-adapter running and waiting gauges an external router reads; and the start-up checks of
--data-parallel-size."""

from __future__ import annotations

import re

import pytest

from radixlora.server.http.bridge import merge_infos, merge_stats
from radixlora.server.http.metrics import Metrics
from radixlora.server.messages import RouterStats, SchedulerStats
from radixlora.step_plan import StepTotals


def stats(**fields) -> SchedulerStats:
    base = dict(kv_capacity=100, kv_used=10, kv_cached=5, running=1, waiting=0,
                prompt_tokens=40, cached_tokens=10, max_loras=8, registered=["a", "b"])
    return SchedulerStats(**(base | fields))


def samples(metrics: Metrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {name: float(value) for name, value in re.findall(r"^(\S+) (\S+)$", text, re.M)
            if not name.startswith("#")}


def test_merged_stats_sum_counts_and_unite_adapters():
    replicas = {
        0: stats(running_adapters=["a"], running_per_adapter={"a": 1},
                 resident_rows={"a": 8}, adapter_loads=3),
        1: stats(kv_used=30, running=2, waiting=1, running_adapters=["a", "b"],
                 waiting_adapters=["b"], running_per_adapter={"a": 1, "b": 1},
                 waiting_per_adapter={"b": 1}, resident_rows={"a": 8, "b": 4},
                 adapter_loads=2),
    }
    replicas[0].step_totals = {"decode": StepTotals(3, 0.5, 0.1, 30, 30)}
    replicas[1].step_totals = {"decode": StepTotals(1, 0.25, 0.1, 10, 10),
                               "mixed": StepTotals(1, 0.5, 0.2, 90, 5)}
    merged = merge_stats(replicas, [0.01], {0: ["a", "b"], 1: ["a", "b", "c"]})
    assert merged.step_totals == {"decode": StepTotals(4, 0.75, 0.2, 40, 40),
                                  "mixed": StepTotals(1, 0.5, 0.2, 90, 5)}
    assert (merged.kv_capacity, merged.kv_used, merged.running, merged.waiting) == (200, 40, 3, 1)
    assert (merged.prompt_tokens, merged.cached_tokens) == (80, 20)
    assert merged.max_loras == 16 and merged.adapter_loads == 5
    assert merged.running_adapters == ["a", "b"] and merged.waiting_adapters == ["b"]
    assert merged.running_per_adapter == {"a": 2, "b": 1}
    assert merged.waiting_per_adapter == {"b": 1}
    assert merged.resident_rows == {"a": 16, "b": 4}
    assert merged.registered == ["a", "b", "c"] and merged.adapter_load_seconds == [0.01]


def test_merged_info_sums_numbers_and_keeps_each_replica():
    infos = [
        {"running": 1, "kv_free_tokens": 90, "adapter_event_seq": 7, "adapter_pinned": ["a"],
         "adapter_refs": {"h1": 1}, "adapters": [{"name": "a", "adapter_id": "h1"}],
         "recent_steps": [[1.0, 0.5, 3, 0], [3.0, 0.5, 3, 10]]},
        {"running": 2, "kv_free_tokens": 80, "adapter_event_seq": 6, "adapter_pinned": ["b"],
         "adapter_refs": {"h1": 2, "h2": 1},
         "adapters": [{"name": "a", "adapter_id": "h1"}, {"name": "b", "adapter_id": "h2"}],
         "recent_steps": [[2.0, 0.5, 1, 5]]},
    ]
    merged = merge_infos(infos)
    assert (merged["running"], merged["kv_free_tokens"]) == (3, 170)
    assert merged["adapter_event_seq"] == 6  # the replica furthest behind
    assert merged["adapter_pinned"] == ["a", "b"]
    assert merged["adapter_refs"] == {"h1": 3, "h2": 1}
    assert [a["name"] for a in merged["adapters"]] == ["a", "b"]
    assert [step[0] for step in merged["recent_steps"]] == [1.0, 2.0, 3.0]  # in time order
    assert merged["replicas"] == infos


def test_per_adapter_gauges_follow_the_latest_stats_with_bounded_labels():
    metrics = Metrics()
    metrics.on_stats(stats(running_per_adapter={"a": 2, "unknown": 1},
                           waiting_per_adapter={"b": 3}))
    got = samples(metrics)
    assert got['radixlora_adapter_running_requests{adapter="a"}'] == 2
    assert got['radixlora_adapter_running_requests{adapter="other"}'] == 1
    assert got['radixlora_adapter_waiting_requests{adapter="b"}'] == 3
    metrics.on_stats(stats(running_per_adapter={"b": 1}))
    got = samples(metrics)
    assert got['radixlora_adapter_running_requests{adapter="b"}'] == 1
    assert not any(k.startswith("radixlora_adapter_waiting_requests{") for k in got)
    assert 'radixlora_adapter_running_requests{adapter="a"}' not in got


def test_replica_gauges_and_router_decisions():
    metrics = Metrics()
    metrics.on_replica_stats(1, stats(kv_used=25, running=3, waiting=2))
    metrics.on_router_stats(RouterStats(policy="cache_aware", outstanding=[4, 5],
                                        tree_tokens=[0, 0],
                                        decisions={"0:prefix": 3, "1:balance": 1}))
    metrics.on_router_stats(RouterStats(policy="cache_aware", outstanding=[0, 1],
                                        tree_tokens=[0, 0],
                                        decisions={"0:prefix": 7, "1:balance": 1}))
    got = samples(metrics)
    assert got['radixlora_replica_running_requests{replica="1"}'] == 3
    assert got['radixlora_replica_waiting_requests{replica="1"}'] == 2
    assert got['radixlora_replica_kv_usage_ratio{replica="1"}'] == 0.25
    assert got['radixlora_replica_radix_hit_rate{replica="1"}'] == 0.25
    assert got['radixlora_replica_outstanding_requests{replica="1"}'] == 1
    assert got['radixlora_router_decisions_total{reason="prefix",replica="0"}'] == 7
    assert got['radixlora_router_decisions_total{reason="balance",replica="1"}'] == 1


def test_replicas_need_as_many_cuda_devices_and_no_tensor_parallel():
    import torch

    from radixlora.cli import StartError, check_replicas
    from radixlora.server.args import ServerArgs

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_replicas({"device": "cpu"}, 4)  # every replica on the CPU
    wanted = visible + 2  # more than visible, and more than one
    with pytest.raises(StartError, match=rf"^--data-parallel-size {wanted} needs {wanted} CUDA "
                                         rf"devices .* {visible} visible"):
        check_replicas({"device": "cuda"}, wanted)
    with pytest.raises(ValueError, match="--data-parallel-size with --tensor-parallel-size"):
        ServerArgs(model="m", data_parallel_size=2, tensor_parallel_size=2)
