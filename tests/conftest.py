"""Session fixtures: tiny random llama / qwen2 / mistral checkpoints and PEFT adapters for each
(scripts/checkpoints.py, no downloads), and the free-resources check."""

from __future__ import annotations

import os

# CPU-only suite: Triton kernels run in the interpreter; triton reads this at kernel import.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread per process: tests start server subprocesses on a 2-core machine, where
# more threads only contend (set before torch is imported; inherited by the subprocesses).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from scripts.checkpoints import build_hf_model, build_peft_adapter  # noqa: E402

ARCHS = ("llama", "qwen2", "mistral")


ADAPTER_SPECS = {
    "a": dict(r=8, lora_alpha=16),
    "b": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
    "c": dict(r=16, lora_alpha=8, use_rslora=True),
    "d": dict(
        r=64,
        lora_alpha=32,
        rank_pattern={"q_proj": 4, "down_proj": 8},
        alpha_pattern={"down_proj": 64},
        layers_to_transform=[1],
    ),
}


@pytest.fixture(scope="session", autouse=True)
def private_cache_dir(tmp_path_factory):
    """The adapter hash cache of the suite and of the servers it starts (they inherit the
    environment) lives in the session's temporary directory, never in ~/.cache."""
    previous = os.environ.get("RADIXLORA_CACHE_DIR")
    os.environ["RADIXLORA_CACHE_DIR"] = str(tmp_path_factory.mktemp("radixlora-cache"))
    yield
    if previous is None:
        del os.environ["RADIXLORA_CACHE_DIR"]
    else:
        os.environ["RADIXLORA_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_hf_model(root / arch, arch, sharded=arch == "mistral") for arch in ARCHS}


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, checkpoints) -> dict[str, dict[str, Path]]:
    """arch -> adapter name -> directory."""
    root = tmp_path_factory.mktemp("adapters")
    out: dict[str, dict[str, Path]] = {}
    for arch, base in checkpoints.items():
        out[arch] = {
            name: build_peft_adapter(base, root / arch / name, seed=10 + i, **spec)
            for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
        }
    return out


def assert_all_free(engine) -> None:
    """Every KV slot and adapter row is back: nothing running, no tree locks, and once the tree
    and the adapter pool are flushed, every page and row is on its free list; every region of
    the runner's output staging ring (when it has one) has been read."""
    outputs = engine.runner.host_outputs
    if outputs is not None:
        assert all(fence.query() for _, _, fence in outputs.regions)
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    tree = sched.tree
    if tree is not None:
        assert tree.protected_size() == 0
        assert sched.kv.free_tokens() + tree.total_size() == sched.kv.capacity_tokens
    sched.flush_cache()
    assert sched.kv.free_tokens() == sched.kv.capacity_tokens
    residency = sched.residency
    assert all(entry.refs == 0 for entry in residency.resident.values())
    for adapter_id in list(residency.resident):
        assert residency.evict(adapter_id)
    assert residency.rows.num_free() == residency.rows.num_rows
