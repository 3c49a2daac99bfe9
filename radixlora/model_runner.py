"""The model runner owns every device tensor (weights, KV pool, adapter pool) and executes step
plans: load adapter rows, build the forward batch once, run, sample."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixlora.attention import AttentionInputs, TritonAttentionBackend, make_attention_backend
from radixlora.config import EngineConfig, ModelConfig
from radixlora.cuda_graph import CudaGraphRunner
from radixlora.device import to_device
from radixlora.forward_batch import ForwardBatch
from radixlora.kernels.lora_ops import LoraBatchMeta, make_lora_backend
from radixlora.kv_cache import KVPool
from radixlora.lora.adapter import MODULE_GROUPS
from radixlora.lora.host_cache import PackedAdapter
from radixlora.lora.pool import AdapterPool, LoraContext, LoraSegments
from radixlora.model.loader import load_model
from radixlora.sampling import GREEDY, SampleOutput, SamplingBatch, sample, with_top_logprobs
from radixlora.step_plan import PlanItem, StepPlan, bytes_to_ids


@dataclass
class StepOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    input_logprobs: list[list[float]] | None = None  # per plan item, when any item is scored


@dataclass
class LaunchedStep:
    """A step queued on the device: its outputs are being copied to the host behind `done`."""

    token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    input_logprobs: torch.Tensor | None = None
    input_counts: list[int] | None = None
    done: torch.cuda.Event | None = None

    def ready(self) -> bool:
        return self.done is None or self.done.query()


class ModelRunner:
    def __init__(self, model_path: str | Path, model_cfg: ModelConfig, config: EngineConfig):
        self.cfg = model_cfg
        self.device = torch.device(config.resolved_device())
        self.dtype = config.torch_dtype(model_cfg)
        self.model = load_model(model_path, model_cfg, self.dtype, self.device, config.load_format)
        num_slots = config.kv_pages * config.page_size
        self.kv_pool = KVPool(
            model_cfg.num_layers,
            num_slots,
            model_cfg.num_kv_heads,
            model_cfg.head_dim,
            self.dtype,
            self.device,
        )
        self.adapter_pool = AdapterPool(model_cfg, config.adapter_rows, self.dtype, self.device,
                                        config.host_adapter_bytes)
        self.attn_backend = make_attention_backend(
            config.attention_backend,
            self.kv_pool,
            model_cfg.num_heads,
            model_cfg.head_dim,
            model_cfg.sliding_window,
            self.device,
        )
        self.lora_backend = make_lora_backend(config.lora_backend, self.device)
        self.graphs = None
        if config.cuda_graph and self.device.type == "cuda":
            if not isinstance(self.attn_backend, TritonAttentionBackend):
                raise ValueError("cuda_graph needs attention_backend triton (or auto on CUDA)")
            self.graphs = CudaGraphRunner(
                self,
                config.max_running,
                model_cfg.max_position,
                config.max_rank * config.max_stacked,
                config.lora_side_stream,
            )
        # tokens sampled by the last launched step: placeholders of the next step point here
        self.last_sampled = torch.zeros(1, dtype=torch.int64, device=self.device)

    def launch(self, plan: StepPlan,
               loads: list[tuple[PackedAdapter, np.ndarray]] = ()) -> LaunchedStep:  # fmt: skip
        """Queue a step on the device (on the CPU it runs to the end) without waiting for it,
        after writing `loads` (the plan's adapter loads, weights resolved) into the pool;
        placeholder ids (< 0) in the plan are the tokens the previously launched step samples."""
        self.adapter_pool.write_all(loads)
        self.adapter_pool.wait_loads()
        host = _host_inputs(plan)
        segments = _lora_segments(plan)
        scored = _scored_rows(plan)
        resolve = self._resolve_placeholders if (host["input_ids"] < 0).any() else None
        key = self._graph_key(host, segments) if scored is None else None
        step = LaunchedStep()
        if key is not None:
            out = self._graph_step(key, plan, host, segments, resolve)
        else:
            out = self._eager_step(plan, host, segments, resolve, scored, step)
        if out is not None:
            self.last_sampled = out.token_ids
            step.token_ids, step.logprobs = out.token_ids, out.logprobs
            step.top_ids, step.top_logprobs = out.top_ids, out.top_logprobs
        return self._copy_to_host(step)

    def _graph_step(self, key, plan: StepPlan, host: dict, segments,
                    resolve) -> SampleOutput | None:  # fmt: skip
        """Replay a graph; it samples every request's row (greedy where the item samples
        nothing), so only top logprobs are left to compute here."""
        rows = self._sampling_batch(plan.items)
        out = self.graphs.forward(key, host, segments, rows, resolve)
        index = [k for k, i in enumerate(plan.items) if i.sample]
        if not index:
            return None
        if len(index) < len(plan.items):
            out = out[to_device(index, torch.int64, self.device)]
        return with_top_logprobs(SampleOutput(out.tokens, out.logprobs), out.logits, out.lse,
                                 rows.num_top_logprobs)  # fmt: skip

    def _eager_step(self, plan: StepPlan, host: dict, segments, resolve, scored,
                    step: LaunchedStep) -> SampleOutput | None:  # fmt: skip
        """Run the model eagerly, then score prompt tokens (into step) and sample."""
        if scored is not None:
            host["logits_indices"] = np.concatenate([scored[0], host["logits_indices"]])
        logits = self.model(self._forward_batch(host, segments, resolve))
        if scored is not None:
            step.input_logprobs = _prompt_logprobs(logits[: len(scored[0])], scored, self.device)
            step.input_counts = scored[2]
            logits = logits[len(scored[0]) :]
        sampled = [i for i in plan.items if i.sample]
        return sample(logits, self._sampling_batch(sampled)) if sampled else None

    def failed(self) -> None:
        """The last launched step did not run: the next step's placeholders have no tokens."""
        self.last_sampled = torch.zeros(1, dtype=torch.int64, device=self.device)

    def finish(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step and read its outputs."""
        if step.done is not None:
            step.done.synchronize()
        input_logprobs = None
        if step.input_counts is not None:
            values = step.input_logprobs.tolist()
            ends = np.cumsum(step.input_counts)
            input_logprobs = [values[e - c : e] for c, e in zip(step.input_counts, ends)]
        if step.token_ids is None:
            return StepOutput([], [], None, input_logprobs)
        top = None
        if step.top_ids is not None:
            top = [list(zip(i, lp))
                   for i, lp in zip(step.top_ids.tolist(), step.top_logprobs.tolist())]
        return StepOutput(step.token_ids.tolist(), step.logprobs.tolist(), top, input_logprobs)

    def _copy_to_host(self, step: LaunchedStep) -> LaunchedStep:
        if self.device.type != "cuda":
            return step
        for name in ("token_ids", "logprobs", "top_ids", "top_logprobs", "input_logprobs"):
            value = getattr(step, name)
            if value is not None:
                setattr(step, name, value.to("cpu", non_blocking=True))
        step.done = torch.cuda.Event()
        step.done.record()
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
        rows = max((len(r) for rows, _ in (segments or {}).values() for r in rows), default=0)
        return self.graphs.key_for(host["qo_lens"], rows, segments is not None)

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
                    host["qo_lens"], rows, scales, self.device, segments.request_sets
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


def _prompt_logprobs(logits: torch.Tensor, scored, device) -> torch.Tensor:
    """The logprob of the prompt token each scored row predicts."""
    ids = to_device(scored[1], torch.int64, device)
    return torch.log_softmax(logits.float(), dim=-1).gather(1, ids[:, None])[:, 0]


def _lora_segments(plan: StepPlan) -> LoraSegments | None:
    """group -> (rows per request, scales per request) and each request's adapter-set id;
    None when no request has an adapter."""
    sets = [plan.adapter_sets[i.adapter_set] for i in plan.items]
    if not any(sets):
        return None
    dense: dict[int, int] = {}  # set index of the plan -> 0, 1, ... in order of first use
    request_sets = np.array(
        [dense.setdefault(i.adapter_set, len(dense)) if s else -1
         for i, s in zip(plan.items, sets)], np.int64)  # fmt: skip
    segments = {}
    for group in MODULE_GROUPS:
        rows = [s.get(group) for s in sets]
        segments[group] = ([r.rows if r else [] for r in rows],
                           [r.scales if r else [] for r in rows])
    return LoraSegments(segments, request_sets)
