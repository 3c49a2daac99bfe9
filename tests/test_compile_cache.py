"""The compile cache's bookkeeping (radixlora.worker.compile_cache) on the CPU: manifests, the
Triton hook in recording and dry-run modes, the compile processes' protocol, and the start-up phase
line. Triton compiles nothing on the CPU, so here Triton's side is the hook's arguments and
preload(); the cache hits themselves show on a GPU as a restart's compile phase of 0.0 s in the
start-up line (docs/PERF.md, "Start-up")."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
from triton import knobs

import radixlora
import radixlora_kernels
from radixlora.config import EngineConfig, ModelConfig
from radixlora.demo import DEMO_MODEL_DIR
from radixlora.startup import phase_line
from radixlora.worker import compile_cache
from radixlora.worker.compile_cache import (
    SCHEDULER_FIELDS,
    KernelCache,
    config_key,
    manifest_key,
)
from radixlora.worker.model_runner import ModelRunner


def hook_args(name: str, data: str) -> dict:
    """What Triton passes jit_cache_hook for a variant (the fields KernelCache reads)."""
    fn = types.SimpleNamespace(module="radixlora_kernels.fake", name=name, jit_function=None)
    return {"key": data, "repr": f"{name}[...]", "fn": fn,
            "compile": {"specialization_data": data}, "is_manual_warmup": False,
            "already_compiled": False}


class FakeCompiler:
    """Stands in for a compile process: keeps what it is sent."""

    sent: list = []

    def __init__(self):
        self.pending = 0
        self.input_open = True
        self.exited = threading.Event()  # set: the process has exited
        self.exited.set()
        self.proc = types.SimpleNamespace(wait=self.exited.wait)

    def send(self, entry) -> None:
        FakeCompiler.sent.append(entry)

    def wait(self) -> None:
        pass

    def end_input(self) -> None:
        self.input_open = False


@pytest.fixture
def preloaded(monkeypatch):
    """Every (module, name, data) preloaded in this process, in order; no compile process."""
    calls = []

    def jit_function(module, qualname):
        return types.SimpleNamespace(preload=lambda data: calls.append((module, qualname, data)))

    monkeypatch.setattr(compile_cache, "_jit_function", jit_function)
    monkeypatch.setattr(compile_cache, "_Compiler", FakeCompiler)
    FakeCompiler.sent = []
    saved = knobs.runtime.jit_cache_hook
    yield calls
    knobs.runtime.jit_cache_hook = saved


def test_config_key_is_the_same_for_serve_warmup_and_the_engine():
    config = EngineConfig(max_rank=32)
    engine_cfg = ModelConfig.from_dir(DEMO_MODEL_DIR).served(config)
    server_cfg = dataclasses.replace(engine_cfg, base_roots=(str(DEMO_MODEL_DIR),))
    server_config = dataclasses.replace(config, host_adapter_bytes=1 << 30,
                                        compile_cache_dir="/elsewhere", seed=7,
                                        lora_target_modules=("q_proj",), start_adapter_rows=800,
                                        start_adapter_rank=16)
    key = config_key(engine_cfg, config, "NVIDIA H200")
    assert config_key(server_cfg, server_config, "NVIDIA H200") == key
    assert config_key(engine_cfg, EngineConfig(max_rank=64), "NVIDIA H200") != key
    assert config_key(engine_cfg, config, "NVIDIA H100") != key


def test_flags_that_only_choose_among_variants_share_one_manifest():
    """A running limit, a memory share, a rank limit: one manifest (and a config key each); a
    dtype, a KV cache dtype, a backend or another device: another."""
    model = ModelConfig.from_dir(DEMO_MODEL_DIR)
    base = EngineConfig()
    key = manifest_key(model, base, "NVIDIA H100")
    same = [dataclasses.replace(base, **change) for change in (
        {"max_running": 64}, {"gpu_memory_utilization": 0.5}, {"max_rank": 16},
        {"cuda_graph": False}, {"max_batch_tokens": 2048})]
    assert {manifest_key(model, c, "NVIDIA H100") for c in same} == {key}
    assert len({config_key(model, c, "NVIDIA H100") for c in [base, *same]}) == len(same) + 1
    other = [dataclasses.replace(base, **change) for change in (
        {"dtype": "float16"}, {"kv_cache_dtype": "fp8"}, {"lora_dtype": "int8"},
        {"attention_backend": "torch"})]
    assert key not in {manifest_key(model, c, "NVIDIA H100") for c in other}
    assert manifest_key(model, base, "NVIDIA H200") != key


def test_flags_the_scheduler_alone_reads_keep_the_config_key():
    """A cache switch, an inter-token target, a cap on adapter sets per batch, grammar limits:
    the worker runs the same kernels, so a launch changing only these needs no dry run; and
    no code outside the scheduler (and the config that defines them) reads them."""
    model = ModelConfig.from_dir(DEMO_MODEL_DIR)
    base = EngineConfig()
    changed = dataclasses.replace(base, enable_radix_cache=False, itl_target_ms=50.0,
                                  max_adapter_sets_per_batch=4, grammar_compile_timeout=3.0,
                                  grammar_compile_memory_mb=256)
    assert config_key(model, changed, "NVIDIA H100") == config_key(model, base, "NVIDIA H100")
    assert {f: getattr(changed, f) != getattr(base, f) for f in SCHEDULER_FIELDS} \
        == dict.fromkeys(SCHEDULER_FIELDS, True)
    root = Path(radixlora.__file__).parent
    sources = [*root.rglob("*.py"), *Path(radixlora_kernels.__file__).parent.rglob("*.py")]
    readers = {f: sorted(str(p.relative_to(root.parent)) for p in sources
                         if re.search(rf"\.{f}\b", p.read_text())) for f in SCHEDULER_FIELDS}
    allowed = ("radixlora/sched/", "radixlora/config.py")
    assert {f: [p for p in paths if not p.startswith(allowed)] for f, paths in readers.items()} \
        == {f: [] for f in SCHEDULER_FIELDS}


def test_a_changed_flag_reuses_the_manifest_and_compiles_only_what_it_adds(tmp_path,
                                                                           preloaded):
    """Flags A record two variants; flags B (the same manifest) preload them, dry-run once
    (B is not covered yet) and send only the variant A never launched to the compile
    processes; then B is covered too and a third start with B or A does no dry run."""
    first = KernelCache(tmp_path, "k", processes=2, config="A")
    first.start_recording()
    hook = knobs.runtime.jit_cache_hook
    hook(**hook_args("rmsnorm", '{"a": 1}'))
    hook(**hook_args("sgmv", '{"b": 2}'))
    first.stop_recording(warn_late=False)
    first.save()
    changed = KernelCache(tmp_path, "k", processes=2, config="B")
    assert len(changed.known) == 2 and not changed.covers_config
    changed.start_recording()
    with changed.dry_run():  # the two known variants are loaded: Triton asks about the new one
        assert knobs.runtime.jit_cache_hook(**hook_args("sgmv", '{"b": 16}')) is True
    assert [e[2] for e in FakeCompiler.sent] == ['{"b": 16}']
    changed.finish()
    changed.stop_recording(warn_late=False)
    changed.save()
    for config in ("A", "B"):
        again = KernelCache(tmp_path, "k", processes=2, config=config)
        assert again.covers_config and len(again.known) == 3


def test_recorded_variants_become_the_manifest_a_later_start_preloads(tmp_path, preloaded):
    first = KernelCache(tmp_path, "k", processes=4)
    assert not first.known
    first.start_recording()
    hook = knobs.runtime.jit_cache_hook
    assert hook(**hook_args("rmsnorm", '{"a": 1}')) is None  # recorded, compiled as usual
    assert hook(**hook_args("rmsnorm", '{"a": 1}')) is None
    assert hook(**hook_args("sgmv", '{"b": 2}')) is None
    first.stop_recording(warn_late=False)
    first.save()
    assert knobs.runtime.jit_cache_hook is None

    again = KernelCache(tmp_path, "k", processes=4)
    assert len(again.known) == 2
    (tmp_path / "triton").mkdir()
    for i in range(2):  # the cache directory holds as many compiled kernels
        (tmp_path / "triton" / f"kernel{i}").mkdir()
    again.start()  # loads on a thread, no compile process
    assert again.finish() == 2
    assert sorted(name for _, name, _ in preloaded) == ["rmsnorm", "sgmv"]
    assert FakeCompiler.sent == []


def test_manifest_without_its_compiled_kernels_goes_to_the_compile_processes(tmp_path,
                                                                             preloaded):
    cache = KernelCache(tmp_path, "k", processes=2)
    cache.start_recording()
    knobs.runtime.jit_cache_hook(**hook_args("rmsnorm", '{"a": 1}'))
    cache.stop_recording(warn_late=False)
    cache.save()
    mounted = KernelCache(tmp_path, "k", processes=2)  # the triton/ directory is empty
    mounted.start()
    assert [e[1] for e in FakeCompiler.sent] == ["rmsnorm"]
    assert mounted.finish() == 1 and [c[1] for c in preloaded] == ["rmsnorm"]


def test_dry_run_sends_each_new_variant_once_and_skips_its_launch(tmp_path, preloaded):
    cache = KernelCache(tmp_path, "k", processes=3)
    cache.start_recording()
    hook = knobs.runtime.jit_cache_hook
    with cache.dry_run():
        assert hook(**hook_args("attention", '{"t": 16}')) is True  # not compiled, not run
        assert hook(**hook_args("attention", '{"t": 16}')) is True
        assert hook(**hook_args("attention", '{"t": 32}')) is True
    assert hook(**hook_args("sampler", '{"v": 1}')) is None  # outside: compiled as usual
    assert [e[2] for e in FakeCompiler.sent] == ['{"t": 16}', '{"t": 32}']
    assert cache.finish() == 2
    cache.stop_recording(warn_late=True)
    cache.save()
    assert len(KernelCache(tmp_path, "k", 1).known) == 3


def test_warm_up_ends_without_waiting_for_the_compile_processes_to_exit(tmp_path, preloaded):
    cache = KernelCache(tmp_path, "k", processes=3)
    cache.start()  # no manifest: the compile processes start
    compilers = list(cache.compilers)
    assert len(compilers) == 3
    for compiler in compilers:
        compiler.exited.clear()
    cache.finish()
    before = set(threading.enumerate())
    cache.stop_recording(warn_late=False)  # returns while none of them has exited
    assert cache.compilers == [] and not any(c.input_open for c in compilers)
    (reaper,) = [t for t in set(threading.enumerate()) - before if t.name == "compile-exits"]
    assert reaper.is_alive()
    for compiler in compilers:
        compiler.exited.set()
    reaper.join(5)
    assert not reaper.is_alive()


def test_a_compile_after_warm_up_is_logged(tmp_path, preloaded, caplog):
    cache = KernelCache(tmp_path, "k", processes=1)
    cache.start_recording()
    cache.stop_recording(warn_late=True)
    with caplog.at_level(logging.WARNING, logger="radixlora.worker.compile_cache"):
        assert knobs.runtime.jit_cache_hook(**hook_args("late", "{}")) is None
        data = json.dumps({"signature": {"x_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"},
                           "constant_keys": [[2]], "constant_vals": [64],
                           "attrs_keys": [[0], [1]],
                           "attrs_vals": [[["tt.divisibility", 16]], [["tt.divisibility", 16]]]})
        assert knobs.runtime.jit_cache_hook(**hook_args("later", data)) is None
    assert "compiled after warm-up: late({})" in caplog.text
    assert ("compiled after warm-up: later(constants {'BLOCK': 64}; specialized "
            "{'x_ptr': [['tt.divisibility', 16]], 'n': [['tt.divisibility', 16]]})") in caplog.text


def test_a_damaged_manifest_is_ignored(tmp_path):
    (tmp_path / compile_cache.MANIFESTS).mkdir()
    (tmp_path / compile_cache.MANIFESTS / "k.json").write_text('{"version": 1, "kernels": [1')
    damaged = KernelCache(tmp_path, "k", 1, config="A")
    assert not damaged.known and not damaged.covers_config


def test_compile_process_answers_every_variant_even_one_it_cannot_compile(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiler = compile_cache._Compiler()
    compiler.send(("radixlora_kernels.no_such_module", "kernel", "{}"))
    compiler.send(("radixlora_kernels.rmsnorm", "no_such_kernel", "{}"))
    compiler.wait()
    assert compiler.pending == 0
    compiler.end_input()
    assert compiler.proc.wait() == 0


def test_cache_dir_flag_points_triton_there(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    root = compile_cache.use_cache_dir(tmp_path / "cc")
    assert root == tmp_path / "cc" and root.is_dir()
    assert knobs.cache.dir == str(tmp_path / "cc" / "triton")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache.use_cache_dir(None) == tmp_path / "xdg" / "radixlora" / "compile"
    assert knobs.cache.dir == str(tmp_path / "mine")  # the user's own Triton cache stays


def test_phase_line_splits_the_time_to_ready():
    line = phase_line(30.0, {"weights": 4.0, "graphs": 9.5, "compile": 0.2, "adapters": 1.0})
    assert line == ("ready in 30.0 s: weights 4.0 s, compile 0.2 s, graphs 9.5 s, "
                    "adapters 1.0 s, other 15.3 s")


def test_a_servers_phases_name_its_process_starts_and_the_wait_for_the_others():
    from radixlora.server.procs.launcher import launch_phases

    children = types.SimpleNamespace(workers=("worker",),
                               ready_at={"worker": 20.0, "scheduler": 21.5, "tokenizer": 19.0})
    phases = {**launch_phases(0.7, children), "imports": 2.1, "weights": 4.0, "graphs": 3.0,
              "pipeline": 0.4}
    assert phases["processes"] == 1.5  # the scheduler came 1.5 s after the worker
    assert phase_line(12.0, phases) == (
        "ready in 12.0 s: launch 0.7 s, imports 2.1 s, weights 4.0 s, graphs 3.0 s, "
        "processes 1.5 s, pipeline 0.4 s, other 0.3 s")
    early = types.SimpleNamespace(workers=("worker",), ready_at={"worker": 20.0, "scheduler": 18.0})
    assert launch_phases(None, early) == {"processes": 0.0}


def test_nested_phases_are_not_counted_twice(monkeypatch):
    clock = iter([0.0, 1.0, 3.0, 10.0, 10.0, 11.0])
    monkeypatch.setattr("radixlora.worker.model_runner.time.perf_counter", lambda: next(clock))
    runner = ModelRunner.__new__(ModelRunner)
    runner.phases = {}
    with runner.phase("sizing"), runner.phase("compile"):  # 0 .. 10, compile 1 .. 3
        pass
    with runner.phase("compile"):  # 10 .. 11
        pass
    assert runner.phases == {"sizing": 8.0, "compile": 3.0}


def test_engine_start_ends_with_the_phase_line(caplog):
    from radixlora import Engine

    with caplog.at_level(logging.INFO, logger="radixlora.engine"):
        Engine(DEMO_MODEL_DIR)
    line = [r.message for r in caplog.records if r.name == "radixlora.engine"][-1]
    assert line.startswith("ready in ") and "weights" in line and "other" in line


class FakeGraphs:
    def __init__(self, keys: int):
        self.left = list(range(keys))
        self.captured: list[int] = []

    def pending(self) -> list[int]:
        return self.left

    def capture_next(self) -> bool:
        self.captured.append(self.left.pop(0))
        return bool(self.left)


def test_worker_captures_left_graphs_only_after_it_has_been_idle_a_while():
    from radixlora.server.procs.worker_proc import IdleCapture

    graphs = FakeGraphs(2)
    idle = IdleCapture(graphs)
    assert idle.poll_ms(250) == IdleCapture.POLL_MS
    idle.step(True, 10.0)
    idle.step(True, 10.1)  # idle, but not long enough
    idle.step(False, 10.15)  # a step: the wait starts again
    idle.step(True, 10.2)
    idle.step(True, 10.3)
    assert graphs.captured == []
    idle.step(True, 10.4)
    idle.step(True, 10.5)
    assert graphs.captured == [0, 1] and not idle.left
    assert idle.poll_ms(250) == 250
    idle.step(True, 20.0)  # nothing left: no capture asked for
    assert graphs.captured == [0, 1]
    nothing = IdleCapture(None)
    nothing.step(True, 0.0)
    nothing.step(True, 1.0)
    assert not nothing.left


def test_a_torch_without_bytecode_gets_it_under_the_cache_once(tmp_path, monkeypatch):
    """Where the installed torch has no bytecode beside its sources, the server's processes
    read and write theirs under the compile cache, and `radixlora warmup` writes it there
    ahead; a subprocess with that environment then imports the module from that bytecode."""
    source = tmp_path / "site" / "fake_torch_root.py"
    source.parent.mkdir()
    source.write_text("VALUE = 41 + 1\n")
    spec = importlib.util.spec_from_file_location("torch", source)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    root = tmp_path / "cache"
    env = compile_cache.bytecode_env(root)
    assert env == {"PYTHONPYCACHEPREFIX": str(root / "pycache")}
    module = types.ModuleType("fake_torch_root")
    module.__file__ = str(source)
    assert compile_cache.write_bytecode(root, [module, types.ModuleType("builtin")]) == 1
    written = list((root / "pycache").rglob("fake_torch_root*.pyc"))
    assert len(written) == 1 and not (source.parent / "__pycache__").exists()
    stamp = written[0].stat().st_mtime_ns
    run = subprocess.run([sys.executable, "-c", "import fake_torch_root as m; print(m.VALUE)"],
                         env={**os.environ, **env, "PYTHONPATH": str(source.parent)},
                         capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "42" and written[0].stat().st_mtime_ns == stamp
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert compile_cache.bytecode_env(root) == {}
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path / "elsewhere"))
    assert compile_cache.bytecode_env(root) == {}


def test_each_idle_turn_is_half_a_graph_capture():
    """capture_next alternates a graph's eager pass and its capture (without a second eager
    pass), so a request arriving during an idle turn waits for half a capture at most."""
    from radixlora.worker.cuda_graph import CudaGraphRunner, GraphKey

    class Turns:
        warmed = None

        def __init__(self, keys):
            self.left, self.calls = list(keys), []

        def pending(self):
            return list(self.left)

        def _reset_inputs(self, key):
            pass

        def _warm_pass(self, key):
            self.calls.append(("eager", key))

        def _capture(self, key, warm=True):
            self.calls.append(("capture", key, warm))
            self.left.remove(key)

    keys = [GraphKey(2, 32, 0), GraphKey(4, 64, 0)]
    graphs = Turns(keys)
    remaining = [CudaGraphRunner.capture_next(graphs) for _ in range(4)]
    assert remaining == [True, True, True, False]
    assert graphs.calls == [("eager", keys[0]), ("capture", keys[0], False),
                            ("eager", keys[1]), ("capture", keys[1], False)]
    assert CudaGraphRunner.capture_next(graphs) is False
