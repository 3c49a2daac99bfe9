"""Model families: what each Hugging Face architecture changes in the one shared decoder
(radixlora.model.decoder), declared as data. A family is a Family defined at the top of one module
of this package (a module may declare related ones); ModelConfig.from_hf reads a checkpoint's
config.json through the family of its model_type, and the decoder, the loader and the adapter reader
act on the fields it sets. Nothing here imports the model: a family is a declaration, never a copy
of a model file (docs/architecture.md, "Adding a model family")."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass

from radixlora.errors import ModelLoadError


@dataclass(frozen=True)
class Family:
    """One family of checkpoints and what it changes.

    traits(config) -> the ModelConfig fields the family sets from its config.json (the text
    part for a multimodal checkpoint): norms, activation, attention scale and soft-capping,
    which layers slide and their rope, rotary dims, biases; "rope" and "local_rope" as raw
    rope parameter dicts (config.rope_config reads them).
    text_config: the key of a multimodal config whose value is the language model's config.
    renames: checkpoint name prefixes mapped to the decoder's ("model.language_model." ->
    "model."), tried in order; skip: prefixes of tensors the decoder does not keep (a vision
    tower). The same renames apply to adapter keys; then `patterns` (regex, replacement) rewrite
    names inside a key (Mixtral's block_sparse_moe.experts.N.w1 -> mlp.experts.N.gate_proj).
    fused_lora: PEFT adapters of this family target qkv_proj and gate_up_proj (one A, one B
    stacked over the modules), which load as their modules' pairs."""

    name: str
    model_types: tuple[str, ...]
    traits: Callable[[dict], dict] = lambda config: {}
    text_config: str | None = None
    renames: tuple[tuple[str, str], ...] = ()
    skip: tuple[str, ...] = ()
    fused_lora: bool = False
    patterns: tuple[tuple[str, str], ...] = ()

    def rename(self, name: str) -> str | None:
        """A checkpoint (or adapter) tensor name as the decoder names it; None: not kept."""
        for prefix in self.skip:
            if name.startswith(prefix):
                return None
        for old, new in self.renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        for pattern, replacement in self.patterns:
            name = re.sub(pattern, replacement, name)
        return name


def layer_types(config: dict, default: Callable[[int], str]) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention": config.json's layer_types
    (transformers 5 writes them), else `default(layer)` (how older configs said it)."""
    types = config.get("layer_types")
    if types is not None:
        return list(types)
    return [default(i) for i in range(config["num_hidden_layers"])]


def windows(config: dict, types: list[str]) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: global attention)."""
    window = config.get("sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)


def moe_traits(config: dict, num_experts: int, moe_layer: Callable[[int], bool]) -> dict:
    """The ModelConfig fields of a mixture-of-experts config: `num_experts` per MoE layer,
    `moe_layer(i)` whether layer i is one."""
    return {"num_experts": num_experts, "experts_per_token": config["num_experts_per_tok"],
            "moe_intermediate_size": config.get("moe_intermediate_size")
            or config["intermediate_size"],
            "moe_layers": tuple(moe_layer(i) for i in range(config["num_hidden_layers"]))}


def _families() -> dict[str, Family]:
    out = {}
    for module in pkgutil.iter_modules(__path__):
        for family in vars(importlib.import_module(f"{__name__}.{module.name}")).values():
            if isinstance(family, Family):
                out.update(dict.fromkeys(family.model_types, family))
    return out


FAMILIES: dict[str, Family] = _families()


def family_for(model_type: str) -> Family:
    """The family serving `model_type`; ModelLoadError naming the supported ones and the
    closest match otherwise."""
    family = FAMILIES.get(model_type)
    if family is not None:
        return family
    close = difflib.get_close_matches(model_type, FAMILIES, n=1, cutoff=0.5)
    hint = f"; the closest is {close[0]!r}" if close else ""
    raise ModelLoadError(f"unsupported model_type {model_type!r}; supported: "
                         f"{sorted(FAMILIES)}{hint}")
