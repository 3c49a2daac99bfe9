"""Adapter slots (radixlora.lora.slots): a projection over slots equals the same projection
with the grouped LoRA path of the torch backend (M6), for a model with a qkv bias, stacked
sets, tokens with no adapter, and after the pool's rows change under the same row ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlora import Engine
from radixlora.kernels.lora_ops import LoraBatchMeta, TorchLoraBackend
from radixlora.lora.adapter import MODULE_GROUPS, load_adapter
from radixlora.lora.pool import LoraContext, LoraSegments
from radixlora.lora.slots import projection


def segments_for(adapters_rows, request_adapters):
    """LoraSegments of a decode batch: request i stacks request_adapters[i] (name, weight)."""
    sets: dict[tuple, int] = {}
    request_sets, per_group = [], {g: ([], []) for g in MODULE_GROUPS}
    for entries in request_adapters:
        request_sets.append(sets.setdefault(tuple(entries), len(sets)) if entries else -1)
        for group in MODULE_GROUPS:
            ids, scales = [], []
            for name, weight in entries:
                rows = adapters_rows[name].get(group, [])
                ids += rows
                scales += [weight] * len(rows)
            per_group[group][0].append(ids)
            per_group[group][1].append(scales)
    return LoraSegments(per_group, np.array(request_sets, np.int64))


@pytest.fixture
def slot_engine(checkpoints, adapters):
    eng = Engine(checkpoints["qwen2"], lora_slots=96, max_rank=64, kv_pages=16)
    runner = eng.runner
    cfg, pool = eng.model_cfg, runner.adapter_pool
    loaded, start = {}, 0
    for name in "abd":
        adapter = load_adapter(name, adapters["qwen2"][name], cfg, 64)
        rows = np.arange(start, start + adapter.rank)
        pool.write(adapter, rows)
        loaded[name] = {g: rows[:r].tolist() for g, r in adapter.group_ranks.items()}
        start += adapter.rank
    return eng, loaded


def reference(runner, segments, x, layer, group):
    qo = [1] * len(segments.request_sets)
    rows, scales = segments[group]
    meta = LoraBatchMeta.from_segments(qo, rows, scales, "cpu", segments.request_sets)
    ctx = LoraContext(runner.adapter_pool, TorchLoraBackend(), {group: meta})
    y, _ = ctx.project(projection(runner.model.layers[layer], group), x, layer, group)
    return y


def slot_project(slots, segments, x, layer, group):
    rows = slots.rows_needed(segments)
    bucket = slots.bucket_for(rows)
    parts = slots.fill(segments)
    names = ("num_groups", "group_indptr", "group_tokens", f"slot_start.{group}",
             f"slot_count.{group}")  # fmt: skip
    groups = tuple(torch.tensor(np.asarray(parts[n]), dtype=torch.int32) for n in names)
    return slots.project(x, layer, group, bucket, groups)


def test_slot_projection_matches_the_grouped_lora_path(slot_engine):
    eng, rows = slot_engine
    runner, slots = eng.runner, eng.runner.adapter_slots
    assert projection(runner.model.layers[0], "qkv").bias is not None  # qwen2: the bias path
    requests = [[("a", 1.0)], [], [("b", 0.5), ("d", 0.25)], [("a", 1.0)]]  # 76 of 96 rows
    segments = segments_for(rows, requests)
    g = torch.Generator().manual_seed(0)
    for layer in range(len(runner.model.layers)):
        for group in MODULE_GROUPS:
            linear = projection(runner.model.layers[layer], group)
            x = torch.randn(len(requests), linear.in_features, generator=g)
            want = reference(runner, segments, x, layer, group)
            got = slot_project(slots, segments, x, layer, group)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got[1], linear(x[1]), atol=1e-6, rtol=0)  # no adapter


def test_slots_copy_only_on_change_and_follow_pool_writes(slot_engine, adapters):
    eng, rows = slot_engine
    runner, slots = eng.runner, eng.runner.adapter_slots
    segments = segments_for(rows, [[("a", 1.0)], [("d", 1.0)]])
    x = torch.randn(2, eng.model_cfg.hidden_size)
    slot_project(slots, segments, x, 0, "qkv")
    table = slots.tables["qkv"]
    slot_project(slots, segments, x, 0, "qkv")
    assert slots.tables["qkv"] is table  # same sets, same pool: nothing copied
    # adapter c takes a's rows: same row ids, new contents
    c = load_adapter("c", adapters["qwen2"]["c"], eng.model_cfg, 64)
    runner.adapter_pool.write(c, np.arange(c.rank) + rows["a"]["qkv"][0])
    got = slot_project(slots, segments, x, 0, "qkv")
    assert slots.tables["qkv"] is not table
    torch.testing.assert_close(got, reference(runner, segments, x, 0, "qkv"), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


def test_slot_buckets_and_overflow(slot_engine):
    eng, rows = slot_engine
    slots = eng.runner.adapter_slots
    assert slots.buckets == [16, 32, 64, 96]
    assert slots.bucket_for(9) == 16 and slots.bucket_for(96) == 96
    assert slots.bucket_for(97) is None
    # a, b+d and d: 8 + (4 + 64) + 64 rows in the widest group
    segments = segments_for(rows, [[("a", 1.0)], [("b", 1.0), ("d", 1.0)], [("d", 1.0)]])
    assert slots.rows_needed(segments) == 140
    with pytest.raises(ValueError, match="140 slot rows"):
        slots.fill(segments)


def test_lora_slots_must_be_positive(checkpoints):
    from radixlora.lora.slots import stack_projections

    eng = Engine(checkpoints["llama"], kv_pages=16)
    with pytest.raises(ValueError, match="lora_slots"):
        stack_projections(eng.runner.model, 0, "cpu")
