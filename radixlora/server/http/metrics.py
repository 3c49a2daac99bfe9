"""Prometheus metrics of the api process (its own registry, exposed at /metrics): per-adapter
request and token counters, TTFT / inter-token / end-to-end latency histograms, and the
scheduler's KV usage and radix hit rate, and the adapter lifecycle (registry events, loads
into the device pool, their latency, evictions, residency), and lora_requests_info (vLLM's
gauge of the running and waiting requests' adapters, which gateways route by). With
data-parallel replicas the unlabelled series are the whole service's (the replicas' stats
merged by the bridge) and the `replica`-labelled ones each replica's, with the router's
outstanding samples and decisions. With `vllm_names` (--vllm-metric-names) the queue, KV
and LoRA gauges are also exported under the names vLLM gives them, which the Gateway API
inference extension's endpoint picker reads by default.

An `adapter` label is only ever "base", a registered adapter's name, STACK or OTHER, so
clients cannot add series by naming adapters (docs/observability.md)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from radixlora.sched.adapter_choice import AdapterChoice
from radixlora.server.messages import AdapterEvent, RouterStats, SampleOutput, SchedulerStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10, 30, 60)
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BASE = "base"
STACK = "stack"  # two or more registered adapters stacked in one request
OTHER = "other"  # any request naming an adapter that is not registered


class VllmGauges:
    """The gauges the endpoint picker reads, under vLLM's names and with its semantics."""

    def __init__(self, r: CollectorRegistry):
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be admitted",
                             registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests running", registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (0 to 1)", registry=r)
        self.gpu_cache_usage = Gauge("vllm:gpu_cache_usage_perc",
                                     "KV cache usage (0 to 1), vLLM's older name", registry=r)
        self.lora_info = Gauge("vllm:lora_requests_info", "Running and waiting requests' "
                               "adapters; the value is when they were last reported",
                               ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                               registry=r)

    def set(self, stats: SchedulerStats) -> None:
        usage = stats.kv_used / max(stats.kv_capacity, 1)
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        self.kv_usage.set(usage)
        self.gpu_cache_usage.set(usage)


class Metrics:
    def __init__(self, vllm_names: bool = False):
        r = self.registry = CollectorRegistry()
        self.vllm = VllmGauges(r) if vllm_names else None
        self.requests = Counter("radixlora_requests", "Requests (prompts) submitted",
                                ["adapter"], registry=r)
        self.finished = Counter("radixlora_requests_finished", "Requests finished",
                                ["adapter", "finish_reason"], registry=r)
        self.aborted = Counter("radixlora_requests_aborted", "Requests aborted (client gone)",
                               ["adapter"], registry=r)
        self.errors = Counter("radixlora_request_errors", "Requests answered with an error",
                              ["code"], registry=r)
        self.base_mismatch = Counter(
            "radixlora_base_mismatch_requests",
            "Requests served with an adapter trained on another weight format than the base's "
            "(--qlora-mismatch serve)", ["adapter"], registry=r)
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
        self.step_counters = {  # StepTotals' fields, by kind of step (decode, mixed)
            field: Counter(f"radixlora_{name}", help_, ["kind"], registry=r)
            for field, name, help_ in (
                ("steps", "steps", "Steps folded"),
                ("seconds", "step_seconds", "Seconds steps held the step pipeline"),
                ("plan_seconds", "step_plan_seconds", "Seconds the scheduler spent planning"),
                ("tokens", "step_tokens", "Tokens the steps computed"),
                ("requests", "step_requests", "Requests in the steps (one per request a step)"))
        }
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
        self.adapter_loads = Counter("radixlora_adapter_loads",
                                     "Adapter loads into the device pool", registry=r)
        self.adapter_evictions = Counter("radixlora_adapter_evictions",
                                         "Adapters evicted from the device pool", registry=r)
        self.adapter_load_failures = Counter("radixlora_adapter_load_failures",
                                             "Adapter versions the worker failed to load (their "
                                             "requests fail, the version is dropped)", registry=r)
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
        self.adapter_rows = Gauge("radixlora_adapter_resident_rows",
                                  "Device pool rows an adapter holds", ["adapter"], registry=r)
        self.adapter_bytes = Gauge("radixlora_adapter_resident_bytes",
                                   "Device pool bytes an adapter holds", ["adapter"], registry=r)
        self.lora_info = Gauge("radixlora_lora_requests_info",
                               "Adapters of the running and waiting requests (vLLM's "
                               "lora_requests_info); the value is when they were last reported",
                               ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                               registry=r)
        self.adapter_running = Gauge("radixlora_adapter_running_requests",
                                     "Running requests on an adapter (a stack counts for each "
                                     "of its adapters)", ["adapter"], registry=r)
        self.adapter_waiting = Gauge("radixlora_adapter_waiting_requests",
                                     "Waiting requests on an adapter (a stack counts for each "
                                     "of its adapters)", ["adapter"], registry=r)
        self.replica_running = Gauge("radixlora_replica_running_requests",
                                     "Running requests of one data-parallel replica",
                                     ["replica"], registry=r)
        self.replica_waiting = Gauge("radixlora_replica_waiting_requests",
                                     "Waiting requests of one data-parallel replica",
                                     ["replica"], registry=r)
        self.replica_kv_usage = Gauge("radixlora_replica_kv_usage_ratio",
                                      "Used KV slots / capacity of one data-parallel replica",
                                      ["replica"], registry=r)
        self.replica_hit_rate = Gauge("radixlora_replica_radix_hit_rate",
                                      "Radix cache hit tokens / looked-up prompt tokens of one "
                                      "data-parallel replica", ["replica"], registry=r)
        self.replica_outstanding = Gauge("radixlora_replica_outstanding_requests",
                                         "Samples the router sent to a replica that have not "
                                         "finished (its load)", ["replica"], registry=r)
        self.router_decisions = Counter("radixlora_router_decisions",
                                        "Requests the router sent to a replica, by why "
                                        "(prefix, adapter, least_loaded, balance, round_robin, "
                                        "pinned)", ["replica", "reason"], registry=r)
        self._last_token: dict[tuple[str, int], float] = {}
        self.registered: frozenset[str] = frozenset()  # names in the scheduler's last stats
        self.announced: set[str] = set()  # added by registry events, not yet in its stats
        self._totals: dict[str, float] = {}  # last cumulative value of each counter from stats
        self._labels: dict[Gauge, set[str]] = {}  # per-adapter gauge -> its adapter labels
        self._lora_info: tuple[str, str, str] | None = None

    def adapter_label(self, choices: list[AdapterChoice] | None) -> str:
        """The bounded label of a prompt's adapters: base, a registered name (at any weight),
        STACK (several registered ones) or OTHER (any name not registered)."""
        if not choices:
            return BASE
        if any(c.name not in self.registered and c.name not in self.announced
               for c in choices):
            return OTHER
        return choices[0].name if len(choices) == 1 else STACK

    def _label(self, gen) -> str:
        return self.adapter_label(gen.req.adapters)

    def on_adapter_event(self, event: AdapterEvent) -> None:
        self.adapter_events.labels(event.kind).inc()
        if event.kind in ("added", "updated") and event.name not in self.registered:
            self.announced.add(event.name)
        elif event.kind == "removed":
            self.announced.discard(event.name)
        if event.kind == "skipped":
            self.adapter_skips.labels(event.reason).inc()
        elif event.kind == "rejected":
            self.adapter_rejections.labels(event.reason).inc()

    def on_submit(self, gen) -> None:
        self.requests.labels(self._label(gen)).inc()

    def on_abort(self, gen) -> None:
        self.aborted.labels(self._label(gen)).inc()
        for index in range(gen.n):
            self._last_token.pop((gen.req.rid, index), None)

    def on_error(self, code: str) -> None:
        self.errors.labels(code).inc()

    def on_output(self, gen, out: SampleOutput, num_tokens: int, first: bool) -> None:
        """first: the first output of gen (the bridge has set gen.first_token_at)."""
        now = time.monotonic()
        adapter = self._label(gen)
        key = (out.rid, out.index)
        if first:
            self.ttft.labels(adapter).observe(gen.first_token_at - gen.created)
            if out.base_mismatch:
                self.base_mismatch.labels(adapter).inc()
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
        for kind, totals in stats.step_totals.items():
            for field, counter in self.step_counters.items():
                self._advance(counter.labels(kind), f"step:{kind}:{field}",
                              getattr(totals, field))
        self.kv_usage.set(stats.kv_used / max(stats.kv_capacity, 1))
        self.kv_cached.set(stats.kv_cached)
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        if stats.prompt_tokens:
            self.hit_rate.set(stats.cached_tokens / stats.prompt_tokens)
        self._advance(self.adapter_loads, "loads", stats.adapter_loads)
        self._advance(self.adapter_evictions, "evictions", stats.adapter_evictions)
        self._advance(self.adapter_load_failures, "load_failures", stats.adapter_load_failures)
        for seconds in stats.adapter_load_seconds:
            self.adapter_load_latency.observe(seconds)
        self.resident_adapters.set(stats.resident_adapters)
        self.resident_bytes.set(stats.resident_bytes)
        self.host_adapters.set(stats.host_adapters)
        self.host_bytes.set(stats.host_bytes)
        self.swaps_waiting.set(stats.swaps_waiting)
        if stats.registered is not None:
            self.registered = frozenset(stats.registered)
            self.announced -= self.registered
        self._set_resident(stats)
        self._set_lora_info(stats)
        if self.vllm is not None:
            self.vllm.set(stats)

    def _set_lora_info(self, stats: SchedulerStats) -> None:
        info = (",".join(stats.running_adapters), ",".join(stats.waiting_adapters),
                str(stats.max_loras))
        gauges = [self.lora_info] + ([self.vllm.lora_info] if self.vllm is not None else [])
        for gauge in gauges:
            if info != self._lora_info and self._lora_info is not None:
                gauge.remove(*self._lora_info)  # one series: the current adapters
            gauge.labels(*info).set_to_current_time()
        self._lora_info = info

    def on_replica_stats(self, replica: int, stats: SchedulerStats) -> None:
        label = str(replica)
        self.replica_running.labels(label).set(stats.running)
        self.replica_waiting.labels(label).set(stats.waiting)
        self.replica_kv_usage.labels(label).set(stats.kv_used / max(stats.kv_capacity, 1))
        if stats.prompt_tokens:
            self.replica_hit_rate.labels(label).set(stats.cached_tokens / stats.prompt_tokens)

    def on_router_stats(self, stats: RouterStats) -> None:
        for replica, load in enumerate(stats.outstanding):
            self.replica_outstanding.labels(str(replica)).set(load)
        for key, total in stats.decisions.items():
            replica, _, reason = key.partition(":")
            self._advance(self.router_decisions.labels(replica, reason), f"router:{key}", total)

    def _advance(self, counter: Counter, key: str, total: float) -> None:
        """Add what a cumulative total from the scheduler grew by (all of it after a restart
        of the count: a smaller total than the last one)."""
        last = self._totals.get(key, 0)
        counter.inc(total - last if total >= last else total)
        self._totals[key] = total

    def _set_resident(self, stats: SchedulerStats) -> None:
        rows = self._by_label(stats.resident_rows)
        self._set_per_adapter(self.adapter_rows, rows)
        self._set_per_adapter(self.adapter_bytes, self._by_label(stats.resident_adapter_bytes))
        self._set_per_adapter(self.adapter_running, self._by_label(stats.running_per_adapter))
        self._set_per_adapter(self.adapter_waiting, self._by_label(stats.waiting_per_adapter))

    def _by_label(self, counts: dict[str, int]) -> dict[str, int]:
        """counts by adapter name -> by bounded label (unregistered names add up as OTHER)."""
        out: dict[str, int] = {}
        for name, count in counts.items():
            label = name if name in self.registered else OTHER
            out[label] = out.get(label, 0) + count
        return out

    def _set_per_adapter(self, gauge: Gauge, values: dict[str, float]) -> None:
        """One series per adapter in values; the series of adapters no longer there go."""
        previous = self._labels.get(gauge, set())
        for label in previous - values.keys():
            gauge.remove(label)
        for label, value in values.items():
            gauge.labels(label).set(value)
        self._labels[gauge] = set(values)

    def render(self) -> bytes:
        return generate_latest(self.registry)
