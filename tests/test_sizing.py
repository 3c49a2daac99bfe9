"""Pool and batch sizing (radixlora.worker.sizing) with fake device memory, the flags and their vLLM
/ SGLang spellings, the graph keys warm-up captures, and the synthetic steps the worker profiles and
warms up with, run through a CPU ModelRunner."""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import pytest
import torch

from radixlora import Engine
from radixlora.cli.flags import add_engine_flags, engine_overrides
from radixlora.config import EngineConfig, ModelConfig
from radixlora.errors import SizingError
from radixlora.lora.layout import bytes_per_row, group_row_bytes
from radixlora.worker.cuda_graph import StaticInputs, graph_keys, graph_reserve
from radixlora.worker.kv_pool import KVPool
from radixlora.worker.model_runner import profile_plan, warm_up_plans
from radixlora.worker.sizing import (
    CPU_DEFAULTS,
    GIB,
    DeviceMemory,
    available_host_bytes,
    batch_limits,
    cpu_config,
    running_bound,
    running_limit,
    size_pools,
    with_host_tier,
)
from scripts.checkpoints import model_config
from tests.conftest import assert_all_free

LLAMA_8B = ModelConfig.from_hf(model_config(
    "llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    torch_dtype="bfloat16"))
H200 = 140 * GIB  # what torch reports for an H200's 141 GB
WEIGHTS_8B = 16 * 10**9


def size_8b(config: EngineConfig, total: int = H200, in_use: int = WEIGHTS_8B + GIB,
            activations: int = 3 * GIB, graphs: int = 2 * GIB):
    config = with_host_tier(batch_limits(config, total), 100 * GIB)
    return size_pools(
        config, DeviceMemory(total, total - in_use), weights_bytes=WEIGHTS_8B,
        activation_bytes=activations, graph_bytes=graphs,
        kv_slot_bytes=KVPool.bytes_per_slot(32, 8, 128, torch.bfloat16),
        group_row_bytes=group_row_bytes(LLAMA_8B, torch.bfloat16),
    )


def test_llama_8b_on_an_h200_holds_500k_kv_tokens_beside_32_rank_64_adapters(caplog):
    config, sizing = size_8b(EngineConfig())
    assert "the KV pool holds" not in caplog.text  # 1,024 requests of 512 tokens fit
    assert KVPool.bytes_per_slot(32, 8, 128, torch.bfloat16) == 128 * 1024
    assert bytes_per_row(LLAMA_8B, torch.bfloat16) == 32 * 2 * (
        4096 * 5 + 4096 + 14336 + 4096 + 1024 * 2 + 4096 + 14336 * 2 + 4096)
    assert sizing.adapter_rows == config.adapter_rows == 32 * 64
    assert sizing.adapters_of_rank(64) == 32 and sizing.adapters_of_rank(16) == 128
    assert sizing.kv_tokens >= 500_000
    assert sizing.kv_tokens == (config.kv_pages - 1) * config.page_size
    used = (WEIGHTS_8B + GIB + sizing.activation_bytes + sizing.graph_bytes + sizing.kv_bytes
            + sizing.adapter_bytes)
    assert 0.9 * H200 - 128 * 1024 < used <= 0.9 * H200  # the whole share, less than a page
    assert (config.max_running, config.max_batch_tokens) == (1024, 8192)
    assert "KV" in sizing.line() and "32 of rank 64" in sizing.line()
    assert sizing.to_dict()["adapters_of_rank_16"] == 128


def test_utilization_and_adapter_flags_move_memory_between_the_pools():
    base = size_8b(EngineConfig())[1]
    low = size_8b(EngineConfig(gpu_memory_utilization=0.5))[1]
    assert low.kv_bytes == pytest.approx(base.kv_bytes - 0.4 * H200, abs=128 * 1024)
    fewer = size_8b(EngineConfig(max_loras=8, max_rank=16))[1]
    assert fewer.adapter_rows == 128
    assert fewer.kv_bytes - base.kv_bytes == pytest.approx(
        base.adapter_bytes - fewer.adapter_bytes, abs=128 * 1024)


@pytest.mark.parametrize("kv_tokens, running", [(1_000, 256), (65_536, 256), (131_072, 512),
                                                 (200_000, 781), (800_000, 1024)])
def test_running_limit_follows_the_kv_pool(kv_tokens, running):
    assert running_limit(kv_tokens) == running


def test_running_limit_is_set_once_the_kv_pool_is_sized():
    small = size_8b(EngineConfig(), total=40 * GIB, in_use=WEIGHTS_8B + GIB,
                    activations=GIB, graphs=GIB)
    assert small[0].max_running == running_limit(small[1].kv_tokens) == small[1].max_running
    assert 256 < small[0].max_running < 1024
    assert batch_limits(EngineConfig(), H200).max_running is None
    assert running_bound(EngineConfig()).max_running == 1024
    assert running_bound(EngineConfig(max_running=12)).max_running == 12


def test_explicit_sizes_win():
    config, sizing = size_8b(EngineConfig(kv_pages=1000, adapter_rows=96, max_running=32,
                                          max_batch_tokens=512, page_size=4))
    assert (config.kv_pages, config.adapter_rows) == (1000, 96)
    assert (config.max_running, config.max_batch_tokens) == (32, 512)
    assert sizing.kv_tokens == 999 * 4


def test_too_little_memory_is_a_sizing_error_naming_the_flags():
    with pytest.raises(SizingError, match="--gpu-memory-utilization"):
        size_8b(EngineConfig(), total=24 * GIB)
    config, sizing = size_8b(EngineConfig(kv_pages=64), total=24 * GIB)  # explicit: no check
    assert config.kv_pages == 64


def test_a_base_that_fills_the_device_gets_a_smaller_adapter_pool_not_an_error(caplog):
    h100, weights = int(79.2 * GIB), int(58.2 * GIB)  # Qwen3-30B-A3B's bf16 weights
    config, sizing = size_8b(EngineConfig(), total=h100, in_use=weights,
                             activations=GIB // 2, graphs=5 * GIB)
    room = int(0.9 * h100) - weights - GIB // 2 - 5 * GIB
    assert sizing.adapter_bytes <= room // 2 < sizing.adapter_bytes + sizing.adapter_row_bytes
    assert sizing.kv_bytes >= room // 2 - 128 * 1024
    assert 65 <= config.adapter_rows < 32 * 64
    assert "--adapter-rows" in caplog.text
    assert f"the KV pool holds {sizing.kv_tokens:,} tokens" in caplog.text  # 70 requests at most
    assert "--kv-cache-dtype fp8" in caplog.text
    with pytest.raises(SizingError, match="no room for a KV pool"):  # explicit rows win
        size_8b(EngineConfig(adapter_rows=32 * 64), total=h100, in_use=weights,
                activations=GIB // 2, graphs=5 * GIB)
    config, _ = size_8b(EngineConfig(kv_pages=64), total=h100, in_use=weights,
                        activations=GIB // 2, graphs=5 * GIB)
    assert config.adapter_rows == 32 * 64  # a KV pool of the user's size leaves the rest


@pytest.mark.parametrize("gib, tokens", [(16, 2048), (40, 4096), (80, 8192), (140, 8192),
                                         (180, 16384)])
def test_prefill_budget_follows_device_memory(gib, tokens):
    assert batch_limits(EngineConfig(), gib * GIB).max_batch_tokens == tokens


def test_host_tier_is_a_share_of_available_host_memory():
    assert with_host_tier(EngineConfig(), 100 * GIB).host_adapter_bytes == 25 * GIB
    assert with_host_tier(EngineConfig(host_adapter_bytes=5), 100 * GIB).host_adapter_bytes == 5
    # four worker processes on the host (replicas x ranks): a quarter of the share each
    assert with_host_tier(EngineConfig(), 100 * GIB, workers=4).host_adapter_bytes == 25 * GIB // 4


def test_each_replica_worker_takes_its_part_of_the_host_tier(tmp_path, monkeypatch):
    """Replicas size at the same moment from the same free memory: each takes 1/N of the
    share, so N replicas pin no more than one would."""
    from radixlora.server.args import ServerArgs
    from radixlora.server.procs import worker_proc
    from scripts.checkpoints import build_tiny_model

    model = build_tiny_model(tmp_path / "model")
    monkeypatch.setattr(worker_proc, "available_host_bytes", lambda: 100 * GIB)
    budgets = [worker_proc.make_executor(ServerArgs(model=str(model), data_parallel_size=n))
               .runner.adapter_pool.host.budget_bytes for n in (2, 4)]
    assert budgets == [25 * GIB // 2, 25 * GIB // 4]
    assert available_host_bytes() > 0
    assert size_8b(EngineConfig())[1].host_adapter_bytes == 25 * GIB
    assert "host tier 25.0 GiB" in size_8b(EngineConfig())[1].line()
    with pytest.raises(ValueError, match="host_adapter_bytes"):
        EngineConfig(host_adapter_bytes=-1)


def test_cpu_defaults_are_small_and_fixed():
    config = cpu_config(EngineConfig(max_running=8), available=8 * GIB)
    assert config.sized and config.max_running == 8 and config.host_adapter_bytes == 2 * GIB
    assert {k: getattr(config, k) for k in CPU_DEFAULTS if k != "max_running"} == {
        k: v for k, v in CPU_DEFAULTS.items() if k != "max_running"}


def test_config_rejects_nonsense_and_context_beyond_the_model():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_running"):
        EngineConfig(max_running=0)
    assert EngineConfig().max_context(LLAMA_8B) == 8192
    assert EngineConfig(context_length=4096).max_context(LLAMA_8B) == 4096
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineConfig(context_length=10_000).max_context(LLAMA_8B)


ALIASES = [
    (["--gpu-memory-utilization", "0.8"], {"gpu_memory_utilization": 0.8}),
    (["--mem-fraction-static", "0.7"], {"gpu_memory_utilization": 0.7}),
    (["--max-loras", "4", "--max-lora-rank", "16"], {"max_loras": 4, "max_rank": 16}),
    (["--max-rank", "8"], {"max_rank": 8}),
    (["--max-num-seqs", "128"], {"max_running": 128}),
    (["--max-running-requests", "96"], {"max_running": 96}),
    (["--max-running", "12"], {"max_running": 12}),
    (["--max-num-batched-tokens", "4096"], {"max_batch_tokens": 4096}),
    (["--chunked-prefill-size", "1024"], {"max_batch_tokens": 1024}),
    (["--max-model-len", "2048"], {"context_length": 2048}),
    (["--context-length", "1024"], {"context_length": 1024}),
    (["--enforce-eager"], {"cuda_graph": False}),
    (["--disable-cuda-graph"], {"cuda_graph": False}),
    ([], {}),
]


@pytest.mark.parametrize("argv, expected", ALIASES)
def test_vllm_and_sglang_spellings_set_the_same_fields(argv, expected):
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    overrides = engine_overrides(parser.parse_args(argv))
    assert overrides == expected
    EngineConfig(**overrides)


def test_graph_keys_cover_every_key_a_batch_can_get(checkpoints):
    engine = Engine(checkpoints["llama"], lora_backend="triton", attention_backend="triton")
    static = StaticInputs(engine.runner, max_batch=256, max_context=16, max_rows=512)
    keys = set(graph_keys(256, 512))
    assert len(keys) == len(graph_keys(256, 512))
    twins = set(graph_keys(256, 512, experts=True)) - keys  # a pool with expert rows
    assert twins == {dataclasses.replace(k, experts=True) for k in keys if k.rows}
    seen = set()
    for batch, extra, rows, lora in itertools.product(
            (1, 2, 3, 5, 9, 16, 17, 100, 256), (0, 1, 15, 40, 300, 600), (0, 1, 33, 512),
            (False, True)):
        qo_lens = [1 + extra] + [1] * (batch - 1)
        key = static.key_for(qo_lens, rows if lora else 0, lora)
        if key is not None:
            assert key in keys, (batch, extra, rows, lora)
            seen.add(key)
    assert len(seen) > len(keys) // 3
    config = dataclasses.replace(EngineConfig(), max_running=256)
    reserve = graph_reserve(config, LLAMA_8B, torch.bfloat16, 10**8)
    # one logits buffer of the largest batch, each graph's sampled values per row
    assert reserve == 256 * 128256 * 2 + sum(k.batch for k in keys) * 32 + 10**8


def test_profile_and_warm_up_steps_run_and_leave_nothing_behind(checkpoints, adapters):
    engine = Engine(checkpoints["llama"], adapters={"a": adapters["llama"]["a"]},
                    max_rank=8, max_batch_tokens=64, max_running=6)
    runner = engine.runner
    plan = profile_plan(20, 6, 8, start=3)
    assert [i.extend_len for i in plan.items] == [4, 4, 3, 3, 3, 3]
    out = runner.finish(runner.launch(plan))
    assert len(out.token_ids) == 6
    plans = warm_up_plans(runner.config, max_context=256, num_slots=300)
    assert {bool(p.adapter_sets[0]) for p in plans} == {False, True}
    assert {len(p.adapter_sets) for p in plans} == {1, 8}
    assert any(sum(i.extend_len for i in p.items) % 16 for p in plans)
    for plan in plans:  # each fits the context and the pool
        assert all(i.start + i.extend_len <= 256 for i in plan.items)
        assert len(plan.kv_slots) // 4 < 300
    for plan in plans:
        assert len(runner.finish(runner.launch(plan)).token_ids) == len(plan.items)
    runner.failed()
    assert engine.generate([[1, 2, 3]], adapters=["a"])[0].outputs[0].token_ids
    assert_all_free(engine)


def test_warm_up_covers_the_lora_tile_sizes_and_both_samplers():
    """Every (segment length, rank) bucket the LoRA kernels tile by, and a greedy step beside
    the filtered ones, on an H200-sized config."""
    config = dataclasses.replace(EngineConfig(), max_batch_tokens=8192, max_running=256,
                                 max_rank=64)
    plans = warm_up_plans(config, max_context=8192, num_slots=10**6)
    buckets = set()
    for plan in plans:
        longest = max(i.extend_len for i in plan.items)
        groups = list(plan.adapter_sets[0].values())
        rank = len(groups[0].rows) if groups else 0
        buckets.add((16 if longest <= 16 else 32 if longest <= 32 else 64, rank))
    assert {(t, r) for t in (16, 32, 64) for r in (8, 16, 32, 64)} <= buckets
    assert {(16, 0), (64, 0)} <= buckets
    # the grouped kernels' tiles for many adapter sets: a step with more than 100 groups
    assert any(len({i.adapter_set for i in p.items}) > 100 for p in plans)
    temperatures = {i.params.temperature for p in plans for i in p.items}
    assert 0.0 in temperatures and len(temperatures) == 2


def test_warm_up_and_graphs_reach_every_moe_tile_of_the_one_program_alignment():
    """Each expert GEMM tile (moe.CONFIGS, by rows an expert gets) that a step aligned by the
    one-program kernel can pick, for Qwen3-MoE's top 8 of 128 experts: warmed up, eagerly or in
    a graph, so none compiles while serving (256 running: Qwen3-30B-A3B on an H100)."""
    from radixlora_kernels.moe import ALIGN_ONE_PROGRAM_MAX_ROWS, CONFIGS, gemm_config

    config = dataclasses.replace(EngineConfig(), max_batch_tokens=8192, max_running=256)
    steps = {sum(i.extend_len for i in plan.items)
             for plan in warm_up_plans(config, max_context=8192, num_slots=10**6)}
    steps |= {key.tokens for key in graph_keys(config.max_running, 0)}
    tiles = {gemm_config(8 * t, 128) for t in steps if 8 * t <= ALIGN_ONE_PROGRAM_MAX_ROWS}
    assert tiles == {c for _, c in CONFIGS}


def test_the_engine_and_runner_share_one_sized_config(checkpoints):
    engine = Engine(checkpoints["llama"], max_running=5)
    assert engine.config is engine.runner.config and engine.config.sized
    assert engine.runner.sizing is None  # the CPU: fixed sizes, nothing measured
    assert (engine.config.kv_pages, engine.config.max_running) == (CPU_DEFAULTS["kv_pages"], 5)
    assert engine.scheduler.kv.num_pages == CPU_DEFAULTS["kv_pages"]


@pytest.mark.parametrize("argv, message", [
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-model-len", "100000"], "max_position_embeddings"),
])
def test_serve_refuses_bad_sizing_flags_before_starting(argv, message, capsys):
    from radixlora.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert message in f"{exit_.value.code} {capsys.readouterr().err}"
