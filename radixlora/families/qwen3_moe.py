"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, a head_dim of its
own) with a mixture-of-experts MLP in every decoder_sparse_step-th layer outside
mlp_only_layers: a router of num_experts logits, softmax, the top num_experts_per_tok experts,
their weights renormalised when norm_topk_prob, each expert a SiLU-gated MLP of
moe_intermediate_size."""

from radixlora.families import Family, moe_traits
from radixlora.families.qwen3 import traits as qwen3_traits


def _traits(config: dict) -> dict:
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or ())
    moe = moe_traits(config, experts,
                     lambda i: experts > 0 and i not in dense and (i + 1) % step == 0)
    return {**qwen3_traits(config), **moe,
            "norm_topk_prob": bool(config.get("norm_topk_prob", False))}


QWEN3_MOE = Family(name="Qwen3-MoE", model_types=("qwen3_moe",), traits=_traits)
