"""Hugging Face checkpoint loading: config.json + model.safetensors (or sharded with
model.safetensors.index.json) into the fused-projection model. Checkpoint naming quirks live
here, not in the model."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from radixlora.config import LORA_MODULES, ModelConfig, checkpoint_quantization
from radixlora.distributed import COLUMN_MODULES, Shard, TensorParallel
from radixlora.errors import ModelLoadError
from radixlora.model.checkpoint_files import weight_files
from radixlora.model.decoder import CausalLM
from radixlora.model.parallel import row_parallel_projections, shard_model, whole_row_absmax
from radixlora.model.quant import (
    NF4Linear,
    NF4Weight,
    attach_scratch,
    check_nf4_cut,
    nf4_from_bnb,
    nf4_modules,
    quantize_projections,
)
from radixlora.model.quant_fp8 import (
    Fp8Linear,
    attach_fp8_path,
    dequantize_fp8,
    fp8_block,
    fp8_experts,
    fp8_experts_supported,
    fp8_modules,
    fp8_projections,
    fp8_scheme,
    row_block_scales,
)
from radixlora.model.weight_reader import WeightReader, stored_tensors

log = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.(weight|bias)$")
# one expert's projection, as transformers saves MoE checkpoints (Mixtral's after its renames)
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_BNB_PART = re.compile(
    r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.\w+_proj\.weight)"
    r"(?:\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\.bitsandbytes__nf4))?$"
)
_FP8_PART = re.compile(
    r"^(model\.layers\.\d+\.(?:self_attn|mlp)\.(?:experts\.\d+\.)?\w+_proj)\."
    r"(weight|weight_scale|weight_scale_inv|input_scale)$"
)
AT_LOAD_BLOCKSIZE = 64  # --quantization nf4: bitsandbytes' default blocksize
_FUSED = {
    "q": ("qkv_proj", 0),
    "k": ("qkv_proj", 1),
    "v": ("qkv_proj", 2),
    "gate": ("gate_up_proj", 0),
    "up": ("gate_up_proj", 1),
}


def load_model(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device,
               load_format: str = "safetensors",
               tp: TensorParallel | None = None) -> CausalLM:
    """The model of the checkpoint at `path` (shape `cfg`); with `tp`, this rank's shard of it:
    each tensor is sliced as it is read, so no rank holds the whole model. cfg.quantization
    "nf4" / "fp8": a checkpoint stored so keeps its projections NF4 (bitsandbytes) / FP8; a
    dense one's are quantized after loading (NF4: bitsandbytes' default blocksize, no double
    quantization; FP8: e4m3 with a scale per output channel). Under tensor parallel each rank's
    quantized weights are its slices of the single-device ones (NF4: where they are whole
    blocks, else ModelLoadError)."""
    path = Path(path)
    shard = tp.shard if tp is not None else None
    stored = _stored_format(path, load_format)
    blocksize = _nf4_blocksize(path) if stored == "nf4" else None
    _check_servable(path, cfg, stored, tp, blocksize or AT_LOAD_BLOCKSIZE, torch.device(device))
    if shard is not None:
        cfg = shard.local
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)
        if blocksize is not None:
            model = nf4_modules(model, blocksize)
        if stored == "fp8":
            model = fp8_modules(model, _fp8_block(path))
            if cfg.is_moe and tp is None and fp8_experts_supported(torch.device(device)):
                model = fp8_experts(model, _fp8_block(path))
        if tp is not None:
            model = shard_model(model, tp)
    model = model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for rotary in model.rotaries():
        rotary.reset_parameters()
    if load_format == "dummy":
        model = _randomize(model)
    elif load_format == "safetensors":
        _load_weights(model, cfg, path, shard)
    else:
        raise ModelLoadError(f"unknown load_format {load_format!r}: safetensors or dummy")
    if cfg.quantization is not None and stored is None:
        model = _quantize_at_load(model, cfg.quantization, tp)
    attach_scratch(model, dtype, device)
    attach_fp8_path(model, device)
    return model.eval()


def _stored_format(path: Path, load_format: str) -> str | None:
    """The weight format the checkpoint's config.json declares (None: dense, or no checkpoint)."""
    if load_format != "safetensors":
        return None
    config = json.loads((path / "config.json").read_text())
    return checkpoint_quantization(config.get("quantization_config"))


def _quantize_at_load(model: CausalLM, quantization: str,
                      tp: TensorParallel | None) -> CausalLM:
    """The loaded dense projections quantized (--quantization); under tensor parallel o and down
    made row-parallel again, FP8 rows scaled by the absmax of the whole row (every rank's)."""
    if quantization == "nf4":
        model = quantize_projections(model, AT_LOAD_BLOCKSIZE)
    else:
        model = fp8_projections(model, whole_row_absmax if tp is not None else None)
    return model if tp is None else row_parallel_projections(model, tp)


def _check_servable(path: Path, cfg: ModelConfig, stored: str | None,
                     tp: TensorParallel | None, blocksize: int, device) -> None:
    if cfg.is_moe and cfg.quantization is not None and stored != "fp8":
        raise ModelLoadError(f"a {cfg.quantization} base is not served on "
                             f"{cfg.family_spec.name} (mixture-of-experts) bases yet: serve it "
                             "in bf16 or fp16")
    if cfg.is_moe and stored == "fp8" and (tp is not None or not fp8_experts_supported(device)):
        log.warning("this FP8 checkpoint's experts are dequantized to the model's dtype at load "
                    "(FP8 experts need one device and FP8 conversions: compute capability 8.9 "
                    "or more, or the CPU), so in bf16 they take twice their checkpoint bytes; "
                    "the attention projections stay FP8")
    if cfg.quantization is None:
        return
    if cfg.quantization == "nf4" and tp is not None:
        _check_nf4_shards(cfg, tp.size, blocksize)
    if stored == "fp8":
        try:
            fp8_scheme(qc := json.loads((path / "config.json").read_text())["quantization_config"])
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
        block = fp8_block(qc)
        if block is not None and tp is not None:
            _check_fp8_shards(cfg, tp.size, block)


def _check_fp8_shards(cfg: ModelConfig, size: int, block: tuple[int, int]) -> None:
    """Raise ModelLoadError unless every row-parallel rank's input columns of o and down are
    whole blocks of the FP8 scales' columns (every rank checks every rank's, so all refuse
    together)."""
    for rank in range(size):
        shard = Shard(rank, size, cfg)
        for proj in ("o_proj", "down_proj"):
            cut, columns = shard.features(proj), cfg.module_shape(proj)[0]
            if cut.start % block[1] or (cut.stop % block[1] and cut.stop != columns):
                raise ModelLoadError(
                    f"--tensor-parallel-size {size}: the FP8 {proj}'s input columns "
                    f"[{cut.start}, {cut.stop}) of rank {rank} are not whole blocks of "
                    f"{block[1]} columns (the checkpoint's weight_block_size)")


def _check_nf4_shards(cfg: ModelConfig, size: int, blocksize: int) -> None:
    """Raise ModelLoadError unless every rank's slice of every NF4 projection is whole blocks:
    its rows (column-parallel), or its columns of every row (row-parallel). Every rank checks
    every rank's slices, so all refuse together."""
    for rank in range(size):
        shard = Shard(rank, size, cfg)
        for proj in LORA_MODULES:  # every projection
            in_features, out_features = cfg.module_shape(proj)
            cut = shard.features(proj)
            try:
                if proj in COLUMN_MODULES:
                    check_nf4_cut((out_features, in_features), blocksize, rows=cut)
                else:
                    check_nf4_cut((out_features, in_features), blocksize, columns=cut)
            except ValueError as e:
                raise ModelLoadError(
                    f"--tensor-parallel-size {size}: the NF4 {proj} [{out_features}, "
                    f"{in_features}] of blocksize {blocksize} does not split into whole blocks "
                    f"(rank {rank}: {e})") from e


def _fp8_block(path: Path) -> tuple[int, int] | None:
    """The weight scale blocks an FP8 checkpoint declares (None: per tensor or channel)."""
    return fp8_block(json.loads((path / "config.json").read_text())["quantization_config"])


def _nf4_blocksize(path: Path) -> int | None:
    """The blocksize of a bitsandbytes NF4 checkpoint's weights (its first quant state)."""
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(".quant_state.bitsandbytes__nf4"):
                    return json.loads(bytes(f.get_tensor(name).tolist()))["blocksize"]
    return None


def _load_weights(model: CausalLM, cfg: ModelConfig, path: Path,
                  shard: Shard | None) -> None:
    """Every checkpoint tensor into its parameter: whole tensors of the parameter's dtype
    straight from the file's bytes (WeightReader), the rest (a rank's slice, a dtype to
    convert, quantized parts) through safetensors."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, int] = {}  # parameter -> rows loaded (fused weights load in slices)
    parts: dict[str, dict[str, torch.Tensor]] = {}  # quantized weight -> its tensors
    kind = _quantized_kind(model)
    pattern = {NF4Linear: _BNB_PART, Fp8Linear: _FP8_PART}.get(kind)
    reader = WeightReader(next(iter(params.values())).device)
    family = cfg.family_spec
    for file in weight_files(path):
        slow = []
        for stored_name, stored in stored_tensors(file).items():
            name = family.rename(stored_name)  # as the decoder names it; None: not kept
            if name is None:
                continue
            part = pattern.match(name) if pattern is not None else None
            if part is not None or shard is not None:
                slow.append((stored_name, name, part))
                continue
            place = _destination(cfg, params, name)
            if place is None:
                continue
            target, dst = place
            if stored.dtype != dst.dtype or not dst.is_contiguous():
                slow.append((stored_name, name, None))
                continue
            if stored.shape != tuple(dst.shape):
                raise ModelLoadError(
                    f"{name}: shape {stored.shape}, expected {tuple(dst.shape)}")
            reader.add(file, stored, dst)
            loaded[target] = loaded.get(target, 0) + dst.numel()
        if slow:
            _load_through_safetensors(file, cfg, params, loaded, parts, slow, shard)
    reader.run()
    _load_quantized(model, cfg, parts, loaded, shard)
    missing = {n for n, p in params.items() if loaded.get(n, 0) != p.numel()}
    missing |= {n for n, m in model.named_modules()
                if isinstance(m, (NF4Linear, Fp8Linear)) and loaded.get(n, 0) != m.out_features}
    missing |= {n for n, m in model.named_modules() if getattr(m, "fp8_block", None) is not None
                and loaded.get(n, 0) != m.num_rows}
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ModelLoadError(f"checkpoint {path} lacks tensors: {sorted(missing)[:5]}")


def _load_through_safetensors(file: Path, cfg: ModelConfig, params, loaded, parts,
                              names: list, shard: Shard | None) -> None:
    """The named tensors of one file ((stored name, decoder's name, quantized-part match or
    None) each) read by safetensors: quantized parts collected into `parts`, the rest loaded (a rank
    reads only its slice of each)."""
    with safe_open(str(file), framework="pt") as f:
        for stored_name, name, part in names:
            if part is not None:
                parts.setdefault(part.group(1), {})[part.group(2) or "weight"] = (
                    f.get_tensor(stored_name))
                continue
            tensor = f.get_tensor(stored_name) if shard is None else f.get_slice(stored_name)
            _load_tensor(cfg, params, loaded, name, tensor, shard)


def _quantized_kind(model) -> type | None:
    return next((type(m) for m in model.modules() if isinstance(m, (NF4Linear, Fp8Linear))),
                None)


def _load_quantized(model, cfg: ModelConfig, parts: dict, loaded: dict[str, int],
                    shard: Shard | None) -> None:
    """Each quantized weight (its tensors by part name) into its rows of the module holding it;
    with `shard`, this rank's slice of it."""
    modules = dict(model.named_modules())
    block = next((m.block for m in modules.values() if isinstance(m, Fp8Linear)), None)
    params = dict(model.named_parameters())
    for name, tensors in parts.items():
        weight_name = name if name.endswith(".weight") else name + ".weight"
        expert = _EXPERT.match(weight_name)
        if expert is not None:
            try:
                _load_fp8_expert(cfg, modules, params, loaded, expert, tensors, block, shard)
            except (KeyError, ValueError) as e:
                raise ModelLoadError(f"{name}: not an fp8 weight: {e}") from e
            continue
        target, rows = _target(cfg, weight_name)
        module_name = target.removesuffix(".weight")
        module = modules.get(module_name)
        rows = rows or (0, getattr(module, "out_features", 0))
        proj = _LAYER.match(weight_name).group(3) + "_proj"
        try:
            if isinstance(module, NF4Linear):
                w = nf4_from_bnb(tensors)
                module.load_rows(rows, w if shard is None else _shard_nf4(shard, proj, w))
            elif isinstance(module, Fp8Linear):
                weight, scale = tensors["weight"], _fp8_scale(tensors)
                if module.block is not None:
                    scale = row_block_scales(scale, weight.shape[0], module.block,
                                             weight.shape[1])
                if shard is not None:
                    weight, scale = _shard_fp8(shard, proj, weight, scale, module.block)
                module.load_rows(rows, weight, scale)
            else:
                raise ModelLoadError(f"unexpected quantized tensor {name} in checkpoint")
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{name}: not a {cfg.quantization} weight: {e}") from e
        loaded[module_name] = loaded.get(module_name, 0) + rows[1] - rows[0]


def _load_fp8_expert(cfg: ModelConfig, modules, params, loaded, match: re.Match, tensors,
                     block: tuple[int, int] | None, shard: Shard | None) -> None:
    """One expert's FP8 gate, up or down weight into its rows of the layer's stacked FP8
    experts with its scales (per row, or per row and block of columns: row_block_scales);
    experts kept in the model's dtype (under tensor parallel) get it dequantized."""
    weight, scale = tensors["weight"], _fp8_scale(tensors)
    layer, expert, proj = int(match.group(1)), int(match.group(2)), match.group(3)
    name = f"layers.{layer}.mlp.experts"
    experts = modules.get(name)
    if experts is None or experts.fp8_block is None:
        _load_tensor(cfg, params, loaded, match.group(0), dequantize_fp8(weight, scale, block),
                     shard)
        return
    if expert >= cfg.num_experts:
        raise ModelLoadError(f"unexpected tensor {match.group(0)} in checkpoint")
    rows, columns = weight.shape
    if block is not None:
        scale = row_block_scales(scale, rows, block, columns)
    elif scale.numel() in (1, rows):
        scale = scale.float().reshape(-1, 1).expand(rows, 1)
    else:
        raise ValueError(f"a weight scale per tensor or per row, got {scale.numel()} values")
    start = {"gate": 0, "up": cfg.moe_intermediate_size, "down": 0}[proj]
    stack = "down" if proj == "down" else "gate_up"
    w_dst = getattr(experts, f"{stack}_proj")[expert, start:start + rows]
    if tuple(w_dst.shape) != (rows, columns):
        raise ModelLoadError(f"{match.group(0)}: shape {(rows, columns)}, expected "
                             f"{tuple(w_dst.shape)}")
    w_dst.copy_(weight)
    getattr(experts, f"{stack}_scale")[expert, start:start + rows].copy_(scale)
    loaded[name] = loaded.get(name, 0) + rows


def _shard_nf4(shard: Shard, proj: str, w: NF4Weight) -> NF4Weight:
    """This rank's rows (column-parallel) or columns (row-parallel) of an NF4 weight."""
    cut = shard.features(proj)
    return w.rows(cut) if proj in COLUMN_MODULES else w.columns(cut)


def _fp8_scale(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """An FP8 weight's scale: quant_method fp8 names block scales weight_scale_inv, meaning
    W = W8 * scale all the same."""
    return tensors["weight_scale"] if "weight_scale" in tensors else tensors["weight_scale_inv"]


def _shard_fp8(shard: Shard, proj: str, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of an FP8 weight and its scales: a column-parallel rank's rows with
    their scales, a row-parallel rank's columns with every row's scale, or with `block` (scales
    per row and block of columns) the scales of its columns' blocks, whole blocks
    (_check_fp8_shards) (W = W8 * s is linear in W8, so the scaled partial products add up to
    the whole one)."""
    if proj in COLUMN_MODULES and scale.numel() > 1:
        scale = shard.weight(proj, "weight", scale)
    elif block is not None:
        cut = shard.features(proj)
        scale = scale[:, cut.start // block[1]:-(-cut.stop // block[1])]
    return shard.weight(proj, "weight", weight), scale


def _load_tensor(cfg, params, loaded, name, tensor, shard: Shard | None = None) -> None:
    place = _destination(cfg, params, name)
    if place is None:
        return
    target, dst = place
    if shard is not None:
        tensor, dst = _shard_tensor(shard, name, target, tensor, dst)
    if dst.shape != tensor.shape:
        raise ModelLoadError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(tensor)
    elements = params[target].numel() if target in _VOCAB else dst.numel()
    loaded[target] = loaded.get(target, 0) + elements


def _destination(cfg: ModelConfig, params, name: str) -> tuple[str, torch.Tensor] | None:
    """(our parameter's name, the tensor a checkpoint tensor goes into: the parameter, its rows
    of a fused one, or one expert's part of stacked experts); None for tensors the model does
    not keep."""
    expert = _EXPERT.match(name)
    if expert is not None:
        return _expert_destination(cfg, params, name, expert)
    target, rows = _target(cfg, name)
    if target is None or (target == "lm_head.weight" and cfg.tie_word_embeddings):
        return None
    param = params.get(target)
    if param is None:
        raise ModelLoadError(f"unexpected tensor {name} in checkpoint")
    return target, (param.data if rows is None else param.data[rows[0] : rows[1]])


def _expert_destination(cfg: ModelConfig, params, name: str,
                        match: re.Match) -> tuple[str, torch.Tensor]:
    """Expert e's gate / up rows of the layer's stacked gate_up_proj, or its down_proj."""
    layer, expert, proj = int(match.group(1)), int(match.group(2)), match.group(3)
    target = f"layers.{layer}.mlp.experts.{'down' if proj == 'down' else 'gate_up'}_proj"
    param = params.get(target)
    if param is None or expert >= cfg.num_experts:
        raise ModelLoadError(f"unexpected tensor {name} in checkpoint")
    if proj == "down":
        return target, param.data[expert]
    size = cfg.moe_intermediate_size
    start = 0 if proj == "gate" else size
    return target, param.data[expert, start : start + size]


_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def _shard_tensor(shard: Shard, name: str, target: str, tensor: torch.Tensor,
                  dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's slice of a checkpoint tensor, where it goes): a projection's rows or
    columns, the vocabulary's rows (the last rank's padding rows zeroed), else all of it.
    `tensor` may be a safetensors slice: only what is indexed is read."""
    if target in _VOCAB:
        dst.zero_()
        rows = tensor[shard.vocab_rows()]
        return rows, dst[: rows.shape[0]]
    expert = _EXPERT.match(name)
    if expert is not None:
        return shard.expert_weight(expert.group(3), tensor), dst
    if target.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return shard.expert_weight(target.rsplit(".", 1)[1], tensor), dst
    m = _LAYER.match(name)
    if m is None:
        return tensor[:], dst
    return shard.weight(f"{m.group(3)}_proj", m.group(4), tensor), dst


def _target(cfg: ModelConfig, name: str) -> tuple[str | None, tuple[int, int] | None]:
    """Our parameter name for a checkpoint tensor, and the row range inside a fused weight."""
    if name.endswith("rotary_emb.inv_freq"):
        return None, None
    if not name.startswith("model.layers."):
        return name.removeprefix("model."), None
    m = _LAYER.match(name)
    if m is None:
        return name.removeprefix("model."), None
    layer, block, proj, kind = m.groups()
    if proj not in _FUSED:
        return f"layers.{layer}.{block}.{proj}_proj.{kind}", None
    fused, index = _FUSED[proj]
    sizes = (
        (cfg.q_dim, cfg.kv_dim, cfg.kv_dim)
        if fused == "qkv_proj"
        else (cfg.intermediate_size, cfg.intermediate_size)
    )
    start = sum(sizes[:index])
    return f"layers.{layer}.{block}.{fused}.{kind}", (start, start + sizes[index])


@torch.no_grad()
def _randomize(model: CausalLM) -> CausalLM:
    """Random weights (benchmarks without a checkpoint): N(0, 0.02), norms at 1."""
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0 - model.cfg.norm_offset)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    return model
