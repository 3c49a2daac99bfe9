"""Batched multi-LoRA for one fused projection: batch metadata and the torch/Triton backends."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from radixlora_kernels.device import to_device

from .dora_scale import dora_scale, dora_scale_ref

GROUP_TOKENS = 16  # tokens per group at most: a popular set's tokens split into several groups


@dataclass(frozen=True)
class LoraGroups:
    """The batch's tokens grouped by distinct adapter set: group g owns the rank rows
    row_ids[row_indptr[g]:row_indptr[g + 1]] and the tokens
    token_ids[group_indptr[g]:group_indptr[g + 1]] (any order, no token in two groups; tokens
    with no adapter are in no group). A set with more than GROUP_TOKENS tokens is split into
    several groups with the same rows, so one popular adapter's tokens spread over programs
    instead of serialising in one program's token loop; there are never more groups than
    tokens. Only the first num_groups groups are used, so static buffers sized by a batch
    bucket serve any mix."""

    num_groups: torch.Tensor  # [1] int32
    group_indptr: torch.Tensor  # [G + 1] int32, offsets into token_ids
    token_ids: torch.Tensor  # [M] int32
    row_indptr: torch.Tensor  # [G + 1] int32, offsets into row_ids
    row_ids: torch.Tensor  # [N] int32, pool rows
    row_scales: torch.Tensor  # [N] float32


@dataclass(frozen=True)
class HostGroups:
    """Host (numpy) form of the token grouping shared by every module group of a batch."""

    group_indptr: np.ndarray  # [G + 1] int64
    token_ids: np.ndarray  # [M] int64
    first_seg: np.ndarray  # [G] int64, a segment of each group (its rows are the group's)

    @classmethod
    def build(
        cls, seg_lens: Sequence[int], seg_sets: Sequence[int], max_tokens: int = GROUP_TOKENS
    ) -> HostGroups:
        """seg_sets[s]: adapter-set id of segment s (any ints; < 0: no adapter); groups hold
        at most max_tokens tokens. Vectorised: no Python work per token."""
        lens = np.asarray(seg_lens, dtype=np.int64)
        sets = np.asarray(seg_sets, dtype=np.int64)
        used = np.flatnonzero(sets >= 0)
        labels, first, seg_set = np.unique(sets[used], return_index=True, return_inverse=True)
        set_of_seg = np.full(len(sets), -1, np.int64)
        set_of_seg[used] = seg_set.reshape(-1)
        token_set = np.repeat(set_of_seg, lens)
        tokens = np.flatnonzero(token_set >= 0)
        order = np.argsort(token_set[tokens], kind="stable")
        sorted_sets = token_set[tokens][order]
        per_set = np.bincount(sorted_sets, minlength=len(labels))
        set_start = np.cumsum(per_set) - per_set
        groups_per_set = -(-per_set // max_tokens)
        group_start = np.cumsum(groups_per_set) - groups_per_set
        rank_in_set = np.arange(len(sorted_sets)) - set_start[sorted_sets]
        group_of_token = group_start[sorted_sets] + rank_in_set // max_tokens
        per_group = np.bincount(group_of_token, minlength=int(groups_per_set.sum()))
        set_of_group = np.repeat(np.arange(len(labels)), groups_per_set)
        return cls(
            group_indptr=indptr(per_group).astype(np.int64),
            token_ids=tokens[order],
            first_seg=used[first][set_of_group],
        )

    @property
    def num_groups(self) -> int:
        return len(self.first_seg)

    def rows(
        self, seg_rows: Sequence[Sequence[int]], seg_scales: Sequence[Sequence[float]]
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row_indptr, row_ids, row_scales) of the groups, from their segments' rows."""
        rows = [seg_rows[s] for s in self.first_seg]
        counts = np.array([len(r) for r in rows], np.int64)
        row_ids = np.array([r for rs in rows for r in rs], np.int64)
        scales = np.array([w for s in self.first_seg for w in seg_scales[s]], np.float32)
        return indptr(counts), row_ids, scales

    def to_device(
        self,
        seg_rows: Sequence[Sequence[int]],
        seg_scales: Sequence[Sequence[float]],
        device: torch.device | str,
    ) -> LoraGroups:
        row_indptr, row_ids, row_scales = self.rows(seg_rows, seg_scales)

        device = torch.device(device)

        def i32(values) -> torch.Tensor:
            return to_device(np.asarray(values, np.int32), torch.int32, device)

        return LoraGroups(
            num_groups=i32([self.num_groups]),
            group_indptr=i32(self.group_indptr),
            token_ids=i32(self.token_ids),
            row_indptr=i32(row_indptr),
            row_ids=i32(row_ids),
            row_scales=to_device(row_scales, torch.float32, device),
        )


def sets_of_segments(
    seg_rows: Sequence[Sequence[int]], seg_scales: Sequence[Sequence[float]]
) -> list[int]:
    """An adapter-set id per segment: equal (rows, scales) share one; no rows: -1."""
    ids: dict[tuple, int] = {}
    return [
        ids.setdefault((tuple(rows), tuple(scales)), len(ids)) if len(rows) else -1
        for rows, scales in zip(seg_rows, seg_scales, strict=True)
    ]


@dataclass(frozen=True)
class LoraBatchMeta:
    """Which pool rows (and weights) each contiguous token segment of a batch uses.

    A segment is one request's tokens (decode: 1, prefill: many); its rows are the
    concatenated rank rows of its adapter set, so a stack of k adapters is one segment.
    A segment with no rows has no adapter and gets no delta.
    """

    seg_indptr: torch.Tensor  # [S + 1] int32, token offsets
    row_indptr: torch.Tensor  # [S + 1] int32, offsets into row_ids
    row_ids: torch.Tensor  # [N] int32, pool rows
    row_scales: torch.Tensor  # [N] float32, stacking weight of each row
    token_seg: torch.Tensor  # [T] int32, segment of each token
    row_seg: torch.Tensor  # [N] int32, segment of each row entry
    max_rows: int  # >= rows of any segment
    max_seg_len: int  # >= tokens of any segment
    groups: LoraGroups | None = None  # the same batch by adapter set; the Triton path uses it
    # [T] int32, the DoRA magnitude row of each token's adapter (-1: none); None: no token of
    # the batch has one in this group
    magnitude_rows: torch.Tensor | None = None

    @classmethod
    def from_segments(
        cls,
        seg_lens: Sequence[int],
        seg_rows: Sequence[Sequence[int]],
        seg_scales: Sequence[Sequence[float]],
        device: torch.device | str,
        seg_sets: Sequence[int] | None = None,
        grouped: bool = True,
        seg_magnitudes: Sequence[int] | None = None,
    ) -> LoraBatchMeta:
        """seg_sets: adapter-set id per segment (< 0: none; default: equal rows and scales);
        grouped: build `groups`, which the Triton backend runs every batch with (decodes,
        prefill chunks and steps mixing both; False: the per-segment kernels, a baseline);
        seg_magnitudes: the DoRA magnitude row of each segment (-1: none)."""
        lens, counts, row_ids, row_scales = _flat_segments(seg_lens, seg_rows, seg_scales)
        # a multiple of 16: the strides of the kernels' rank-space buffers then never depend
        # on the token count's parity, so no step compiles a kernel variant of its own
        max_rows = -(-int(counts.max(initial=0)) // 16) * 16
        groups = None
        if grouped:
            if seg_sets is None:
                seg_sets = sets_of_segments(seg_rows, seg_scales)
            groups = HostGroups.build(lens, seg_sets).to_device(seg_rows, seg_scales, device)

        device = torch.device(device)

        def to_dev(values, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        return cls(
            seg_indptr=to_dev(indptr(lens), torch.int32),
            row_indptr=to_dev(indptr(counts), torch.int32),
            row_ids=to_dev(row_ids, torch.int32),
            row_scales=to_dev(row_scales, torch.float32),
            token_seg=to_dev(_segment_of_each(lens), torch.int32),
            row_seg=to_dev(_segment_of_each(counts), torch.int32),
            max_rows=max_rows,
            max_seg_len=int(lens.max(initial=0)),
            groups=groups,
            magnitude_rows=None if seg_magnitudes is None else to_dev(
                np.repeat(np.asarray(seg_magnitudes, np.int32), lens), torch.int32),
        )

    @property
    def num_segments(self) -> int:
        return self.seg_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.token_seg.numel()

    @property
    def num_rows(self) -> int:
        return self.row_ids.numel()


def indptr(counts) -> np.ndarray:
    """Offsets of consecutive runs of these lengths: [0, c0, c0 + c1, ...]."""
    return np.concatenate([[0], np.cumsum(counts)])


def _segment_of_each(counts: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(counts), dtype=np.int32), counts)


def _flat_segments(
    seg_lens: Sequence[int],
    seg_rows: Sequence[Sequence[int]],
    seg_scales: Sequence[Sequence[float]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens of each segment, rows of each segment, every segment's rows and scales in
    order) as arrays, with no Python work per row; ValueError naming the first bad segment."""
    if not len(seg_lens) == len(seg_rows) == len(seg_scales):
        raise ValueError(
            f"seg_lens, seg_rows, seg_scales differ in length: "
            f"{len(seg_lens)}, {len(seg_rows)}, {len(seg_scales)}"
        )
    lens = np.asarray(seg_lens, np.int64).reshape(len(seg_lens))
    counts = np.fromiter(map(len, seg_rows), np.int64, len(seg_rows))
    scale_counts = np.fromiter(map(len, seg_scales), np.int64, len(seg_scales))
    bad = (lens < 0) | (counts != scale_counts)
    if bad.any():
        s = int(np.argmax(bad))
        raise ValueError(f"segment {s}: length {lens[s]} must be >= 0 and rows ({counts[s]}) "
                         f"need one scale each ({scale_counts[s]})")
    total = int(counts.sum())
    row_ids = np.fromiter(itertools.chain.from_iterable(seg_rows), np.int64, total)
    if (row_ids < 0).any():
        s = int(np.searchsorted(np.cumsum(counts), np.argmax(row_ids < 0), side="right"))
        raise ValueError(f"segment {s}: negative pool row in {list(seg_rows[s])}")
    row_scales = np.fromiter(itertools.chain.from_iterable(seg_scales), np.float32, total)
    return lens, counts, row_ids, row_scales


class LoraBackend(ABC):
    """Applies the LoRA deltas of one fused projection for a whole batch, in two phases: the
    shrink reads only x, so it may run beside the base GEMM (LoraContext.project); the expand
    adds into the GEMM's output, or stores the deltas for a GEMM to add (accumulate=False)."""

    name: str
    uses_groups = False  # whether it reads LoraBatchMeta.groups (else they need not be built)

    def apply(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a_pool: torch.Tensor,
        b_pool: torch.Tensor,
        out_offsets: Sequence[int],
        meta: LoraBatchMeta,
        qscales: torch.Tensor | None = None,
    ) -> None:
        """Semantics (mutates y only):
            for s in range(S):
                t0, t1 = seg_indptr[s], seg_indptr[s + 1]
                r0, r1 = row_indptr[s], row_indptr[s + 1]
                rows, sc = row_ids[r0:r1], row_scales[r0:r1]
                for i in range(n_slices):
                    cols = slice(out_offsets[i], out_offsets[i + 1])
                    if qscales is not None:  # an int8 pool
                        sc = sc * qscales[i, rows]
                    v = (x[t0:t1].float() @ a_pool[i, rows].float().T) * sc
                    y[t0:t1, cols] += v @ b_pool[rows, cols].float()

        Args:
            x: [T, in_dim]; y: [T, out_total], updated in place.
            a_pool: [n_slices, num_rows, in_dim]; b_pool: [num_rows, out_total] (scaling folded),
                both in x's dtype or both int8.
            out_offsets: n_slices + 1 python ints, the column range of each slice in y/b_pool.
            meta: the batch's segments and rows (num_tokens == T).
            qscales: [n_slices, num_rows] float32, given exactly for int8 pools: the
                dequantization scale of each (slice, row), A's row scale times B's
                (AdapterPool.pack).
        """
        _check_tokens(meta, x, y)
        # a backend with no int8 path (scripts/bench_sgmv.py's baseline) takes no qscales
        v = self.shrink(x, a_pool, meta) if qscales is None else self.shrink(x, a_pool, meta,
                                                                             qscales)
        if v is not None:
            self.expand(v, b_pool, out_offsets, meta, y)

    @abstractmethod
    def shrink(
        self,
        x: torch.Tensor,
        a_pool: torch.Tensor,
        meta: LoraBatchMeta,
        qscales: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The first phase of `apply`: the scaled rank-space activations, in the layout this
        backend's expand reads (None: the batch has no rows, nothing to add)."""

    @abstractmethod
    def expand(
        self,
        v: torch.Tensor,
        b_pool: torch.Tensor,
        out_offsets: Sequence[int],
        meta: LoraBatchMeta,
        y: torch.Tensor,
        accumulate: bool = True,
    ) -> None:
        """The second phase of `apply`: y += the deltas of v (from this backend's shrink), or
        with accumulate=False y := the deltas (zero in rows of tokens with no adapter)."""

    def scale_dora(self, y: torch.Tensor, b_pool: torch.Tensor, out_offsets: Sequence[int],
                   meta: LoraBatchMeta, bias: torch.Tensor | None = None,
                   delta: torch.Tensor | None = None,
                   qscales: torch.Tensor | None = None) -> None:
        """DoRA's scales on a complete projection output (radixlora.worker.dora): each token with
        a magnitude row gets g * (y - bias + delta) + bias, with g - 1 read from that row of
        b_pool; into y, or with `delta` (a deferred delta) into delta, so y + delta is it."""
        dora_scale_ref(y, b_pool, out_offsets, meta.magnitude_rows, bias, delta, qscales)

    def deferred_delta(
        self,
        x: torch.Tensor,
        a_pool: torch.Tensor,
        b_pool: torch.Tensor,
        out_offsets: Sequence[int],
        meta: LoraBatchMeta,
        delta: torch.Tensor,
        qscales: torch.Tensor | None = None,
    ) -> None:
        """delta [T, out_total] float32 := the deltas `apply` would add to y. delta comes zeroed
        from a workspace; rows of tokens with no adapter must stay zero, so a delta buffer can
        serve every layer."""
        delta.zero_()
        self.apply(x, delta, a_pool, b_pool, out_offsets, meta, qscales)

    def expert_lora(self, x, rows_per_a, topk_ids, a_pool, b_pool, rows, y, out_scale=None,
                    qscales=None) -> None:
        """An MoE layer's expert LoRA deltas added into its GEMM rows y
        (radixlora_kernels.moe_lora; rows: moe_lora.token_rows of the group's meta)."""
        from .moe_lora import expert_lora_ref

        expert_lora_ref(x, rows_per_a, topk_ids, a_pool, b_pool, rows, y, out_scale, qscales)


class TorchLoraBackend(LoraBackend):
    """Batched pure torch (CPU path and reference): every row of the batch against every token,
    masked to the token's own segment. O(T * N) work, no loop over segments."""

    name = "torch"

    def shrink(self, x, a_pool, meta, qscales=None) -> torch.Tensor | None:
        _check_tokens(meta, x)
        if meta.num_rows == 0:
            return None
        rows = meta.row_ids.long()
        v = x.float() @ a_pool[:, rows].float().transpose(1, 2)
        weights = token_row_weights(meta)  # [T, N]
        if qscales is not None:
            weights = weights * qscales[:, None, rows]  # [n_slices, T, N]
        return v * weights  # [n_slices, T, N]

    def expand(self, v, b_pool, out_offsets, meta, y, accumulate=True) -> None:
        _check_tokens(meta, y)
        b_sel = b_pool[meta.row_ids.long()].float()
        off = list(out_offsets)
        delta = torch.cat([v[i] @ b_sel[:, off[i] : off[i + 1]] for i in range(len(off) - 1)], 1)
        if accumulate:
            y += delta.to(y.dtype)
        else:
            y.copy_(delta)


def token_row_weights(meta: LoraBatchMeta) -> torch.Tensor:
    """[T, N] float32: row_scales[n] where token t and row entry n share a segment, else 0."""
    same_seg = meta.token_seg[:, None] == meta.row_seg[None, :]
    return same_seg.float() * meta.row_scales[None, :]


class TritonLoraBackend(LoraBackend):
    """SGMV shrink + expand: two launches per projection whatever the adapter mix. With
    meta.groups (every batch the engine builds) the grouped kernels read each distinct adapter
    set's rows once per group of tokens; without, one program row per request segment (the
    per-segment kernels, kept as the baseline scripts/bench_sgmv.py compares against)."""

    name = "triton"
    uses_groups = True

    def __init__(self, split_k: int | None = None, tuning=None, side_tuning=None) -> None:
        """tuning: launch parameters of the grouped kernels; side_tuning: those of deferred
        deltas, which run beside a base GEMM (None: chosen by rank width)."""
        # Imported here so the torch backend works where triton is absent.
        from . import sgmv_grouped
        from .sgmv_expand import sgmv_expand
        from .sgmv_shrink import sgmv_shrink

        self._shrink, self._expand, self.split_k = sgmv_shrink, sgmv_expand, split_k
        self._grouped = sgmv_grouped
        self.tuning, self.side_tuning = tuning, side_tuning

    def shrink(self, x, a_pool, meta, qscales=None) -> torch.Tensor | None:
        _check_tokens(meta, x)
        if (g := meta.groups) is not None:
            return self._grouped.grouped_shrink(
                x, a_pool, *_group_index(g), g.row_scales, meta.max_rows,
                tuning=self._tuning(meta), qscales=qscales,
            )
        if meta.num_rows == 0:
            return None
        return self._shrink(
            x, a_pool, meta.seg_indptr, meta.row_indptr, meta.row_ids, meta.row_scales,
            meta.max_rows, max_seg_len=meta.max_seg_len, split_k=self.split_k, qscales=qscales,
        )

    def expand(self, v, b_pool, out_offsets, meta, y, accumulate=True, act_dtype=None) -> None:
        """act_dtype: the model's activation dtype where y is not in it (a float32 delta):
        an int8 b_pool's product is fp32 only for float32 activations (expand_fp32_dot)."""
        _check_tokens(meta, y)
        if (g := meta.groups) is not None:
            if not accumulate:
                y.zero_()  # grouped kernels leave rows of tokens in no group untouched
            self._grouped.grouped_expand(
                v, b_pool, out_offsets, *_group_index(g), y,
                tuning=self._tuning(meta), accumulate=accumulate, act_dtype=act_dtype,
            )
            return
        index = (meta.seg_indptr, meta.row_indptr, meta.row_ids)
        self._expand(v, b_pool, out_offsets, *index, y, max_seg_len=meta.max_seg_len,
                     accumulate=accumulate, act_dtype=act_dtype)

    def deferred_delta(self, x, a_pool, b_pool, out_offsets, meta, delta, qscales=None) -> None:
        """Grouped: the expand overwrites the rows of the groups' tokens only, so no launch
        zeroes anything. The float32 delta is x's deltas: an int8 pool's expand multiplies in
        x's precision, not delta's."""
        g = meta.groups
        if g is None:
            _check_tokens(meta, x, delta)
            delta.zero_()
            v = self.shrink(x, a_pool, meta, qscales)
            if v is not None:
                self.expand(v, b_pool, out_offsets, meta, delta, act_dtype=x.dtype)
            return
        _check_tokens(meta, x, delta)
        tuning = self.side_tuning or self._grouped.tuning_for_rows(meta.max_rows, beside_gemm=True)
        index = _group_index(g)
        v = self._grouped.grouped_shrink(x, a_pool, *index, g.row_scales, meta.max_rows,
                                         tuning=tuning, qscales=qscales)
        self._grouped.grouped_expand(v, b_pool, out_offsets, *index, delta, tuning=tuning,
                                     accumulate=False, act_dtype=x.dtype)

    def scale_dora(self, y, b_pool, out_offsets, meta, bias=None, delta=None,
                   qscales=None) -> None:
        dora_scale(y, b_pool, out_offsets, meta.magnitude_rows, bias, delta, qscales)

    def expert_lora(self, x, rows_per_a, topk_ids, a_pool, b_pool, rows, y, out_scale=None,
                    qscales=None) -> None:
        from .moe_lora import expert_lora

        expert_lora(x, rows_per_a, topk_ids, a_pool, b_pool, rows, y, out_scale, qscales)

    def _tuning(self, meta: LoraBatchMeta):
        return self.tuning or self._grouped.tuning_for_rows(meta.max_rows)


def _group_index(g: LoraGroups) -> tuple[torch.Tensor, ...]:
    return g.num_groups, g.group_indptr, g.token_ids, g.row_indptr, g.row_ids


def _check_tokens(meta: LoraBatchMeta, *tensors: torch.Tensor) -> None:
    if any(t.shape[0] != meta.num_tokens for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(f"{shapes} must have meta's {meta.num_tokens} tokens")


LORA_BACKENDS: dict[str, type[LoraBackend]] = {
    TorchLoraBackend.name: TorchLoraBackend,
    TritonLoraBackend.name: TritonLoraBackend,
}


def make_lora_backend(name: str, device: torch.device | str) -> LoraBackend:
    """The backend called `name`; "auto" is triton on CUDA, torch elsewhere."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in LORA_BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; choose auto or {sorted(LORA_BACKENDS)}")
    return LORA_BACKENDS[name]()
