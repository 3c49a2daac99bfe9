"""scripts/bench_e2e.py's pure parts: the peak-rate floor (a hand-computed case), the PEFT
adapter writer (loaded back by radixlora and PEFT), the sharded checkpoint writer (loaded back
by radixlora), and the goodput workload's arithmetic (SLO, goodput, arrivals split over client
processes, the base share). The whole benchmark is not run here (`python scripts/bench_e2e.py
--tiny`)."""

from __future__ import annotations

import argparse
import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from radixlora.config import LORA_MODULES, ModelConfig
from radixlora.lora.adapter import load_adapter
from scripts import bench_e2e
from scripts.checkpoints import build_tiny_model

# hidden 4, intermediate 8, 1 layer, 2 heads / 1 KV head of dim 2, vocab 10
SMALL = bench_e2e.Shape(hidden=4, intermediate=8, layers=1, heads=2, kv_heads=1, head_dim=2,
                        vocab=10)


def test_shape_counts():
    # q 4x4 + k 4x2 + v 4x2 + o 4x4 + gate/up/down 3 x 4x8 = 144, + 2 norms of 4 per layer,
    # + the final norm 4 + the LM head 10x4
    assert SMALL.params() == 144 + 8 + 4 + 40
    # (in + out): q 8, k 6, v 6, o 8, gate 12, up 12, down 12
    assert SMALL.lora_in_out() == 64


def test_moe_shape_matches_the_published_parameter_counts():
    """Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated (embeddings included; the
    card rounds). A decode step of one token reads its 8 experts' weights; a large batch reads
    all 128."""
    shape = bench_e2e.Shape.from_config(bench_e2e.QWEN3_30B_A3B)
    embedding = shape.vocab * shape.hidden
    assert abs(shape.params() + embedding - 3.3e9) < 0.1e9
    every = shape.decode_weight_bytes(100_000) // 2
    assert abs(every + embedding - 30.5e9) < 0.05e9
    assert shape.decode_weight_bytes(1) == 2 * shape.params()
    assert shape.decode_weight_bytes(1) < shape.decode_weight_bytes(16) < 2 * every


def test_floor_hand_computed():
    reqs = [bench_e2e.Planned(prompt_len=3, output_len=3, adapter="x", rank=2),
            bench_e2e.Planned(prompt_len=2, output_len=2)]
    out = bench_e2e.floor(SMALL, reqs, peak_flops=1000.0, peak_bytes_per_s=100.0)
    assert out["dense_flops"] == 2 * 196 * 5
    assert out["attention_flops"] == 4 * 1 * 4 * (9 + 4) / 2  # 104
    assert out["lora_flops"] == 2 * 2 * 64 * 1 * 3  # rank 2, 3 prompt tokens: 768
    assert out["prefill_flops"] == 1960 + 104 + 768
    # KV bytes per token: 2 (K, V) x 1 layer x 1 head x dim 2 x 2 bytes = 8
    # step 1: both run; weights 392, adapter x 2 x 64 x 1 x 2 = 256, KV 8 x (4 + 3)
    # step 2: only the first (output 3 > 2); weights 392, adapter 256, KV 8 x 5
    assert out["decode_steps"] == 2
    assert out["decode_bytes"] == (392 + 256 + 56) + (392 + 256 + 40)
    assert out["floor_s"] == pytest.approx(2832 / 1000 + 1392 / 100)


def test_floor_counts_each_adapter_once_per_step():
    one = [bench_e2e.Planned(1, 2, "x", 2), bench_e2e.Planned(1, 2, "x", 2)]
    two = [bench_e2e.Planned(1, 2, "x", 2), bench_e2e.Planned(1, 2, "y", 2)]
    kv = 8 * (2 + 2)
    assert bench_e2e.floor(SMALL, one)["decode_bytes"] == 392 + 256 + kv
    assert bench_e2e.floor(SMALL, two)["decode_bytes"] == 392 + 2 * 256 + kv


def test_adapter_writer_loads_in_radixlora(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    path = bench_e2e.write_adapter(tmp_path / "ad", cfg, rank=4, seed=3)
    adapter = load_adapter("ad", path, ModelConfig.from_dir(model), max_rank=64)
    model_cfg = ModelConfig.from_dir(model)
    assert adapter.rank == 4
    assert set(adapter.group_ranks.values()) == {4}
    assert set(adapter.weights) == {(layer, m) for layer in range(model_cfg.num_layers)
                                    for m in LORA_MODULES}
    for (_, module), (a, b) in adapter.weights.items():
        in_dim, out_dim = model_cfg.module_shape(module)
        assert a.shape == (4, in_dim) and b.shape == (out_dim, 4)
        assert a.abs().sum() > 0 and b.abs().sum() > 0
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == list(LORA_MODULES)


def test_adapter_writer_loads_in_peft(tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = build_tiny_model(tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    path = bench_e2e.write_adapter(tmp_path / "ad", cfg, rank=4, seed=3, dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    lora = peft.PeftModel.from_pretrained(base, path)
    down = lora.base_model.model.model.layers[1].mlp.down_proj
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        want = f.get_tensor("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")
    assert torch.equal(down.lora_B["default"].weight, want)
    assert want.abs().sum() > 0


def test_checkpoint_writer_shards_and_loads(tmp_path):
    cfg = dict(bench_e2e.LLAMA3_8B, vocab_size=300, hidden_size=32, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    bench_e2e.write_checkpoint(tmp_path, cfg, "cpu", shard_bytes=20_000, tokenizer_vocab=300)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / s).is_file() for s in shards)
    from radixlora.model.loader import load_model

    model_cfg = ModelConfig.from_dir(tmp_path)
    model = load_model(tmp_path, model_cfg, torch.float32, "cpu")
    std = model.lm_head.weight.std().item()
    assert 0.015 < std < 0.025
    with safe_open(str(tmp_path / index["weight_map"]["lm_head.weight"]), framework="pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert (tmp_path / "tokenizer.json").is_file()


def run(ttft_p99: float, itl_p99: float, failed: int = 0) -> dict:
    return {"ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": ttft_p99},
            "itl_ms": {"p50": 1.0, "p90": 2.0, "p99": itl_p99}, "failed": failed}


def test_goodput_is_the_highest_rate_up_to_which_every_rate_meets_the_slo():
    slo = bench_e2e.parse_slo("ttft_p99=300,itl_p99=100")
    assert slo == {"ttft_p99": 300.0, "itl_p99": 100.0}
    runs = {8.0: run(198, 72), 16.0: run(244, 93), 24.0: run(364, 114), 32.0: run(290, 99)}
    assert bench_e2e.goodput(runs, slo) == 16.0  # 32 meets it only above a miss: noise
    assert bench_e2e.goodput({8.0: run(100, 50, failed=1)}, slo) is None
    assert bench_e2e.goodput({8.0: run(100, 50)}, {"itl_p90": 1.5}) is None
    with pytest.raises(argparse.ArgumentTypeError):
        bench_e2e.parse_slo("latency_p99=3")


def test_poisson_arrivals_split_over_processes_keep_their_times():
    arrivals = [0.5, 0.7, 1.0, 2.5, 2.6]
    gaps = [bench_e2e.process_gaps(arrivals, k, 2) for k in range(2)]
    assert gaps[0] == pytest.approx([0.5, 0.5, 1.6]) and gaps[1] == pytest.approx([0.7, 1.8])
    assert list(itertools.accumulate(gaps[0])) == pytest.approx(arrivals[0::2])


def test_half_of_the_goodput_requests_are_on_the_base_model():
    ctx = SimpleNamespace(scale=bench_e2e.TINY, vocab=100, base_name="base")
    specs = bench_e2e.sharegpt_specs(ctx, ["q0", "q1"], seed=1, n=8, base_share=0.5)
    assert [s.adapter for s in specs] == ["q0", "base", "q1", "base", "q0", "base", "q1", "base"]
    assert {s.adapter for s in bench_e2e.sharegpt_specs(ctx, [], seed=1, n=4)} == {"base"}


def test_each_launch_reads_its_own_start_up_line(tmp_path):
    """b's restarts share one server log: a launch's phase split is the line logged after it
    started, never an earlier launch's."""
    log_path = tmp_path / "server.log"
    line = "2026-12-06 18:09:31,080 [api] INFO radixlora.server.procs.launcher: ready in {} s"
    log_path.write_text(line.format("9.0") + "\n")
    server = bench_e2e.Server(tmp_path, {}, 0, [], log_path)
    assert server.phase_line() == "ready in 9.0 s"
    server.log_offset = log_path.stat().st_size  # what start() records
    with open(log_path, "a") as f:
        f.write(line.format("4.2") + "\n")
    assert server.phase_line() == "ready in 4.2 s"


def test_b_uses_its_own_compile_cache_unless_the_flags_name_one(tmp_path):
    flags = bench_e2e.with_b_cache(["--max-running", "8"], tmp_path)
    assert flags == ["--max-running", "8", "--compile-cache-dir", str(tmp_path / bench_e2e.B_CACHE)]
    mine = ["--compile-cache-dir", "/srv/cache"]
    assert bench_e2e.with_b_cache(mine, tmp_path) == mine


def test_steps_taken_in_with_the_next_are_counted_as_answered_late():
    # run 49's pattern: mixed steps about 200 ms apart, one answered at 400 ms, the next 1 ms
    # after it; the first step is an earlier run's and not counted
    steps = [[0.5, 0.2, 1, 1], [5.0, 0.2, 20, 8192], [5.2, 0.2, 36, 8192],
             [5.6, 0.4, 52, 8192], [5.601, 0.001, 68, 8192], [5.8, 0.2, 84, 8192]]
    run = {"steps": {"decode": {"steps": 2}, "mixed": {"steps": 3}}}
    together = bench_e2e.answered_together(steps, run)
    assert together == {"count": 1, "mean_late_ms": pytest.approx(400.0)}
    none = bench_e2e.answered_together(steps, {"steps": {"mixed": {"steps": 0}}})
    assert none == {"count": 0, "mean_late_ms": None}


def test_each_long_gap_is_put_down_to_a_long_step_steps_it_sat_out_or_a_stall():
    """Steps as /get_server_info's recent_steps give them: [fold time, seconds, requests,
    tokens], each running over [fold - seconds, fold]."""
    steps = [[1.00, 0.02, 8, 0], [1.30, 0.28, 6, 2054], [1.32, 0.02, 8, 0], [1.34, 0.02, 8, 0],
             [1.36, 0.02, 8, 0], [1.38, 0.02, 8, 0], [1.40, 0.02, 8, 0], [2.00, 0.02, 8, 0]]
    assert bench_e2e.gap_cause(1.31, 0.30, steps) == ("one long step", 2054)
    assert bench_e2e.gap_cause(1.40, 0.08, steps)[0] == "steps it sat out"
    assert bench_e2e.gap_cause(1.98, 0.50, steps)[0] == "no step (a host stall)"
    causes = bench_e2e.gap_causes([[1.40, 0.08], [1.31, 0.30], [1.98, 0.50]], steps)
    assert {c: v["gaps"] for c, v in causes.items()} == dict.fromkeys(bench_e2e.GAP_CAUSES, 1)
    assert causes["one long step"]["time_share"] == pytest.approx(0.30 / 0.88)
    assert causes["one long step"]["mean_step_tokens"] == 2054
    assert causes["no step (a host stall)"]["mean_step_tokens"] is None
