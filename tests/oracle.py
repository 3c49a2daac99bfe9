"""transformers + PEFT reference computations for the engine tests."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(base: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def peft_model(base: Path, adapters: dict[str, Path]):
    """A PeftModel with every adapter loaded (none active until set_active)."""
    from peft import PeftModel

    names = list(adapters)
    model = PeftModel.from_pretrained(hf_model(base), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.no_grad()
def logprobs(model, token_ids: list[int], active: list[str] | None = None) -> torch.Tensor:
    """log_softmax of the logits at every position: [len(token_ids), vocab]. `active` selects
    PEFT adapters (several = their deltas summed, weights 1); None runs the base."""
    ids = torch.tensor([token_ids])
    if active is None:
        if hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                logits = model(ids).logits[0]
        else:
            logits = model(ids).logits[0]
    else:
        model.base_model.set_adapter(active)
        logits = model(ids).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@torch.no_grad()
def merged_logprobs(model, token_ids: list[int], weights: dict[str, float]) -> torch.Tensor:
    """Independent formula for weighted stacks: W' = W + sum_i w_i * s_i * B_i @ A_i merged into
    a copy of the base weights, then a plain forward with adapters disabled."""
    from peft.tuners.lora import Linear as LoraLinear

    saved = []
    for module in model.modules():
        if isinstance(module, LoraLinear):
            weight = module.base_layer.weight
            saved.append((weight, weight.detach().clone()))
            for name, w in weights.items():
                if name in module.lora_A:
                    delta = module.lora_B[name].weight @ module.lora_A[name].weight
                    weight += w * module.scaling[name] * delta
    try:
        return logprobs(model, token_ids, active=None)
    finally:
        for weight, original in saved:
            weight.copy_(original)
