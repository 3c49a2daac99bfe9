"""Mixtral (8x7B, 8x22B): Mistral's attention with a mixture-of-experts MLP in every layer: a
router of num_local_experts logits, softmax, the top num_experts_per_tok experts with their
weights renormalised to sum to 1, each expert a SiLU-gated MLP (w1 gate, w3 up, w2 down,
under block_sparse_moe in the checkpoints transformers saves)."""

from radixlora.families import Family, layer_types, moe_traits, windows


def _traits(config: dict) -> dict:
    bias = bool(config.get("attention_bias", False))
    types = layer_types(config, lambda i: "sliding_attention")
    return {"qkv_bias": bias, "o_bias": bias, "layer_windows": windows(config, types),
            "norm_topk_prob": True,
            **moe_traits(config, config["num_local_experts"], lambda i: True)}


MIXTRAL = Family(
    name="Mixtral", model_types=("mixtral",), traits=_traits,
    patterns=((r"\.block_sparse_moe\.", ".mlp."),
              (r"(\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
              (r"(\.experts\.\d+)\.w3\.", r"\1.up_proj."),
              (r"(\.experts\.\d+)\.w2\.", r"\1.down_proj.")),
)
