"""CUDA graphs for decode steps and short extends. Each (batch bucket, token bucket, LoRA row
bucket) gets one graph captured on first use (or all at once by capture_all); every input of a
step (token ids, positions, KV slots, attention and LoRA metadata) lives in static buffers
refilled before replay, so a step costs a few host-to-device copies and one graph launch
instead of ~1,000 kernel launches. A decode graph (one token per request) uses the split-K
decode kernel; an extend graph (short prompts or cache hits, mixed with decodes) the extend one.

Padding requests decode token 0 at position 0 into the reserved KV slot 0 over a one-token
context with no adapter rows; padding tokens past the last request belong to no segment. Their
logits are never read.

LoRA runs the grouped SGMV path under every graph: the step's tokens grouped by distinct adapter
set (padding and base-only requests belong to no group), so the rows live in the group buffers
and the per-segment metadata carries none; graphs therefore need the Triton LoRA backend. On CUDA
each projection's LoRA work that reads only x is captured on a side stream, a parallel branch of
the graph beside the base GEMM (EngineConfig.lora_side_stream): the shrink, or in buckets of at
most LORA_DEFER_MAX_TOKENS tokens the whole delta (on a high-priority stream), deferred to the
kernel that reads the projection's output (LoraContext)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from radixlora.attention import TritonAttentionMeta
from radixlora.forward_batch import ForwardBatch
from radixlora.kernels.lora_ops import HostGroups, LoraBatchMeta, LoraGroups
from radixlora.lora.adapter import MODULE_GROUPS
from radixlora.lora.pool import LoraContext, LoraSegments, high_priority_stream

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
EXTEND_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)
MAX_EXTEND_BATCH = 16
ROW_BUCKETS = (0, 32, 128, 512)
# Deferred deltas take the expand off the critical path but cost a float32 write and read of
# every projection output: a win where launches dominate, a loss where bytes do.
LORA_DEFER_MAX_TOKENS = 32


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor


@dataclass(frozen=True)
class GraphKey:
    batch: int
    tokens: int
    rows: int

    @property
    def decode(self) -> bool:
        return self.tokens == self.batch


class StaticInputs:
    """Static input buffers of every graph and the bucketing rules; device-agnostic, so the
    padding logic runs (and is tested) on the CPU too through static_forward()."""

    def __init__(self, runner, max_batch: int, max_context: int, max_rows: int):
        if runner.lora_backend.name != "triton":
            raise ValueError("cuda_graph needs lora_backend triton (or auto on CUDA)")
        self.runner = runner
        # CudaGraphRunner: the side stream of the LoRA work, by whether the bucket defers
        self.lora_streams: dict[bool, torch.cuda.Stream] = {}
        self.buckets = [b for b in BATCH_BUCKETS if b <= max_batch] or [1]
        self.extend_buckets = [b for b in self.buckets if b <= MAX_EXTEND_BATCH]
        self.row_buckets = sorted({r for r in ROW_BUCKETS if r < max_rows} | {max_rows})
        dev, n = runner.device, self.buckets[-1]
        t = max(n, EXTEND_TOKEN_BUCKETS[-1])
        i32 = dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(t, dtype=torch.int64, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        self.qo_indptr = torch.arange(n + 1, **i32)
        self.kv_indptr = torch.arange(n + 1, **i32)
        self.kv_indices = torch.zeros(n * max_context, **i32)
        self.token_seg = torch.zeros(t, **i32)
        self.no_seg_rows = torch.zeros(n + 1, **i32)
        self.no_rows = torch.zeros(0, **i32)
        self.num_groups = torch.zeros(1, **i32)
        self.group_indptr = torch.zeros(t + 1, **i32)  # groups never outnumber tokens
        self.group_tokens = torch.zeros(t, **i32)
        rows = t * self.row_buckets[-1] + 1
        self.row_indptr = {g: torch.zeros(t + 1, **i32) for g in MODULE_GROUPS}
        self.row_ids = {g: torch.zeros(rows, **i32) for g in MODULE_GROUPS}
        self.row_scales = {
            g: torch.zeros(rows, dtype=torch.float32, device=dev) for g in MODULE_GROUPS
        }

    def key_for(self, qo_lens: list[int], max_rows: int, has_lora: bool) -> GraphKey | None:
        """The graph a batch replays into, or None when it needs the eager path."""
        batch, tokens = len(qo_lens), sum(qo_lens)
        if batch > self.buckets[-1] or max_rows > self.row_buckets[-1]:
            return None
        rows = (
            self.row_buckets[bisect.bisect_left(self.row_buckets, max(max_rows, 1))]
            if (has_lora)
            else 0
        )
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        if tokens == batch:
            return GraphKey(bucket, bucket, rows)
        if batch > self.extend_buckets[-1]:
            return None
        bucket = self.extend_buckets[bisect.bisect_left(self.extend_buckets, batch)]
        need = tokens + bucket - batch  # padding requests take one token each
        if need > EXTEND_TOKEN_BUCKETS[-1]:
            return None
        token_bucket = EXTEND_TOKEN_BUCKETS[bisect.bisect_left(EXTEND_TOKEN_BUCKETS, need)]
        return GraphKey(bucket, max(token_bucket, bucket + 1), rows)

    def static_forward(self, key: GraphKey, host: dict, lora_segments, resolve=None):
        """What a graph replay computes, run eagerly: logits of each request's last token."""
        self._fill(key, host, lora_segments, resolve)
        return self.runner.model(self._static_batch(key))[: len(host["qo_lens"])]

    def _fill(self, key: GraphKey, host: dict, lora_segments, resolve=None) -> None:
        """Copy a batch into the static buffers; `resolve` replaces placeholder ids in place."""
        qo_lens = host["qo_lens"]
        pad_reqs = key.batch - len(qo_lens)
        pad_tokens = key.tokens - sum(qo_lens) - pad_reqs
        self._copy(self.input_ids, _pad(host["input_ids"], pad_reqs + pad_tokens), np.int64)
        if resolve is not None:
            resolve(self.input_ids[: len(host["input_ids"])])
        self._copy(self.positions, _pad(host["positions"], pad_reqs + pad_tokens), np.int64)
        self._copy(self.out_cache_loc, _pad(host["out_cache_loc"], pad_reqs + pad_tokens), np.int64)
        qo = np.concatenate([qo_lens, np.ones(pad_reqs, np.int64)])
        kv = np.concatenate([host["kv_lens"], np.ones(pad_reqs, np.int64)])
        self._copy(self.qo_indptr, _indptr(qo), np.int32)
        self._copy(self.kv_indptr, _indptr(kv), np.int32)
        self._copy(self.logits_indices, np.cumsum(qo) - 1, np.int64)
        self._copy(self.kv_indices, _pad(host["kv_indices"], pad_reqs), np.int32)
        if lora_segments is not None and key.rows:
            self._fill_groups(qo_lens, lora_segments)

    def _fill_groups(self, qo_lens: list[int], lora_segments: LoraSegments) -> None:
        groups = HostGroups.build(qo_lens, lora_segments.request_sets)
        self._copy(self.num_groups, np.array([groups.num_groups]), np.int32)
        self._copy(self.group_indptr, groups.group_indptr, np.int32)
        self._copy(self.group_tokens, groups.token_ids, np.int32)
        for group in MODULE_GROUPS:
            row_indptr, row_ids, row_scales = groups.rows(*lora_segments[group])
            self._copy(self.row_indptr[group], row_indptr, np.int32)
            self._copy(self.row_ids[group], row_ids, np.int32)
            self._copy(self.row_scales[group], row_scales, np.float32)

    @staticmethod
    def _copy(dst: torch.Tensor, values: np.ndarray, dtype) -> None:
        src = torch.from_numpy(np.ascontiguousarray(values, dtype=dtype))
        if dst.is_cuda:  # pinned, so the copy is queued behind the step in flight, not waited on
            src = src.pin_memory()
        dst[: len(src)].copy_(src, non_blocking=True)

    def _static_batch(self, key: GraphKey) -> ForwardBatch:
        b, t, rows = key.batch, key.tokens, key.rows
        attn = TritonAttentionMeta(
            self.qo_indptr[: b + 1], self.kv_indptr[: b + 1], self.kv_indices, t - b + 1, key.decode
        )
        lora = None
        if rows:
            n = t * rows + 1
            metas = {
                g: LoraBatchMeta(
                    self.qo_indptr[: b + 1],
                    self.no_seg_rows[: b + 1],
                    self.no_rows,
                    self.no_rows.float(),
                    self.token_seg[:t],
                    self.no_rows,
                    rows,
                    t - b + 1,
                    LoraGroups(
                        self.num_groups,
                        self.group_indptr[: t + 1],
                        self.group_tokens[:t],
                        self.row_indptr[g][: t + 1],
                        self.row_ids[g][:n],
                        self.row_scales[g][:n],
                    ),
                )
                for g in MODULE_GROUPS
            }
            defer = t <= LORA_DEFER_MAX_TOKENS
            lora = LoraContext(
                self.runner.adapter_pool, self.runner.lora_backend, metas,
                self.lora_streams.get(defer), defer,
            )  # fmt: skip
        return ForwardBatch(
            self.input_ids[:t],
            self.positions[:t],
            self.out_cache_loc[:t],
            self.logits_indices[:b],
            self.runner.attn_backend,
            attn,
            lora,
        )

    def _reset_inputs(self, key: GraphKey) -> None:
        """Safe contents for warm-up and capture: padding requests only."""
        self._fill(
            key,
            {
                "qo_lens": [],
                "kv_lens": np.zeros(0, np.int64),
                "input_ids": np.zeros(0),
                "positions": np.zeros(0),
                "out_cache_loc": np.zeros(0),
                "kv_indices": np.zeros(0),
            },
            None,
        )
        self.num_groups.zero_()


class CudaGraphRunner(StaticInputs):
    def __init__(
        self,
        runner,
        max_batch: int,
        max_context: int,
        max_rows: int,
        lora_side_stream: bool = True,
    ):
        super().__init__(runner, max_batch, max_context, max_rows)
        self.graphs: dict[GraphKey, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        if lora_side_stream:
            # high priority where the side branch is the whole delta, so it finishes within
            # its GEMM; normal beside the large buckets' compute-bound GEMMs (PERF.md, run 11)
            self.lora_streams = {True: high_priority_stream(runner.device),
                                 False: torch.cuda.Stream(runner.device)}  # fmt: skip

    def forward(self, key: GraphKey, host: dict, lora_segments, resolve=None) -> torch.Tensor:
        """Logits [batch, vocab] of each request's last token, by replaying key's graph."""
        entry = self.graphs.get(key) or self._capture(key)  # capture resets the buffers
        self._fill(key, host, lora_segments, resolve)
        entry.graph.replay()
        return entry.logits[: len(host["qo_lens"])]

    def reset(self) -> None:
        """Drop every captured graph (recaptured on use) with the memory pool they shared."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()

    def capture_decode(self) -> None:
        """Capture every decode graph now (extend graphs are captured on first use)."""
        for rows in self.row_buckets:
            for bucket in reversed(self.buckets):
                if GraphKey(bucket, bucket, rows) not in self.graphs:
                    self._capture(GraphKey(bucket, bucket, rows))

    def _capture(self, key: GraphKey) -> _Graph:
        self._reset_inputs(key)
        fb = self._static_batch(key)
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
        self.graphs[key] = entry
        return entry


def _pad(values: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([np.asarray(values), np.zeros(n, np.int64)])


def _indptr(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)])
