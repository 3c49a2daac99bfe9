"""How big the pools and batches are when the flags leave them open.

On the CPU they are small fixed values. On CUDA, after the weights are loaded and a profiling
step has measured what activations take: a `gpu_memory_utilization` share of the device's
memory, less what is in use (weights, CUDA context, other processes), the activations and the
CUDA graphs, is split between the adapter pool (`max_loras` adapters of rank `max_rank` on every
target module, or `adapter_rows` rows, at the byte size of a row in the pool's dtype: an int8
pool's `max_loras` cost about half a bf16 pool's; when both pools are sized, at most
ADAPTER_SHARE_MAX of their room) and the KV pool (the rest, or `kv_pages`).
Batch limits follow the device and the KV pool: a chunked-prefill budget of `max_batch_tokens`
tokens per step by the device's size, and `max_running` requests by the KV pool (one per
TOKENS_PER_RUNNING tokens of it, between CUDA_MIN_RUNNING and CUDA_MAX_RUNNING): the scheduler
admits requests while their KV fits, so the limit only keeps a batch of short requests from
growing without end. Batches above the largest CUDA-graph bucket run eagerly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from radixlora.config import (
    EXPERT_GROUPS,
    LINEAR_GROUPS,
    MODULE_GROUPS,
    EngineConfig,
    ModelConfig,
    target_groups,
)
from radixlora.errors import AdapterError, SizingError
from radixlora.lora.adapter import LoraAdapter
from radixlora.lora.header import adapter_from_header

log = logging.getLogger(__name__)

GIB = 1 << 30
CPU_DEFAULTS = {"kv_pages": 4096, "adapter_rows": 512, "max_running": 64,
                "max_batch_tokens": 2048}
# what the worker resolves and the other processes follow
SIZED_FIELDS = (*CPU_DEFAULTS, "host_adapter_bytes", "lora_target_modules")
HOST_TIER_SHARE = 0.25  # of the host memory available at start, for packed adapters
# Running requests on CUDA: one per TOKENS_PER_RUNNING tokens of the KV pool, within these
# bounds (an H200 beside an 8B model: 1024). On an H200, a ShareGPT-like burst of 2,000 requests
# ran 11.2k tok/s at 1024 against 9.9k at 2048, whose mixed steps filled the whole prefill
# budget beside 1,000 decodes (docs/perf-log.md, run 30).
CUDA_MIN_RUNNING, CUDA_MAX_RUNNING = 256, 1024
TOKENS_PER_RUNNING = 256
MIN_KV_TOKENS = 4096
# a default-sized adapter pool takes at most this share of the room the KV and adapter pools
# share, so a base that fills most of the device still starts with a KV pool
ADAPTER_SHARE_MAX = 0.5
INFER_ADAPTERS = 1000  # start-up adapters whose headers with_start_adapters reads
# a sized KV pool that cannot hold max_running requests of this many tokens is reported (a
# ShareGPT-like request holds about 460 at its end): the batch will stop at the KV pool
KV_HINT_TOKENS = 512
# chunked-prefill tokens per step by device memory (GiB): an H100/H200 class device gets 8192
PREFILL_BUDGETS = ((160, 16384), (60, 8192), (30, 4096), (0, 2048))


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # bytes of the device
    free: int  # bytes free now: after the weights and the CUDA context


@dataclass(frozen=True)
class PoolSizing:
    """What was sized, in bytes and counts (the start-up log line and /get_server_info)."""

    device_bytes: int
    utilization: float
    weights_bytes: int
    activation_bytes: int
    graph_bytes: int  # reserved for CUDA graphs (estimated before they are captured)
    kv_tokens: int
    kv_bytes: int
    adapter_rows: int  # of each target group (the others: EngineConfig.group_rows)
    adapter_bytes: int
    # one rank row on every target group of every layer, in the pool's storage dtype (an int8
    # row counts its int8 values and its float32 scales: bytes_per_row)
    adapter_row_bytes: int
    adapter_groups: tuple[str, ...]  # the target groups
    host_adapter_bytes: int  # the pinned host tier's budget
    max_running: int
    max_batch_tokens: int

    def adapters_of_rank(self, rank: int) -> int:
        return self.adapter_rows // rank

    def line(self) -> str:
        return (
            f"sized pools: weights {_gib(self.weights_bytes)}, KV {self.kv_tokens:,} tokens "
            f"({_gib(self.kv_bytes)}), adapters {self.adapter_rows} rows "
            f"({_gib(self.adapter_bytes)}: {self.adapters_of_rank(16)} of rank 16, "
            f"{self.adapters_of_rank(64)} of rank 64, on {'/'.join(self.adapter_groups)}), "
            f"activations {_gib(self.activation_bytes)}, graphs {_gib(self.graph_bytes)}, "
            f"host tier {_gib(self.host_adapter_bytes)}; "
            f"{self.utilization:.2f} of {_gib(self.device_bytes)}; max running "
            f"{self.max_running}, {self.max_batch_tokens} prefill tokens per step"
        )

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "adapters_of_rank_16": self.adapters_of_rank(16),
                "adapters_of_rank_64": self.adapters_of_rank(64)}


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def available_host_bytes() -> int:
    """Host memory available now (MemAvailable: free plus reclaimable caches), from
    /proc/meminfo; where there is none, free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def with_host_tier(config: EngineConfig, available: int, workers: int = 1) -> EngineConfig:
    """The host tier's budget, unless set: HOST_TIER_SHARE of the available host memory, split
    evenly between the `workers` worker processes of the host (data-parallel replicas times
    tensor-parallel ranks), each of which keeps a tier of its own."""
    if config.host_adapter_bytes is not None:
        return config
    share = int(HOST_TIER_SHARE * available / workers)
    return dataclasses.replace(config, host_adapter_bytes=share)


def with_start_adapters(config: EngineConfig, adapter_paths: Iterable[str | Path],
                        model: ModelConfig) -> EngineConfig:
    """What the adapters given at start decide of a default-sized adapter pool, read from the
    configs and safetensors headers of the first INFER_ADAPTERS (one that does not read is left
    to the registry, which refuses it with the reason): the modules it is sized for
    (with_lora_targets), start_adapter_rows, the rows they take together (scaled to every
    path given, when there are more than were read), and start_adapter_rank, the largest rank
    of those read (which graphs are captured before ready)."""
    paths = list(adapter_paths)
    headers = []
    for path in paths[:INFER_ADAPTERS]:
        try:
            headers.append(adapter_from_header(Path(path).name, path, model, config.max_rank, ""))
        except (AdapterError, OSError):
            continue
    if headers and config.start_adapter_rows is None:
        rows = sum(h.pool_rows for h in headers)
        if len(paths) > INFER_ADAPTERS:
            rows = -(-rows * len(paths) // len(headers))
        config = dataclasses.replace(config, start_adapter_rows=rows)
    if headers and config.start_adapter_rank is None:
        config = dataclasses.replace(config, start_adapter_rank=max(h.rank for h in headers))
    return with_lora_targets(config, headers, model)


def with_lora_targets(config: EngineConfig, headers: Iterable[LoraAdapter],
                      model: ModelConfig) -> EngineConfig:
    """lora_target_modules, unless set: the modules the adapters given at start adapt, or,
    without any, every linear module the base serves LoRA on (None; an MoE base's experts only
    when an adapter given at start adapts them or --lora-target-modules names them)."""
    if config.lora_target_modules is not None:
        return config
    groups = {g for header in headers for g in header.group_ranks}
    servable = set(target_groups(model.lora_modules))  # an MoE base: attention, experts
    groups = (groups & servable) or servable - set(EXPERT_GROUPS)
    if groups == set(LINEAR_GROUPS) & servable:  # what None means on this base
        return config
    modules = tuple(m for g in MODULE_GROUPS if g in groups for m in MODULE_GROUPS[g])
    log.info("adapter pool sized for %s, the modules of the adapters given at start (adapters "
             "on other modules are served one at a time; --lora-target-modules sets them)",
             ", ".join(modules))
    return dataclasses.replace(config, lora_target_modules=modules)


def adapter_dir_paths(root: str | Path | None) -> list[Path]:
    """The adapter sub-directories of --adapter-dir, as its registry lists them."""
    if root is None or not Path(root).is_dir():
        return []
    return sorted(Path(e.path) for e in os.scandir(root)
                  if not e.name.startswith(".") and e.is_dir())


def cpu_config(config: EngineConfig, available: int | None = None) -> EngineConfig:
    """The CPU's fixed defaults for whatever the flags left open."""
    config = dataclasses.replace(
        config, **{k: v for k, v in CPU_DEFAULTS.items() if getattr(config, k) is None}
    )
    return with_host_tier(config, available_host_bytes() if available is None else available)


def batch_limits(config: EngineConfig, device_bytes: int) -> EngineConfig:
    """max_batch_tokens for a CUDA device of that size, unless set. max_running, unless set,
    stays open until the KV pool is sized (running_limit); until then the steps that profile
    activations and reserve graphs assume CUDA_MAX_RUNNING (running_bound)."""
    budget = next(tokens for gib, tokens in PREFILL_BUDGETS if device_bytes >= gib * GIB)
    return dataclasses.replace(config, max_batch_tokens=config.max_batch_tokens or budget)


def running_bound(config: EngineConfig) -> EngineConfig:
    """The config with max_running at most what sizing may choose: for profiling."""
    return dataclasses.replace(config, max_running=config.max_running or CUDA_MAX_RUNNING)


def running_limit(kv_tokens: int) -> int:
    """Default max_running on CUDA for a KV pool of kv_tokens tokens."""
    return min(CUDA_MAX_RUNNING, max(CUDA_MIN_RUNNING, kv_tokens // TOKENS_PER_RUNNING))


def adapter_rows_for(config: EngineConfig, group_row_bytes: Mapping[str, int]) -> int:
    """The target groups' rows (EngineConfig.group_rows) of a default-sized pool: `max_loras`
    adapters of rank `max_rank`. With adapters on fewer modules than every linear one, the
    memory those rows would take on every module buys more rows of the target groups, after
    the other groups' few: the pool takes them as far as the adapters given at start need
    (start_adapter_rows: every one resident at once), or all of them when none was given
    (adapters will come through the API)."""
    if config.adapter_rows is not None:
        return config.adapter_rows
    rows = config.max_loras * config.max_rank
    targets = _targets(config, group_row_bytes)
    linear = {g: b for g, b in group_row_bytes.items() if g not in EXPERT_GROUPS}
    if set(targets) == set(linear):
        return rows
    others = sum(b for g, b in linear.items() if g not in targets)
    budget = rows * sum(linear.values()) - min(rows, config.max_rank + 1) * others
    fit = budget // sum(group_row_bytes[g] for g in targets)
    return max(rows, min(fit, config.start_adapter_rows or fit))


def _targets(config: EngineConfig, group_row_bytes: Mapping[str, int]) -> list[str]:
    """The target groups (--lora-target-modules) the model has."""
    return [g for g in target_groups(config.lora_target_modules) if g in group_row_bytes]


def _pool_bytes(config: EngineConfig, rows: int, group_row_bytes: Mapping[str, int]) -> int:
    group_rows = dataclasses.replace(config, adapter_rows=rows).group_rows(group_row_bytes)
    return sum(n * group_row_bytes[g] for g, n in group_rows.items())


def _rows_within(config: EngineConfig, rows: int, group_row_bytes: Mapping[str, int],
                 cap: int) -> int:
    """`rows`, or fewer so the pool's bytes stay within `cap`; never fewer than one adapter of
    rank `max_rank` needs (DoRA's magnitude row included)."""
    if _pool_bytes(config, rows, group_row_bytes) <= cap:
        return rows
    least = config.max_rank + 1
    per_row = sum(group_row_bytes[g] for g in _targets(config, group_row_bytes))
    spare = cap - _pool_bytes(config, least, group_row_bytes)
    fewer = min(rows, max(least, least + spare // per_row))
    log.warning("the adapter pool holds %d rows, not the %d its default size asks for "
                "(--max-loras %d x --max-lora-rank %d, in rows of the target modules the "
                "adapters given at start need): at most %.0f%% of the %s left for the KV and "
                "adapter pools (--adapter-rows sets it)", fewer, rows, config.max_loras,
                config.max_rank, ADAPTER_SHARE_MAX * 100, _gib(int(cap / ADAPTER_SHARE_MAX)))
    return fewer


def size_pools(config: EngineConfig, memory: DeviceMemory, *, weights_bytes: int,
               activation_bytes: int, graph_bytes: int, kv_slot_bytes: int,
               group_row_bytes: Mapping[str, int]) -> tuple[EngineConfig, PoolSizing]:
    """The config with kv_pages, adapter_rows and max_running set (max_batch_tokens must be),
    and what was sized. `memory` is measured after the weights are loaded; explicit kv_pages,
    adapter_rows and max_running win. `group_row_bytes`: a rank row's bytes in each module
    group's pool, over every layer."""
    in_use = memory.total - memory.free
    budget = int(config.gpu_memory_utilization * memory.total) - in_use
    room = budget - activation_bytes - graph_bytes
    rows = adapter_rows_for(config, group_row_bytes)
    if config.adapter_rows is None and config.kv_pages is None:
        rows = _rows_within(config, rows, group_row_bytes, int(room * ADAPTER_SHARE_MAX))
    adapter_bytes = _pool_bytes(config, rows, group_row_bytes)
    kv_budget = room - adapter_bytes
    page_bytes = kv_slot_bytes * config.page_size
    pages = config.kv_pages or kv_budget // page_bytes
    if pages * config.page_size < MIN_KV_TOKENS and config.kv_pages is None:
        raise SizingError(
            f"no room for a KV pool: {config.gpu_memory_utilization:.2f} of "
            f"{_gib(memory.total)} is {_gib(budget + in_use)}, of which {_gib(in_use)} is in "
            f"use (weights {_gib(weights_bytes)}), activations need {_gib(activation_bytes)}, "
            f"graphs {_gib(graph_bytes)} and the adapter pool {_gib(adapter_bytes)} "
            f"({rows} rows); raise --gpu-memory-utilization, lower --max-loras or "
            f"--max-lora-rank, or set --kv-pages")
    tokens = (int(pages) - 1) * config.page_size  # page 0 is the padding target
    sized = dataclasses.replace(config, kv_pages=int(pages), adapter_rows=rows,
                                max_running=config.max_running or running_limit(tokens))
    if config.kv_pages is None and tokens < sized.max_running * KV_HINT_TOKENS:
        log.warning("the KV pool holds %s tokens: %d requests of %d tokens at a time, of the %d "
                    "that may run, so batches will stop short (the adapter pool took %s: "
                    "--max-loras, --max-lora-rank or --adapter-rows give the KV pool some of "
                    "it; --kv-cache-dtype fp8 holds twice the tokens)", f"{tokens:,}",
                    tokens // KV_HINT_TOKENS, KV_HINT_TOKENS, sized.max_running,
                    _gib(adapter_bytes))
    return sized, PoolSizing(
        device_bytes=memory.total,
        utilization=config.gpu_memory_utilization,
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        graph_bytes=graph_bytes,
        kv_tokens=tokens,
        kv_bytes=sized.kv_pages * page_bytes,
        adapter_rows=rows,
        adapter_bytes=adapter_bytes,
        adapter_row_bytes=sum(group_row_bytes[g] for g in _targets(config, group_row_bytes)),
        adapter_groups=tuple(g for g, n in sized.group_rows(group_row_bytes).items()
                             if n == rows),
        host_adapter_bytes=sized.host_adapter_bytes,
        max_running=sized.max_running,
        max_batch_tokens=sized.max_batch_tokens,
    )
