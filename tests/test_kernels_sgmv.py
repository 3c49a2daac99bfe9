"""SGMV shrink/expand and the LoRA backends against a pure-torch loop reference (M6).

The Triton kernels run under TRITON_INTERPRET=1 on the CPU; shapes stay tiny.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before any import

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import random  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from radixlora.lora.layout import quantize_rows  # noqa: E402
from radixlora.worker.lora_context import LoraContext  # noqa: E402
from radixlora_kernels.lora_ops import (  # noqa: E402
    HostGroups,
    LoraBatchMeta,
    LoraGroups,
    TorchLoraBackend,
    TritonLoraBackend,
    make_lora_backend,
)
from radixlora_kernels.sgmv_expand import sgmv_expand, sgmv_expand_ref  # noqa: E402
from radixlora_kernels.sgmv_grouped import (  # noqa: E402
    GroupedTuning,
    grouped_expand,
    grouped_expand_ref,
    grouped_shrink,
    grouped_shrink_ref,
)
from radixlora_kernels.sgmv_shrink import sgmv_shrink, sgmv_shrink_ref  # noqa: E402

RANKS = [4, 8, 16, 32, 64, 12, 4, 8, 16, 24]
SLICE_WIDTHS = {1: [96], 2: [48, 32], 3: [40, 16, 24]}  # q/k/v unequal, as under GQA


def loop_ref(x, y, a_pool, b_pool, out_offsets, seg_lens, seg_rows, seg_scales) -> None:
    """The semantics, straight from python lists (independent of LoraBatchMeta)."""
    t0, off = 0, out_offsets
    for n, rows, scales in zip(seg_lens, seg_rows, seg_scales, strict=True):
        t1 = t0 + n
        if rows:
            idx, sc = torch.tensor(rows), torch.tensor(scales, dtype=torch.float32)
            for i in range(a_pool.shape[0]):
                v = (x[t0:t1].float() @ a_pool[i, idx].float().T) * sc
                delta = v @ b_pool[idx, off[i] : off[i + 1]].float()
                y[t0:t1, off[i] : off[i + 1]] += delta.to(y.dtype)
        t0 = t1


@dataclass
class Pool:
    a: torch.Tensor  # [n_slices, num_rows, in_dim]
    b: torch.Tensor  # [num_rows, out_total]
    out_offsets: list[int]
    adapter_rows: list[list[int]]  # rows of each adapter: scattered, in no order


def make_pool(ranks, widths, in_dim, dtype=torch.float32, seed=0) -> Pool:
    g = torch.Generator().manual_seed(seed)
    spare = 7  # rows nobody owns, filled with data a wrong gather would pick up
    perm = torch.randperm(sum(ranks) + spare, generator=g).tolist()
    adapter_rows, start = [], 0
    for r in ranks:
        adapter_rows.append(perm[start : start + r])
        start += r
    num_rows, out_total = len(perm), sum(widths)
    a = torch.randn(len(widths), num_rows, in_dim, generator=g) / in_dim**0.5
    b = torch.randn(num_rows, out_total, generator=g) / 4
    offsets = [sum(widths[:i]) for i in range(len(widths) + 1)]
    return Pool(a.to(dtype), b.to(dtype), offsets, adapter_rows)


def stack_rows(pool: Pool, adapter_sets):
    """adapter_sets: per segment, [(adapter, weight), ...] -> seg_rows, seg_scales."""
    seg_rows = [[r for a, _ in aset for r in pool.adapter_rows[a]] for aset in adapter_sets]
    seg_scales = [[w for a, w in aset for _ in pool.adapter_rows[a]] for aset in adapter_sets]
    return seg_rows, seg_scales


def _single(adapters):
    return [[(a, 1.0)] if a is not None else [] for a in adapters]


def scenario(name: str, n_adapters: int):
    """(seg_lens, adapter_sets) for one batch shape x adapter popularity pattern."""
    rng = random.Random(name)
    if name == "decode_distinct":
        return [1] * 10, _single(range(10))
    if name == "decode_identical":
        return [1] * 9, _single([3] * 9)
    if name == "skewed":  # one long prefill + many decodes, zipf-like popularity, some base-only
        adapters = [0 if rng.random() < 0.6 else rng.choice([None, 1, 4, 7]) for _ in range(13)]
        return [24] + [1] * 12, _single(adapters)
    if name == "no_adapter_mix":  # includes an empty segment that has an adapter
        return [3, 1, 0, 5, 1, 2], _single([None, 2, 5, None, 4, None])
    if name == "stacks":  # k = 1..8 adapters per segment, weights != 1
        lens = [2, 1, 4, 1, 1, 3, 1, 2]
        sets = [
            [(a, rng.uniform(-1.5, 1.5)) for a in rng.sample(range(n_adapters), k)]
            for k in range(1, 9)
        ]
        return lens, sets
    if name == "prefill_mixed":
        return [7, 13, 9, 1], _single([5, 0, 5, 9])
    raise KeyError(name)


SCENARIOS = ["decode_distinct", "decode_identical", "skewed", "no_adapter_mix", "stacks"]
SCENARIOS += ["prefill_mixed"]


def build_case(name, n_slices, in_dim=48, dtype=torch.float32, seed=0):
    pool = make_pool(RANKS, SLICE_WIDTHS[n_slices], in_dim, dtype, seed)
    seg_lens, sets = scenario(name, len(RANKS))
    seg_rows, seg_scales = stack_rows(pool, sets)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(seg_lens), in_dim, generator=g).to(dtype)
    y0 = torch.randn(sum(seg_lens), pool.out_offsets[-1], generator=g).to(dtype)
    return pool, x, y0, (seg_lens, seg_rows, seg_scales)


def expected(pool, x, y0, segs) -> torch.Tensor:
    y = y0.float().clone()
    loop_ref(x, y, pool.a, pool.b, pool.out_offsets, *segs)
    return y


def run_backend(backend, pool, x, y0, segs) -> torch.Tensor:
    """One segment per request (the grouped path has its own tests below)."""
    y = y0.clone()
    meta = LoraBatchMeta.from_segments(*segs, device="cpu", grouped=False)
    backend.apply(x, y, pool.a, pool.b, pool.out_offsets, meta)
    return y


@pytest.mark.parametrize("n_slices", [1, 2, 3])
@pytest.mark.parametrize("name", SCENARIOS)
def test_triton_backend_matches_loop_reference(name, n_slices):
    pool, x, y0, segs = build_case(name, n_slices, in_dim=48 if n_slices != 2 else 64)
    y = run_backend(TritonLoraBackend(split_k=2), pool, x, y0, segs)
    torch.testing.assert_close(y, expected(pool, x, y0, segs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_slices", [1, 2, 3])
@pytest.mark.parametrize("name", SCENARIOS)
def test_torch_backend_matches_loop_reference(name, n_slices):
    pool, x, y0, segs = build_case(name, n_slices)
    y = run_backend(TorchLoraBackend(), pool, x, y0, segs)
    torch.testing.assert_close(y, expected(pool, x, y0, segs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split_k", [1, 4])
def test_split_k_variants_agree(split_k):
    pool, x, y0, segs = build_case("stacks", 2, in_dim=64)
    y = run_backend(TritonLoraBackend(split_k=split_k), pool, x, y0, segs)
    torch.testing.assert_close(y, expected(pool, x, y0, segs), rtol=1e-4, atol=1e-4)


def test_bf16_matches_fp32_reference():
    pool, x, y0, segs = build_case("skewed", 3, dtype=torch.bfloat16)
    y = run_backend(TritonLoraBackend(), pool, x, y0, segs)
    ref = expected(pool, x, y0, segs)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=3e-2)


def _meta_args(meta: LoraBatchMeta):
    return meta.seg_indptr, meta.row_indptr, meta.row_ids


def test_shrink_writes_zeros_outside_rows_and_overwrites_out():
    pool, x, _, segs = build_case("no_adapter_mix", 3)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu")
    args = (*_meta_args(meta), meta.row_scales, meta.max_rows)
    out = torch.full((3, x.shape[0], meta.max_rows), 7.0)
    v = sgmv_shrink(x, pool.a, *args, out=out, split_k=2)
    assert v is out
    torch.testing.assert_close(v, sgmv_shrink_ref(x, pool.a, *args), rtol=1e-5, atol=1e-5)
    assert v[:, :3].abs().max() == 0  # first segment has no adapter


def test_expand_leaves_base_only_tokens_bitwise_untouched():
    pool, x, y0, segs = build_case("no_adapter_mix", 2)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu")
    v = torch.randn(2, x.shape[0], meta.max_rows)
    y = y0.clone()
    sgmv_expand(v, pool.b, pool.out_offsets, *_meta_args(meta), y)
    y_ref = y0.clone()
    sgmv_expand_ref(v, pool.b, pool.out_offsets, *_meta_args(meta), y_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    base_only = (meta.token_seg == 0) | (meta.token_seg == 3) | (meta.token_seg == 5)
    assert torch.equal(y[base_only], y0[base_only])


@pytest.mark.parametrize("name", ["no_adapter_mix", "base_only"])
def test_expand_overwrite_stores_deltas_and_zeros(name):
    """accumulate=False: every segment's rows become its deltas, zeros where it has no adapter
    (so a GEMM can add into them), whatever y held."""
    pool, x, _, segs = build_case("no_adapter_mix", 3)
    if name == "base_only":
        segs = (segs[0], [[] for _ in segs[1]], [[] for _ in segs[2]])
    meta = LoraBatchMeta.from_segments(*segs, device="cpu", grouped=False)
    v = torch.randn(3, x.shape[0], meta.max_rows)
    y = torch.full((x.shape[0], pool.out_offsets[-1]), float("nan"))
    y_ref = torch.zeros_like(y)
    sgmv_expand(v, pool.b, pool.out_offsets, *_meta_args(meta), y, accumulate=False)
    sgmv_expand_ref(v, pool.b, pool.out_offsets, *_meta_args(meta), y_ref, accumulate=False)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    base_only = torch.tensor([len(rows) == 0 for rows in segs[1]])[meta.token_seg.long()]
    assert y[base_only].eq(0).all() and (name == "base_only" or y[~base_only].ne(0).any())


@pytest.mark.parametrize("block_t,block_n", [(16, 16), (32, 64)])
def test_expand_launch_settings_do_not_change_the_result(block_t, block_n):
    """Tiles of other sizes than the launcher's choice give the same result."""
    pool, x, y0, segs = build_case("no_adapter_mix", 2)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu")
    v = torch.randn(2, x.shape[0], meta.max_rows)
    y, y_ref = y0.clone(), y0.clone()
    sgmv_expand(v, pool.b, pool.out_offsets, *_meta_args(meta), y, block_t=block_t,
                block_n=block_n, num_warps=8)
    sgmv_expand_ref(v, pool.b, pool.out_offsets, *_meta_args(meta), y_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


def test_kernels_accept_strided_pools():
    pool, x, y0, segs = build_case("decode_distinct", 2)
    wide_b = torch.randn(pool.b.shape[0], pool.b.shape[1] + 5)
    wide_b[:, 3 : 3 + pool.b.shape[1]] = pool.b
    a_t = pool.a.transpose(1, 2).contiguous().transpose(1, 2)  # in_dim not the last stride
    strided = Pool(a_t, wide_b[:, 3 : 3 + pool.b.shape[1]], pool.out_offsets, pool.adapter_rows)
    y = run_backend(TritonLoraBackend(split_k=2), strided, x, y0, segs)
    torch.testing.assert_close(y, expected(pool, x, y0, segs), rtol=1e-4, atol=1e-4)


def test_reference_kernels_match_loop_reference():
    pool, x, y0, segs = build_case("stacks", 3)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu")
    args = _meta_args(meta)
    v = sgmv_shrink_ref(x, pool.a, *args, meta.row_scales, meta.max_rows)
    y = y0.clone()
    sgmv_expand_ref(v, pool.b, pool.out_offsets, *args, y)
    torch.testing.assert_close(y, expected(pool, x, y0, segs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", [TorchLoraBackend(), TritonLoraBackend()])
def test_batch_without_rows_is_a_no_op(backend):
    pool, x, y0, _ = build_case("decode_distinct", 3)
    segs = ([4, 0, 6], [[], [], []], [[], [], []])
    y = run_backend(backend, pool, x[:10], y0[:10], segs)
    assert torch.equal(y, y0[:10])
    meta = LoraBatchMeta.from_segments(*segs, device="cpu")
    v = sgmv_shrink(x[:10], pool.a, *_meta_args(meta), meta.row_scales, meta.max_rows)
    assert v.shape == (3, 10, 0)


def test_from_segments_derives_indices():
    meta = LoraBatchMeta.from_segments([2, 0, 3], [[5, 1], [9], []], [[1.0, 1.0], [0.5], []], "cpu")
    assert meta.seg_indptr.tolist() == [0, 2, 2, 5]
    assert meta.row_indptr.tolist() == [0, 2, 3, 3]
    assert meta.row_ids.tolist() == [5, 1, 9]
    assert meta.token_seg.tolist() == [0, 0, 2, 2, 2]
    assert meta.row_seg.tolist() == [0, 0, 1]
    # max_rows: a multiple of 16 (kernel arguments independent of the batch's parities)
    assert (meta.max_rows, meta.max_seg_len, meta.num_tokens, meta.num_rows) == (16, 3, 5, 3)
    assert meta.seg_indptr.dtype == meta.row_ids.dtype == torch.int32
    assert meta.row_scales.dtype == torch.float32


@pytest.mark.parametrize(
    ("segs", "match"),
    [
        (([1, 2], [[0]], [[1.0]]), "differ in length"),
        (([1, 1], [[0], [0, 1]], [[1.0], [1.0]]), "segment 1: .* rows \\(2\\) need one scale"),
        (([1, -1], [[0], [0]], [[1.0], [1.0]]), "segment 1: length -1 must be >= 0"),
        (([1, 0, 1], [[4], [], [2, -3]], [[1.0], [], [1.0, 1.0]]),
         "segment 2: negative pool row in \\[2, -3\\]"),
    ],
)
def test_from_segments_rejects_inconsistent_lists(segs, match):
    with pytest.raises(ValueError, match=match):
        LoraBatchMeta.from_segments(*segs, device="cpu")


def _shrink_call(**bad):
    pool, x, _, segs = build_case("decode_distinct", 3)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu")
    kwargs = dict(
        x=x, a_pool=pool.a, seg_indptr=meta.seg_indptr, row_indptr=meta.row_indptr,
        row_ids=meta.row_ids, row_scales=meta.row_scales, max_rows=meta.max_rows,
        split_k=None, out=None,
    )
    kwargs.update({k: f(kwargs[k]) if callable(f) else f for k, f in bad.items()})
    return lambda: sgmv_shrink(**kwargs)


SHRINK_BAD = {
    "in_dim": {"x": lambda x: x[:, :-1]},
    "dtype": {"x": lambda x: x.double()},
    "a_pool_2d": {"a_pool": lambda a: a[0]},
    "row_ids_int64": {"row_ids": lambda r: r.long()},
    "scales_len": {"row_scales": lambda s: s[:-1]},
    "indptr_len": {"row_indptr": lambda r: r[:-1]},
    "negative_max_rows": {"max_rows": -1},
    "split_k_zero": {"split_k": 0},
    "out_shape": {"out": torch.zeros(3, 1, 1)},
}


@pytest.mark.parametrize("case", sorted(SHRINK_BAD))
def test_shrink_rejects_bad_arguments(case):
    with pytest.raises(ValueError):
        _shrink_call(**SHRINK_BAD[case])()


def _expand_call(**bad):
    pool, x, y0, segs = build_case("decode_distinct", 3)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu")
    kwargs = dict(
        v=torch.zeros(3, x.shape[0], meta.max_rows), b_pool=pool.b, out_offsets=pool.out_offsets,
        seg_indptr=meta.seg_indptr, row_indptr=meta.row_indptr, row_ids=meta.row_ids, y=y0,
    )
    kwargs.update({k: f(kwargs[k]) for k, f in bad.items()})
    return lambda: sgmv_expand(**kwargs)


EXPAND_BAD = {
    "v_dtype": {"v": lambda v: v.half()},
    "v_tokens": {"v": lambda v: v[:, :-1]},
    "y_width": {"y": lambda y: y[:, :-1]},
    "b_pool_3d": {"b_pool": lambda b: b[None]},
    "offsets_end": {"out_offsets": lambda o: [*o[:-1], o[-1] - 1]},
    "offsets_count": {"out_offsets": lambda o: o[:-1]},
    "offsets_decreasing": {"out_offsets": lambda o: [0, o[2], o[1], o[3]]},
    "four_slices": {
        "v": lambda v: torch.zeros(4, *v.shape[1:]),
        "out_offsets": lambda o: [0, 1, 2, 3, o[-1]],
    },
    "seg_indptr_dtype": {"seg_indptr": lambda s: s.float()},
}


@pytest.mark.parametrize("case", sorted(EXPAND_BAD))
def test_expand_rejects_bad_arguments(case):
    with pytest.raises(ValueError):
        _expand_call(**EXPAND_BAD[case])()


def test_backend_rejects_token_count_mismatch_and_unknown_name():
    pool, x, y0, segs = build_case("decode_distinct", 1)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu")
    with pytest.raises(ValueError):
        TorchLoraBackend().apply(x[:-1], y0[:-1], pool.a, pool.b, pool.out_offsets, meta)
    with pytest.raises(ValueError):
        make_lora_backend("cutlass", "cpu")
    assert make_lora_backend("auto", "cpu").name == "torch"


# ---- grouped path: tokens grouped by distinct adapter set -----------------------------------


def grouped_scenario(name: str):
    """(seg_lens, adapter_sets) of decode-like batches for the grouped kernels."""
    rng = random.Random(name)
    if name == "distinct_mixed_ranks":  # ranks 4..64, one token each
        return [1] * 10, _single(range(10))
    if name == "no_adapter_rows":
        return [1] * 8, _single([None, 2, None, None, 2, 7, None, None])
    if name == "stacks_1_to_8":  # repeated stacks share a group; weights != 1
        sets = [
            [(a, rng.uniform(-1.5, 1.5)) for a in rng.sample(range(len(RANKS)), k)]
            for k in range(1, 9)
        ]
        return [1] * 12, [sets[i % 8] for i in range(12)]
    if name == "skewed":  # one group holds most tokens (> several BLOCK_M blocks), interleaved
        adapters = [0 if rng.random() < 0.8 else rng.choice([None, 1, 4, 7]) for _ in range(45)]
        return [1] * 45, _single(adapters)
    if name == "single_token_groups_and_short_extends":
        return [1, 3, 1, 2, 1, 1], _single([5, 0, 9, 5, 3, None])
    raise KeyError(name)


GROUPED_SCENARIOS = ["distinct_mixed_ranks", "no_adapter_rows", "stacks_1_to_8", "skewed"]
GROUPED_SCENARIOS += ["single_token_groups_and_short_extends"]


def build_grouped_case(name, n_slices, in_dim=48, dtype=torch.float32, seed=0):
    pool = make_pool(RANKS, SLICE_WIDTHS[n_slices], in_dim, dtype, seed)
    seg_lens, sets = grouped_scenario(name)
    seg_rows, seg_scales = stack_rows(pool, sets)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(seg_lens), in_dim, generator=g).to(dtype)
    y0 = torch.randn(sum(seg_lens), pool.out_offsets[-1], generator=g).to(dtype)
    return pool, x, y0, (seg_lens, seg_rows, seg_scales)


def grouped_meta(segs) -> LoraBatchMeta:
    meta = LoraBatchMeta.from_segments(*segs, device="cpu", grouped=True)
    assert meta.groups is not None
    return meta


# in_dim in 2-3 splits; expand work items of one tile, or of 2 tiles (pipelined, the
# last one partial where a slice is not a multiple of 16 columns); shrink items of every slice
# at once where the slices' row tiles fit MAX_MERGED_ROWS (here: at most 16 rows with 3 slices,
# 32 with 2, as in no_adapter_rows and single_token_groups_and_short_extends)
GROUPED_TUNINGS = {"tile_items": GroupedTuning(k_chunk=32, block_k=16, merge_slices=False),
                   "chunk_items": GroupedTuning(k_chunk=32, block_k=16, block_n=16, col_chunk=32,
                                                expand_stages=2, merge_slices=False),
                   "merged_slices": GroupedTuning(k_chunk=32, block_k=16,
                                                  merge_slices=True)}


@pytest.mark.parametrize("tuning", GROUPED_TUNINGS)
@pytest.mark.parametrize("n_slices", [1, 2, 3])
@pytest.mark.parametrize("name", GROUPED_SCENARIOS)
def test_grouped_backend_matches_loop_reference(name, n_slices, tuning):
    pool, x, y0, segs = build_grouped_case(name, n_slices, in_dim=48 if n_slices != 2 else 80)
    y = y0.clone()
    tuning = GROUPED_TUNINGS[tuning]
    TritonLoraBackend(tuning=tuning).apply(
        x, y, pool.a, pool.b, pool.out_offsets, grouped_meta(segs)
    )
    torch.testing.assert_close(y, expected(pool, x, y0, segs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("min_items_per_sm", [0, 64])
def test_small_bucket_splitting_keeps_results(min_items_per_sm):
    """0: in_dim in one split; 64: split down to block_k (one partial sum per split)."""
    pool, x, y0, segs = build_grouped_case("single_token_groups_and_short_extends", 3, in_dim=80)
    y = y0.clone()
    tuning = GroupedTuning(block_k=16, min_items_per_sm=min_items_per_sm)
    TritonLoraBackend(tuning=tuning).apply(
        x, y, pool.a, pool.b, pool.out_offsets, grouped_meta(segs)
    )
    torch.testing.assert_close(y, expected(pool, x, y0, segs), rtol=1e-4, atol=1e-4)


def _group_args(meta: LoraBatchMeta):
    g = meta.groups
    return g.num_groups, g.group_indptr, g.token_ids, g.row_indptr, g.row_ids


def _pad_groups(meta: LoraBatchMeta, extra: int) -> LoraBatchMeta:
    """Static-buffer form: capacity for `extra` more groups, filled with garbage never read."""
    g = meta.groups
    junk = torch.full((extra,), 10**6, dtype=torch.int32)
    padded = LoraGroups(
        g.num_groups,
        torch.cat([g.group_indptr, junk]),
        torch.cat([g.token_ids, junk]),
        torch.cat([g.row_indptr, junk]),
        g.row_ids,
        g.row_scales,
    )
    return dataclasses.replace(meta, groups=padded)


@pytest.mark.parametrize("in_dim,splits", [(48, 1), (48, 3), (160, 10)])
def test_grouped_kernels_match_their_references_with_padding(in_dim, splits):
    """The shrink stores one partial sum per in_dim split (only the group tokens' entries
    within their rows are defined); the expand adds them up, given partials or their sum (10
    splits: two steps of 8 loads, the second partly masked)."""
    pool, x, y0, segs = build_grouped_case("skewed", 3, in_dim=in_dim)
    meta = _pad_groups(grouped_meta(segs), extra=5)
    tuning = GroupedTuning(k_chunk=in_dim // splits, block_k=16)
    args = _group_args(meta)
    v = grouped_shrink(x, pool.a, *args, meta.groups.row_scales, meta.max_rows, tuning=tuning)
    assert v.shape == (splits, 3, x.shape[0], meta.max_rows)
    v_ref = grouped_shrink_ref(x, pool.a, *args, meta.groups.row_scales, meta.max_rows)
    defined = torch.zeros_like(v_ref, dtype=torch.bool)
    tok_at, rows_at = meta.groups.group_indptr.tolist(), meta.groups.row_indptr.tolist()
    for g in range(int(meta.groups.num_groups)):
        tokens = meta.groups.token_ids[tok_at[g] : tok_at[g + 1]].long()
        defined[:, tokens, : rows_at[g + 1] - rows_at[g]] = True
    torch.testing.assert_close(v.sum(0)[defined], v_ref[defined])
    for given in (v, v_ref):
        y, y_ref = y0.clone(), y0.clone()
        grouped_expand(given, pool.b, pool.out_offsets, *args, y, tuning=tuning)
        grouped_expand_ref(given, pool.b, pool.out_offsets, *args, y_ref)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y_ref, expected(pool, x, y0, segs), rtol=1e-4, atol=1e-4)


def test_grouped_expand_leaves_tokens_of_no_group_bitwise_untouched():
    pool, x, y0, segs = build_grouped_case("no_adapter_rows", 2)
    meta = grouped_meta(segs)
    y = y0.clone()
    grouped_expand(torch.randn(2, x.shape[0], meta.max_rows), pool.b, pool.out_offsets,
                   *_group_args(meta), y)
    base_only = [0, 2, 3, 6, 7]
    assert torch.equal(y[base_only], y0[base_only])
    assert not torch.equal(y[1], y0[1])


@pytest.mark.parametrize("split", ["one_split", "split_partials"])
def test_deferred_delta_equals_what_apply_adds(split):
    """The deferred path (the expand overwriting the groups' rows of a float32 delta) gives the
    delta apply adds, bit for bit in fp32; the rows of tokens with no adapter stay zero, so one
    delta buffer serves every layer."""
    pool, x, y0, segs = build_grouped_case("no_adapter_rows", 3)
    meta = grouped_meta(segs)
    tuning = GroupedTuning(k_chunk=48 if split == "one_split" else 16, block_k=16)
    backend = TritonLoraBackend(tuning=tuning, side_tuning=tuning)
    delta = torch.zeros_like(y0)
    for _ in range(2):  # the second layer reuses delta
        backend.deferred_delta(x, pool.a, pool.b, pool.out_offsets, meta, delta)
        y = torch.zeros_like(y0)
        backend.apply(x, y, pool.a, pool.b, pool.out_offsets, meta)
        assert torch.equal(delta, y)
    assert not delta[[0, 2, 3, 6, 7]].any() and delta[1].any()
    torch.testing.assert_close(y0 + delta, expected(pool, x, y0, segs), rtol=1e-4, atol=1e-4)
    torch_delta = torch.full_like(y0, 7.0)  # the generic path zeroes its delta first
    TorchLoraBackend().deferred_delta(x, pool.a, pool.b, pool.out_offsets, meta, torch_delta)
    torch.testing.assert_close(torch_delta, delta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("int8", [False, True], ids=["float_pool", "int8_pool"])
@pytest.mark.parametrize("defer", [False, True], ids=["after_gemm", "deferred"])
def test_lora_context_projects_linear_plus_deltas(defer, int8):
    """LoraContext over two layers gives linear(x) plus the LoRA deltas, added into y or
    returned as a delta for y's consumer, in the workspace `begin` zeroed. A group no request
    uses costs no LoRA work. An int8 pool's layers hand their qscales to the kernels."""
    pool, x, y0, segs = build_grouped_case("stacks_1_to_8", 3)
    meta = grouped_meta(segs)
    tuning = GroupedTuning(k_chunk=16, block_k=16)
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(pool.out_offsets[-1], x.shape[1], generator=gen)
    stored, qscales = pool, {}
    if int8:
        stored, scales, pool = int8_pool(pool)
        qscales = {"qkv": scales}
    layers = SimpleNamespace(a=[{"qkv": stored.a}] * 2, b=[{"qkv": stored.b}] * 2,
                             qscales=[qscales] * 2,
                             out_offsets={"qkv": pool.out_offsets})
    ctx = LoraContext(layers, TritonLoraBackend(tuning=tuning, side_tuning=tuning),
                      {"qkv": meta, "o": None}, defer=defer)
    ctx.begin(x.shape[0], x.device)
    linear = functools.partial(torch.matmul, other=weight.T)
    want = expected(pool, x, linear(x), segs)
    for layer in range(2):
        y, delta = ctx.project(linear, x, layer, "qkv")
        assert (delta is not None) == defer
        torch.testing.assert_close(y + delta if defer else y, want, rtol=1e-4, atol=1e-4)
    y, delta = ctx.project(linear, x, 0, "o")
    assert delta is None and torch.equal(y, linear(x))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bias", [False, True], ids=["delta_then_gemm", "bias_after_gemm"])
def test_lora_context_prefill_batch_gives_linear_plus_deltas(backend, bias):
    """An eager batch of prefill segments (ungrouped metadata): without bias the deltas are
    stored first and the GEMM adds them; with bias they are added after it. Either way y is
    linear(x) plus the deltas, and tokens with no adapter get linear(x) alone."""
    pool, x, _, segs = build_case("no_adapter_mix", 3)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu", grouped=False)
    layers = SimpleNamespace(a=[{"qkv": pool.a}], b=[{"qkv": pool.b}], qscales=[{}],
                             out_offsets={"qkv": pool.out_offsets})
    lora = TritonLoraBackend(split_k=2) if backend == "triton" else TorchLoraBackend()
    overwrites = []
    expand = lora.expand
    lora.expand = lambda *args, **kw: (overwrites.append(not kw.get("accumulate", True)),
                                       expand(*args, **kw))[1]
    torch.manual_seed(3)
    linear = torch.nn.Linear(x.shape[1], pool.out_offsets[-1], bias=bias)
    with torch.no_grad(), _nan_filled_empty_tensors():  # a row left unwritten shows as NaN
        y, delta = LoraContext(layers, lora, {"qkv": meta}).project(linear, x, 0, "qkv")
    with torch.no_grad():
        want = expected(pool, x, linear(x), segs)
    assert delta is None and overwrites == [not bias]
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)


@contextlib.contextmanager
def _nan_filled_empty_tensors():
    """torch.empty and friends return NaN-filled memory inside the block."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = was_filling


@pytest.mark.parametrize("grouped", [False, True])
def test_triton_backend_expand_overwrite_zeroes_tokens_without_adapter(grouped):
    pool, x, y0, segs = build_case("no_adapter_mix", 2)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu", grouped=grouped)
    backend = TritonLoraBackend(split_k=2)
    v = backend.shrink(x, pool.a, meta)
    y = y0.clone()
    backend.expand(v, pool.b, pool.out_offsets, meta, y, accumulate=False)
    zeros = torch.zeros_like(y0)
    torch.testing.assert_close(y, expected(pool, x, zeros, segs), rtol=1e-4, atol=1e-4)


def test_grouped_expand_overwrites_only_the_groups_tokens():
    pool, x, y0, segs = build_grouped_case("skewed", 2)
    meta = grouped_meta(segs)
    args = _group_args(meta)
    v = grouped_shrink(x, pool.a, *args, meta.groups.row_scales, meta.max_rows)
    y, y_ref = y0.clone(), y0.clone()
    grouped_expand(v, pool.b, pool.out_offsets, *args, y, accumulate=False)
    grouped_expand_ref(v, pool.b, pool.out_offsets, *args, y_ref, accumulate=False)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    delta = torch.zeros_like(y0)
    grouped_expand(v, pool.b, pool.out_offsets, *args, delta)
    grouped = torch.zeros(x.shape[0], dtype=torch.bool)
    grouped[meta.groups.token_ids.long()] = True
    assert torch.equal(y[grouped], delta[grouped]) and torch.equal(y[~grouped], y0[~grouped])


def test_grouped_bf16_matches_fp32_reference():
    pool, x, y0, segs = build_grouped_case("stacks_1_to_8", 3, dtype=torch.bfloat16)
    y = y0.clone()
    TritonLoraBackend().apply(x, y, pool.a, pool.b, pool.out_offsets, grouped_meta(segs))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected(pool, x, y0, segs), rtol=2e-2, atol=3e-2)


def test_host_groups_gather_tokens_by_set_without_reordering_segments():
    host = HostGroups.build([1, 2, 1, 0, 1, 1], [4, -1, 9, 4, 4, 9])
    assert host.group_indptr.tolist() == [0, 2, 4]  # set 4: tokens 0, 4; set 9: tokens 3, 5
    assert host.token_ids.tolist() == [0, 4, 3, 5]
    assert host.first_seg.tolist() == [0, 2]
    row_indptr, row_ids, scales = host.rows([[7, 8], [], [3], [], [7, 8], [3]],
                                            [[1.0, 1.0], [], [0.5], [], [1.0, 1.0], [0.5]])
    assert row_indptr.tolist() == [0, 2, 3]
    assert row_ids.tolist() == [7, 8, 3]
    assert scales.tolist() == [1.0, 1.0, 0.5]


def test_host_groups_split_popular_sets_and_drop_empty_ones():
    host = HostGroups.build([1] * 7 + [0], [0, 1, 0, 0, 2, 0, 0, 5], max_tokens=2)
    assert host.group_indptr.tolist() == [0, 2, 4, 5, 6, 7]  # set 0: 5 tokens in 3 groups
    assert host.token_ids.tolist() == [0, 2, 3, 5, 6, 1, 4]
    assert host.first_seg.tolist() == [0, 0, 0, 1, 4]  # set 5 has no token: no group
    row_indptr, row_ids, _ = host.rows([[3, 4]] * 8, [[1.0, 1.0]] * 8)
    assert row_indptr.tolist() == [0, 2, 4, 6, 8, 10]
    assert HostGroups.build([1, 1], [-1, -1]).num_groups == 0


def test_from_segments_groups_decodes_and_prefill_chunks_alike():
    rows, scales = [[5, 1], [9], [5, 1], []], [[1.0, 1.0], [0.5], [1.0, 1.0], []]
    meta = LoraBatchMeta.from_segments([1, 1, 1, 1], rows, scales, "cpu")
    assert meta.groups.num_groups.tolist() == [2]
    assert meta.groups.token_ids.tolist() == [0, 2, 1]
    mixed = LoraBatchMeta.from_segments([40, 1, 1, 1], rows, scales, "cpu")
    # set (5, 1): the chunk's 40 tokens and token 41, 16 a group; set (9): token 40
    assert mixed.groups.group_indptr.tolist() == [0, 16, 32, 41, 42]
    assert mixed.groups.token_ids.tolist() == [*range(40), 41, 40]
    assert LoraBatchMeta.from_segments([40, 1, 1, 1], rows, scales, "cpu",
                                       grouped=False).groups is None


GROUPED_BAD = {
    "token_ids_int64": {"token_ids": lambda t: t.long()},
    "num_groups_shape": {"num_groups": lambda n: n.repeat(2)},
    "indptr_len": {"row_indptr": lambda r: r[:-1]},
}


@pytest.mark.parametrize("case", sorted(GROUPED_BAD))
def test_grouped_launchers_reject_bad_metadata(case):
    pool, x, y0, segs = build_grouped_case("no_adapter_rows", 1)
    meta = grouped_meta(segs)
    names = ("num_groups", "group_indptr", "token_ids", "row_indptr", "row_ids")
    kw = dict(zip(names, _group_args(meta), strict=True))
    kw.update({k: f(kw[k]) for k, f in GROUPED_BAD[case].items()})
    with pytest.raises(ValueError):
        grouped_shrink(x, pool.a, row_scales=meta.groups.row_scales, max_rows=meta.max_rows, **kw)
    with pytest.raises(ValueError):
        grouped_expand(torch.zeros(1, x.shape[0], meta.max_rows), pool.b, pool.out_offsets,
                       y=y0, **kw)


def int8_pool(pool: Pool) -> tuple[Pool, torch.Tensor, Pool]:
    """(the pool quantized as AdapterPool.pack quantizes: per (slice, row), A over in_dim and B
    over the slice's columns; its qscales [n_slices, num_rows]; the float pool those int8 rows
    and scales stand for: A times qscales, B as is)."""
    qa, a_scales = quantize_rows(pool.a.float())
    off = pool.out_offsets
    b_parts = [quantize_rows(pool.b[:, lo:hi].float()) for lo, hi in zip(off[:-1], off[1:])]
    qb = torch.cat([q for q, _ in b_parts], 1)
    qscales = a_scales * torch.stack([s for _, s in b_parts])
    quant = dataclasses.replace(pool, a=qa, b=qb)
    dequant = dataclasses.replace(pool, a=qa.float() * qscales[:, :, None], b=qb.float())
    return quant, qscales, dequant


# grouped: the scenario is a grouped_scenario; no_adapter_rows (at most 16 rows) merges the 3
# slices into one shrink tile
INT8_CASES = [("triton", "stacks", False), ("triton", "skewed", False),
              ("triton", "distinct_mixed_ranks", True), ("triton", "stacks_1_to_8", True),
              ("triton", "no_adapter_rows", True), ("torch", "stacks", False),
              ("torch", "skewed", True)]


@pytest.mark.parametrize("backend,name,grouped", INT8_CASES)
def test_int8_pool_equals_its_dequantized_float_pool(backend, name, grouped):
    """An int8 pool with its qscales gives what the loop reference gives on the float pool its
    rows and scales stand for (fp32 rounding apart), on the per-segment and grouped kernels;
    and stays within int8's error of the unquantized pool."""
    pool, x, y0, segs = (build_grouped_case if grouped else build_case)(name, 3)
    quant, qscales, dequant = int8_pool(pool)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu", grouped=grouped)
    tuning = GroupedTuning(k_chunk=16, block_k=16)  # 3 in_dim splits
    triton_lora = TritonLoraBackend(split_k=2, tuning=tuning)
    lora = triton_lora if backend == "triton" else TorchLoraBackend()
    y = y0.clone()
    lora.apply(x, y, quant.a, quant.b, quant.out_offsets, meta, qscales)
    torch.testing.assert_close(y, expected(dequant, x, y0, segs), rtol=1e-4, atol=1e-4)
    exact = expected(pool, x, y0, segs)
    assert (y - exact).abs().max() <= 0.02 * (exact - y0).abs().max()


def test_int8_kernels_match_their_references():
    """sgmv_shrink/grouped_shrink with qscales against their torch references; the expands
    read int8 B as it is."""
    pool, x, y0, segs = build_case("stacks", 2, in_dim=32)
    quant, qscales, _ = int8_pool(pool)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu", grouped=True)
    seg_args = (*_meta_args(meta), meta.row_scales, meta.max_rows)
    v = sgmv_shrink(x, quant.a, *seg_args, qscales=qscales)
    torch.testing.assert_close(v, sgmv_shrink_ref(x, quant.a, *seg_args, qscales))
    y, y_ref = y0.clone(), y0.clone()
    sgmv_expand(v, quant.b, quant.out_offsets, *_meta_args(meta), y)
    sgmv_expand_ref(v, quant.b, quant.out_offsets, *_meta_args(meta), y_ref)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    args = (*_group_args(meta), meta.groups.row_scales, meta.max_rows)
    v = grouped_shrink(x, quant.a, *args, qscales=qscales).sum(0)
    v_ref = grouped_shrink_ref(x, quant.a, *args, qscales)
    tok_at, rows_at = meta.groups.group_indptr.tolist(), meta.groups.row_indptr.tolist()
    for g in range(int(meta.groups.num_groups)):  # only the groups' tokens and rows are defined
        tokens = meta.groups.token_ids[tok_at[g] : tok_at[g + 1]].long()
        cols = slice(0, rows_at[g + 1] - rows_at[g])
        torch.testing.assert_close(v[:, tokens, cols], v_ref[:, tokens, cols])


def test_int8_pool_needs_its_qscales_and_only_it_has_them():
    pool, x, _, segs = build_case("stacks", 1)
    quant, qscales, _ = int8_pool(pool)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu", grouped=False)
    seg_args = (*_meta_args(meta), meta.row_scales, meta.max_rows)
    with pytest.raises(ValueError, match="qscales must be given exactly for an int8 a_pool"):
        sgmv_shrink(x, quant.a, *seg_args)
    with pytest.raises(ValueError, match="qscales must be given exactly for an int8 a_pool"):
        sgmv_shrink(x, pool.a, *seg_args, qscales=qscales)
    with pytest.raises(ValueError, match=rf"qscales must be float32 \(1, {pool.a.shape[1]}\)"):
        sgmv_shrink(x, quant.a, *seg_args, qscales=qscales[:, :-1])
