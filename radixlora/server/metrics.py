"""Prometheus metrics of the api process (its own registry, exposed at /metrics): per-adapter
request and token counters, TTFT / inter-token / end-to-end latency histograms, and the
scheduler's KV usage and radix hit rate, and the adapter lifecycle (registry events, loads
into the device pool, their latency, evictions, residency)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixlora.server.messages import AdapterEvent, SampleOutput, SchedulerStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10, 30, 60)
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("radixlora_requests", "Requests (prompts) submitted",
                                ["adapter"], registry=r)
        self.finished = Counter("radixlora_requests_finished", "Requests finished",
                                ["adapter", "finish_reason"], registry=r)
        self.aborted = Counter("radixlora_requests_aborted", "Requests aborted (client gone)",
                               ["adapter"], registry=r)
        self.errors = Counter("radixlora_request_errors", "Requests answered with an error",
                              ["code"], registry=r)
        self.prompt_tokens = Counter("radixlora_prompt_tokens", "Prompt tokens",
                                     ["adapter"], registry=r)
        self.cached_tokens = Counter("radixlora_cached_prompt_tokens",
                                     "Prompt tokens served from the radix cache",
                                     ["adapter"], registry=r)
        self.generation_tokens = Counter("radixlora_generation_tokens", "Generated tokens",
                                         ["adapter"], registry=r)
        self.ttft = Histogram("radixlora_time_to_first_token_seconds", "Time to first token",
                              ["adapter"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixlora_inter_token_latency_seconds", "Inter-token latency",
                             ["adapter"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixlora_e2e_request_latency_seconds", "End-to-end latency",
                             ["adapter"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_usage = Gauge("radixlora_kv_usage_ratio", "Used KV slots / capacity",
                              registry=r)
        self.kv_cached = Gauge("radixlora_kv_cached_tokens", "KV tokens held by the radix tree",
                               registry=r)
        self.running = Gauge("radixlora_running_requests", "Running requests", registry=r)
        self.waiting = Gauge("radixlora_waiting_requests", "Waiting requests", registry=r)
        self.hit_rate = Gauge("radixlora_radix_hit_rate",
                              "Radix cache hit tokens / looked-up prompt tokens", registry=r)
        self.adapter_events = Counter("radixlora_adapter_events", "Registry events by kind",
                                      ["kind"], registry=r)
        self.adapter_skips = Counter("radixlora_adapter_skips", "Adapters skipped by the registry",
                                     ["skip_reason"], registry=r)
        self.adapter_rejections = Counter("radixlora_adapter_rejections",
                                          "Adapters the registry rejected", ["reason"], registry=r)
        self.adapter_loads = Gauge("radixlora_adapter_loads",
                                   "Adapter loads into the device pool since start", registry=r)
        self.adapter_evictions = Gauge("radixlora_adapter_evictions",
                                       "Adapters evicted from the device pool since start",
                                       registry=r)
        self.adapter_load_latency = Histogram("radixlora_adapter_load_seconds",
                                              "Worker time to get an adapter to the pool (disk "
                                              "or host tier)", buckets=LOAD_BUCKETS, registry=r)
        self.resident_adapters = Gauge("radixlora_resident_adapters",
                                       "Adapters resident in the device pool", registry=r)
        self.resident_bytes = Gauge("radixlora_resident_adapter_bytes",
                                    "Device pool bytes of the resident adapters", registry=r)
        self.host_adapters = Gauge("radixlora_host_adapters",
                                   "Adapters in the worker's pinned host tier", registry=r)
        self.host_bytes = Gauge("radixlora_host_adapter_bytes",
                                "Bytes of the worker's pinned host tier", registry=r)
        self.swaps_waiting = Gauge("radixlora_adapter_swaps_waiting",
                                   "Requests held back by the swap cap at the last step",
                                   registry=r)
        self._last_token: dict[tuple[str, int], float] = {}

    def on_adapter_event(self, event: AdapterEvent) -> None:
        self.adapter_events.labels(event.kind).inc()
        if event.kind == "skipped":
            self.adapter_skips.labels(event.reason).inc()
        elif event.kind == "rejected":
            self.adapter_rejections.labels(event.reason).inc()

    def on_submit(self, gen) -> None:
        self.requests.labels(gen.adapter_label).inc()

    def on_abort(self, gen) -> None:
        self.aborted.labels(gen.adapter_label).inc()
        for index in range(gen.n):
            self._last_token.pop((gen.req.rid, index), None)

    def on_error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def on_output(self, gen, out: SampleOutput, num_tokens: int, first: bool) -> None:
        """first: the first output of gen (the bridge has set gen.first_token_at)."""
        now = time.monotonic()
        adapter = gen.adapter_label
        key = (out.rid, out.index)
        if first:
            self.ttft.labels(adapter).observe(gen.first_token_at - gen.created)
            self.prompt_tokens.labels(adapter).inc(out.prompt_tokens)
            self.cached_tokens.labels(adapter).inc(out.cached_tokens)
        last = self._last_token.get(key)
        if last is not None and num_tokens:
            for _ in range(num_tokens):
                self.itl.labels(adapter).observe((now - last) / num_tokens)
        self._last_token[key] = now
        self.generation_tokens.labels(adapter).inc(num_tokens)
        if out.finish_reason is not None:
            self._last_token.pop(key, None)
            self.finished.labels(adapter, out.finish_reason).inc()
            if gen.finished:
                self.e2e.labels(adapter).observe(now - gen.created)

    def on_stats(self, stats: SchedulerStats) -> None:
        self.kv_usage.set(stats.kv_used / max(stats.kv_capacity, 1))
        self.kv_cached.set(stats.kv_cached)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        if stats.prompt_tokens:
            self.hit_rate.set(stats.cached_tokens / stats.prompt_tokens)
        self.adapter_loads.set(stats.adapter_loads)
        self.adapter_evictions.set(stats.adapter_evictions)
        for seconds in stats.adapter_load_seconds:
            self.adapter_load_latency.observe(seconds)
        self.resident_adapters.set(stats.resident_adapters)
        self.resident_bytes.set(stats.resident_bytes)
        self.host_adapters.set(stats.host_adapters)
        self.host_bytes.set(stats.host_bytes)
        self.swaps_waiting.set(stats.swaps_waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
