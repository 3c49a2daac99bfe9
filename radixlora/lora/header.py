"""The checks of a PEFT adapter that need no tensor data, and no torch: its adapter_config.json
(typed and ranged), its safetensors header (names, shapes, dtypes, offsets that tile the file) and
whether every LoRA pair fits the base model. `radixlora serve` runs them before any process loads
the model (check_header), in the api process, which never imports torch;
radixlora.lora.adapter reads the tensors themselves."""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import re._constants as sre_constants
import re._parser as sre_parse
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, BinaryIO, Literal, TypeVar

import msgspec

from radixlora.config import (
    FUSED_MODULES,
    GROUP_OF,
    LORA_MODULES,
    MODULE_GROUPS,
    ModelConfig,
    checkpoint_quantization,
)
from radixlora.errors import AdapterError, ModelLoadError
from radixlora.structured import subpatterns

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# a LoRA weight's name once PEFT's base_model.model. prefix is gone and the family's renames
# applied (Gemma 3's model.language_model. is model.)
_KEY = re.compile(
    r"^(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_(A|B)(?:\.[^.]+)?\.weight$"
)
# DoRA's magnitude vector m [out] of a module (PEFT saves it without the adapter name)
_MAGNITUDE = re.compile(
    r"^(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))"
    r"\.lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?$"
)
# an MoE base's stacked experts adapted by PEFT's target_parameters: the LoRA of the first
# parameter listed sits under base_layer. of the second's (both: mlp.experts.gate_up_proj and
# mlp.experts.down_proj; which is which, their shapes tell)
_EXPERTS = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts((?:\.base_layer)*)\.lora_(A|B)(?:\.[^.]+)?\.weight$"
)
# LoRA on one expert's own module, as adapters trained before transformers 5 stacked the
# experts name it (Mixtral's experts.N.w1 / w3 / w2 renamed by its family)
_OWN_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
    r"\.lora_(A|B)(?:\.[^.]+)?\.weight$"
)
_OWN_MODULE = re.compile(r"^experts\.\d+\.")
# the target_parameters names an MoE base's adapters may carry (PEFT's all-linear writes the
# stacked experts' short names and the router's gate.weight)
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj", "gate.weight")
# modules of the base PEFT can adapt that radixlora does not serve (named when refused)
UNSERVED_MODULES = ("embed_tokens", "lm_head")
# the module a PEFT tensor belongs to: its LoRA weights, or the base layer PEFT saves beside them
_LORA_OF = re.compile(r"(?:^|\.)(\w+)\.(?:lora_\w+|base_layer)\b")
MAX_ADAPTER_BYTES = 8 << 30
CHANGING = "adapter_changing"  # AdapterError.code: the files changed or vanished while read
MAX_CONFIG_BYTES = 1 << 20
MAX_ALPHA = 1e6
MAX_MAGNITUDE = 1e6  # a DoRA magnitude scales a whole projection's output
MAX_PATTERN_CHARS = 256
MAX_PATTERN_REPEATS = 4
MAX_PATTERNS = 512  # keys of rank_pattern or alpha_pattern
MAX_SAFETENSORS_HEADER = 100 << 20  # safetensors' own limit
_T = TypeVar("_T")
_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT)

Rank = Annotated[int, msgspec.Meta(ge=1)]
Alpha = Annotated[float, msgspec.Meta(ge=-MAX_ALPHA, le=MAX_ALPHA)]
PositiveAlpha = Annotated[float, msgspec.Meta(gt=0, le=MAX_ALPHA)]
Layer = Annotated[int, msgspec.Meta(ge=0)]


class LoraConfig(msgspec.Struct, kw_only=True):
    """The fields of a PEFT adapter_config.json that radixlora reads, typed and ranged; the many
    other keys PEFT writes are ignored."""

    peft_type: str = "LORA"
    r: Rank = 8
    lora_alpha: Alpha = 8
    target_modules: str | list[str] | None = None
    rank_pattern: dict[str, Rank] | None = None
    alpha_pattern: dict[str, PositiveAlpha] | None = None
    use_rslora: bool | None = False
    layers_to_transform: Layer | list[Layer] | None = None
    bias: Literal["none", "all", "lora_only"] = "none"
    use_dora: bool | None = False
    modules_to_save: list[str] | None = None
    fan_in_fan_out: bool | None = False
    trainable_token_indices: list[int] | dict[str, list[int]] | None = None
    target_parameters: list[str] | None = None  # PEFT's LoRA on parameters (fused experts)
    base_model_name_or_path: str | None = None
    # radixlora's own key: the weight format of the base the adapter was trained on ("nf4" for
    # QLoRA, "none" for a dense base); without it, the format its base_model_name_or_path's
    # config.json declares when that is a local directory, else a dense base
    base_quantization: Literal["nf4", "fp8", "none"] | None = None


@dataclass(frozen=True)
class LoraAdapter:
    """One validated adapter version. `content_hash` (sha256 of config + tensors) is its identity:
    the same name re-published with other weights is a different adapter."""

    name: str
    path: str
    content_hash: str
    rank: int
    group_ranks: dict[str, int]
    # (layer, module) -> (A [r, in] fp32, B [out, r] fp32 with alpha/r folded in)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    trained_on: str | None = None  # the base's weight format in training: "nf4", "fp8", None
    # non-empty: trained on another weight format than the served base's, served anyway
    # (ModelConfig.qlora_mismatch "serve"); says which
    base_mismatch: str = ""
    # DoRA: the module groups whose modules carry a magnitude vector, in MODULE_GROUPS order
    # (empty: a plain LoRA), and (layer, module) -> m [out] fp32 (with the weights)
    dora_groups: tuple[str, ...] = ()
    magnitudes: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    @property
    def adapter_id(self) -> str:
        return self.content_hash

    @property
    def nbytes(self) -> int:
        pairs = sum(a.numel() + b.numel() for a, b in self.weights.values())
        return (pairs + sum(m.numel() for m in self.magnitudes.values())) * 4

    @property
    def pool_rows(self) -> int:
        """Rows it takes in the adapter pool: its rank rows, and for DoRA one more, the
        magnitude row (radixlora.worker.dora)."""
        return self.rank + bool(self.dora_groups)


def adapter_from_header(name: str, path: str | Path, model: ModelConfig, max_rank: int,
                        digest: str, roots: Sequence[str | Path] = ()) -> LoraAdapter:
    """An adapter without weights, identified by `digest`, from its config and the safetensors
    header alone: every check that needs names, shapes and dtypes runs, none that needs tensor
    values (the caller vouches for those: radixlora.lora.registration's hash cache, or reads
    and validates them next). With `roots`, each file must resolve inside one of them."""
    path = Path(path)
    config_path, tensor_path = adapter_files(name, path)
    config = parse_config(name, read_file(name, config_path, MAX_CONFIG_BYTES, roots))
    tensors = read_regular(name, tensor_path, MAX_ADAPTER_BYTES, roots,
                            functools.partial(tensor_header, name))
    pairs = list(checked_pairs(name, config, tensors, model, max_rank))
    group_ranks = group_ranks_of((module, a.shape[0]) for (_, module, _), (a, _), _, _ in pairs)
    trained_on, mismatch = check_base_format(name, config, model)
    dora = dora_groups({(layer, module): m for (layer, module, _), _, _, m in pairs
                         if m is not None})
    return LoraAdapter(name, str(path), digest, max(group_ranks.values()), group_ranks, {},
                       trained_on, mismatch, dora)


def check_header(name: str, path: str | Path, model: ModelConfig, max_rank: int,
                 roots: Sequence[str | Path] = ()) -> None:
    """Every check of adapter_from_header (config, tensor names, shapes, dtypes): run before
    the tensors are read, so a wrong adapter of any size is refused for the cost of its
    header."""
    adapter_from_header(name, path, model, max_rank, "", roots)


def check_base_format(name: str, config: LoraConfig, model: ModelConfig) -> tuple[str | None, str]:
    """(the base weight format the adapter was trained on, the mismatch with the served base's
    or ""). A QLoRA adapter's deltas were fitted to the NF4-rounded weights, not the dense ones
    (and the other way round; an fp8 base stands for its dense original, as in vLLM): under
    model.qlora_mismatch "refuse" a mismatch is an AdapterError, under "serve" it is logged and
    kept on the adapter to be reported."""
    trained_on = trained_base_format(config, model)
    if (trained_on == "nf4") == (model.quantization == "nf4"):  # fp8 approximates dense
        return trained_on, ""
    mismatch = (f"trained on a {trained_on or 'dense'} base, served on a "
                f"{model.quantization or 'dense'} base")
    if model.qlora_mismatch != "serve":
        raise AdapterError(name, f"{mismatch}; its outputs would drift (serve it on a matching "
                           "base, or start with --qlora-mismatch serve)",
                           code="quantization_mismatch")
    log.warning("adapter %r is %s (--qlora-mismatch serve)", name, mismatch)
    return trained_on, mismatch


def trained_base_format(config: LoraConfig, model: ModelConfig) -> str | None:
    """The weight format of the base an adapter was trained on: its base_quantization, else
    what its base_model_name_or_path's config.json declares (a local directory), else dense."""
    if config.base_quantization is not None:
        return None if config.base_quantization == "none" else config.base_quantization
    base = config.base_model_name_or_path
    if not base or not _may_read_base(base, model.base_roots):
        return None
    return _declared_format(base)


def _may_read_base(base: str, roots: tuple[str, ...] | None) -> bool:
    """Whether base_model_name_or_path may be opened: anywhere without roots, else only when
    it resolves (symlinks followed) inside one of them; otherwise it is a name (a hub id)."""
    if roots is None:
        return True
    return _inside(os.path.realpath(base), roots)


@functools.lru_cache(maxsize=64)
def _declared_format(base: str) -> str | None:
    """The weight format a local checkpoint's config.json declares (cached: many adapters name
    one base, and a registry validates thousands)."""
    config = os.path.join(base, "config.json")
    if not os.path.isfile(config):
        return None
    try:
        with open(config, "rb") as f:
            qc = msgspec.json.decode(f.read(MAX_CONFIG_BYTES)).get("quantization_config")
        return checkpoint_quantization(qc)
    except (OSError, msgspec.DecodeError, AttributeError, ModelLoadError):
        return None


def dora_groups(magnitudes) -> tuple[str, ...]:
    groups = {GROUP_OF[module] for _, module in magnitudes}
    return tuple(g for g in MODULE_GROUPS if g in groups)


def group_ranks_of(module_ranks) -> dict[str, int]:
    group_ranks: dict[str, int] = {}
    for module, rank in module_ranks:
        group = GROUP_OF[module]
        group_ranks[group] = max(group_ranks.get(group, 0), rank)
    return group_ranks


def adapter_files(name: str, path: Path) -> tuple[Path, Path]:
    if not path.is_dir():
        raise AdapterError(name, f"directory {path} does not exist")
    config_path = path / "adapter_config.json"
    tensor_path = path / "adapter_model.safetensors"
    if not os.path.lexists(config_path):
        raise AdapterError(name, f"no adapter_config.json in {path}")
    if not os.path.lexists(tensor_path):
        if (path / "adapter_model.bin").exists():
            raise AdapterError(
                name,
                "only a pickle adapter_model.bin was found; radixlora never "
                "unpickles: convert it to adapter_model.safetensors",
            )
        raise AdapterError(name, f"no adapter_model.safetensors in {path}")
    return config_path, tensor_path


def read_file(name: str, path: Path, max_bytes: int, roots: Sequence[str | Path]) -> bytes:
    data = read_regular(name, path, max_bytes, roots, lambda f, _: f.read(max_bytes + 1))
    if len(data) > max_bytes:
        raise AdapterError(name, f"{path.name} is larger than {_size(max_bytes)}")
    return data


def read_regular(name: str, path: Path, max_bytes: int, roots: Sequence[str | Path],
                  read: Callable[[BinaryIO, int], _T]) -> _T:
    """`read(file, size)` of one regular file of at most max_bytes. The file is opened by its
    real path without following links and non-blocking (a FIFO swapped in cannot block the
    read), and what was opened is checked again, so a file replaced between the checks is
    refused."""
    real = os.path.realpath(path)
    if roots and not _inside(real, roots):
        raise AdapterError(name, f"{path.name} resolves outside the allowed adapter roots",
                           code="path_not_allowed")
    try:
        before = os.stat(real)
        _check_regular(name, path.name, before, max_bytes)
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb") as f:
            opened = os.fstat(f.fileno())
            _check_regular(name, path.name, opened, max_bytes)
            if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
                raise AdapterError(name, f"{path.name} was replaced while it was read")
            return read(f, opened.st_size)
    except FileNotFoundError as e:
        if os.path.lexists(path):  # a link to nothing
            raise AdapterError(name, f"{path.name} is unreadable: {e.strerror}",
                               code="unreadable_adapter") from e
        raise AdapterError(name, f"{path.name} vanished while it was read",
                           code=CHANGING) from e
    except OSError as e:
        raise AdapterError(name, f"{path.name} is unreadable: {e.strerror}",
                           code="unreadable_adapter") from e


def tensor_header(name: str, f: BinaryIO, size: int) -> dict[str, TensorMeta]:
    """The tensors a safetensors file declares (names, shapes, dtypes), read from its header:
    no tensor data is read. The header's offsets must tile the rest of the file exactly: a
    file with bytes beyond its tensors, or fewer than they need, is refused here."""
    prefix = f.read(8)
    length = int.from_bytes(prefix, "little")
    if len(prefix) < 8 or length > min(MAX_SAFETENSORS_HEADER, size - 8):
        raise AdapterError(name, "adapter_model.safetensors is corrupted: no valid header")
    try:
        header = msgspec.json.decode(f.read(length), type=dict[str, msgspec.Raw])
        header.pop("__metadata__", None)
        entries = {key: msgspec.json.decode(raw, type=_HeaderEntry) for key, raw in header.items()}
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise AdapterError(name, f"adapter_model.safetensors is corrupted: {e}") from e
    metas = {key: _meta_tensor(name, key, entry) for key, entry in entries.items()}
    _check_offsets(name, entries, metas, size - 8 - length)
    return metas


def _check_offsets(name: str, entries: dict[str, _HeaderEntry], metas: dict[str, TensorMeta],
                   data_bytes: int) -> None:
    """The tensors' byte ranges follow one another from 0, each as long as its shape and dtype
    need, and end where the file does (as safetensors itself requires, checked before the
    data is read rather than after)."""
    end = 0
    for key, entry in sorted(entries.items(), key=lambda kv: kv[1].data_offsets):
        begin, stop = entry.data_offsets
        meta = metas[key]
        need = math.prod(meta.shape) * meta.dtype.itemsize
        if begin != end or stop - begin != need:
            raise AdapterError(name, f"adapter_model.safetensors is corrupted: tensor {key!r} "
                                     f"has offsets [{begin}, {stop}], expected "
                                     f"[{end}, {end + need}]")
        end = stop
    if end != data_bytes:
        what = (f"{data_bytes - end} bytes after its tensors" if data_bytes > end else
                f"{end - data_bytes} bytes fewer than its tensors need (truncated?)")
        raise AdapterError(name, f"adapter_model.safetensors is corrupted: it has {what}")


class _HeaderEntry(msgspec.Struct):
    dtype: str
    shape: list[Annotated[int, msgspec.Meta(ge=0)]]
    data_offsets: tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]]


@dataclass(frozen=True)
class DType:
    """A safetensors dtype as the layout checks read it (torch's name, bytes per element,
    floating point or not), without torch."""

    name: str
    itemsize: int
    is_floating_point: bool

    def __str__(self) -> str:
        return f"torch.{self.name}"  # as torch prints its dtypes, so messages read alike


SAFETENSORS_DTYPES = {code: DType(name, size, floating) for code, name, size, floating in (
    ("F64", "float64", 8, True), ("F32", "float32", 4, True), ("F16", "float16", 2, True),
    ("BF16", "bfloat16", 2, True), ("F8_E4M3", "float8_e4m3fn", 1, True),
    ("F8_E5M2", "float8_e5m2", 1, True), ("I64", "int64", 8, False), ("I32", "int32", 4, False),
    ("I16", "int16", 2, False), ("I8", "int8", 1, False), ("U8", "uint8", 1, False),
    ("BOOL", "bool", 1, False))}


@dataclass(frozen=True)
class TensorMeta:
    """What the layout checks read of a tensor (its shape and dtype), without its data."""

    shape: tuple[int, ...]
    dtype: DType

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point


def _meta_tensor(name: str, key: str, entry: _HeaderEntry) -> TensorMeta:
    dtype = SAFETENSORS_DTYPES.get(entry.dtype)
    if dtype is None:
        raise AdapterError(name, f"adapter_model.safetensors is corrupted: tensor {key!r} has "
                                 f"unknown dtype {entry.dtype!r}")
    return TensorMeta(tuple(entry.shape), dtype)


def _check_regular(name: str, file: str, st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise AdapterError(name, f"{file} is not a regular file")
    if st.st_size > max_bytes:
        raise AdapterError(name, f"{file} is larger than {_size(max_bytes)}")


def _inside(real: str, roots: Sequence[str | Path]) -> bool:
    for root in roots:
        real_root = os.path.realpath(root)
        if real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep):
            return True
    return False


def _size(n: int) -> str:
    return f"{n >> 30} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def parse_config(name: str, raw: bytes) -> LoraConfig:
    config = _decode_config(name, raw)
    if config.peft_type != "LORA":
        raise AdapterError(name, f"peft_type {config.peft_type!r} is not supported (LORA only)")
    unsupported = {
        "modules_to_save": "modules_to_save",
        "fan_in_fan_out": "fan_in_fan_out",
        "trainable_token_indices": "trainable tokens",
    }
    others = [p for p in config.target_parameters or ()
              if not p.endswith(EXPERT_PARAMETERS)]
    if others:
        raise AdapterError(name, f"target_parameters {', '.join(map(str, others))} are not "
                                 f"supported: radixlora serves LoRA on parameters only on an "
                                 f"MoE base's stacked experts and router "
                                 f"({', '.join(EXPERT_PARAMETERS)})",
                           code="unsupported_adapter")
    for key, what in unsupported.items():
        if getattr(config, key):
            listed = getattr(config, key)
            named = f" ({', '.join(map(str, listed))})" if isinstance(listed, list) else ""
            raise AdapterError(name, f"{what}{named} are not supported: radixlora serves LoRA "
                                     f"on the {'/'.join(LORA_MODULES)} projections only",
                               code="unsupported_adapter")
    if config.bias != "none":
        raise AdapterError(
            name,
            f"bias={config.bias!r} is not supported (only 'none')",
            code="unsupported_adapter",
        )
    _check_patterns(name, "rank_pattern", config.rank_pattern or {})
    _check_patterns(name, "alpha_pattern", config.alpha_pattern or {})
    return config


def _decode_config(name: str, raw: bytes) -> LoraConfig:
    """The typed config; a wrong type or range names its field (`$.r`, `$.rank_pattern...`)."""
    try:
        return msgspec.json.decode(raw, type=LoraConfig)
    except msgspec.ValidationError as e:
        if " - at `$" not in str(e):  # the document itself, not one of its fields
            raise AdapterError(name, "adapter_config.json must hold a JSON object") from e
        raise AdapterError(name, f"adapter_config.json: invalid field: {e}",
                           code="invalid_adapter_config") from e
    except msgspec.DecodeError as e:
        raise AdapterError(name, f"adapter_config.json is not valid JSON: {e}") from e
    except RecursionError as e:
        raise AdapterError(name, "adapter_config.json is not valid JSON: nested too deeply") from e


def _check_patterns(name: str, field: str, patterns: dict) -> None:
    if len(patterns) > MAX_PATTERNS:
        raise AdapterError(name, f"adapter_config.json: {field} has more than {MAX_PATTERNS} "
                           "keys", code="invalid_adapter_config")
    for pattern in patterns:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise AdapterError(name, f"adapter_config.json: {field} key {pattern[:32]!r}... is "
                               f"longer than {MAX_PATTERN_CHARS} characters",
                               code="invalid_adapter_config")
        try:
            _pattern_regex(pattern)
            _check_backtracking(sre_parse.parse(pattern))
        except (re.error, RecursionError, OverflowError) as e:
            raise AdapterError(name, f"adapter_config.json: {field} key {pattern!r} is not a "
                               f"valid regular expression: {e}",
                               code="invalid_adapter_config") from e


@functools.lru_cache(maxsize=2 * MAX_PATTERNS)
def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile(rf"(.*\.)?({pattern})$")


def _check_backtracking(sub, in_repeat: bool = False) -> int:
    """The number of repetitions in a parsed pattern; re.error for a repetition or alternation
    inside a repetition, or too many repetitions: Python's re has no time limit, and such a
    pattern can backtrack for hours on one module path."""
    count = 0
    for op, av in sub:
        repeat = op in _REPEATS and av[1] > 1
        if in_repeat and (repeat or op is sre_constants.BRANCH):
            raise re.error("a repetition or alternation inside a repetition is not allowed")
        count += repeat
        for child in subpatterns(av):
            count += _check_backtracking(child, in_repeat or repeat)
    if count > MAX_PATTERN_REPEATS:
        raise re.error(f"more than {MAX_PATTERN_REPEATS} repetitions")
    return count


def checked_pairs(name, config, tensors, model: ModelConfig, max_rank):
    """((layer, module, key), (A, B), scale, m) of every LoRA pair whose names, layers, ranks,
    dtypes and shapes fit the model, in order (m: its DoRA magnitude vector, None without
    use_dora); the checks need tensor metadata only. LoRA on each expert's own modules comes
    first, as the stacked experts' pairs (_stacked_own_experts)."""
    pairs, magnitudes = _pair_tensors(name, tensors, model)
    _check_magnitudes(name, config, pairs, magnitudes)
    layers = _layers_to_transform(config)
    if config.use_dora and (router := next((k for _, m, k in pairs if m == "router"), None)):
        raise AdapterError(name, f"{router}: DoRA on the router is not supported",
                           code="unsupported_adapter")
    own = {k: pairs.pop(k) for k in [k for k in pairs if _OWN_MODULE.match(k[1])]}
    if own:
        if config.use_dora:
            raise AdapterError(name, f"{next(iter(own))[2]}: DoRA on the experts is not "
                                     f"supported", code="unsupported_adapter")
        stacked = {layer for layer, module, _ in pairs if module.startswith("experts.")}
        if clash := stacked & {layer for layer, _, _ in own}:
            raise AdapterError(name, f"model.layers.{min(clash)}.mlp.experts: adapted both as "
                                     f"stacked experts and expert by expert")
        yield from _stacked_own_experts(name, config, own, model, max_rank, layers)
    for (layer, module, key), (a, b) in sorted(pairs.items()):
        if layers is not None and layer not in layers:
            raise AdapterError(name, f"{key} is outside layers_to_transform")
        rank, alpha = _rank_alpha(config, key)
        _check_shapes(name, key, a, b, rank, model.module_shape(module), max_rank)
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        for part, rows in _parts(model, module):
            m = magnitudes.get(key)
            yield ((layer, part, key), (a, _rows(b, rows)), scale,
                   None if m is None else _rows(m, rows))
    if not pairs and not own:
        raise AdapterError(name, "adapter_model.safetensors holds no LoRA weights")


def _stacked_own_experts(name, config, own, model: ModelConfig, max_rank, layers):
    """checked_pairs' yields for LoRA on each expert's own modules (experts.N.gate_proj /
    up_proj / down_proj), as PEFT converts such adapters to the stacked experts: per layer one
    experts.gate_up_proj pair whose rank is gate's plus up's (A their rows stacked, B block
    diagonal) and one experts.down_proj pair, each module's scale folded into its B (scale 1),
    experts the adapter leaves out at zero."""
    h, mi, count = model.hidden_size, model.moe_intermediate_size, model.num_experts
    parts: dict[int, dict[tuple[str, int], tuple]] = {}
    for (layer, module, key), (a, b) in sorted(own.items()):
        _, expert, proj = module.split(".")
        if layers is not None and layer not in layers:
            raise AdapterError(name, f"{key} is outside layers_to_transform")
        if not model.moe_layer(layer) or int(expert) >= count:
            raise AdapterError(name, f"{key}: layer {layer} of the base has no expert {expert}")
        rank, alpha = _rank_alpha(config, key)
        _check_shapes(name, key, a, b, rank, (mi, h) if proj == "down_proj" else (h, mi),
                      max_rank)
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        parts.setdefault(layer, {})[(proj, int(expert))] = (a, b, scale)
    for layer, pairs in parts.items():
        for module, projs, out_dim in (("experts.gate_up_proj", ("gate_proj", "up_proj"), 2 * mi),
                                       ("experts.down_proj", ("down_proj",), h)):
            ranks = {p: max((a.shape[0] for (q, _), (a, _, _) in pairs.items() if q == p),
                            default=0) for p in projs}
            total, key = sum(ranks.values()), f"model.layers.{layer}.mlp.{module}"
            if not total:
                continue
            if total > max_rank:
                raise AdapterError(name, f"{key}: its experts' {' + '.join(projs)} ranks add "
                                         f"up to {total}, above the server's max rank "
                                         f"{max_rank} (raise --max-lora-rank)")
            yield ((layer, module, key),
                   _own_experts_stacked(pairs, projs, ranks, count, out_dim), 1.0, None)


def _own_experts_stacked(pairs, projs, ranks, count: int, out_dim: int):
    """(A [rank, E * in], B [E * out, rank]) of one stacked module from its experts' pairs."""
    a0, b0, _ = next(iter(pairs.values()))
    total = sum(ranks.values())
    in_dim = next(a.shape[1] for (q, _), (a, _, _) in pairs.items() if q in projs)
    if isinstance(a0, TensorMeta):
        return (TensorMeta((total, count * in_dim), a0.dtype),
                TensorMeta((count * out_dim, total), b0.dtype))
    import torch

    a_out = torch.zeros(total, count, in_dim)
    b_out = torch.zeros(count, out_dim, total)
    start, part_out = 0, out_dim // len(projs)
    for i, proj in enumerate(projs):
        for (q, expert), (a, b, scale) in pairs.items():
            if q == proj:
                a_out[start:start + a.shape[0], expert] = a.float()
                b_out[expert, i * part_out:(i + 1) * part_out,
                      start:start + a.shape[0]] = b.float() * scale
        start += ranks[proj]
    return a_out.reshape(total, -1), b_out.reshape(-1, total)


def _check_magnitudes(name, config: LoraConfig, pairs, magnitudes) -> None:
    """use_dora: every LoRA pair has a floating-point magnitude vector of its output size, and
    no other module has one; without use_dora, no magnitude vector at all."""
    if not config.use_dora:
        if magnitudes:
            raise AdapterError(name, f"{next(iter(magnitudes))} is a DoRA magnitude vector but "
                                     "adapter_config.json does not set use_dora",
                               code="unsupported_adapter")
        return
    for (_, _, key), (_, b) in pairs.items():
        m = magnitudes.get(key)
        if m is None:
            raise AdapterError(name, f"{key} has no lora_magnitude_vector (use_dora is set)")
        if not m.is_floating_point() or tuple(m.shape) != (b.shape[0],):
            raise AdapterError(name, f"{key}: lora_magnitude_vector must be floating point of "
                                     f"shape ({b.shape[0]},), got {m.dtype} {tuple(m.shape)}")
    paired = {key for _, _, key in pairs}
    for key in magnitudes:
        if key not in paired:
            raise AdapterError(name, f"{key} has a lora_magnitude_vector but no LoRA weights")


def _parts(model: ModelConfig, module: str) -> list[tuple[str, tuple[int, int] | None]]:
    """The modules a target stands for, with their rows of its B: a fused target (Phi-3's
    qkv_proj, gate_up_proj) splits into its modules, each the same A and its rows of B (so
    the pool, int8 rows, DoRA and tensor parallel see ordinary modules); others are whole."""
    if module not in FUSED_MODULES:
        return [(module, None)]
    out, start = [], 0
    for part in FUSED_MODULES[module]:
        size = model.module_shape(part)[1]
        out.append((part, (start, start + size)))
        start += size
    return out


def _rows(t, rows: tuple[int, int] | None):
    """Rows [start, end) of a tensor, or of a header's TensorMeta; all of it for None."""
    if rows is None:
        return t
    if isinstance(t, TensorMeta):
        return TensorMeta((rows[1] - rows[0], *t.shape[1:]), t.dtype)
    return t[rows[0]:rows[1]]


def _pair_tensors(name, tensors, model: ModelConfig):
    """({(layer, module, key): (A, B)}, {key: DoRA magnitude vector})."""
    halves: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    experts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    magnitudes: dict[str, torch.Tensor] = {}
    family = model.family_spec
    targets = model.lora_modules + (tuple(FUSED_MODULES) if family.fused_lora else ())
    for tensor_name, tensor in tensors.items():
        renamed = family.rename(tensor_name.removeprefix("base_model.model."))
        if renamed is None:
            raise AdapterError(name, f"tensor {tensor_name!r} adapts a part of the checkpoint "
                                     f"the {family.name} language model does not have")
        if model.is_moe and (e := _EXPERTS.match(renamed)):
            experts.setdefault((int(e.group(1)), e.group(2)), {})[e.group(3)] = tensor
            continue
        if model.is_moe and (e := _OWN_EXPERT.match(renamed)):
            layer, module = int(e.group(1)), f"experts.{e.group(2)}.{e.group(3)}"
            key = f"model.layers.{layer}.mlp.{module}"
            halves.setdefault((layer, module, key), {})[e.group(4)] = tensor
            continue
        match = _KEY.match(renamed)
        if match is None and (m := _MAGNITUDE.match(renamed)):
            magnitudes[m.group(1)] = tensor
            continue
        if match is None:
            lora_of = _LORA_OF.search(tensor_name)
            module = lora_of.group(1) if lora_of else None
            if model.is_moe and ".experts." in renamed:
                raise AdapterError(name, _moe_refusal(model, renamed.split(".lora_")[0]),
                                   code="unsupported_adapter")
            if module in UNSERVED_MODULES:
                raise AdapterError(name, f"LoRA on {module!r} is not supported: radixlora serves "
                                         f"LoRA on the {'/'.join(targets)} projections only",
                                   code="unsupported_adapter")
            raise AdapterError(
                name,
                f"tensor {tensor_name!r} is not a LoRA weight of a "
                f"{'/'.join(targets)} projection of this base model",
            )
        key, layer, module, side = (
            match.group(1),
            int(match.group(2)),
            match.group(3),
            match.group(4),
        )
        if module == "gate" and ".mlp." in key and model.moe_layer(layer):
            module = "router"
        if module not in targets and model.is_moe:
            raise AdapterError(name, _moe_refusal(model, key), code="unsupported_adapter")
        if module not in targets:
            raise AdapterError(
                name,
                f"target module {module!r} is not supported on {family.name} models; "
                f"supported: {', '.join(targets)}",
            )
        if layer >= model.num_layers:
            raise AdapterError(name, f"{key}: the base model has {model.num_layers} layers")
        halves.setdefault((layer, module, key), {})[side] = tensor
    halves.update(_expert_pairs(name, experts, model))
    for (_, _, key), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(name, f"{key} has lora_{'A' if 'A' not in pair else 'B'} missing")
    return {k: (v["A"], v["B"]) for k, v in halves.items()}, magnitudes


def _expert_pairs(name, experts, model: ModelConfig):
    """The experts' LoRA pairs as those of two modules, experts.gate_up_proj and
    experts.down_proj ({(layer, module, key): {"A": A, "B": B}}): PEFT's target_parameters
    factors, A [E * r, in] (expert-major) and B [out, r * E] (rank-major), become one A
    [r, E * in] whose rank row j holds every expert's row j, and one B [E * out, r]. A pair is
    the gate_up one when A reads the hidden state and B writes 2 x moe_intermediate_size
    outputs, the down one when A reads moe_intermediate_size and B writes the hidden size."""
    h, mi, count = model.hidden_size, model.moe_intermediate_size, model.num_experts
    pairs = {}
    for (layer, nest), pair in experts.items():
        where = f"model.layers.{layer}.mlp.experts{nest}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(name, f"{where} has lora_{'A' if 'A' not in pair else 'B'} "
                                     f"missing")
        a, b = pair["A"], pair["B"]
        shapes = (tuple(a.shape[1:]), tuple(b.shape[:1]))
        param = {((h,), (2 * mi,)): "gate_up_proj", ((mi,), (h,)): "down_proj"}.get(shapes)
        rows = a.shape[0] if a.dim() == 2 else 0
        if (param is None or a.dim() != 2 or b.dim() != 2 or rows % count
                or tuple(b.shape[1:]) != (rows,) or not model.moe_layer(layer)):
            raise AdapterError(name, f"{where}: lora_A {tuple(a.shape)} and lora_B "
                                     f"{tuple(b.shape)} are neither experts.gate_up_proj's "
                                     f"({count} x r, {h}) and ({2 * mi}, r x {count}) nor "
                                     f"experts.down_proj's ({count} x r, {mi}) and ({h}, r x "
                                     f"{count}) of an MoE layer")
        module = f"experts.{param}"
        key = f"model.layers.{layer}.mlp.{module}"
        if (layer, module, key) in pairs:
            raise AdapterError(name, f"{key} is adapted twice")
        pairs[(layer, module, key)] = dict(zip("AB", _experts_side_by_side(a, b, count)))
    return pairs


def _experts_side_by_side(a, b, count: int):
    rank, in_dim, out_dim = a.shape[0] // count, a.shape[1], b.shape[0]
    if isinstance(a, TensorMeta):
        return (TensorMeta((rank, count * in_dim), a.dtype),
                TensorMeta((count * out_dim, rank), b.dtype))
    a = a.reshape(count, rank, in_dim).transpose(0, 1).reshape(rank, count * in_dim)
    b = b.reshape(out_dim, rank, count).permute(2, 0, 1).reshape(count * out_dim, rank)
    return a, b


def _moe_refusal(model: ModelConfig, key: str) -> str:
    return (f"{key}: LoRA on each expert's own modules or on a dense MLP of a "
            f"{model.family_spec.name} base is not served; radixlora serves LoRA on its "
            f"attention projections, its router (mlp.gate) and its stacked experts as PEFT's "
            f"target_parameters trains them ({', '.join(model.lora_modules)})")


def _layers_to_transform(config: LoraConfig) -> set[int] | None:
    layers = config.layers_to_transform
    if layers is None:
        return None
    return {layers} if isinstance(layers, int) else set(layers)


def _rank_alpha(config: LoraConfig, key: str) -> tuple[int, float]:
    """PEFT's rule: the first pattern key matching the end of the module path wins."""
    rank = _pattern_value(config.rank_pattern or {}, key, config.r)
    alpha = _pattern_value(config.alpha_pattern or {}, key, config.lora_alpha)
    return rank, alpha


def _pattern_value(patterns: dict, key: str, default):
    for pattern, value in patterns.items():
        if _pattern_regex(pattern).match(key):
            return value
    return default


def _check_shapes(name, key, a, b, rank, shape, max_rank) -> None:
    in_dim, out_dim = shape
    if not isinstance(rank, int) or rank <= 0:
        raise AdapterError(name, f"{key}: rank r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise AdapterError(name, f"{key}: rank {rank} exceeds the server's max rank {max_rank}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise AdapterError(name, f"{key}: LoRA weights must be floating point, got "
                                 f"{a.dtype} and {b.dtype}", code="unsupported_adapter")
    if a.dim() != 2 or b.dim() != 2:
        raise AdapterError(name, f"{key}: LoRA weights must be 2-D")
    if tuple(a.shape) != (rank, in_dim) or tuple(b.shape) != (out_dim, rank):
        raise AdapterError(
            name,
            f"{key}: shape mismatch: lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, expected ({rank}, {in_dim}) and ({out_dim}, {rank})",
        )
