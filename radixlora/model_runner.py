"""The model runner owns every device tensor (weights, KV pool, adapter pool) and executes the
scheduler's batch plans: load adapter rows, build the forward batch once, run, sample."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixlora.attention import AttentionInputs, TritonAttentionBackend, make_attention_backend
from radixlora.config import EngineConfig, ModelConfig
from radixlora.cuda_graph import CudaGraphRunner
from radixlora.forward_batch import ForwardBatch
from radixlora.kernels.lora_ops import LoraBatchMeta, make_lora_backend
from radixlora.kv_cache import KVPool
from radixlora.lora.adapter import MODULE_GROUPS
from radixlora.lora.pool import AdapterPool, LoraContext, LoraSegments
from radixlora.model.loader import load_model
from radixlora.sampling import SamplingBatch, sample
from radixlora.scheduler import BatchPlan


@dataclass
class StepOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    input_logprobs: list[list[float]] | None = None  # per plan item, when any item is scored


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
        self.adapter_pool = AdapterPool(model_cfg, config.adapter_rows, self.dtype, self.device)
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
            )

    def execute(self, plan: BatchPlan) -> StepOutput:
        for adapter, rows in plan.adapter_loads:
            self.adapter_pool.write(adapter, rows)
        host = _host_inputs(plan)
        segments = _lora_segments(plan)
        sampled = [i for i in plan.items if i.sample]
        scored = _scored_rows(plan)
        key = self._graph_key(host, segments) if scored is None else None
        if key is not None:
            logits = self.graphs.forward(key, host, segments)
            if len(sampled) < len(plan.items):
                logits = logits[[i.sample for i in plan.items]]
        else:
            if scored is not None:
                host["logits_indices"] = np.concatenate([scored[0], host["logits_indices"]])
            logits = self.model(self._forward_batch(host, segments))
        input_logprobs = None
        if scored is not None:
            input_logprobs = _prompt_logprobs(logits[: len(scored[0])], scored)
            logits = logits[len(scored[0]) :]
        if not sampled:
            return StepOutput([], [], None, input_logprobs)
        out = sample(logits, self._sampling_batch(sampled))
        top = None
        if out.top_ids is not None:
            top = [
                list(zip(i, lp)) for i, lp in zip(out.top_ids.tolist(), out.top_logprobs.tolist())
            ]
        return StepOutput(out.token_ids.tolist(), out.logprobs.tolist(), top, input_logprobs)

    def _graph_key(self, host: dict, segments):
        if self.graphs is None:
            return None
        rows = max((len(r) for rows, _ in (segments or {}).values() for r in rows), default=0)
        return self.graphs.key_for(host["qo_lens"], rows, segments is not None)

    def _forward_batch(self, host: dict, segments) -> ForwardBatch:
        names = ("input_ids", "positions", "out_cache_loc", "kv_indices", "logits_indices")
        dev = {k: torch.from_numpy(host[k].astype(np.int64)).to(self.device) for k in names}
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

    def _sampling_batch(self, sampled) -> SamplingBatch:
        return SamplingBatch.build(
            [i.req.params for i in sampled],
            [i.req.seed for i in sampled],
            [len(i.req.output_ids) for i in sampled],
            self.device,
        )


def _host_inputs(plan: BatchPlan) -> dict:
    """Flat host arrays of one batch (one segment per request, in plan order)."""
    items = plan.items
    qo_lens = [len(i.extend_ids) for i in items]
    kv_lens = np.array([i.start + n for i, n in zip(items, qo_lens)], np.int64)
    ends = np.cumsum(qo_lens)
    return {
        "qo_lens": qo_lens,
        "kv_lens": kv_lens,
        "input_ids": np.concatenate([i.extend_ids for i in items]),
        "positions": np.concatenate([np.arange(i.start, k) for i, k in zip(items, kv_lens)]),
        "out_cache_loc": np.concatenate(
            [i.req.kv_slots[i.start : k] for i, k in zip(items, kv_lens)]
        ),
        "kv_indices": np.concatenate([i.req.kv_slots[:k] for i, k in zip(items, kv_lens)]),
        "logits_indices": np.array([e - 1 for i, e in zip(items, ends) if i.sample], np.int64),
    }


def _scored_rows(plan: BatchPlan) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """(batch rows whose logits are scored, the prompt token each scores, count per item);
    None when no item of the plan scores prompt tokens."""
    if all(i.score_ids is None for i in plan.items):
        return None
    rows, targets, counts, offset = [], [], [], 0
    for item in plan.items:
        ids = item.score_ids if item.score_ids is not None else np.zeros(0, np.int32)
        rows.append(offset + item.score_from - item.start + np.arange(len(ids)))
        targets.append(ids.astype(np.int64))
        counts.append(len(ids))
        offset += len(item.extend_ids)
    return np.concatenate(rows), np.concatenate(targets), counts


def _prompt_logprobs(logits: torch.Tensor, scored) -> list[list[float]]:
    """Per plan item, the logprobs of the prompt tokens its scored rows predict."""
    _, targets, counts = scored
    ids = torch.from_numpy(targets).to(logits.device)
    values = torch.log_softmax(logits.float(), dim=-1).gather(1, ids[:, None])[:, 0].tolist()
    ends = np.cumsum(counts)
    return [values[e - c : e] for c, e in zip(counts, ends)]


def _lora_segments(plan: BatchPlan) -> LoraSegments | None:
    """group -> (rows per request, scales per request) and each request's adapter-set id;
    None when no request has an adapter."""
    keys = [i.req.adapter_set.key for i in plan.items]
    if all(not plan.lora_rows[k] for k in keys):
        return None
    set_ids: dict[tuple, int] = {}
    request_sets = [set_ids.setdefault(k, len(set_ids)) if plan.lora_rows[k] else -1 for k in keys]
    segments = {}
    for group in MODULE_GROUPS:
        pairs = [plan.lora_rows[k].get(group, ([], [])) for k in keys]
        segments[group] = ([p[0] for p in pairs], [p[1] for p in pairs])
    return LoraSegments(segments, np.array(request_sets, np.int64))
