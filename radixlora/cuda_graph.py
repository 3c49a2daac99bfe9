"""CUDA graphs for decode steps. Each (batch bucket, LoRA row bucket) gets one graph captured on
first use; every input a decode step needs (token ids, positions, KV slots, attention and LoRA
metadata) lives in static buffers that are refilled before replay, so a step costs a few
host-to-device copies and one graph launch instead of ~1,000 kernel launches.

Padding rows of a bucket decode token 0 at position 0 into the reserved KV slot 0 over a
one-token context, with no adapter rows; their logits are never read."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from radixlora.attention import TritonAttentionMeta
from radixlora.forward_batch import ForwardBatch
from radixlora.kernels.lora_ops import LoraBatchMeta
from radixlora.lora.adapter import MODULE_GROUPS
from radixlora.lora.pool import LoraContext

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
ROW_BUCKETS = (0, 32, 128, 512)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


class CudaGraphRunner:
    def __init__(self, runner, max_batch: int, max_context: int, max_rows: int):
        self.runner = runner
        self.buckets = [b for b in BATCH_BUCKETS if b <= max_batch] or [1]
        self.row_buckets = [r for r in ROW_BUCKETS if r <= max_rows] + (
            [max_rows] if max_rows not in ROW_BUCKETS else []
        )
        dev, n = runner.device, self.buckets[-1]
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.qo_indptr = torch.arange(n + 1, **i32)
        self.kv_indptr = torch.arange(n + 1, **i32)
        self.kv_indices = torch.zeros(n * max_context, **i32)
        self.seg_indptr = torch.arange(n + 1, **i32)
        self.token_seg = torch.arange(n, **i32)
        rows = n * self.row_buckets[-1] + 1
        self.row_indptr = {g: torch.zeros(n + 1, **i32) for g in MODULE_GROUPS}
        self.row_ids = {g: torch.zeros(rows, **i32) for g in MODULE_GROUPS}
        self.row_scales = {
            g: torch.zeros(rows, dtype=torch.float32, device=dev) for g in MODULE_GROUPS
        }
        self.row_seg = torch.zeros(rows, **i32)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture_all(self) -> None:
        """Capture every (batch bucket, row bucket) graph now instead of on first use."""
        for bucket in reversed(self.buckets):
            for rows in self.row_buckets:
                if (bucket, rows) not in self.graphs:
                    self._capture(bucket, rows)

    def fits(self, batch: int, max_rows: int) -> bool:
        return batch <= self.buckets[-1] and max_rows <= self.row_buckets[-1]

    def forward(
        self, input_ids, positions, out_cache_loc, kv_lens, kv_indices, lora_segments
    ) -> torch.Tensor:
        """Logits [batch, vocab] of one decode step. lora_segments: group -> (rows, scales)
        per request, or None when no request of the batch has an adapter."""
        batch = len(input_ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        need = _max_rows(lora_segments)
        rows = (
            0
            if lora_segments is None
            else self.row_buckets[bisect.bisect_left(self.row_buckets, max(need, 1))]
        )
        self._fill(
            batch, bucket, input_ids, positions, out_cache_loc, kv_lens, kv_indices, lora_segments
        )
        entry = self.graphs.get((bucket, rows)) or self._capture(bucket, rows)
        entry.graph.replay()
        return entry.logits[:batch]

    def _fill(
        self, batch, bucket, input_ids, positions, out_cache_loc, kv_lens, kv_indices, lora_segments
    ) -> None:
        pad = bucket - batch
        self.input_ids[:bucket].copy_(_host(np.pad(input_ids, (0, pad)), np.int64))
        self.positions[:bucket].copy_(_host(np.pad(positions, (0, pad)), np.int64))
        self.out_cache_loc[:bucket].copy_(_host(np.pad(out_cache_loc, (0, pad)), np.int64))
        lens = np.concatenate([kv_lens, np.ones(pad, np.int64)])
        self.kv_indptr[: bucket + 1].copy_(_host(np.concatenate([[0], np.cumsum(lens)]), np.int32))
        indices = np.concatenate([kv_indices, np.zeros(pad, np.int64)])
        self.kv_indices[: len(indices)].copy_(_host(indices, np.int32))
        if lora_segments is None:
            return
        for group in MODULE_GROUPS:
            seg_rows, seg_scales = lora_segments[group]
            counts = [len(r) for r in seg_rows] + [0] * pad
            self.row_indptr[group][: bucket + 1].copy_(
                _host(np.concatenate([[0], np.cumsum(counts)]), np.int32)
            )
            flat = [r for rows in seg_rows for r in rows]
            if flat:
                self.row_ids[group][: len(flat)].copy_(_host(np.asarray(flat), np.int32))
                scales = np.asarray([s for ss in seg_scales for s in ss], np.float32)
                self.row_scales[group][: len(flat)].copy_(_host(scales, np.float32))

    def _static_batch(self, bucket: int, rows: int) -> ForwardBatch:
        attn = TritonAttentionMeta(
            self.qo_indptr[: bucket + 1], self.kv_indptr[: bucket + 1], self.kv_indices, 1, True
        )
        lora = None
        if rows:
            metas = {
                g: LoraBatchMeta(
                    self.seg_indptr[: bucket + 1],
                    self.row_indptr[g][: bucket + 1],
                    self.row_ids[g][: bucket * rows + 1],
                    self.row_scales[g][: bucket * rows + 1],
                    self.token_seg[:bucket],
                    self.row_seg[: bucket * rows + 1],
                    rows,
                    1,
                )
                for g in MODULE_GROUPS
            }
            lora = LoraContext(self.runner.adapter_pool, self.runner.lora_backend, metas)
        return ForwardBatch(
            self.input_ids[:bucket],
            self.positions[:bucket],
            self.out_cache_loc[:bucket],
            self.logits_indices[:bucket],
            self.runner.attn_backend,
            attn,
            lora,
        )

    def _capture(self, bucket: int, rows: int) -> _Graph:
        fb = self._static_batch(bucket, rows)
        model = self.runner.model
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles Triton kernels and settles allocations
                model(fb)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = model(fb)
        entry = _Graph(graph, logits)
        self.graphs[(bucket, rows)] = entry
        return entry


def _max_rows(lora_segments) -> int:
    if lora_segments is None:
        return 0
    return max((len(r) for rows, _ in lora_segments.values() for r in rows), default=0)


def _host(values: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=dtype))
