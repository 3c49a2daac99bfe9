"""Tiny random checkpoints and PEFT adapters, built with transformers + PEFT (no downloads).

Every adapter has a non-zero lora_B (PEFT's default zero B would hide every bug)."""

from __future__ import annotations

import os

# CPU-only suite: Triton kernels run in the interpreter; triton reads this at kernel import.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread per process: tests start server subprocesses on a 2-core machine, where
# more threads only contend (set before torch is imported; inherited by the subprocesses).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import json  # noqa: E402
from pathlib import Path

import pytest
import torch

VOCAB = 256
ARCHS = ("llama", "qwen2", "mistral")


def _hf_config(arch: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        eos_token_id=1,
        bos_token_id=0,
    )
    if arch == "llama":
        return tf.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "rope_theta": 50000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    return tf.MistralConfig(**common, sliding_window=24, tie_word_embeddings=False)


def build_base(path: Path, arch: str, sharded: bool = False, seed: int = 0) -> Path:
    import transformers as tf

    torch.manual_seed(seed)
    cls = {
        "llama": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "mistral": tf.MistralForCausalLM,
    }[arch]
    model = cls(_hf_config(arch)).float()
    if arch == "qwen2":  # q/k/v biases start at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.1)
    model.save_pretrained(path, max_shard_size="60KB" if sharded else "5GB")
    return path


def build_adapter(base_path: Path, path: Path, seed: int, **lora_kwargs) -> Path:
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = tf.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    lora_kwargs.setdefault(
        "target_modules",
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    config = LoraConfig(init_lora_weights=False, **lora_kwargs)
    model = get_peft_model(base, config)
    with (
        torch.no_grad()
    ):  # default init gives lora_B ~ U(-1/sqrt(r), 1/sqrt(r)); keep deltas modest
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    model.save_pretrained(path)
    assert any(
        json.loads((path / "adapter_config.json").read_text()).get(k) is not None for k in ("r",)
    )
    return path


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


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_base(root / arch, arch, sharded=arch == "mistral") for arch in ARCHS}


@pytest.fixture(scope="session")
def adapters(tmp_path_factory, checkpoints) -> dict[str, dict[str, Path]]:
    """arch -> adapter name -> directory."""
    root = tmp_path_factory.mktemp("adapters")
    out: dict[str, dict[str, Path]] = {}
    for arch, base in checkpoints.items():
        out[arch] = {
            name: build_adapter(base, root / arch / name, seed=10 + i, **spec)
            for i, (name, spec) in enumerate(ADAPTER_SPECS.items())
        }
    return out


def assert_all_free(engine) -> None:
    """Every KV slot and adapter row is back: nothing running, no tree locks, and once the tree
    and the adapter pool are flushed, every page and row is on its free list."""
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
