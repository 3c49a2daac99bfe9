"""scripts/bench_many_adapters.py: its adapter writer (loaded back by radixlora and by
safetensors), its disk check, and the whole `--tiny` run on the CPU (a real `radixlora serve
--adapter-dir` launch, then one with --adapter flags) with every figure in its JSON."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from radixlora.config import ModelConfig
from radixlora.lora.adapter import load_adapter
from scripts import bench_many_adapters as bench
from scripts.checkpoints import TINY_CONFIG, build_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def test_adapter_writer_loads_in_radixlora(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    assert bench.write_pool(tmp_path / "pool", cfg, model, 3, 8, "cpu", 2) > 0
    assert bench.write_pool(tmp_path / "pool", cfg, model, 3, 8, "cpu", 2) == 0  # reused
    model_cfg = ModelConfig.from_dir(model)
    ids = set()
    for i in range(3):
        path = tmp_path / "pool" / bench.adapter_name(i)
        adapter = load_adapter(path.name, path, model_cfg, max_rank=64)
        ids.add(adapter.adapter_id)
        assert adapter.rank == 8
        assert set(adapter.weights) == {(layer, m) for layer in range(model_cfg.num_layers)
                                        for m in bench.QKVO}
        file = path / "adapter_model.safetensors"
        assert file.stat().st_size == bench.adapter_file_bytes(
            bench.Shape.from_config(cfg), 8)
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_tensor(key)
                assert tensor.dtype == torch.bfloat16 and tensor.abs().sum() > 0
                want = 0.01 if "lora_B" in key else tensor.shape[1] ** -0.5
                assert 0.5 * want < tensor.float().std().item() < 1.5 * want
    assert len(ids) == 3  # distinct content: the registry would alias equal adapters
    served = bench.link_serve_dir(tmp_path / "pool", tmp_path / "serve", 2)
    assert sorted(p.name for p in (tmp_path / "serve").iterdir()) == sorted(served)
    assert os.path.samefile(served["m00001"] / "adapter_model.safetensors",
                            tmp_path / "pool" / "m00001" / "adapter_model.safetensors")


def test_disk_check_refuses_what_cannot_fit(tmp_path):
    shape = bench.Shape.from_config(TINY_CONFIG)
    size = bench.adapter_file_bytes(shape, 8)
    report = bench.check_disk(tmp_path, 0, 0, 10, size, margin=0)
    # the adapters written, then in the server's state their snapshots and packed copies
    assert sum(r["need_bytes"] for r in report.values()) == 3 * 10 * size
    huge = 10**15 // size
    with pytest.raises(SystemExit, match=r"not enough disk for \d+ adapters.*At most \d+ "):
        bench.check_disk(tmp_path, 0, 0, huge, size, margin=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def numbers(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from numbers(value)
    elif isinstance(node, list):
        for value in node:
            yield from numbers(value)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield node


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out))
    cmd = [sys.executable, "scripts/bench_many_adapters.py", "--tiny", "--start-flags",
           "--work-dir", str(tmp_path / "work"), "--port", str(free_port())]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "bench_many_adapters.json").read_text())
    assert all(math.isfinite(x) for x in numbers(results))
    scale = bench.TINY
    assert results["files"]["adapters"] == scale.c_many == 24
    assert results["files"]["rank"] == 8 and results["files"]["adapter_file_bytes"] > 0
    assert results["git_commit"] and "--tiny" in results["command"]

    for key in ("start", "start_flags"):
        start = results[key]
        assert start["adapters"] == 24
        for figure in ("weights_loaded_s", "ready_s", "first_s", "listed_s", "servable_s",
                       "last_s"):
            assert start[figure] > 0
        assert min(start["first_s"], start["ready_s"]) > start["weights_loaded_s"]
        assert start["listed_s"] <= start["servable_s"]
        assert start["first_after_ready_s"] >= 0 and start["last_after_ready_s"] > 0

    host = results["host_tier"]
    assert host["host_adapter_bytes"] > 0 and host["adapter_packed_bytes"] > 0
    assert host["holds_adapters"] > 0 and host["holds_adapters_by_file_size"] > 0

    s = results["s"]
    assert s["warmup"]["requests"] == scale.s_warmup and s["warmup"]["failed"] == 0
    assert set(s["runs"]) == {str(n) for n in scale.s_counts}
    for count, run in s["runs"].items():
        assert run["requests"] == scale.s_requests and run["failed"] == 0
        assert run["output_tokens"] == scale.s_requests * scale.s_out
        assert run["output_token_throughput"] > 0 and run["ratio_to_smallest"] > 0
        assert 0 < run["distinct_adapters"] <= int(count)
        assert run["ttft_ms"]["p99"] > 0 and run["adapter_loads"] >= 0
    assert s["runs"][str(scale.s_counts[0])]["ratio_to_smallest"] == 1.0

    c = results["c"]
    assert c["many"]["adapters"] == scale.c_many and c["few"]["adapters"] == scale.c_few
    assert 0 < c["requests"] <= scale.c_max_requests and c["rate"] > 0
    assert c["source_rate"] == s["runs"][str(scale.c_many)]["request_throughput"]
    for key in ("many", "few"):
        assert c[key]["requests"] == c["requests"] and c[key]["failed"] == 0
        assert c[key]["ttft_ms"]["p99"] > 0
    assert c["ttft_p99_ratio"] > 0
    assert "TTFT P99 ratio" in proc.stdout and "output tok/s" in proc.stdout
