"""Qwen3 (dense, every size): the Llama decoder with an RMSNorm over each head of q and k
before rotary (q_norm, k_norm), a head_dim of its own (not hidden / heads), tied embeddings in
the small sizes, and a sliding window from max_window_layers on when use_sliding_window."""

from radixlora.families import Family, layer_types, windows


def traits(config: dict) -> dict:
    slide = config.get("use_sliding_window", False)
    types = layer_types(config, lambda i: "sliding_attention" if slide and i >= config.get(
        "max_window_layers", 0) else "full_attention")
    bias = bool(config.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True,
            "layer_windows": windows(config, types)}


QWEN3 = Family(name="Qwen3", model_types=("qwen3",), traits=traits)
