"""Adapter memory that follows the adapters: the module groups the pool is sized for
(--lora-target-modules, or inferred from the adapters given at start) hold every row, the
others max_rank + 1, so an adapter on q/k/v/o occupies its own bytes. The allocator's two zones,
its invariants under churn, the sizing arithmetic on Llama-3-8B shapes, and the engine against
transformers + PEFT while adapters on other modules are evicted and reloaded mid-burst."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.config import DENSE_GROUPS, LINEAR_GROUPS, EngineConfig, ModelConfig, target_groups
from radixlora.lora.adapter import LoraAdapter
from radixlora.lora.layout import group_row_bytes
from radixlora.sched.residency import AdapterResidency, RowAllocator
from radixlora.worker import sizing
from radixlora.worker.sizing import GIB, DeviceMemory, size_pools, with_start_adapters
from scripts.checkpoints import build_peft_adapter
from tests.conftest import assert_all_free
from tests.oracle import logprobs, peft_model
from tests.test_engine_peft import check_against, prompt
from tests.test_sizing import LLAMA_8B

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def fake(name: str, rank: int, groups=DENSE_GROUPS, dora: bool = False) -> LoraAdapter:
    return LoraAdapter(name, f"/x/{name}", f"id-{name}", rank, dict.fromkeys(groups, rank), {},
                       dora_groups=("qkv",) if dora else ())


def test_target_modules_name_groups():
    assert target_groups(None) == target_groups(("all",)) == LINEAR_GROUPS
    assert target_groups(("all-linear", "experts")) == (*LINEAR_GROUPS, "experts_gate_up",
                                                        "experts_down")
    assert target_groups(("q_proj", "experts.down_proj")) == ("qkv", "experts_down")
    assert target_groups(("q_proj", "v_proj")) == ("qkv",)
    assert target_groups(("down_proj", "qkv_proj", "o_proj")) == ("qkv", "o", "down")
    with pytest.raises(ValueError, match="unknown modules"):
        EngineConfig(lora_target_modules=("lm_head",))
    config = EngineConfig(lora_target_modules=["q_proj", "o_proj"], adapter_rows=100, max_rank=8)
    assert config.lora_target_modules == ("q_proj", "o_proj")
    assert config.group_rows() == {"qkv": 100, "o": 100, "gate_up": 9, "down": 9}


def test_the_low_rows_stay_for_the_adapters_that_need_them():
    rows = RowAllocator(10, low=4)
    high = rows.alloc(5)
    assert sorted(high.tolist()) == [4, 5, 6, 7, 8] and rows.num_free(low_only=True) == 4
    assert sorted(rows.alloc(3, low_only=True).tolist()) == [0, 1, 2]
    with pytest.raises(MemoryError, match="below row 4"):
        rows.alloc(2, low_only=True)
    assert rows.alloc(2).tolist() == [9, 3]  # the last high row, then a low one
    rows.free(high)
    assert rows.num_free() == 5 and rows.num_free(low_only=True) == 0


def test_an_adapter_on_fewer_modules_takes_only_the_rows_of_its_groups():
    """qkv and o have 41 rows, gate_up and down 9 (max_rank 8 + 1): four q/k/v/o adapters of
    rank 8 fill the 32 high rows beside one on every module, which goes to the low rows; a
    second one on every module evicts the first, never a q/k/v/o adapter."""
    residency = AdapterResidency({"qkv": 41, "o": 41, "gate_up": 9, "down": 9})
    attn = [fake(f"a{i}", 8, ("qkv", "o")) for i in range(4)]
    full, full2 = fake("f", 8), fake("f2", 8)
    assert residency.can_acquire([*attn, full])
    residency.acquire([*attn, full])
    assert all(min(residency.rows_of(a.adapter_id)) >= 9 for a in attn)
    assert max(residency.rows_of(full.adapter_id)) < 9
    residency.release([a.adapter_id for a in [*attn, full]])
    assert residency.can_acquire([full2])
    residency.acquire([full2])
    assert not residency.is_resident(full.adapter_id)
    assert all(residency.is_resident(a.adapter_id) for a in attn)
    assert residency.oversized([full, full2]) is not None  # 16 low rows, 9 exist
    assert "--lora-target-modules" in residency.oversized([full, full2])
    assert residency.oversized([*attn]) is None


def test_churn_of_thousands_of_loads_leaks_no_row():
    """Random acquires, releases and prefetches of adapters of ranks 1-16 on q/k/v/o, on every
    module and with DoRA's extra row: every resident adapter's rows are distinct, below the
    rows of each group it adapts, and once all are released and evicted every row is free."""
    groups = {"qkv": 64, "o": 64, "gate_up": 17, "down": 17}
    residency = AdapterResidency(groups)
    rng = random.Random(0)
    pool = [fake(f"x{i}", rng.randint(1, 16), rng.choice([("qkv", "o"), DENSE_GROUPS,
                                                         ("qkv",)]), dora=i % 7 == 0)
            for i in range(300)]
    held: list[list[LoraAdapter]] = []
    for _ in range(3000):
        if held and rng.random() < 0.5:
            residency.release([a.adapter_id for a in held.pop(rng.randrange(len(held)))])
        elif rng.random() < 0.2:
            adapter = rng.choice(pool)
            if not residency.is_resident(adapter.adapter_id):
                residency.prefetch(adapter, {}, 0)
        else:
            batch = list({a.adapter_id: a for a in rng.sample(pool, rng.randint(1, 3))}.values())
            if residency.oversized(batch) is None and residency.can_acquire(batch):
                residency.acquire(batch)
                held.append(batch)
        owned = [r for e in residency.resident.values() for r in e.rows.tolist()]
        assert len(owned) == len(set(owned))
        assert len(owned) + residency.rows.num_free() == 64
        for entry in residency.resident.values():
            bound = min(groups[g] for g in entry.adapter.group_ranks)
            assert len(entry.rows) == entry.adapter.pool_rows and entry.rows.max() < bound
    for batch in held:
        residency.release([a.adapter_id for a in batch])
    for adapter_id in list(residency.resident):
        assert residency.evict(adapter_id)
    assert residency.rows.num_free() == 64 and residency.rows.num_free(low_only=True) == 17
    assert residency.num_evictions > 100


def sized_8b(config: EngineConfig):
    return size_pools(config, DeviceMemory(80 * GIB, 62 * GIB), weights_bytes=16 * GIB,
                      activation_bytes=3 * GIB, graph_bytes=2 * GIB, kv_slot_bytes=131072,
                      group_row_bytes=group_row_bytes(LLAMA_8B, torch.bfloat16))


def per_gib(sizing, rank: int) -> float:
    return sizing.adapters_of_rank(rank) / (sizing.adapter_bytes / GIB)


def test_on_llama_8b_the_same_bytes_hold_three_times_the_qkvo_adapters():
    """The default pool (32 adapters of rank 64 on every module, 10 GiB): 256 adapters of rank 8
    on q/k/v/o when rows span every module; 770 when the pool is sized for q/k/v/o (the other
    groups keep 65 rows: one adapter of any rank). Rank 16 on every module: unchanged."""
    base = EngineConfig(max_running=256, max_batch_tokens=8192, host_adapter_bytes=0)
    config, every = sized_8b(base)
    _, qkvo = sized_8b(dataclasses.replace(base, lora_target_modules=QKVO))
    assert (every.adapter_rows, every.adapters_of_rank(8)) == (2048, 256)
    assert qkvo.adapters_of_rank(8) == 770 and qkvo.adapter_groups == ("qkv", "o")
    assert qkvo.adapter_bytes <= every.adapter_bytes
    assert qkvo.kv_tokens >= every.kv_tokens
    assert round(per_gib(every, 8), 1) == 25.6 and round(per_gib(qkvo, 8), 1) == 77.0
    assert round(per_gib(every, 16), 1) == 12.8
    assert config.group_rows()["gate_up"] == 2048


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, checkpoints, adapters):
    """Three q/v/o adapters (ranks 4, 8, 8), and two on every module (ranks 8 and 16)."""
    root = tmp_path_factory.mktemp("fleet")
    base = checkpoints["llama"]
    attn = {f"attn{i}": build_peft_adapter(base, root / f"attn{i}", seed=40 + i, r=r,
                                           lora_alpha=2 * r,
                                           target_modules=["q_proj", "v_proj", "o_proj"])
            for i, r in enumerate((4, 8, 8))}
    return attn, {"a": adapters["llama"]["a"], "c": adapters["llama"]["c"]}


def test_start_adapters_decide_the_target_modules_and_rows(checkpoints, fleet, monkeypatch):
    attn, full = fleet
    cfg = ModelConfig.from_dir(checkpoints["llama"])
    config = EngineConfig(max_rank=16)
    inferred = with_start_adapters(config, attn.values(), cfg)
    assert inferred.lora_target_modules == QKVO and inferred.start_adapter_rows == 4 + 8 + 8
    both = with_start_adapters(config, [*attn.values(), full["a"]], cfg)
    assert both.lora_target_modules is None and both.start_adapter_rows == 20 + 8
    for nothing in ([], ["/nonexistent"]):
        none = with_start_adapters(config, nothing, cfg)
        assert none.lora_target_modules is none.start_adapter_rows is None
    assert inferred.start_adapter_rank == both.start_adapter_rank == 8
    assert with_start_adapters(config, [*attn.values(), full["c"]], cfg).start_adapter_rank == 16
    assert none.start_adapter_rank is None
    given = dataclasses.replace(config, lora_target_modules=("down_proj",), start_adapter_rows=5,
                                start_adapter_rank=4)
    assert with_start_adapters(given, attn.values(), cfg) is given
    monkeypatch.setattr(sizing, "INFER_ADAPTERS", 2)  # 6 paths, 2 read: rows scaled by 3
    assert with_start_adapters(config, [*attn.values()] * 2, cfg).start_adapter_rows == 36


def test_the_pool_grows_past_max_loras_only_as_far_as_the_start_adapters_need():
    """A q/k/v/o pool of default size on Llama-3-8B: with no adapter given at start, the bytes
    of 32 rank-64 adapters on every module buy 6,166 rows (770 rank-8 adapters). 100 rank-8
    adapters given at start need 800: the pool keeps max_loras x max_rank = 2,048 rows, 35% of
    those bytes, and the KV pool takes the rest (373,028 tokens, not 319,494); 300 get their
    2,400; 1,000 want more than the bytes buy and get the same 6,166. --adapter-rows wins."""
    base = EngineConfig(max_running=256, max_batch_tokens=8192, host_adapter_bytes=0,
                        lora_target_modules=QKVO)
    _, unknown = sized_8b(base)
    sized = {n: sized_8b(dataclasses.replace(base, start_adapter_rows=8 * n))[1]
             for n in (100, 300, 1000)}
    assert unknown.adapters_of_rank(8) == 770
    assert sized[100].adapter_rows == 2048 and sized[300].adapter_rows == 2400
    assert sized[1000].adapter_rows == unknown.adapter_rows
    assert sized[100].adapter_bytes < 0.35 * unknown.adapter_bytes
    gained = unknown.adapter_bytes - sized[100].adapter_bytes
    assert sized[100].kv_tokens - unknown.kv_tokens == gained // 131072
    explicit = dataclasses.replace(base, start_adapter_rows=800, adapter_rows=5000)
    assert sized_8b(explicit)[1].adapter_rows == 5000


def test_adapters_on_other_modules_take_turns_in_the_low_rows_and_match_peft(checkpoints, fleet):
    """The engine starts with the q/v/o adapters only, so its pool is sized for q/k/v/o: 24
    rows there, 17 (max_rank + 1) on gate_up and down. Two adapters on every module, loaded
    later, share those 17 rows with each other (8 + 16 rows: never both resident) and with
    the q/v/o adapters, in one mixed burst: every output equals PEFT's."""
    attn, full = fleet
    engine = Engine(checkpoints["llama"], adapters=attn, max_rank=16, kv_pages=512,
                    adapter_rows=24)
    assert engine.config.lora_target_modules == QKVO
    pool = engine.runner.adapter_pool
    assert {g: t.shape[2] for g, t in pool.a_all.items()} == {
        "qkv": 24, "o": 24, "gate_up": 17, "down": 17}
    for name, path in full.items():
        engine.load_adapter(name, path)
    ref_model = peft_model(checkpoints["llama"], {**attn, **full})
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    specs = ["a", "attn0", "c", "attn1", "a", "attn2", "c", None]
    prompts = [prompt(60 + i, 5 + i) for i in range(len(specs))]
    outs = [engine.generate(ids, params, adapters=spec) for ids, spec in zip(prompts, specs)]
    burst = engine.generate(prompts, params, adapters=specs)
    for ids, spec, alone, together in zip(prompts, specs, outs, burst):
        out = together.outputs[0]
        check_against(logprobs(ref_model, ids + out.token_ids, None if spec is None else [spec]),
                      ids, out)
        assert out.token_ids == alone[0].outputs[0].token_ids
    assert engine.scheduler.residency.num_evictions >= 2
    assert_all_free(engine)
    rows = engine.scheduler.residency.rows
    assert rows.num_free() == 24 and rows.num_free(low_only=True) == 17
