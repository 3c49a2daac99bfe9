"""Llama, Mistral and Qwen2: the decoder as it is (RMSNorm, SiLU-gated MLP, rotary on the whole
head). Mistral slides a window over every layer; Qwen2 has biases on q, k and v, and slides
from max_window_layers on when use_sliding_window."""

from radixlora.families import Family, layer_types, windows


def _traits(config: dict) -> dict:
    model_type = config["model_type"]
    bias = bool(config.get("attention_bias", False))
    if model_type == "qwen2":
        slide = config.get("use_sliding_window", False)
        types = layer_types(config, lambda i: "sliding_attention" if slide and i >= config.get(
            "max_window_layers", 0) else "full_attention")
        return {"qkv_bias": True, "o_bias": False, "layer_windows": windows(config, types)}
    types = layer_types(config, lambda i: "sliding_attention")
    return {"qkv_bias": bias, "o_bias": bias, "layer_windows": windows(config, types)}


LLAMA = Family(name="Llama", model_types=("llama", "mistral", "qwen2"), traits=_traits)
