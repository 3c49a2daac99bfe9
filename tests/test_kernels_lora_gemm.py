"""The fused decode projection (base GEMM + grouped LoRA in one launch) against the loop
reference of tests/test_kernels_sgmv.py and its own torch reference (M6). Runs under
TRITON_INTERPRET=1; shapes stay tiny."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before any import

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from radixlora.kernels.lora_gemm import (  # noqa: E402
    MAX_TOKENS,
    _sync_words,
    lora_gemm,
    lora_gemm_ref,
    pick_tiling,
    supports,
)
from tests.test_kernels_sgmv import (  # noqa: E402
    RANKS,
    _pad_groups,
    _single,
    grouped_meta,
    grouped_scenario,
    loop_ref,
    make_pool,
    stack_rows,
)

WIDTHS = {1: [96], 2: [64, 32], 3: [64, 32, 32]}  # slice boundaries on 16- and 32-wide tiles


def scenario(name: str):
    if name == "popular_split_groups":  # 30 tokens, most on one adapter: groups of 16 share rows
        rng = random.Random(name)
        adapters = [0 if rng.random() < 0.7 else rng.choice([None, 3, 6]) for _ in range(30)]
        return [1] * 30, _single(adapters)
    return grouped_scenario(name)


SCENARIOS = ["distinct_mixed_ranks", "no_adapter_rows", "stacks_1_to_8", "popular_split_groups",
             "single_token_groups_and_short_extends"]  # fmt: skip


def build(name, n_slices, in_dim, dtype=torch.float32, seed=0):
    pool = make_pool(RANKS, WIDTHS[n_slices], in_dim, dtype, seed)
    seg_lens, sets = scenario(name)
    segs = (seg_lens, *stack_rows(pool, sets))
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(seg_lens), in_dim, generator=g).to(dtype)
    w = (torch.randn(pool.out_offsets[-1], in_dim, generator=g) / in_dim**0.5).to(dtype)
    return pool, x, w, segs


def run(pool, x, w, meta):
    g = meta.groups
    args = (g.num_groups, g.group_indptr, g.token_ids, g.row_indptr, g.row_ids, g.row_scales)
    return (lora_gemm(x, w, pool.a, pool.b, pool.out_offsets, *args),
            lora_gemm_ref(x, w, pool.a, pool.b, pool.out_offsets, *args))


def loop_expected(pool, x, w, segs):
    y = x.float() @ w.float().T
    loop_ref(x, y, pool.a, pool.b, pool.out_offsets, *segs)
    return y


@pytest.mark.parametrize("in_dim", [64, 128])  # 16- and 32-wide tiles
@pytest.mark.parametrize("n_slices", [1, 2, 3])
@pytest.mark.parametrize("name", SCENARIOS)
def test_lora_gemm_matches_loop_reference(name, n_slices, in_dim):
    pool, x, w, segs = build(name, n_slices, in_dim)
    meta = grouped_meta(segs)
    y, y_ref = run(pool, x, w, meta)
    torch.testing.assert_close(y_ref.float(), loop_expected(pool, x, w, segs), rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)


def test_lora_gemm_with_spare_group_capacity_and_repeated_launches():
    """Static-buffer metadata (capacity past num_groups holds garbage) and the self-resetting
    counters: three launches in a row, the counters zero after each."""
    pool, x, w, segs = build("stacks_1_to_8", 3, 128)
    meta = _pad_groups(grouped_meta(segs), extra=5)
    for _ in range(3):
        y, y_ref = run(pool, x, w, meta)
        torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
        assert not _sync_words(x.device).any()


def test_lora_gemm_bfloat16():
    pool, x, w, segs = build("popular_split_groups", 3, 128, dtype=torch.bfloat16)
    y, _ = run(pool, x, w, grouped_meta(segs))
    torch.testing.assert_close(y.float(), loop_expected(pool, x, w, segs), rtol=2e-2, atol=2e-2)


def test_lora_gemm_no_adapter_tokens_get_the_base_projection():
    pool, x, w, segs = build("no_adapter_rows", 2, 64)
    y, _ = run(pool, x, w, grouped_meta(segs))
    base_only = [0, 2, 3, 6, 7]
    torch.testing.assert_close(y[base_only], x[base_only] @ w.T, rtol=1e-5, atol=1e-5)


def test_lora_gemm_rejects_what_it_cannot_tile():
    pool, x, w, segs = build("distinct_mixed_ranks", 3, 64)
    meta = grouped_meta(segs)
    g = meta.groups
    args = (g.num_groups, g.group_indptr, g.token_ids, g.row_indptr, g.row_ids, g.row_scales)
    assert supports(x, w, pool.a, pool.b, pool.out_offsets)
    assert not supports(x, w[:80], pool.a, pool.b[:, :80], [0, 40, 56, 80])
    assert pick_tiling(80, 48) is None and pick_tiling(80, 96).block_k == 32
    with pytest.raises(ValueError, match="no tile"):
        lora_gemm(x, w[:80], pool.a, pool.b[:, :80], [0, 40, 56, 80], *args)
    too_many = torch.zeros(MAX_TOKENS + 1, 64)
    with pytest.raises(ValueError, match="at most"):
        lora_gemm(too_many, w, pool.a, pool.b, pool.out_offsets, *args)
    with pytest.raises(ValueError, match="contiguous"):
        lora_gemm(x, w.T.contiguous().T, pool.a, pool.b, pool.out_offsets, *args)
    with pytest.raises(ValueError, match="share a dtype"):
        lora_gemm(x, w.double(), pool.a, pool.b, pool.out_offsets, *args)
