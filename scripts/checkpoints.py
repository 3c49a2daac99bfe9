"""Small checkpoints for tests, benchmarks and the demo's training: Hugging Face config fields,
a byte-level BPE tokenizer, random base models and random PEFT LoRA adapters.

`build_tiny_model` and `build_tiny_adapter` write the files with safetensors alone;
`build_hf_model` and `build_peft_adapter` go through transformers and PEFT (imported when
called). Tests import this module as `scripts.checkpoints`, scripts as `checkpoints`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ("<pad>", "<s>", "</s>")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
# the projections PEFT adapters of each family target (Phi-3 keeps q/k/v and gate/up fused;
# on MoE bases radixlora serves LoRA on attention)
FAMILY_TARGETS = {"phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
                  "qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj"),
                  "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj")}
# PEFT's target_parameters of an MoE base's stacked experts (LoRA on every expert)
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# Gemma 3's multimodal checkpoint: adapters target the language model's projections only
LANGUAGE_ONLY = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
SMALL_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def model_config(arch: str = "llama", **fields) -> dict:
    """The config.json fields of a small `arch` model: SMALL_SHAPE, then `fields`."""
    return {"model_type": arch, "architectures": [ARCHITECTURES[arch]], **SMALL_SHAPE, **fields}


def hf_config(arch: str = "llama", **fields):
    """model_config(arch, **fields) as a transformers config."""
    import transformers

    fields = model_config(arch, **fields)
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer trained on `texts`, SPECIALS first (ids 0, 1, 2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# ---- safetensors only: a tiny random Llama with a tokenizer, and PEFT-format adapters --------

TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Multi-LoRA serving keeps one base model resident and many adapters beside it.",
    "A radix cache shares prefix KV between requests of the same adapter set.",
    "Legal, medical, code and support adapters answer in their own voice.",
]
TINY_CONFIG = model_config(
    "llama",
    vocab_size=512,
    intermediate_size=160,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    torch_dtype="float32",
)


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
    """A random TINY_CONFIG Llama with a tokenizer.json, in Hugging Face format."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    cfg = dict(TINY_CONFIG)
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
    build_tokenizer(TINY_CORPUS * 4, cfg["vocab_size"]).save(str(path / "tokenizer.json"))
    return path


def build_tiny_adapter(model_path: str | Path, path: str | Path, rank: int, seed: int,
                       dora: bool = False) -> Path:
    """A random rank-`rank` LoRA on every TARGETS module of a build_tiny_model checkpoint, in
    PEFT format (non-zero lora_B). dora: a DoRA adapter (use_dora), each magnitude vector the
    norms of its base rows times 1 + N(0, 0.2^2)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    g = torch.Generator().manual_seed(seed)
    base = load_file(Path(model_path) / "model.safetensors") if dora else {}
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (out_dim, in_dim) in _shapes(cfg).items():
            block = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=g) / in_dim**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=g)
            if dora:
                norms = base[f"model.layers.{layer}.{block}.{name}.weight"].norm(dim=1)
                tensors[f"{key}.lora_magnitude_vector"] = norms * (
                    1 + 0.2 * torch.randn(out_dim, generator=g))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
        "bias": "none",
        "use_rslora": False,
        "use_dora": dora,
        "base_model_name_or_path": str(model_path),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


# ---- transformers + PEFT: llama / qwen2 / mistral checkpoints and PEFT-made adapters ---------

HF_VOCAB = 256


def hf_test_config(arch: str):
    """The tests' small `arch` config: llama with llama3 rope scaling, qwen2 with tied
    embeddings, mistral with a sliding window."""
    common = dict(
        vocab_size=HF_VOCAB,
        intermediate_size=128,
        max_position_embeddings=512,
        initializer_range=0.1,
        eos_token_id=1,
        bos_token_id=0,
    )
    if arch == "llama":
        return hf_config(
            arch,
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
        return hf_config(arch, **common, tie_word_embeddings=True)
    if arch in FAMILY_CONFIGS:
        return FAMILY_CONFIGS[arch](common)
    return hf_config(arch, **common, sliding_window=24, tie_word_embeddings=False)


def _qwen3(common: dict):
    """q/k norms, a head_dim of its own (32, not hidden / heads = 16), tied embeddings."""
    return hf_config("qwen3", **common, head_dim=32, tie_word_embeddings=True)


def _gemma2(common: dict):
    """Sliding (8 tokens) and global layers, soft-capping small enough to bend the scores and
    the logits, an attention scale of its own."""
    return hf_config("gemma2", **common, head_dim=16, query_pre_attn_scalar=24,
                     sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                     layer_types=["sliding_attention", "full_attention"])


def _gemma3_text_fields(common: dict) -> dict:
    """Three layers, two sliding (8 tokens) with their own rope base, q/k norms."""
    return dict(**common, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24,
                sliding_window=8, final_logit_softcapping=3.0,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 100000.0},
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 1000.0}})


def _gemma3_text(common: dict):
    return hf_config("gemma3_text", **_gemma3_text_fields(common))


def _gemma3(common: dict):
    """The multimodal checkpoint: a gemma3_text language model beside a tiny vision tower."""
    import transformers

    text = {k: v for k, v in model_config("gemma3_text", **_gemma3_text_fields(common)).items()
            if k != "architectures"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                     eos_token_id=1, bos_token_id=0, initializer_range=0.1)


def _phi3(common: dict):
    """Phi-4-mini's partial rotary (0.75 of a head) with longrope (a short and a long factor
    list), a sliding window over every layer."""
    rotary_half = 3 * (64 // 4) // 4 // 2  # head_dim 16, 12 channels rotate
    return hf_config("phi3", **{**common, "max_position_embeddings": 512}, sliding_window=16,
                     pad_token_id=0,
                     tie_word_embeddings=False, partial_rotary_factor=0.75,
                     original_max_position_embeddings=64,
                     rope_scaling={"rope_type": "longrope",
                                   "short_factor": [1.0 + 0.1 * i for i in range(rotary_half)],
                                   "long_factor": [2.0 + 0.3 * i for i in range(rotary_half)]})


def _qwen3_moe(common: dict):
    """Three layers, the middle one a dense MLP (mlp_only_layers); 6 experts of 32 channels,
    2 per token, their weights renormalised."""
    return hf_config("qwen3_moe", **{**common, "num_hidden_layers": 3}, head_dim=32,
                     moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                     norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                     tie_word_embeddings=False)


def _mixtral(common: dict):
    """4 experts, 2 per token, a sliding window over every layer."""
    return hf_config("mixtral", **{**common, "intermediate_size": 48}, num_local_experts=4,
                     num_experts_per_tok=2, sliding_window=24, tie_word_embeddings=False)


FAMILY_CONFIGS = {"qwen3": _qwen3, "gemma2": _gemma2, "gemma3_text": _gemma3_text,
                  "gemma3": _gemma3, "phi3": _phi3, "qwen3_moe": _qwen3_moe, "mixtral": _mixtral}


def build_hf_model(path: Path, arch: str, sharded: bool = False, seed: int = 0) -> Path:
    """A random hf_test_config(arch) model saved by transformers (sharded: many small files)."""
    import transformers

    torch.manual_seed(seed)
    cls = getattr(transformers, ARCHITECTURES[arch])
    model = cls(hf_test_config(arch)).float()
    if arch == "qwen2":  # q/k/v biases start at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.1)
    model.save_pretrained(path, max_shard_size="60KB" if sharded else "5GB")
    return path


def build_peft_adapter(base_path: Path, path: Path, seed: int, **lora_kwargs) -> Path:
    """A random LoRA made and saved by PEFT (LoraConfig(**lora_kwargs), every TARGETS module
    unless given), with a non-zero lora_B: PEFT's default zero B would hide every bug. With
    use_dora=True, the magnitudes are moved off the norms PEFT initialises them to (g = 1)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    lora_kwargs.setdefault("target_modules", list(TARGETS))
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():  # init gives lora_B ~ U(-1/sqrt(r), 1/sqrt(r)); keep deltas modest
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
            if "lora_magnitude_vector" in name:  # DoRA: magnitudes moved off their init norms
                p.mul_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    assert json.loads((path / "adapter_config.json").read_text()).get("r") is not None
    return path


def build_nf4_model(path: Path, arch: str, double_quant: bool = True, seed: int = 0,
                    sharded: bool = False) -> Path:
    """build_hf_model(arch) saved as an NF4 checkpoint (save_nf4)."""
    dense = build_hf_model(Path(path).with_name(Path(path).name + "-dense"), arch, seed=seed)
    return save_nf4(dense, path, double_quant, sharded)


def save_nf4(dense: Path, path: Path, double_quant: bool = True, sharded: bool = False) -> Path:
    """The dense checkpoint at `dense` loaded by transformers with a bitsandbytes NF4 config
    (blocksize 64, bitsandbytes' own) on the CPU and saved 4-bit at `path`: packed weights,
    absmaxes and quant states as transformers writes them."""
    import transformers

    config = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        dense, quantization_config=config, dtype=torch.float32, device_map="cpu")
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "5GB")
    return Path(path)


def build_fp8_model(path: Path, dense: Path, strategy: str = "channel",
                    block: tuple[int, int] = (128, 128)) -> tuple[Path, Path]:
    """The dense checkpoint at `dense` (transformers, float32) with its projections in FP8 e4m3
    as compressed-tensors stores them (`weight` e4m3, `weight_scale` [out, 1] per channel or
    [1] per tensor, dynamic per-token activations), or for strategy "block" as Qwen's and
    DeepSeek's FP8 checkpoints do (quant_method fp8, `weight_scale_inv` per block of `block`
    [rows, columns]), and beside it (path + "-ref") the same model with those weights
    dequantized (W8 * scale, float32): its exact reference."""
    from safetensors.torch import load_file

    path, ref = Path(path), Path(str(path) + "-ref")
    tensors = load_file(str(Path(dense) / "model.safetensors"))
    fp8, dequantized = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        projection = name.endswith("_proj.weight") or re.search(r"\.experts\.\d+\.w[123]\.weight$",
                                                               name)  # Mixtral's experts
        if projection and strategy == "block":
            w8, scale, full = quantize_fp8_blocks(w, block)
            fp8[name], fp8[name + "_scale_inv"] = w8, scale
            dequantized[name] = w8.float() * full
        elif projection:
            absmax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().max()
            scale = (absmax / 448.0).float().reshape(-1, 1) if strategy == "channel" else (
                (absmax / 448.0).float().reshape(1))
            w8 = (w / scale).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale"] = w8, scale
            dequantized[name] = w8.float() * scale
    config = json.loads((Path(dense) / "config.json").read_text())
    quantization = ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                     "weight_block_size": list(block)} if strategy == "block"
                    else _compressed_tensors_fp8(strategy))
    for out, weights, qc in ((path, fp8, quantization), (ref, dequantized, None)):
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": qc}
                                                    if qc else config))
    return path, ref


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int]):
    """(W8, scales [cdiv(out, rows), cdiv(in, columns)], the scales spread over W's shape):
    each block scaled by its own absmax / 448, the last row and column blocks partial."""
    rows, cols = block
    nr, nc = -(-w.shape[0] // rows), -(-w.shape[1] // cols)
    padded = torch.zeros(nr * rows, nc * cols)
    padded[:w.shape[0], :w.shape[1]] = w.float()
    absmax = padded.view(nr, rows, nc, cols).abs().amax(dim=(1, 3))
    scale = (absmax / 448.0).clamp(min=1e-12)
    full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:w.shape[0], :w.shape[1]]
    return (w.float() / full).to(torch.float8_e4m3fn), scale, full


def _compressed_tensors_fp8(strategy: str) -> dict:
    """compressed-tensors' quantization_config of llm-compressor's FP8_DYNAMIC scheme."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "symmetric": True, "dynamic": True},
        }},
        "ignore": ["lm_head"],
    }
