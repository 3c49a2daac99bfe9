"""The model runner owns every device tensor (weights, KV pool, adapter pool) and executes step
plans: load adapter rows, build the forward batch once, run, sample."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixlora.config import (
    DENSE_GROUPS,
    EXPERT_GROUPS,
    MODULE_GROUPS,
    EngineConfig,
    ModelConfig,
)
from radixlora.distributed import TensorParallel
from radixlora.lora.host_cache import PackedAdapter
from radixlora.lora.layout import group_row_bytes
from radixlora.model.checkpoint_files import weight_files
from radixlora.model.forward_batch import ForwardBatch
from radixlora.model.loader import load_model
from radixlora.sampling_params import GREEDY, SamplingParams, needs_adjustments
from radixlora.step_plan import GroupRows, PlanItem, StepPlan, bytes_to_ids, ids_to_bytes
from radixlora.structured import mask_words
from radixlora.worker import compile_cache
from radixlora.worker.adapter_pool import AdapterPool
from radixlora.worker.attention import (
    AttentionInputs,
    TritonAttentionBackend,
    make_attention_backend,
)
from radixlora.worker.cuda_graph import CudaGraphRunner, graph_reserve
from radixlora.worker.dora import DoraBase
from radixlora.worker.kv_pool import KVPool
from radixlora.worker.lora_context import LoraContext, LoraSegments
from radixlora.worker.sampler import (
    LogitAdjustments,
    Penalties,
    SampleOutput,
    SamplingBatch,
    TokenMask,
    sample,
    with_top_logprobs,
)
from radixlora.worker.sizing import (
    DeviceMemory,
    PoolSizing,
    available_host_bytes,
    batch_limits,
    cpu_config,
    running_bound,
    size_pools,
    with_host_tier,
)
from radixlora_kernels.device import HostRead, StagingRing, to_device, to_host
from radixlora_kernels.lora_ops import LoraBatchMeta, make_lora_backend

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    input_logprobs: list[list[float]] | None = None  # per plan item, when any item is scored
    # per plan item, per scored prompt token: its item's params.logprobs most likely tokens
    input_top: list[list[list[tuple[int, float]]]] | None = None


@dataclass
class LaunchedStep:
    """A step queued on the device: its outputs are being copied to the host behind `done`."""

    token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    input_logprobs: torch.Tensor | None = None
    input_counts: list[int] | None = None
    input_top_ids: torch.Tensor | None = None  # [scored rows, k]
    input_top_logprobs: torch.Tensor | None = None
    input_top_k: list[int] | None = None  # per plan item
    done: torch.cuda.Event | None = None
    read: HostRead | None = None  # the fence of the outputs' region of host_outputs
    awaiting: LateSample | None = None  # its sampling waits for late masks (sample_late)

    def ready(self) -> bool:
        return self.awaiting is None and (self.done is None or self.done.query())


# a step's outputs, copied to the host as it is launched (LaunchedStep)
OUTPUT_NAMES = ("token_ids", "logprobs", "top_ids", "top_logprobs", "input_logprobs",
                "input_top_ids", "input_top_logprobs")
OUTPUT_STAGING_BYTES = 16 << 20


@dataclass
class LateSample:
    """A launched step's sampling, held until the masks of its late_mask items come."""

    logits: torch.Tensor
    items: list[PlanItem]  # the sampling items, in sampling order
    batch: SamplingBatch
    processors: tuple  # all but the token mask


class ModelRunner:
    """Owns the weights, the KV pool and the adapter pool. `config` is the engine config with
    every pool and batch limit resolved (radixlora.worker.sizing): on CUDA from the memory
    left after the weights and a profiling step, `sizing` saying what was sized."""

    def __init__(self, model_path: str | Path, model_cfg: ModelConfig, config: EngineConfig,
                 tp: TensorParallel | None = None, device: torch.device | None = None):
        """tp: this rank of a tensor-parallel group, whose shard of the model, KV heads and
        adapters the runner holds (`cfg` is then the rank's shape); device: default the
        config's."""
        self.tp = tp
        self.cfg = model_cfg if tp is None else tp.shard.local
        self.device = device or torch.device(config.resolved_device())
        self.dtype = config.torch_dtype(model_cfg)
        self.lora_dtype = config.lora_pool_dtype(model_cfg)  # the adapter pool's storage
        self.kv_dtype = config.kv_storage_dtype(model_cfg)  # the KV pool's storage
        self.attention_name = config.attention_backend
        cuda = self.device.type == "cuda"
        self.phases: dict[str, float] = {}  # start-up phase -> seconds (phase_line)
        # the host side of every step's outputs (LaunchedStep.read frees a step's region)
        self.host_outputs = StagingRing(OUTPUT_STAGING_BYTES) if cuda else None
        self.kernels = self._open_kernel_cache(config) if cuda else None
        with self.phase("weights"):
            self.model = load_model(model_path, model_cfg, self.dtype, self.device,
                                    config.load_format, tp)
        self._log_weights(model_path, config.load_format)
        self.lora_backend = make_lora_backend(config.lora_backend, self.device)
        self.graphs = None
        self.sizing: PoolSizing | None = None
        if self.kernels is not None:
            with self.phase("compile"):
                loaded = self.kernels.finish()
            if loaded:
                log.info("%d kernels compiled or loaded ahead in %.1f s after the weights",
                         loaded, self.phases["compile"])
        with self.phase("sizing"):
            config = self._size_for_cuda(config) if cuda else cpu_config(config)
        self.config = config
        self._build_pools(config.kv_pages * config.page_size,
                          config.group_rows(self.cfg.lora_groups), config.host_adapter_bytes)
        if config.cuda_graph and cuda:
            if not isinstance(self.attn_backend, TritonAttentionBackend):
                raise ValueError("cuda_graph needs attention_backend triton (or auto on CUDA)")
            self.graphs = CudaGraphRunner(
                self,
                config.max_running,
                config.max_context(model_cfg),
                config.max_rank * config.max_stacked,
                config.lora_side_stream,
            )

    def _open_kernel_cache(self, config: EngineConfig) -> compile_cache.KernelCache:
        """The compile cache of this configuration (of this rank's shard), recording from now
        until warm-up ends; the variants its manifest lists start loading (or compiling, in
        processes that split the cores between tensor-parallel ranks) while the weights
        load."""
        root = compile_cache.use_cache_dir(config.compile_cache_dir)
        device = torch.cuda.get_device_name(self.device)
        ranks = self.tp.size if self.tp is not None else 1
        kernels = compile_cache.KernelCache(root, compile_cache.manifest_key(self.cfg, config,
                                                                             device),
                                            (os.cpu_count() or 2) // ranks - 1,
                                            compile_cache.config_key(self.cfg, config, device))
        kernels.start_recording()
        kernels.start()
        return kernels

    def _log_weights(self, model_path, load_format: str) -> None:
        seconds = self.phases["weights"]
        if load_format != "safetensors":
            log.info("weights made in %.1f s", seconds)
            return
        gb = sum(f.stat().st_size for f in weight_files(Path(model_path))) / 1e9
        log.info("weights loaded in %.1f s: %.3g GB of checkpoint at %.3g GB/s", seconds, gb,
                 gb / max(seconds, 1e-9))

    @contextlib.contextmanager
    def phase(self, name: str):
        """Time a start-up phase; a phase inside another is not counted in the outer one."""
        outer, self._inner = getattr(self, "_inner", 0.0), 0.0
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            self.phases[name] = self.phases.get(name, 0.0) + elapsed - self._inner
            self._inner = outer + elapsed

    def compile_dry(self, run) -> None:
        """On a start whose configuration the kernel manifest does not cover yet: run `run`
        dry, the kernel variants the manifest lacks compiled in parallel processes, then loaded
        (see radixlora.worker.compile_cache)."""
        if self.kernels is None or self.kernels.covers_config:
            return
        log.info("a dry run finds the kernel variants this configuration lacks; they compile in "
                 "%d processes (once per configuration and versions)", self.kernels.processes)
        started = time.perf_counter()
        with self.phase("compile"):
            with self.kernels.dry_run():
                run()
            loaded = self.kernels.finish()
        log.info("%d kernel variants compiled and loaded in %.1f s", loaded,
                 time.perf_counter() - started)

    def _build_pools(self, num_slots: int, group_rows: dict[str, int], host_bytes: int) -> None:
        cfg = self.cfg
        self.kv_pool = KVPool(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim,
                              self.kv_dtype, self.device, self.dtype)
        shard = self.tp.shard if self.tp is not None else None
        self.adapter_pool = AdapterPool(cfg, group_rows, self.lora_dtype, self.device,
                                        host_bytes, shard)
        self.adapter_pool.dora_base = DoraBase(self.model, self.dtype)
        self.attn_backend = make_attention_backend(self.attention_name, self.kv_pool, cfg,
                                                   self.device)
        # tokens sampled by the last launched step: placeholders of the next step point here
        self.last_sampled = torch.zeros(1, dtype=torch.int64, device=self.device)

    def _size_for_cuda(self, config: EngineConfig) -> EngineConfig:
        """Batch limits from the device's size, then the pools from the memory left after the
        weights, the activations of the largest steps (measured) and the graphs (estimated)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        config = with_host_tier(batch_limits(config, total), available_host_bytes())
        weights = torch.cuda.memory_allocated(self.device)
        bound = running_bound(config)
        prefill, decode = self._profile_activations(bound)
        graphs = graph_reserve(bound, self.cfg, self.dtype, decode) if config.cuda_graph else 0
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        config, self.sizing = size_pools(
            config, DeviceMemory(total, free), weights_bytes=weights,
            activation_bytes=max(prefill, decode), graph_bytes=graphs,
            kv_slot_bytes=KVPool.bytes_per_slot(self.cfg.num_layers, self.cfg.num_kv_heads,
                                                self.cfg.head_dim, self.kv_dtype),
            group_row_bytes=group_row_bytes(self.cfg, self.lora_dtype),
        )
        log.info(self.sizing.line())
        if self.tp is not None:  # every rank's pools and batches hold the same
            config = dataclasses.replace(config, kv_pages=self.tp.min_int(config.kv_pages),
                                         adapter_rows=self.tp.min_int(config.adapter_rows),
                                         max_running=self.tp.min_int(config.max_running))
        return config

    def _profile_activations(self, config: EngineConfig) -> tuple[int, int]:
        """Peak bytes the largest prefill step (max_batch_tokens tokens) and the largest decode
        step (max_running requests) allocate beyond the weights, every request on an adapter
        of the largest rank, run eagerly on small temporary pools (which also compiles the
        eager path's kernels)."""
        tokens, running, rank = config.max_batch_tokens, config.max_running, config.max_rank
        groups = tuple(filter(config.holds, self.cfg.lora_groups))
        self._build_pools(tokens + running + 1, dict.fromkeys(groups, rank), 0)
        plans = (profile_plan(tokens, min(running, tokens), rank, groups=groups),
                 profile_plan(running, running, rank, groups=groups))
        self.compile_dry(lambda: [self.finish(self.launch(plan)) for plan in plans])
        peaks = []
        for plan in plans:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            self.finish(self.launch(plan))
            peaks.append(torch.cuda.max_memory_allocated(self.device) - before)
        del self.kv_pool, self.adapter_pool, self.attn_backend
        return peaks[0], peaks[1]

    def warm_up(self, defer_graphs: bool = False) -> None:
        """On CUDA, before the first request: capture every graph serving can replay (with
        defer_graphs, only CudaGraphRunner.startup_keys: the caller captures the rest with
        capture_next while idle, or a step captures its own on first use), then run eager
        steps of the shapes graphs do not cover (long prefills, cached prefixes, with and
        without adapters, lengths that are and are not multiples of 16), so no request waits
        for a kernel compile. Without a kernel manifest, the kernel variants of all of these
        are first found in a dry run and compiled in parallel (radixlora.worker.compile_cache)."""
        if self.device.type != "cuda" or not self.config.warm_up:
            if self.kernels is not None:
                self.kernels.stop_recording(warn_late=False)
            return
        num_slots = self.kv_pool.k_cache[0].shape[0]
        plans = warm_up_plans(self.config, self.config.max_context(self.cfg), num_slots,
                              tuple(filter(self.config.holds, self.cfg.lora_groups)))

        def dry_run() -> None:
            graphs, self.graphs = self.graphs, None  # eager only: nothing captured dry
            try:
                if graphs is not None:
                    graphs.dry_run()
                for plan in plans:
                    self.finish(self.launch(plan))
            finally:
                self.graphs = graphs

        self.compile_dry(dry_run)
        reserved = torch.cuda.memory_reserved(self.device)
        with self.phase("graphs"):
            if self.graphs is not None and defer_graphs:
                self.graphs.capture(self.graphs.startup_keys())
            elif self.graphs is not None:
                self.graphs.capture_all()
            torch.cuda.synchronize(self.device)
        graph_bytes = torch.cuda.memory_reserved(self.device) - reserved
        with self.phase("warm-up"):
            for plan in plans:
                self.finish(self.launch(plan))
        log.info("warm-up: %d graphs captured in %.1f s (%.2f GiB; %d more when idle), eager "
                 "steps in %.1f s", len(self.graphs.graphs) if self.graphs else 0,
                 self.phases["graphs"], graph_bytes / (1 << 30),
                 len(self.graphs.pending()) if self.graphs else 0, self.phases["warm-up"])
        self.kernels.stop_recording(warn_late=True)
        self.kernels.save()

    def launch(self, plan: StepPlan,
               loads: list[tuple[PackedAdapter, np.ndarray]] = ()) -> LaunchedStep:
        """Queue a step on the device (on the CPU it runs to the end) without waiting for it,
        after writing `loads` (the plan's adapter loads, weights resolved) into the pool;
        placeholder ids (< 0) in the plan are the tokens the previously launched step samples."""
        self.adapter_pool.write_all(loads, plan.adapter_sets)
        self.adapter_pool.wait_loads()
        self.adapter_pool.finish_dora(plan.adapter_sets)
        refused = self.adapter_pool.dora_faults(plan.adapter_sets)
        if refused:
            raise AdaptersRefused(refused)
        host = _host_inputs(plan)
        segments = _lora_segments(plan)
        scored = _scored_rows(plan)
        resolve = self._resolve_placeholders if (host["input_ids"] < 0).any() else None
        adjusted = any(needs_adjustments(i.params, i.out_index) or i.allowed is not None
                       or i.late_mask for i in plan.items if i.sample)
        key = self._graph_key(host, segments) if scored is None else None
        step = LaunchedStep()
        if key is not None:
            out = self._graph_step(key, plan, host, segments, resolve, step if adjusted else None)
        else:
            out = self._eager_step(plan, host, segments, resolve, scored, step)
        if step.awaiting is not None:
            return step
        self._sampled(step, out)
        return self._copy_to_host(step)

    def sample_late(self, step: LaunchedStep, words: bytes) -> None:
        """Sample a step that waited for the masks of its late_mask items (StepMasks.words)."""
        late, step.awaiting = step.awaiting, None
        n, row = sum(i.late_mask for i in late.items), 4 * mask_words(self.cfg.vocab_size)
        if len(words) != n * row:
            raise ValueError(f"{len(words) // row} late masks for {n} late items")
        given = iter(np.frombuffer(words, np.int32).reshape(n, -1))
        mask = TokenMask.build([next(given) if i.late_mask else i.allowed for i in late.items])
        processors = tuple(p for p in (*late.processors, mask) if p is not None)
        self._sampled(step, sample(late.logits, late.batch, processors))
        self._copy_to_host(step)

    def _sampled(self, step: LaunchedStep, out: SampleOutput | None) -> None:
        if out is not None:
            self.last_sampled = out.token_ids
            step.token_ids, step.logprobs = out.token_ids, out.logprobs
            step.top_ids, step.top_logprobs = out.top_ids, out.top_logprobs

    def _graph_step(self, key, plan: StepPlan, host: dict, segments, resolve,
                    adjusted: LaunchedStep | None) -> SampleOutput | None:
        """Replay a graph; it samples every request's row (greedy where the item samples
        nothing), so only top logprobs are left to compute here. A step with penalties, biases
        or token masks (`adjusted`, the step being launched) samples again from the graph's
        logits, eagerly: the forward still runs as a graph."""
        rows = self._sampling_batch(plan.items)
        out = self.graphs.forward(key, host, segments, rows, resolve)
        index = [k for k, i in enumerate(plan.items) if i.sample]
        if not index:
            return None
        if adjusted is not None:  # a copy: the processors write into the logits
            logits = out.logits[to_device(index, torch.int64, self.device)]
            return self._sample_adjusted(logits, plan.items, host["input_ids"], adjusted)
        if len(index) < len(plan.items):
            out = out[to_device(index, torch.int64, self.device)]
        return with_top_logprobs(SampleOutput(out.tokens, out.logprobs), out.logits, out.lse,
                                 rows.num_top_logprobs)

    def _eager_step(self, plan: StepPlan, host: dict, segments, resolve, scored,
                    step: LaunchedStep) -> SampleOutput | None:
        """Run the model eagerly, then score prompt tokens (into step) and sample."""
        if scored is None:
            logits = self.model(self._forward_batch(host, segments, resolve))
        else:
            host["logits_indices"] = np.concatenate([scored[0], host["logits_indices"]])
            hidden = self.model.hidden(self._forward_batch(host, segments, resolve))
            ks = [(i.params.logprobs or 0) if i.score_ids is not None else 0 for i in plan.items]
            (step.input_logprobs, step.input_top_ids,
             step.input_top_logprobs) = _prompt_logprobs(hidden[: len(scored[0])],
                                                         self.model.logits, scored,
                                                         self.device, max(ks))
            step.input_counts, step.input_top_k = scored[2], ks
            logits = self.model.logits(hidden[len(scored[0]) :])
        if not any(i.sample for i in plan.items):
            return None
        return self._sample_adjusted(logits, plan.items, host["input_ids"], step)

    def _sample_adjusted(self, logits: torch.Tensor, items: list[PlanItem],
                         input_ids: np.ndarray, step: LaunchedStep) -> SampleOutput | None:
        """Sample the logits of the sampling items (rows in item order) through their
        penalties, biases and token masks; a step with late_mask items is left awaiting its
        masks (sample_late) and returns None."""
        sampled = [i for i in items if i.sample]
        adjust = LogitAdjustments.build([i.params for i in sampled],
                                        [i.out_index for i in sampled], self.cfg.eos_token_ids,
                                        [i.banned for i in sampled])
        penalties = self._penalties(items, input_ids)
        if any(i.late_mask for i in sampled):
            step.awaiting = LateSample(logits, sampled, self._sampling_batch(sampled),
                                       tuple(p for p in (adjust, penalties) if p is not None))
            return None
        mask = TokenMask.build([i.allowed for i in sampled])
        processors = tuple(p for p in (adjust, penalties, mask) if p is not None)
        return sample(logits, self._sampling_batch(sampled), processors)

    def _penalties(self, items: list[PlanItem], input_ids: np.ndarray) -> Penalties | None:
        """The Penalties of the sampling items that have them (rows in sampling order). An
        item's pending newest output token is its last input token, a placeholder, resolved
        here as the forward resolved it."""
        rows, params, outputs, prompts = [], [], [], []
        ends = np.cumsum([i.extend_len for i in items])
        for row, (item, end) in enumerate((i, e) for i, e in zip(items, ends) if i.sample):
            if item.output_ids is None:
                continue
            ids = bytes_to_ids(item.output_ids).astype(np.int64)
            if input_ids[end - 1] < 0:
                ids = np.append(ids, input_ids[end - 1])
            rows.append(row)
            params.append(item.params)
            outputs.append(ids)
            prompts.append(bytes_to_ids(item.prompt_ids or b"").astype(np.int64))
        if not rows:
            return None
        dev = self.device
        tokens = to_device(np.concatenate(outputs), torch.int64, dev)
        self._resolve_placeholders(tokens)

        def owners(parts: list[np.ndarray]) -> torch.Tensor:
            return to_device(np.repeat(np.arange(len(parts)), [len(p) for p in parts]),
                             torch.int64, dev)

        return Penalties(
            np.array(rows, np.int64),
            np.array([p.presence_penalty for p in params], np.float32),
            np.array([p.frequency_penalty for p in params], np.float32),
            np.array([p.repetition_penalty for p in params], np.float32),
            (owners(outputs), tokens),
            (owners(prompts), to_device(np.concatenate(prompts), torch.int64, dev)),
        )

    def failed(self) -> None:
        """The last launched step did not run: the next step's placeholders have no tokens."""
        self.last_sampled = torch.zeros(1, dtype=torch.int64, device=self.device)

    def finish(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step and read its outputs."""
        try:
            return self._read(step)
        finally:
            if step.read is not None:  # its host copies are read: their region is free
                step.read.read = True

    def _read(self, step: LaunchedStep) -> StepOutput:
        if step.done is not None:
            step.done.synchronize()
        input_logprobs = input_top = None
        if step.input_counts is not None:
            values = step.input_logprobs.tolist()
            ends = np.cumsum(step.input_counts)
            input_logprobs = [values[e - c : e] for c, e in zip(step.input_counts, ends)]
            input_top = _prompt_top(step, ends)
        if step.token_ids is None:
            return StepOutput([], [], None, input_logprobs, input_top)
        top = None
        if step.top_ids is not None:
            top = [list(zip(i, lp))
                   for i, lp in zip(step.top_ids.tolist(), step.top_logprobs.tolist())]
        return StepOutput(step.token_ids.tolist(), step.logprobs.tolist(), top, input_logprobs,
                          input_top)

    def _copy_to_host(self, step: LaunchedStep) -> LaunchedStep:
        """Queue the copies of the step's outputs into host_outputs (none on the CPU, unless a
        test gives it one), then on CUDA the event `finish` waits for."""
        if self.host_outputs is not None:
            names = [name for name in OUTPUT_NAMES if getattr(step, name) is not None]
            copies, step.read = to_host([getattr(step, name) for name in names],
                                        self.host_outputs)
            for name, copy in zip(names, copies):
                setattr(step, name, copy)
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()
            step.done.record(torch.cuda.current_stream(self.device))
        return step

    def _resolve_placeholders(self, input_ids: torch.Tensor) -> None:
        """In place on the device: id -1 - i becomes the i-th token of the last launched step
        (clamped, so a step launched after a failed one reads garbage, never out of bounds)."""
        last = self.last_sampled
        index = (-1 - input_ids).clamp(0, last.numel() - 1)
        input_ids.copy_(torch.where(input_ids < 0, last[index], input_ids))

    def _graph_key(self, host: dict, segments):
        if self.graphs is None:
            return None
        per_group = segments or {}
        rows = max((len(r) for rows, _ in per_group.values() for r in rows), default=0)
        experts = any(any(per_group[g][0]) for g in EXPERT_GROUPS if g in per_group)
        return self.graphs.key_for(host["qo_lens"], rows, segments is not None,
                                   bool(segments and segments.magnitudes), experts)

    def _forward_batch(self, host: dict, segments, resolve=None) -> ForwardBatch:
        names = ("input_ids", "positions", "out_cache_loc", "kv_indices", "logits_indices")
        dev = {k: to_device(host[k], torch.int64, self.device) for k in names}
        if resolve is not None:
            resolve(dev["input_ids"])
        attn_meta = self.attn_backend.build_metadata(
            AttentionInputs(host["qo_lens"], host["kv_lens"].tolist(), dev["kv_indices"])
        )
        lora = None
        if segments is not None:
            metas = {
                g: LoraBatchMeta.from_segments(
                    host["qo_lens"], rows, scales, self.device, segments.request_sets,
                    grouped=self.lora_backend.uses_groups,
                    seg_magnitudes=segments.magnitudes.get(g),
                )
                if any(rows)
                else None
                for g, (rows, scales) in segments.items()
            }
            lora = LoraContext(self.adapter_pool, self.lora_backend, metas)
        return ForwardBatch(
            dev["input_ids"],
            dev["positions"],
            dev["out_cache_loc"],
            dev["logits_indices"],
            self.attn_backend,
            attn_meta,
            lora,
        )

    @staticmethod
    def _sampling_batch(items: list[PlanItem]) -> SamplingBatch:
        """One row per item; items that sample nothing get a greedy row."""
        return SamplingBatch.build(
            [i.params if i.sample else GREEDY for i in items],
            [i.seed if i.sample else 0 for i in items],
            [i.out_index if i.sample else 0 for i in items],
        )


PROFILE_PARAMS = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)
GREEDY_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def profile_plan(tokens: int, requests: int, rank: int, start: int = 0, sets: int = 1,
                 params: SamplingParams = PROFILE_PARAMS,
                 groups: Sequence[str] = DENSE_GROUPS) -> StepPlan:
    """A synthetic step: `requests` requests extending `tokens` tokens in all (the first ones
    one more when they do not divide evenly) after `start` cached ones, each sampling with
    `params` (default: every filter on), request k on adapter set k % sets, each set `rank`
    rows in each of `groups` (base only when rank is 0). KV slots 1, 2, ... (slot 0 is the
    padding target)."""
    extends = np.full(requests, tokens // requests)
    extends[: tokens % requests] += 1
    items = [PlanItem(int(n), start, True, params, k, 0, k % sets)
             for k, n in enumerate(extends)]
    slots = 1 + np.arange(int((extends + start).sum()))
    rows = GroupRows(list(range(rank)), [1.0] * rank)
    adapter_set = {group: rows for group in groups} if rank else {}
    return StepPlan(step=0, items=items, input_ids=ids_to_bytes(np.ones(tokens)),
                    kv_slots=ids_to_bytes(slots), adapter_sets=[adapter_set] * sets)


def warm_up_plans(config: EngineConfig, max_context: int, num_slots: int,
                  groups: Sequence[str] = DENSE_GROUPS) -> list[StepPlan]:
    """Eager steps of each kind of shape the graphs leave to the eager path, those that fit
    the context and the KV pool. Base only: the largest prefill chunk, odd lengths, one long
    prompt (greedy: the sampler's unfiltered variant), cached prefixes, many requests of a
    token or two (decodes beside a prefill). With adapters, for the LoRA kernels' tile sizes:
    segments of more than 32, of 17-32 and of at most 16 tokens, each on 8 rank-16 adapters,
    on 128 rank-8 ones (the grouped kernels tile many adapter sets, and rank rows that 16 does
    not divide, otherwise), on one of rank 32 and on one of the largest rank."""
    tokens, running, rank = config.max_batch_tokens, config.max_running, config.max_rank
    wide = min(running, 16)
    # 1,536 tokens: an MoE base's one-program alignment with its largest tile (Qwen3-MoE's
    # top 8 of 128 experts: 96 rows an expert), which the other steps reach only when about
    # 1,024 requests may run
    base = [(tokens, wide, 0, PROFILE_PARAMS), (tokens - 1, 3, 0, PROFILE_PARAMS),
            (1536, 4, 0, PROFILE_PARAMS), (1000, 1, 0, GREEDY_PARAMS),
            (777, 5, 123, PROFILE_PARAMS), (running + 37, running, 0, PROFILE_PARAMS)]
    segments = [(tokens, wide), (24 * wide, wide), (running + 37, running)]
    loras: dict[int, int] = {}  # rank -> adapter sets
    for r, sets in ((16, 8), (8, 128), (32, 1), (rank, 1)) if rank else ():
        loras.setdefault(min(r, rank), sets)
    plans = [profile_plan(n, r, 0, start, params=params) for n, r, start, params in base
             if fits(n, r, start, config, max_context, num_slots)]
    return plans + [profile_plan(n, r, lora, sets=sets, groups=groups) for n, r in segments
                    for lora, sets in loras.items()
                    if fits(n, r, 0, config, max_context, num_slots)]


def fits(tokens: int, requests: int, start: int, config: EngineConfig, max_context: int,
         num_slots: int) -> bool:
    """A synthetic step fits the prefill budget, the context and the KV pool."""
    return (requests <= tokens <= config.max_batch_tokens
            and -(-tokens // requests) + start <= max_context
            and tokens + requests * start < num_slots)


def _host_inputs(plan: StepPlan) -> dict:
    """Flat host arrays of one batch (one segment per request, in plan order)."""
    items = plan.items
    qo_lens = [i.extend_len for i in items]
    kv_lens = np.array([i.start + i.extend_len for i in items], np.int64)
    kv_slots = bytes_to_ids(plan.kv_slots)
    kv_ends = np.cumsum(kv_lens)
    ends = np.cumsum(qo_lens)
    return {
        "qo_lens": qo_lens,
        "kv_lens": kv_lens,
        "input_ids": bytes_to_ids(plan.input_ids),
        "positions": np.concatenate([np.arange(i.start, k) for i, k in zip(items, kv_lens)]),
        "out_cache_loc": np.concatenate(
            [kv_slots[e - i.extend_len : e] for i, e in zip(items, kv_ends)]
        ),
        "kv_indices": kv_slots,
        "logits_indices": np.array([e - 1 for i, e in zip(items, ends) if i.sample], np.int64),
    }


def _scored_rows(plan: StepPlan) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """(batch rows whose logits are scored, the prompt token each scores, count per item);
    None when no item of the plan scores prompt tokens."""
    if all(i.score_ids is None for i in plan.items):
        return None
    rows, targets, counts, offset = [], [], [], 0
    for item in plan.items:
        ids = bytes_to_ids(item.score_ids or b"")
        rows.append(offset + item.score_from - item.start + np.arange(len(ids)))
        targets.append(ids.astype(np.int64))
        counts.append(len(ids))
        offset += item.extend_len
    return np.concatenate(rows), np.concatenate(targets), counts


SCORE_ROWS = 256  # prompt positions whose full-vocabulary logits exist at once


@torch.inference_mode()
def _prompt_logprobs(hidden: torch.Tensor, head, scored, device, k: int = 0):
    """(the logprob of the prompt token each scored row predicts, and with k > 0 each row's k
    most likely tokens and their logprobs, else None, None), from the rows' final hidden
    states, whose logits `head` makes SCORE_ROWS rows at a time, each slice reduced at once:
    a long prompt never holds logits for every position."""
    ids = to_device(scored[1], torch.int64, device)
    chosen, top_ids, top_logprobs = [], [], []
    for at in range(0, len(hidden), SCORE_ROWS):
        logits = head(hidden[at : at + SCORE_ROWS]).float()
        lse = torch.logsumexp(logits, dim=-1)
        chosen.append(logits.gather(1, ids[at : at + SCORE_ROWS, None])[:, 0] - lse)
        if k:
            values, top = logits.topk(k, dim=-1)
            top_ids.append(top)
            top_logprobs.append(values - lse[:, None])
    if not k:
        return torch.cat(chosen), None, None
    return torch.cat(chosen), torch.cat(top_ids), torch.cat(top_logprobs)


def _prompt_top(step: LaunchedStep, ends: np.ndarray):
    """Per plan item, per scored prompt token, its item's k (token id, logprob) pairs; None
    when no item asked for any."""
    if step.input_top_ids is None:
        return None
    ids, lps = step.input_top_ids.tolist(), step.input_top_logprobs.tolist()
    return [[list(zip(i[:k], lp[:k])) for i, lp in zip(ids[e - c : e], lps[e - c : e])]
            for c, e, k in zip(step.input_counts, ends, step.input_top_k)]


def _lora_segments(plan: StepPlan) -> LoraSegments | None:
    """group -> (rows per request, scales per request) and each request's adapter-set id;
    None when no request has an adapter."""
    sets = [plan.adapter_sets[i.adapter_set] for i in plan.items]
    if not any(sets):
        return None
    dense: dict[int, int] = {}  # set index of the plan -> 0, 1, ... in order of first use
    request_sets = np.array(
        [dense.setdefault(i.adapter_set, len(dense)) if s else -1
         for i, s in zip(plan.items, sets)], np.int64)
    segments, magnitudes = {}, {}
    for group in MODULE_GROUPS:
        rows = [s.get(group) for s in sets]
        if not any(rows):
            continue
        segments[group] = ([r.rows if r else [] for r in rows],
                           [r.scales if r else [] for r in rows])
        if any(r and r.magnitude >= 0 for r in rows):
            magnitudes[group] = [r.magnitude if r else -1 for r in rows]
    return LoraSegments(segments, request_sets, magnitudes)


class AdaptersRefused(Exception):
    """A step read adapters found invalid once written (a DoRA adapter whose norms vanish):
    it did not run. `reasons`: adapter id -> why."""

    def __init__(self, reasons: dict[str, str]):
        super().__init__(f"adapters refused: {reasons}")
        self.reasons = reasons
