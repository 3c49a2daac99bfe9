"""The worker's LoRA work inside a forward: a batch's rows and scales per module group
(LoraSegments) and the context the model's projections call to add each token's adapter
deltas from the device pool (LoraContext)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixlora.config import EXPERT_GROUPS
from radixlora.model.parallel import RowParallelLinear
from radixlora_kernels.lora_ops import LoraBatchMeta
from radixlora_kernels.moe_lora import TokenRows, token_rows

if TYPE_CHECKING:
    from radixlora.worker.adapter_pool import AdapterPool


class LoraSegments(dict):
    """group -> (rows per request, scales per request) of one batch, in plan order, plus
    request_sets: the adapter-set id of each request (-1: no adapter), by which the grouped
    SGMV path gathers the tokens of each distinct set, and magnitudes: group -> the DoRA
    magnitude row of each request (-1: none), for the groups some request's DoRA adapter
    adapts."""

    def __init__(self, per_group: dict[str, tuple[list, list]], request_sets: np.ndarray,
                 magnitudes: dict[str, list[int]] | None = None):
        super().__init__(per_group)
        self.request_sets = request_sets
        self.magnitudes = magnitudes or {}


class LoraContext:
    """LoRA inputs of one forward batch: the pool, the backend, one metadata per module group
    (None when no request of the batch uses that group, so its work is skipped, not zeroed).

    `project` returns (y, delta): linear(x) plus the LoRA deltas of x is y + delta. By default
    the deltas are added into y after the GEMM and delta is None; eager batches of prefill
    segments (ungrouped metadata, no bias) instead store the deltas first and let the GEMM add
    them (`_delta_then_gemm`). Deferred (`defer`, small CUDA
    graph buckets), the deltas come back as a float32 delta that y's consumer adds as it loads y
    (rotary + KV store, the norms' residual add, SiLU-mul), so no LoRA launch follows the GEMM.
    Tokens of DoRA adapters (meta.magnitude_rows) then get their adapter's per-channel scale of
    the whole output, base and delta (`_scale_dora`, radixlora.worker.dora): one launch after the
    GEMM, deferred or not, in batches that have such tokens.
    A deferred forward draws its deltas from one workspace zeroed once per forward (`begin`):
    one delta per group shared by all layers, whose rows of tokens with no adapter are never
    written and stay zero. (The shrink's v needs no zeroing: its in_dim splits store partial
    sums that the expand adds up.)

    With a side stream (CUDA graph capture), the LoRA work that only reads x (the shrink, or
    the whole delta when deferred) runs on it beside the base GEMM; at decode sizes it is
    latency the GEMM hides. Invariant: the side stream waits for everything queued on the
    compute stream before each projection's LoRA work, and the compute stream waits for it right
    after the GEMM, so x is ready when read and v or delta when used, and a layer's delta is
    overwritten only after the previous layer's consumer has read it. Memory (the caching
    allocator reuses a block only on the stream that allocated it): delta is allocated on the
    compute stream (workspace); v on the side stream, reused only by later side-stream work,
    which runs after the expand that read it (the deferred expand runs on the side stream, the
    other after the join, before the next projection's fork); x belongs to the compute
    stream and is freed after the join, so its block is reused only by work queued after the
    LoRA work that read it."""

    def __init__(
        self,
        pool: AdapterPool,
        backend,
        metas: dict[str, LoraBatchMeta | None],
        side_stream: torch.cuda.Stream | None = None,
        defer: bool = False,
    ):
        self.pool = pool
        self.backend = backend
        self.metas = metas
        self.side_stream = side_stream
        self.defer = defer
        self._delta: dict[str, torch.Tensor] = {}  # deferred workspace, per group
        self._token_rows: dict[str, TokenRows] = {}  # expert group -> its rows, per forward

    def begin(self, num_tokens: int, device) -> None:
        """Start a forward: a deferred context takes a zeroed workspace (one fill)."""
        self._token_rows = {}
        if not self.defer:
            return
        used = [g for g, m in self.metas.items() if m is not None]
        shapes = [(num_tokens, self.pool.out_offsets[g][-1]) for g in used]
        sizes = [math.prod(shape) for shape in shapes]
        buf = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        views = zip(used, buf.split(sizes), shapes, strict=True)
        self._delta = {g: t.view(shape) for g, t, shape in views}

    def project(
        self, linear: torch.nn.Module, x: torch.Tensor, layer_id: int, group: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, delta): linear(x) plus the batch's LoRA deltas of `group` in layer `layer_id`
        is y + delta (delta None: nothing to add)."""
        meta = self.metas.get(group)
        if meta is None:
            return linear(x), None
        a, b, out_offsets, qs = self._pools(layer_id, group)
        if isinstance(linear, RowParallelLinear):
            return self._row_parallel(linear, x, a, b, out_offsets, meta, qs), None
        if self.defer:
            delta = self._delta[group]
            y, _ = self._beside_gemm(linear, x, lambda: self.backend.deferred_delta(
                x, a, b, out_offsets, meta, delta, qs))
            self._scale_dora(linear, y, b, out_offsets, meta, qs, delta)
            return y, delta
        plain = isinstance(linear, torch.nn.Linear) and linear.bias is None
        if self.side_stream is None and meta.groups is None and plain:
            y = self._delta_then_gemm(linear, x, a, b, out_offsets, meta, qs)
        else:
            y, v = self._beside_gemm(linear, x, lambda: self.backend.shrink(x, a, meta, qs))
            if v is not None:
                self.backend.expand(v, b, out_offsets, meta, y)
        self._scale_dora(linear, y, b, out_offsets, meta, qs)
        return y, None

    def experts(self, layer_id: int):
        """The expert LoRA hook of MoE layer `layer_id` (radixlora_kernels.moe.moe_experts), or
        None when no request of the batch adapts the experts. Each token's rank rows are
        found once per forward and group (token_rows), then read by every layer."""
        if all(self.metas.get(g) is None for g in EXPERT_GROUPS):
            return None

        def add(group, a, rows_per_a, topk_ids, y, out_scale=None) -> None:
            meta = self.metas.get(group)
            if meta is None:
                return
            rows = self._token_rows.get(group)
            if rows is None:
                rows = self._token_rows[group] = token_rows(meta)
            a_pool, b_pool, _, qs = self._pools(layer_id, group)
            self.backend.expert_lora(a, rows_per_a, topk_ids, a_pool, b_pool, rows, y,
                                     out_scale, qs)

        return add

    def _scale_dora(self, linear, y, b, out_offsets, meta, qs, delta=None) -> None:
        """DoRA's scales once the output is complete (radixlora.worker.dora): a batch without a
        DoRA token in this group launches nothing. A row-parallel output is this rank's partial
        sum, whose bias comes after the all-reduce."""
        if meta.magnitude_rows is not None:
            bias = None if isinstance(linear, RowParallelLinear) else linear.bias
            self.backend.scale_dora(y, b, out_offsets, meta, bias, delta, qs)

    def _delta_then_gemm(self, linear, x: torch.Tensor, a, b, out_offsets, meta,
                         qs) -> torch.Tensor:
        """linear(x) plus the deltas, written first and added by the GEMM (beta = 1): the expand
        only stores, and the GEMM reads them in its epilogue instead of an expand reading and
        rewriting y after it. Every row of y is written first: the segments of a
        LoraBatchMeta cover all its tokens, and tokens with no adapter get zeros."""
        v = self.backend.shrink(x, a, meta, qs)
        if v is None:
            return linear(x)
        y = x.new_empty(x.shape[0], linear.out_features)
        self.backend.expand(v, b, out_offsets, meta, y, accumulate=False)
        return y.addmm_(x, linear.weight.t())

    def _row_parallel(self, linear: RowParallelLinear, x: torch.Tensor, a, b, out_offsets,
                      meta, qs) -> torch.Tensor:
        """Tensor parallel, o and down: x and A hold this rank's input columns, so both the
        base product and the shrink are partial sums; the expand is linear in the shrink, so
        each rank's partial delta (its partial shrink times the whole B) is added to its partial
        product and the one all-reduce of the output sums both: no collective of its own.
        DoRA's scale is per output channel, so it scales each partial sum; the bias is added
        after the all-reduce."""
        y = linear.partial(x)
        v = self.backend.shrink(x, a, meta, qs)
        if v is not None:
            self.backend.expand(v, b, out_offsets, meta, y)
        self._scale_dora(linear, y, b, out_offsets, meta, qs)
        return linear.reduce(y)

    def _beside_gemm(self, linear, x: torch.Tensor, lora_work):
        """(linear(x), lora_work()), the LoRA work on the side stream beside the GEMM if any."""
        if self.side_stream is None:
            return linear(x), lora_work()
        compute = torch.cuda.current_stream(x.device)
        self.side_stream.wait_stream(compute)
        with torch.cuda.stream(self.side_stream):
            out = lora_work()
        y = linear(x)
        compute.wait_stream(self.side_stream)
        return y, out

    def _pools(self, layer_id: int, group: str):
        """(a_pool, b_pool, out_offsets, qscales) of one layer's group; qscales None unless the
        pool is int8."""
        pool = self.pool
        qscales = pool.qscales[layer_id].get(group)
        return pool.a[layer_id][group], pool.b[layer_id][group], pool.out_offsets[group], qscales


def high_priority_stream(device) -> torch.cuda.Stream:
    """A stream at the device's highest priority (torch clamps a priority past the device's
    range to its end): its CTAs are scheduled ahead of waiting CTAs of normal streams."""
    return torch.cuda.Stream(device, priority=-(1 << 20))
