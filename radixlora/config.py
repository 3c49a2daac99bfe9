"""One frozen config tree: the base model's shape (read from config.json) and the engine's knobs."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from radixlora.errors import ModelLoadError
from radixlora.families import family_for

if TYPE_CHECKING:
    import torch

# the model dtypes torch_dtype resolves, by name: torch is imported only where a dtype is asked
# for, so the processes that only read configs and parse requests (the api) start without it
DTYPES = ("float32", "bfloat16", "float16")
LORA_DTYPES = ("auto", "int8")  # the adapter pool's storage: the model's dtype, or int8 rows
# the KV cache's storage: the model's dtype, or FP8 e4m3 (vLLM's and SGLang's spellings)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


# the projections a LoRA adapter may target (PEFT's module names), and the fused groups the
# model computes them in (one GEMM per group and layer; the adapter pool is laid out by group)
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# an MoE base's stacked experts, as PEFT's target_parameters adapts them: one A and one B per
# expert of each parameter, the experts of one rank row side by side (ModelConfig.module_shape)
EXPERT_MODULES = ("experts.gate_up_proj", "experts.down_proj")
MODULE_GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "router": ("router",),  # an MoE layer's router (PEFT: mlp.gate), its logits adapted
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
    "experts_gate_up": ("experts.gate_up_proj",),
    "experts_down": ("experts.down_proj",),
}
EXPERT_GROUPS = ("experts_gate_up", "experts_down")
LINEAR_GROUPS = tuple(g for g in MODULE_GROUPS if g not in EXPERT_GROUPS)
# a dense base's (ModelConfig.lora_groups)
DENSE_GROUPS = tuple(g for g, mods in MODULE_GROUPS.items() if set(mods) <= set(LORA_MODULES))
GROUP_OF = {m: g for g, mods in MODULE_GROUPS.items() for m in mods}
# PEFT target modules some families keep fused (Phi-3): one A and one B stacked over these
FUSED_MODULES: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                             "gate_up_proj": ("gate_proj", "up_proj")}
ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope")
# --lora-target-modules' spellings of every linear module (PEFT's all-linear: not the experts,
# which are parameters, not linear modules), and of both expert parameters
ALL_TARGETS = ("all", "all-linear")
ALL_EXPERTS = "experts"


def target_groups(modules) -> tuple[str, ...]:
    """The module groups of target module names (PEFT's, fused ones included), in
    MODULE_GROUPS order; None or "all" / "all-linear": every linear group; "experts": both
    expert groups."""
    if modules is None:
        return LINEAR_GROUPS
    known = {*GROUP_OF, *FUSED_MODULES, *ALL_TARGETS, ALL_EXPERTS}
    unknown = sorted(set(modules) - known)
    if unknown:
        names = [*LORA_MODULES, *FUSED_MODULES, *EXPERT_MODULES, *ALL_TARGETS, ALL_EXPERTS]
        raise ValueError(f"lora_target_modules: unknown modules {unknown}; known: {names}")
    groups = set(LINEAR_GROUPS) if any(m in ALL_TARGETS for m in modules) else set()
    groups |= set(EXPERT_GROUPS) if ALL_EXPERTS in modules else set()
    groups |= {GROUP_OF[m] for name in modules if name in GROUP_OF or name in FUSED_MODULES
               for m in FUSED_MODULES.get(name, (name,))}
    return tuple(g for g in MODULE_GROUPS if g in groups)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary frequencies (radixlora.model.rope): `rope_type` default, llama3, linear, yarn or
    longrope with its parameters as transformers reads them. attention_factor scales cos and
    sin (yarn, longrope), so the rotated channels of q and k. longrope keeps
    both factor lists: `use_long` (set for a served context past original_max_position) picks
    the long ones."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    use_long: bool = False


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # what the family changes in the decoder (radixlora.families): the family's name, RMSNorm's
    # weight offset (Gemma: 1 + weight), norms after attention and after the MLP too, a norm
    # of each head of q and k, the MLP's gate activation ("silu", "gelu_tanh"), embeddings
    # scaled by sqrt(hidden_size), the attention scale (None: head_dim^-0.5), soft-capping of
    # attention scores and of the final logits, each layer's sliding window (empty: none), the
    # rope of sliding layers where it differs, the rotated dims of a head (None: all)
    family: str = "Llama"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    qk_norm: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_windows: tuple[int | None, ...] = ()
    local_rope: RopeConfig | None = None
    rotary_dim: int | None = None
    # a mixture-of-experts base (qwen3_moe, mixtral): the experts of an MoE layer, the experts
    # each token is routed to, an expert's intermediate size, whether the top-k routing weights
    # are renormalised to sum to 1, and which layers are MoE (empty: a dense base)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    # the served base's weight format: "nf4" (bitsandbytes 4-bit), "fp8", or None (dense); a
    # checkpoint's own quantization_config, or what EngineConfig.quantization asks at load
    quantization: str | None = None
    # an adapter trained on another weight format than `quantization`: "refuse" or "serve"
    # (served, the mismatch reported); radixlora.lora.adapter checks it at validation
    qlora_mismatch: str = "refuse"
    # directories an adapter's base_model_name_or_path may be read from (its config.json, for
    # the base's weight format); a path outside them is a name, never opened. None: any local
    # path (the offline Engine, which reads only its user's files)
    base_roots: tuple[str, ...] | None = None

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a LoRA-targetable projection."""
        h, i = self.hidden_size, self.intermediate_size
        e, mi = self.num_experts, self.moe_intermediate_size
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
            "qkv_proj": (h, self.q_dim + 2 * self.kv_dim),
            "gate_up_proj": (h, 2 * i),
            "router": (h, e),
            # every expert's A rows side by side ([r, E * in]), and B's outputs ([E * out, r])
            "experts.gate_up_proj": (e * h, e * 2 * mi),
            "experts.down_proj": (e * mi, e * h),
        }[module]

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            cfg = json.loads((path / "config.json").read_text())
        except FileNotFoundError as e:
            raise ModelLoadError(f"no config.json in {path}") from e
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"config.json in {path} is not JSON: {e}") from e
        gen = _read_optional_json(path / "generation_config.json")
        return cls.from_hf(cfg, gen)

    @classmethod
    def from_hf(cls, cfg: dict, gen: dict | None = None) -> ModelConfig:
        """A checkpoint's config.json (and generation_config.json) read through its family."""
        family = family_for(cfg.get("model_type", ""))
        if family.text_config is not None and family.text_config in cfg:
            cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings"),
                   "eos_token_id": cfg.get("eos_token_id"),
                   "quantization_config": cfg.get("quantization_config"),
                   **cfg[family.text_config],
                   "model_type": cfg["model_type"]}
            cfg = {k: v for k, v in cfg.items() if v is not None}
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        traits = family.traits({**cfg, "head_dim": head_dim})
        rope = rope_config(traits.pop("rope", None) or _rope_params(cfg), cfg)
        local = traits.pop("local_rope", None)
        bias = bool(cfg.get("attention_bias", False))
        fields = dict(
            arch=cfg["model_type"],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position=cfg.get("max_position_embeddings", 4096),
            rope=rope,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=_eos_ids(cfg, gen or {}),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            quantization=checkpoint_quantization(cfg.get("quantization_config")),
            family=family.name,
            local_rope=None if local is None else rope_config(local, cfg),
        )
        fields.update(traits)
        if not any(fields["layer_windows"]):
            fields["layer_windows"] = ()
        return cls(**fields)

    @property
    def family_spec(self):
        """The Family this base belongs to (radixlora.families)."""
        return family_for(self.arch)

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layers)

    def moe_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """The projections adapters of this base may target: on an MoE base, attention's, the
        router's and the stacked experts' (LoRA on a dense layer's MLP is refused by name)."""
        return LORA_MODULES[:4] + ("router",) + EXPERT_MODULES if self.is_moe else LORA_MODULES

    @property
    def lora_groups(self) -> tuple[str, ...]:
        """The module groups of lora_modules, in MODULE_GROUPS order: those the adapter pool
        holds."""
        groups = {GROUP_OF[m] for m in self.lora_modules}
        return tuple(g for g in MODULE_GROUPS if g in groups)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window; None: it attends to the whole context."""
        return self.layer_windows[layer] if self.layer_windows else None

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rope of layer `layer`: sliding layers have a base of their own in some families
        (Gemma 3's local_rope)."""
        return self.local_rope if self.local_rope and self.window(layer) else self.rope

    @property
    def sm_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def served(self, engine: EngineConfig) -> ModelConfig:
        """This base as `engine` serves it: quantized at load (--quantization) and with its
        policy for adapters trained on another weight format (--qlora-mismatch)."""
        quantization = self.quantization
        if engine.quantization is not None:
            if quantization not in (None, engine.quantization):
                raise ModelLoadError(f"the checkpoint is already {quantization}; "
                                     f"--quantization {engine.quantization} cannot apply")
            quantization = engine.quantization
        served = dataclasses.replace(self, quantization=quantization,
                                     qlora_mismatch=engine.qlora_mismatch)
        if self.rope.rope_type == "longrope":
            long = engine.max_context(self) > self.rope.original_max_position
            served = dataclasses.replace(served, rope=dataclasses.replace(self.rope,
                                                                          use_long=long))
        return served


def checkpoint_quantization(qc: dict | None) -> str | None:
    """The weight format a config.json's quantization_config declares: "nf4" (bitsandbytes
    4-bit NF4), "fp8" (compressed-tensors or vLLM's fp8), None without one; others refused."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "bitsandbytes" and qc.get("load_in_4bit"):
        if qc.get("bnb_4bit_quant_type", "fp4") != "nf4":
            raise ModelLoadError("bitsandbytes 4-bit checkpoints: nf4 only, got "
                                 f"{qc.get('bnb_4bit_quant_type')!r}")
        return "nf4"
    if method in ("fp8", "compressed-tensors"):
        return "fp8"
    raise ModelLoadError(f"quantization_config with quant_method {method!r} is not supported "
                         "(bitsandbytes nf4, fp8, compressed-tensors fp8)")


def _read_optional_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _rope_params(cfg: dict) -> dict:
    """The rope parameters of a config.json: transformers >= 5 writes `rope_parameters`, older
    checkpoints rope_theta and rope_scaling."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def rope_config(params: dict, cfg: dict) -> RopeConfig:
    """RopeConfig from rope parameters as transformers names them (`cfg`: the config.json, for
    the lengths they default to)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # Phi-3's first name for longrope
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: "
                             f"{', '.join(ROPE_TYPES)}")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    original = int(params.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings")
                   or cfg.get("max_position_embeddings", 8192))
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope"):
        factor = cfg.get("max_position_embeddings", original) / original
    rope = RopeConfig(theta=theta, rope_type=rope_type, factor=float(factor or 1.0),
                      original_max_position=original)
    if rope_type == "llama3":
        return dataclasses.replace(rope, low_freq_factor=float(params["low_freq_factor"]),
                                   high_freq_factor=float(params["high_freq_factor"]))
    if rope_type == "yarn":
        return dataclasses.replace(
            rope, beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
            attention_factor=float(params.get("attention_factor") or _yarn_mscale(rope.factor)))
    if rope_type == "longrope":
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if rope.factor <= 1 else math.sqrt(
                1 + math.log(rope.factor) / math.log(original))
        return dataclasses.replace(rope, attention_factor=float(attention),
                                   short_factor=tuple(map(float, params["short_factor"])),
                                   long_factor=tuple(map(float, params["long_factor"])))
    return rope  # linear


def _yarn_mscale(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _eos_ids(cfg: dict, gen: dict) -> tuple[int, ...]:
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of the offline engine and the scheduler/worker processes.

    `kv_pages` and `adapter_rows` size the two device pools, `max_running` and
    `max_batch_tokens` the batches; None (the default) leaves them to radixlora.worker.sizing: sized
    from device memory on CUDA (a `gpu_memory_utilization` share of it, the adapter pool
    holding `max_loras` adapters of rank `max_rank`), small fixed values on the CPU.
    `context_length` caps prompt + output tokens (None: the model's). `max_stacked` caps the
    adapters of one request; `host_adapter_bytes` is the budget of the host tier of packed
    adapters (None: a share of the host memory available at start).
    """

    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 1
    kv_pages: int | None = None
    adapter_rows: int | None = None
    max_running: int | None = None
    max_batch_tokens: int | None = None
    # while requests decode, a step's prefill is capped to last about this long by the measured
    # step costs (radixlora.sched.step_budget); None: steps take max_batch_tokens
    itl_target_ms: float | None = None
    context_length: int | None = None
    gpu_memory_utilization: float = 0.90
    max_loras: int = 32
    host_adapter_bytes: int | None = None
    max_rank: int = 64
    max_stacked: int = 8
    max_adapter_sets_per_batch: int | None = None  # None: as many as the pool's rows hold
    # the modules whose groups get the adapter pool's `adapter_rows` rows (SGLang's
    # --lora-target-modules); the other groups get `max_rank + 1` rows, one adapter of any rank
    # at a time (group_rows). None: every module (once sized: inferred from the adapters given
    # at start, radixlora.worker.sizing.with_start_adapters)
    lora_target_modules: tuple[str, ...] | None = None
    # rank rows (DoRA magnitude rows included) that every adapter given at start takes at once;
    # a default-sized pool of fewer target modules grows past max_loras x max_rank rows only
    # this far (radixlora.worker.sizing.adapter_rows_for). None: no adapter given at start
    start_adapter_rows: int | None = None
    # the largest rank of the adapters given at start: the CUDA graphs of LoRA row buckets up
    # to its bucket are captured before ready, larger ones after (CudaGraphRunner.startup_keys).
    # None: no adapter given at start
    start_adapter_rank: int | None = None
    lora_backend: str = "auto"
    lora_dtype: str = "auto"  # adapter pool storage: "auto" (the model's dtype) or "int8"
    # KV cache storage: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (e4m3, scale 1: K and V
    # are rounded to FP8 as they are stored and read back exactly, as vLLM and SGLang do without
    # calibrated scales)
    kv_cache_dtype: str = "auto"
    # quantize a dense base at load: "nf4" (bitsandbytes'), "fp8" (e4m3, a scale per channel)
    quantization: str | None = None
    qlora_mismatch: str = "refuse"  # an adapter trained on another base format: or "serve"
    attention_backend: str = "auto"
    enable_radix_cache: bool = True
    cuda_graph: bool = True  # decode steps replay captured graphs (CUDA only)
    lora_side_stream: bool = True  # in graphs, LoRA work runs beside the base GEMMs
    overlap_schedule: bool = True  # plan step N+1 while step N runs on the device
    warm_up: bool = True  # CUDA: compile kernels and capture every graph before serving
    # CUDA: compiled kernels and their manifests, kept across starts
    # (radixlora.worker.compile_cache; None: ~/.cache/radixlora/compile, or Triton's
    # TRITON_CACHE_DIR when that is set)
    compile_cache_dir: str | None = None
    seed: int = 0
    load_format: str = "safetensors"  # or "dummy": random weights, for benchmarks
    # what compiling one request's grammar may take (radixlora.structured.GrammarBudget)
    grammar_compile_timeout: float = 10.0
    grammar_compile_memory_mb: int = 512

    def __post_init__(self):
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.quantization not in (None, "nf4", "fp8"):
            raise ValueError(f"quantization must be nf4, fp8 or None, got "
                             f"{self.quantization!r}")
        if self.qlora_mismatch not in ("refuse", "serve"):
            raise ValueError(f"qlora_mismatch must be refuse or serve, got "
                             f"{self.qlora_mismatch!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {list(LORA_DTYPES)}, "
                             f"got {self.lora_dtype!r}")
        if self.itl_target_ms is not None and self.itl_target_ms <= 0:
            raise ValueError(f"itl_target_ms must be > 0, got {self.itl_target_ms}")
        if self.grammar_compile_timeout <= 0:
            raise ValueError(f"grammar_compile_timeout must be > 0, got "
                             f"{self.grammar_compile_timeout}")
        if self.host_adapter_bytes is not None and self.host_adapter_bytes < 0:
            raise ValueError(f"host_adapter_bytes must be >= 0, got {self.host_adapter_bytes}")
        if self.lora_target_modules is not None:  # a list, from JSON, becomes a tuple
            object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))
            target_groups(self.lora_target_modules)
        for name in ("kv_pages", "adapter_rows", "max_running", "max_batch_tokens",
                     "context_length", "max_loras", "max_rank", "max_stacked", "page_size",
                     "max_adapter_sets_per_batch", "grammar_compile_memory_mb",
                     "start_adapter_rows", "start_adapter_rank"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @property
    def sized(self) -> bool:
        """Every pool and batch limit is set (radixlora.worker.sizing.resolve has run)."""
        return None not in (self.kv_pages, self.adapter_rows, self.max_running,
                            self.max_batch_tokens, self.host_adapter_bytes)

    def max_context(self, model: ModelConfig) -> int:
        """Prompt + output tokens one request may reach: --context-length, at most the model's."""
        if self.context_length is None:
            return model.max_position
        if self.context_length > model.max_position:
            raise ValueError(f"context_length {self.context_length} exceeds the model's "
                             f"max_position_embeddings ({model.max_position})")
        return self.context_length

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        name = self.dtype
        if name == "auto":
            name = model.torch_dtype if model.torch_dtype in DTYPES else "float32"
            if name != "float32" and self.resolved_device() == "cpu":
                name = "float32"
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or auto, got {name!r}")
        import torch

        return getattr(torch, name)

    def group_rows(self, groups: Iterable[str] = DENSE_GROUPS) -> dict[str, int]:
        """Rows of each of these module groups' adapter pools (sized; the model's lora_groups,
        by default a dense base's): `adapter_rows` for the target modules' groups, `max_rank +
        1` (at most `adapter_rows`) for the other linear ones, so that an adapter of any rank,
        DoRA's magnitude row included, still fits; none for the experts unless targeted (a rank
        row of every expert is some hundred times a linear group's, so the pool holds them only
        when asked: --lora-target-modules experts, or an expert adapter given at start)."""
        targets = target_groups(self.lora_target_modules)
        floor = min(self.adapter_rows, self.max_rank + 1)
        return {g: self.adapter_rows if g in targets else floor if self.holds(g) else 0
                for g in groups}

    def holds(self, group: str) -> bool:
        """Whether the adapter pool has rows of `group`: every linear group, an MoE base's
        expert groups only when targeted (group_rows)."""
        return group not in EXPERT_GROUPS or group in target_groups(self.lora_target_modules)

    def kv_storage_dtype(self, model: ModelConfig) -> torch.dtype:
        """The KV pool's storage dtype: FP8 e4m3 or the model's compute dtype."""
        import torch

        if self.kv_cache_dtype.startswith("fp8"):
            return torch.float8_e4m3fn
        return self.torch_dtype(model)

    def lora_pool_dtype(self, model: ModelConfig) -> torch.dtype:
        """The adapter pool's storage dtype: int8 (rows dequantized in the LoRA kernels) or
        the model's compute dtype."""
        import torch

        return torch.int8 if self.lora_dtype == "int8" else self.torch_dtype(model)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
