"""Paged extend / decode attention kernels vs pure-torch references, under TRITON_INTERPRET."""

from __future__ import annotations

import os
from dataclasses import dataclass

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from radixlora.worker.attention import AttentionInputs, TritonAttentionBackend  # noqa: E402
from radixlora.worker.kv_pool import KVPool  # noqa: E402
from radixlora_kernels.attention_decode import decode_attention, decode_attention_ref  # noqa: E402
from radixlora_kernels.attention_extend import (  # noqa: E402
    extend_attention,
    extend_attention_ref,
    extend_tiles,
)
from radixlora_kernels.device import int32_parts_to_device  # noqa: E402

# The interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584), so the
# half-precision cases here use fp16; scripts/bench_attention.py checks bf16 on the GPU.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_slots, Hkv, D]
    v_cache: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    k_dense: list[torch.Tensor]  # per request [kv_len, Hkv, D], before paging
    v_dense: list[torch.Tensor]
    qo_lens: list[int]
    sm_scale: float


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _page_slots(kv_lens: list[int], page_size: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Slots of each request, taken page by page from a shuffled free list (never contiguous)."""
    pages_needed = [-(-n // page_size) for n in kv_lens]
    free = torch.randperm(sum(pages_needed) + 3, generator=gen).tolist()
    slots = []
    for n, n_pages in zip(kv_lens, pages_needed, strict=True):
        pages, free = free[:n_pages], free[n_pages:]
        offsets = torch.arange(page_size)
        per_page = [p * page_size + offsets for p in pages]
        slots.append(torch.cat(per_page)[:n] if per_page else torch.zeros(0, dtype=torch.long))
    return slots


def make_case(
    qo_lens: list[int],
    prefix_lens: list[int],
    n_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 16,
    page_size: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [p + q for p, q in zip(prefix_lens, qo_lens, strict=True)]
    slots = _page_slots(kv_lens, page_size, gen)
    num_slots = (max((int(s.max()) for s in slots if len(s)), default=0) + 1) + page_size
    shape = (num_slots, n_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(qo_lens), n_kv_heads * group, head_dim, generator=gen).to(dtype)
    return PagedCase(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        qo_indptr=_indptr(qo_lens),
        kv_indptr=_indptr(kv_lens),
        kv_indices=torch.cat(slots).to(torch.int32),
        k_dense=[k_cache[s] for s in slots],
        v_dense=[v_cache[s] for s in slots],
        qo_lens=qo_lens,
        sm_scale=head_dim**-0.5,
    )


def oracle(case: PagedCase, sliding_window: int | None = None) -> torch.Tensor:
    """softmax(q k^T) v per request, per query token, on the dense (unpaged) K/V, in fp64."""
    out, q_off = [], 0
    for k, v, qo_len in zip(case.k_dense, case.v_dense, case.qo_lens, strict=True):
        group = case.q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        for i in range(qo_len):
            pos = len(k) - qo_len + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            qi = case.q[q_off + i].double()  # [Hq, D]
            s = torch.einsum("hd,khd->hk", qi, k[first : pos + 1]) * case.sm_scale
            out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[first : pos + 1]))
        q_off += qo_len
    return torch.stack(out)


def run_extend(case: PagedCase, sliding_window: int | None = None) -> torch.Tensor:
    o = torch.full_like(case.q, float("nan"))
    return extend_attention(
        case.q, case.k_cache, case.v_cache, o, case.qo_indptr, case.kv_indptr,
        case.kv_indices, case.sm_scale, sliding_window=sliding_window,
    )


def extend_ref(case: PagedCase, sliding_window: int | None = None) -> torch.Tensor:
    return extend_attention_ref(
        case.q, case.k_cache, case.v_cache, case.qo_indptr, case.kv_indptr,
        case.kv_indices, case.sm_scale, sliding_window=sliding_window,
    )


def run_decode(case: PagedCase, num_splits: int, sliding_window: int | None = None):
    o = torch.full_like(case.q, float("nan"))
    return decode_attention(
        case.q, case.k_cache, case.v_cache, o, case.kv_indptr, case.kv_indices,
        case.sm_scale, sliding_window=sliding_window, num_splits=num_splits,
    )


def decode_ref(case: PagedCase, sliding_window: int | None = None) -> torch.Tensor:
    return decode_attention_ref(
        case.q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices,
        case.sm_scale, sliding_window=sliding_window,
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


# --- references vs an independent oracle (pure torch, fast) -------------------------------------


@pytest.mark.parametrize("window", [None, 1, 4])
@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_ref_matches_oracle(page_size: int, window: int | None) -> None:
    case = make_case([1, 5, 17], [0, 9, 3], group=2, page_size=page_size, seed=1)
    assert_close(extend_ref(case, window), oracle(case, window), torch.float32)


@pytest.mark.parametrize("window", [None, 3])
def test_decode_ref_matches_oracle(window: int | None) -> None:
    case = make_case([1, 1, 1], [0, 6, 30], group=4, page_size=4, seed=2)
    assert_close(decode_ref(case, window), oracle(case, window), torch.float32)


# --- extend kernel --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "page_size", "head_dim", "prefix_lens"),
    [
        (1, 1, 16, [0, 0, 0]),
        (2, 4, 32, [7, 0, 40]),
        (4, 16, 16, [33, 2, 0]),
    ],
)
def test_extend_fp32(group: int, page_size: int, head_dim: int, prefix_lens: list[int]) -> None:
    case = make_case(
        [1, 5, 17], prefix_lens, group=group, head_dim=head_dim, page_size=page_size, seed=3
    )
    assert_close(run_extend(case), extend_ref(case), torch.float32)


def test_extend_multiple_query_blocks() -> None:
    case = make_case([70, 3], [20, 64], n_kv_heads=1, group=2, page_size=8, seed=4)
    assert_close(run_extend(case), extend_ref(case), torch.float32)


def test_extend_sliding_window() -> None:
    case = make_case([1, 5, 40], [50, 0, 30], group=2, page_size=4, seed=5)
    assert_close(run_extend(case, 9), extend_ref(case, 9), torch.float32)


def test_extend_fp16() -> None:
    case = make_case([1, 5, 17], [12, 0, 35], group=2, page_size=4, dtype=torch.float16, seed=6)
    assert_close(run_extend(case), extend_ref(case), torch.float16)


def test_extend_odd_head_dim() -> None:
    case = make_case([3, 6], [5, 0], group=2, head_dim=24, page_size=2, seed=7)
    assert_close(run_extend(case), extend_ref(case), torch.float32)


# --- mixed batches: extend tiles and indirect decodes ---------------------------------------------

MIXED_QO = [1, 5, 1, 40, 1, 3]
MIXED_PREFIX = [9, 0, 33, 20, 0, 6]


def test_extend_tiles_name_each_query_block_once() -> None:
    reqs, blocks = extend_tiles([3, 0, 70, 32, 33], 32)
    assert reqs.tolist() == [0, 2, 2, 2, 3, 4, 4]
    assert blocks.tolist() == [0, 0, 1, 2, 0, 0, 1]
    assert reqs.dtype == blocks.dtype == np.int32


@pytest.mark.parametrize("window", [None, 7])
def test_extend_over_tiles_writes_only_their_requests(window: int | None) -> None:
    case = make_case(MIXED_QO, MIXED_PREFIX, group=2, page_size=4, seed=12)
    lens = np.array(MIXED_QO)
    tiles = [torch.from_numpy(t) for t in extend_tiles(np.where(lens > 1, lens, 0), 32)]
    o = torch.full_like(case.q, float("nan"))
    extend_attention(case.q, case.k_cache, case.v_cache, o, case.qo_indptr, case.kv_indptr,
                     case.kv_indices, case.sm_scale, sliding_window=window,
                     tiles=tuple(tiles))
    rows = torch.from_numpy(np.repeat(lens > 1, lens))
    assert_close(o[rows], oracle(case, window)[rows], torch.float32)
    assert o[~rows].isnan().all()


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_rows_of_a_mixed_batch(num_splits: int, window: int | None) -> None:
    case = make_case(MIXED_QO, MIXED_PREFIX, group=4, page_size=4, seed=13)
    decodes = torch.tensor([0, 2, 4], dtype=torch.int32)
    o = torch.full_like(case.q, float("nan"))
    decode_attention(case.q, case.k_cache, case.v_cache, o, case.kv_indptr, case.kv_indices,
                     case.sm_scale, sliding_window=window, num_splits=num_splits,
                     rows=(decodes, case.qo_indptr))
    rows = case.qo_indptr[decodes.long()].long()
    assert_close(o[rows], oracle(case, window)[rows], torch.float32)
    others = torch.ones(len(o), dtype=torch.bool)
    others[rows] = False
    assert o[others].isnan().all()


@pytest.mark.parametrize("window", [None, 7])
def test_backend_splits_a_mixed_batch_between_the_kernels(window: int | None) -> None:
    case = make_case(MIXED_QO, MIXED_PREFIX, group=2, page_size=1, seed=14)
    pool = KVPool(1, case.k_cache.shape[0], case.k_cache.shape[1], case.k_cache.shape[2],
                  torch.float32, torch.device("cpu"))
    pool.k_cache[0].copy_(case.k_cache)
    pool.v_cache[0].copy_(case.v_cache)
    backend = TritonAttentionBackend(pool, case.q.shape[1], case.q.shape[2], window)
    kv_lens = (case.kv_indptr[1:] - case.kv_indptr[:-1]).tolist()
    meta = backend.build_metadata(AttentionInputs(MIXED_QO, kv_lens, case.kv_indices.long()))
    assert meta.split.decodes.tolist() == [0, 2, 4]
    # three decodes before the tiles: each view still starts 16-byte aligned, as Triton's
    # specialization of pointers needs for one kernel variant whatever the batch's mix
    for part in (meta.split.decodes, meta.split.tile_req, meta.split.tile_m):
        assert part.data_ptr() % 16 == 0
    assert_close(backend._attend(case.q, 0, meta), oracle(case, window), torch.float32)


def test_int32_parts_reach_the_device_aligned_and_whole() -> None:
    parts = [np.arange(n, dtype=np.int32) + 10 * n for n in (3, 0, 5, 4, 1)]
    views = int32_parts_to_device(parts, torch.device("cpu"))
    assert [v.tolist() for v in views] == [p.tolist() for p in parts]
    assert all(v.dtype == torch.int32 and v.data_ptr() % 16 == 0 for v in views)


# --- decode kernel --------------------------------------------------------------------------------


DECODE_KV_LENS = [1, 2, 17, 33, 64, 70]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize(("group", "page_size"), [(1, 1), (2, 4), (4, 16)])
def test_decode_fp32(group: int, page_size: int, num_splits: int) -> None:
    prefix = [n - 1 for n in DECODE_KV_LENS]
    case = make_case([1] * len(prefix), prefix, group=group, page_size=page_size, seed=8)
    assert_close(run_decode(case, num_splits), decode_ref(case), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])  # 1: the split kernel stores o, no merge
def test_decode_head_dim_32_fp16(num_splits: int) -> None:
    prefix = [n - 1 for n in DECODE_KV_LENS]
    case = make_case(
        [1] * len(prefix), prefix, group=4, head_dim=32, page_size=4, dtype=torch.float16
    )
    assert_close(run_decode(case, num_splits), decode_ref(case), torch.float16)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_sliding_window(num_splits: int) -> None:
    prefix = [n - 1 for n in DECODE_KV_LENS]
    case = make_case([1] * len(prefix), prefix, group=2, page_size=4, seed=9)
    assert_close(run_decode(case, num_splits, 20), decode_ref(case, 20), torch.float32)


def test_decode_matches_extend_with_one_token() -> None:
    case = make_case([1, 1, 1], [0, 15, 60], group=2, page_size=4, seed=10)
    assert_close(run_decode(case, 2), run_extend(case), torch.float32)


def test_default_num_splits() -> None:
    prefix = [n - 1 for n in DECODE_KV_LENS]
    case = make_case([1] * len(prefix), prefix, group=2, page_size=4, seed=11)
    o = torch.empty_like(case.q)
    decode_attention(
        case.q, case.k_cache, case.v_cache, o, case.kv_indptr, case.kv_indices, case.sm_scale
    )
    assert_close(o, decode_ref(case), torch.float32)


# --- launcher validation --------------------------------------------------------------------------


def test_extend_rejects_bad_arguments() -> None:
    case = make_case([2, 3], [1, 0])
    o = torch.empty_like(case.q)
    args = (case.qo_indptr, case.kv_indptr, case.kv_indices, case.sm_scale)
    with pytest.raises(ValueError, match="int32"):
        extend_attention(case.q, case.k_cache, case.v_cache, o, case.qo_indptr.long(), *args[1:])
    with pytest.raises(ValueError, match="o must match"):
        extend_attention(case.q, case.k_cache, case.v_cache, o[:1], *args)
    with pytest.raises(ValueError, match="k_cache"):
        extend_attention(case.q, case.k_cache.half(), case.v_cache, o, *args)
    with pytest.raises(ValueError, match="multiple"):
        extend_attention(case.q[:, :3], case.k_cache, case.v_cache, o[:, :3], *args)
    with pytest.raises(ValueError, match="sliding_window"):
        extend_attention(case.q, case.k_cache, case.v_cache, o, *args, sliding_window=0)


def test_decode_rejects_bad_arguments() -> None:
    case = make_case([1, 1], [3, 0])
    o = torch.empty_like(case.q)
    with pytest.raises(ValueError, match="kv_indptr"):
        decode_attention(
            case.q, case.k_cache, case.v_cache, o, case.kv_indptr[:2], case.kv_indices, 1.0
        )
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(
            case.q[..., :8], case.k_cache, case.v_cache, o[..., :8], case.kv_indptr,
            case.kv_indices, 1.0,
        )


# --- soft-capped scores (Gemma 2): the kernels against the references and an fp64 oracle --------


def capped_oracle(case: PagedCase, cap: float, sliding_window: int | None = None):
    """oracle() with scores cap * tanh(s / cap) before the softmax."""
    out, q_off = [], 0
    for k, v, qo_len in zip(case.k_dense, case.v_dense, case.qo_lens, strict=True):
        group = case.q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        for i in range(qo_len):
            pos = len(k) - qo_len + i
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            s = torch.einsum("hd,khd->hk", case.q[q_off + i].double(), k[first:pos + 1])
            s = cap * torch.tanh(s * case.sm_scale / cap)
            out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[first:pos + 1]))
        q_off += qo_len
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcapped_extend_and_decode_match_the_oracle(window, dtype) -> None:
    cap = 0.5  # small: the scores of these random cases bend well into tanh
    case = make_case([5, 1, 9], [3, 6, 0], dtype=dtype, seed=3)
    o = torch.full_like(case.q, float("nan"))
    got = extend_attention(case.q, case.k_cache, case.v_cache, o, case.qo_indptr,
                           case.kv_indptr, case.kv_indices, case.sm_scale,
                           sliding_window=window, softcap=cap)
    ref = extend_attention_ref(case.q, case.k_cache, case.v_cache, case.qo_indptr,
                               case.kv_indptr, case.kv_indices, case.sm_scale,
                               sliding_window=window, softcap=cap)
    expected = capped_oracle(case, cap, window)
    assert_close(got, expected, dtype)
    assert_close(ref, expected, dtype)
    assert not torch.allclose(expected, oracle(case, window), atol=1e-3)  # the cap bends it
    decode = make_case([1, 1, 1], [4, 11, 0], dtype=dtype, seed=4)
    for splits in (1, 3):
        o = torch.full_like(decode.q, float("nan"))
        got = decode_attention(decode.q, decode.k_cache, decode.v_cache, o, decode.kv_indptr,
                               decode.kv_indices, decode.sm_scale, sliding_window=window,
                               num_splits=splits, softcap=cap)
        assert_close(got, capped_oracle(decode, cap, window), dtype)
    ref = decode_attention_ref(decode.q, decode.k_cache, decode.v_cache, decode.kv_indptr,
                               decode.kv_indices, decode.sm_scale, sliding_window=window,
                               softcap=cap)
    assert_close(ref, capped_oracle(decode, cap, window), dtype)
