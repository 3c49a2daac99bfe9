"""The model runner owns every device tensor (weights, KV pool, adapter pool) and executes the
scheduler's batch plans: load adapter rows, build the forward batch once, run, sample."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixlora.attention import AttentionInputs, make_attention_backend
from radixlora.config import EngineConfig, ModelConfig
from radixlora.forward_batch import ForwardBatch
from radixlora.kernels.lora_ops import LoraBatchMeta, make_lora_backend
from radixlora.kv_cache import KVPool
from radixlora.lora.adapter import MODULE_GROUPS
from radixlora.lora.pool import AdapterPool, LoraContext
from radixlora.model.loader import load_model
from radixlora.sampling import SamplingBatch, sample
from radixlora.scheduler import BatchPlan


@dataclass
class StepOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


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
            config.attention_backend, self.kv_pool, model_cfg.num_heads, model_cfg.head_dim,
            model_cfg.sliding_window, self.device)
        self.lora_backend = make_lora_backend(config.lora_backend, self.device)

    def execute(self, plan: BatchPlan) -> StepOutput:
        for adapter, rows in plan.adapter_loads:
            self.adapter_pool.write(adapter, rows)
        fb, sampled = self._forward_batch(plan)
        logits = self.model(fb)
        if not sampled:
            return StepOutput([], [], None)
        out = sample(logits, self._sampling_batch(sampled))
        top = None
        if out.top_ids is not None:
            top = [
                list(zip(i, lp)) for i, lp in zip(out.top_ids.tolist(), out.top_logprobs.tolist())
            ]
        return StepOutput(out.token_ids.tolist(), out.logprobs.tolist(), top)

    def _forward_batch(self, plan: BatchPlan) -> tuple[ForwardBatch, list]:
        items = plan.items
        qo_lens = [len(i.extend_ids) for i in items]
        kv_lens = [i.start + n for i, n in zip(items, qo_lens)]
        ends = np.cumsum(qo_lens)
        host = {
            "input_ids": np.concatenate([i.extend_ids for i in items]),
            "positions": np.concatenate([np.arange(i.start, k) for i, k in zip(items, kv_lens)]),
            "out_cache_loc": np.concatenate(
                [i.req.kv_slots[i.start : k] for i, k in zip(items, kv_lens)]
            ),
            "kv_indices": np.concatenate([i.req.kv_slots[:k] for i, k in zip(items, kv_lens)]),
            "logits_indices": np.array([e - 1 for i, e in zip(items, ends) if i.sample], np.int64),
        }
        dev = {k: torch.from_numpy(v.astype(np.int64)).to(self.device) for k, v in host.items()}
        attn_meta = self.attn_backend.build_metadata(
            AttentionInputs(qo_lens, kv_lens, dev["kv_indices"])
        )
        fb = ForwardBatch(
            dev["input_ids"],
            dev["positions"],
            dev["out_cache_loc"],
            dev["logits_indices"],
            self.attn_backend,
            attn_meta,
            self._lora_context(plan, qo_lens),
        )
        return fb, [i for i in items if i.sample]

    def _lora_context(self, plan: BatchPlan, qo_lens: list[int]) -> LoraContext | None:
        metas = {}
        for group in MODULE_GROUPS:
            seg_rows, seg_scales = [], []
            for item in plan.items:
                rows, scales = plan.lora_rows[item.req.adapter_set.key].get(group, ([], []))
                seg_rows.append(rows)
                seg_scales.append(scales)
            has_rows = any(seg_rows)
            metas[group] = (
                LoraBatchMeta.from_segments(qo_lens, seg_rows, seg_scales, self.device)
                if has_rows
                else None
            )
        if all(m is None for m in metas.values()):
            return None
        return LoraContext(self.adapter_pool, self.lora_backend, metas)

    def _sampling_batch(self, sampled) -> SamplingBatch:
        return SamplingBatch.build(
            [i.req.params for i in sampled],
            [i.req.seed for i in sampled],
            [len(i.req.output_ids) for i in sampled],
            self.device,
        )
