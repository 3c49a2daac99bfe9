"""Gemma 2 and Gemma 3 (gemma2, gemma3_text, and the language model of a multimodal gemma3
checkpoint). What differs from Llama: RMSNorm scales by (1 + weight); a norm after attention
and after the MLP besides the ones before (sandwich norms); GELU-tanh gating; embeddings scaled
by sqrt(hidden_size); attention scaled by query_pre_attn_scalar^-0.5; sliding-window layers
interleaved with global ones (Gemma 2: every other one; Gemma 3: five in six, with a rope base of
their own); logit soft-capping of attention scores (Gemma 2) and of the final logits; Gemma 3
normalises each head of q and k."""

from radixlora.families import Family, layer_types, windows

VISION = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
          "multi_modal_projector.")


def _common(config: dict, types: list[str]) -> dict:
    bias = bool(config.get("attention_bias", False))
    activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    return {
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "activation": "gelu_tanh" if activation in ("gelu_pytorch_tanh", "gelu") else activation,
        "embed_scale": True,
        "qkv_bias": bias,
        "o_bias": bias,
        "attn_scale": config.get("query_pre_attn_scalar", config["head_dim"]) ** -0.5,
        "attn_softcap": config.get("attn_logit_softcapping"),
        "final_softcap": config.get("final_logit_softcapping"),
        "layer_windows": windows(config, types),
        "tie_word_embeddings": config.get("tie_word_embeddings", True),
    }


def _gemma2(config: dict) -> dict:
    return _common(config, layer_types(config, lambda i: "full_attention" if i % 2
                                       else "sliding_attention"))


def _gemma3(config: dict) -> dict:
    pattern = config.get("sliding_window_pattern", 6)
    types = layer_types(config, lambda i: "sliding_attention" if (i + 1) % pattern
                        else "full_attention")
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: rope parameters per layer type
        rope, local = params["full_attention"], params["sliding_attention"]
    else:
        rope = {**(config.get("rope_scaling") or {}),
                "rope_theta": config.get("rope_theta", 1_000_000.0)}
        local = {"rope_type": "default",
                 "rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    traits = {**_common(config, types), "qk_norm": True, "rope": rope, "local_rope": local}
    if config["model_type"] == "gemma3":  # transformers' multimodal model never caps logits
        traits["final_softcap"] = None
    return traits


GEMMA_2 = Family(name="Gemma 2", model_types=("gemma2",), traits=_gemma2)
GEMMA_3 = Family(
    name="Gemma 3", model_types=("gemma3_text", "gemma3"), traits=_gemma3,
    text_config="text_config",
    renames=(("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head.")),
    skip=VISION,
)
