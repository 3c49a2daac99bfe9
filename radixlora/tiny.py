"""A tiny random Llama checkpoint with a byte-level BPE tokenizer and PEFT adapters, written in
Hugging Face / PEFT format with safetensors alone (no transformers needed). Used by the quick-start
demo until the bundled trained demo model exists."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Multi-LoRA serving keeps one base model resident and many adapters beside it.",
    "A radix cache shares prefix KV between requests of the same adapter set.",
    "Legal, medical, code and support adapters answer in their own voice.",
]

CONFIG = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=512,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok


def _shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


def build_tiny_model(path: str | Path, seed: int = 0) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    cfg = dict(CONFIG)
    tensors = {
        "model.embed_tokens.weight": torch.randn(
            cfg["vocab_size"], cfg["hidden_size"], generator=g
        ),
        "model.norm.weight": torch.ones(cfg["hidden_size"]),
        "lm_head.weight": 0.1 * torch.randn(cfg["vocab_size"], cfg["hidden_size"], generator=g),
    }
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for name, shape in _shapes(cfg).items():
            block = "self_attn" if name[0] in "qkvo" else "mlp"
            tensors[f"{prefix}.{block}.{name}.weight"] = 0.1 * torch.randn(*shape, generator=g)
        tensors[f"{prefix}.input_layernorm.weight"] = torch.ones(cfg["hidden_size"])
        tensors[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(cfg["hidden_size"])
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    build_tokenizer(cfg["vocab_size"]).save(str(path / "tokenizer.json"))
    return path


def build_tiny_adapter(model_path: str | Path, path: str | Path, rank: int, seed: int) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (out_dim, in_dim) in _shapes(cfg).items():
            block = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=g) / in_dim**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=g)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
        "bias": "none",
        "use_rslora": False,
        "base_model_name_or_path": str(model_path),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path
