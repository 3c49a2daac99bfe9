"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini (phi3): checkpoints and PEFT adapters keep q, k, v fused
(qkv_proj) and gate and up fused (gate_up_proj); rotary covers the first
partial_rotary_factor of each head (Phi-4-mini: 0.75); the 128k variants scale rope with
longrope; a sliding window over every layer where the config sets one."""

from radixlora.families import Family, layer_types, windows


def _traits(config: dict) -> dict:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    types = layer_types(config, lambda i: "sliding_attention")
    return {"rotary_dim": int(head_dim * partial), "layer_windows": windows(config, types)}


PHI3 = Family(name="Phi-3", model_types=("phi3",), traits=_traits, fused_lora=True)
