"""Flags shared by the commands that build an Engine (`radixlora serve`, `radixlora batch`): the
EngineConfig overrides (with vLLM's and SGLang's spellings), the model (a directory or a Hugging
Face id) and its adapters in every accepted form, and the bundled demo as the default model.
Nothing here imports torch: `--help` and bad flags answer at once."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's and SGLang's spellings
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", *DTYPE_ALIASES)
DEVICE_CHOICES = ("auto", "cuda", "cpu")
LORA_DTYPE_CHOICES = ("auto", "int8")

# EngineConfig field -> (type, its flags: ours first, then vLLM's and SGLang's spellings, help)
ENGINE_FLAGS = {
    "gpu_memory_utilization": (float, ("--gpu-memory-utilization", "--mem-fraction-static"),
                               "share of the GPU's memory for weights, KV and adapter pools, "
                               "activations and graphs (default 0.90)"),
    "kv_pages": (int, ("--kv-pages",), "KV pool pages (default: sized from GPU memory; 4096 "
                                       "on the CPU)"),
    "page_size": (int, ("--page-size", "--block-size"), "tokens per KV page (default 1)"),
    "max_loras": (int, ("--max-loras",), "adapters of --max-lora-rank the device's adapter pool "
                                         "holds at once (default 32)"),
    "max_rank": (int, ("--max-lora-rank", "--max-rank"), "largest adapter rank accepted "
                                                         "(default 64)"),
    "adapter_rows": (int, ("--adapter-rows",), "adapter pool rank rows (default: --max-loras x "
                                               "--max-lora-rank; 512 on the CPU)"),
    "max_adapter_sets_per_batch": (
        int, ("--max-adapter-sets-per-batch", "--max-loras-per-batch"),
        "distinct adapter sets (the base model counts as one) in one batch; requests on more "
        "wait (default: as many as the adapter pool's rows hold)"),
    "host_adapter_bytes": (int, ("--host-adapter-bytes",), "bytes of the host tier of packed "
                                                           "adapters (default: 25%% of the "
                                                           "host memory available at start)"),
    "max_stacked": (int, ("--max-stacked",), "adapters one request may stack (default 8)"),
    "max_running": (int, ("--max-running", "--max-num-seqs", "--max-running-requests"),
                    "requests decoding at once (default 256 on a GPU, 64 on the CPU)"),
    "max_batch_tokens": (int, ("--max-batch-tokens", "--max-num-batched-tokens",
                               "--chunked-prefill-size"),
                         "prompt tokens per step, longer prompts are chunked (default by GPU "
                         "memory: 8192 on a 60-160 GiB GPU; 2048 on the CPU)"),
    "itl_target_ms": (float, ("--itl-target-ms",),
                      "while requests decode, cap each step's prompt tokens so that the step "
                      "(one inter-token gap of every stream) lasts about this many ms, by the "
                      "step times measured so far; prompts alone still take "
                      "--max-batch-tokens (default: no cap)"),
    "context_length": (int, ("--context-length", "--max-model-len"),
                       "prompt + output tokens per request (default: the model's)"),
    "device": (str, ("--device",), "where to run; auto: cuda when available, else cpu "
                                   "(default auto)"),
    "dtype": (str, ("--dtype",), "weights' and pools' dtype; auto: the checkpoint's on a GPU, "
                                 "float32 on the CPU; half = float16, float = float32 "
                                 "(default auto)"),
    "lora_dtype": (str, ("--lora-dtype",), "adapter pool storage; auto: the model's dtype; int8: "
                                           "A and B rows in int8 with a scale per row, "
                                           "dequantized in the LoRA kernels, about half the "
                                           "bytes per adapter (default auto)"),
    "kv_cache_dtype": (str, ("--kv-cache-dtype",), "KV cache storage; auto: the model's dtype; "
                                                   "fp8 (or fp8_e4m3): e4m3 with scale 1, "
                                                   "twice the tokens per GiB (default auto)"),
    "quantization": (str, ("--quantization",), "quantize a dense base's projections at load: "
                                               "nf4 as bitsandbytes does (blocksize 64), fp8 "
                                               "as e4m3 with a scale per output channel; a "
                                               "checkpoint's own quantization_config needs no "
                                               "flag (default: none)"),
    "load_format": (str, ("--load-format",), "safetensors: the checkpoint's weights; dummy: "
                                             "random weights of the shape its config.json "
                                             "gives, no weight file read (benchmarks of "
                                             "models larger than the disk; default "
                                             "safetensors)"),
    "seed": (int, ("--seed", "--random-seed"), "seeds the sampling of requests that give no "
                                                "seed of their own, so a server started "
                                                "again with it answers the same requests "
                                                "alike (default 0)"),
    "qlora_mismatch": (str, ("--qlora-mismatch",), "an adapter trained on another base weight "
                                                   "format (a QLoRA adapter on a dense base, or "
                                                   "the reverse): refuse it, or serve it and "
                                                   "report the mismatch (default refuse)"),
    "grammar_compile_timeout": (float, ("--grammar-compile-timeout",),
                                "seconds compiling one request's grammar (JSON schema, regex, "
                                "choice, EBNF) may take before the request is refused with a "
                                "400 (default 10)"),
    "grammar_compile_memory_mb": (int, ("--grammar-compile-memory",),
                                  "MiB of memory compiling one request's grammar may take "
                                  "before the request is refused with a 400 (default 512)"),
}
CHOICES = {"device": DEVICE_CHOICES, "dtype": DTYPE_CHOICES, "lora_dtype": LORA_DTYPE_CHOICES,
           "quantization": ("nf4", "fp8"), "qlora_mismatch": ("refuse", "serve"),
           "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3"), "load_format": ("safetensors", "dummy")}


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text already says it (flags
    whose default is computed at start-up) or the option is an on/off switch."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is argparse.SUPPRESS
        if ("default" in text or unset or action.default == [] or action.nargs == 0
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def positive(kind, allow_zero: bool = False):
    """An argparse type: a number of `kind`, > 0 (>= 0 with allow_zero)."""

    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {value!r}") from None
        if not (number >= 0 if allow_zero else number > 0):
            raise argparse.ArgumentTypeError(f"must be {'>=' if allow_zero else '>'} 0, got "
                                             f"{value}")
        return number

    parse.__name__ = kind.__name__
    return parse


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """EngineConfig overrides (default: the config's, sized on the device)."""
    for field, (kind, flags, help_text) in ENGINE_FLAGS.items():
        choices = CHOICES.get(field)
        kind = kind if choices else positive(kind, allow_zero=field in ("host_adapter_bytes",
                                                                        "seed"))
        p.add_argument(*flags, dest=field, type=kind,
                       default=None, choices=choices, help=help_text)
    p.add_argument("--max-cpu-loras", type=positive(int), default=None, metavar="N",
                   help="size the host tier to hold N adapters of --max-lora-rank on every "
                        "target module (sets --host-adapter-bytes; default: see that flag)")
    p.add_argument("--lora-target-modules", dest="lora_target_modules", nargs="+",
                   default=None, metavar="MODULE",
                   help="the modules the adapter pool is sized for (SGLang's flag): their "
                        "groups get the pool's rows, the other modules room for one adapter "
                        "of --max-lora-rank at a time, an MoE base's experts none unless "
                        "named (experts) (default: the modules of the adapters given at "
                        "start, else every linear one)")
    p.add_argument("--disable-overlap-schedule", dest="overlap_schedule", action="store_false",
                   default=None, help="fold each step's results in before planning the next "
                                      "(default: overlap on)")
    p.add_argument("--disable-cuda-graph", "--enforce-eager", dest="cuda_graph",
                   action="store_false", default=None,
                   help="run every step eagerly (default: CUDA graphs on a GPU)")
    p.add_argument("--compile-cache-dir", dest="compile_cache_dir", default=None, metavar="DIR",
                   help="where compiled GPU kernels are kept for later starts; mount it in a "
                        "container, or fill it ahead with `radixlora warmup` (default: "
                        "~/.cache/radixlora/compile, or TRITON_CACHE_DIR when that is set)")
    p.add_argument("--disable-radix-cache", dest="enable_radix_cache", action="store_false",
                   default=None, help="no prefix cache: every prompt is computed in full "
                                      "(default: the radix cache on)")
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="accepted for vLLM compatibility: the prefix cache is on unless "
                        "--disable-radix-cache")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM/SGLang compatibility: radixlora never runs a "
                        "checkpoint's own code, and a model whose architecture it does not "
                        "implement is refused at start with or without this flag")


def engine_overrides(args: argparse.Namespace) -> dict:
    fields = (*ENGINE_FLAGS, "overlap_schedule", "cuda_graph", "enable_radix_cache",
              "compile_cache_dir", "lora_target_modules")
    out = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    if "dtype" in out:
        out["dtype"] = DTYPE_ALIASES.get(out["dtype"], out["dtype"])
    return out


def resolved_overrides(args: argparse.Namespace, model: str | Path) -> dict:
    """engine_overrides plus what needs the model: --max-cpu-loras as host tier bytes (that many
    adapters of --max-lora-rank on every target module, packed in the adapter pool's dtype)."""
    out = engine_overrides(args)
    count = getattr(args, "max_cpu_loras", None)
    if count is None:
        return out
    if "host_adapter_bytes" in out:
        raise SystemExit("give either --max-cpu-loras or --host-adapter-bytes, not both")
    from radixlora.config import EngineConfig, ModelConfig
    from radixlora.lora.layout import bytes_per_row

    config = EngineConfig(**out)
    model_cfg = ModelConfig.from_dir(model)
    row_bytes = bytes_per_row(model_cfg, config.lora_pool_dtype(model_cfg))
    out["host_adapter_bytes"] = count * config.max_rank * row_bytes
    return out


def adapter_pairs(values: list[str], flag: str = "--adapter") -> dict[str, str]:
    pairs = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"{flag} expects NAME=PATH, got {value!r}")
        pairs[name] = path
    return pairs


def lora_modules(values: list[str]) -> dict[str, str]:
    """vLLM's --lora-modules: NAME=PATH or JSON {"name", "path", "base_model_name"}."""
    pairs = {}
    for value in values:
        if value.lstrip().startswith("{"):
            name, path, _ = _json_pair(value, "--lora-modules", "name", "path")
            pairs[name] = path
        else:
            pairs.update(adapter_pairs([value], "--lora-modules"))
    return pairs


def lora_paths(values: list[str]) -> dict[str, str]:
    """SGLang's --lora-paths: PATH (named after its directory), NAME=PATH, or JSON
    {"lora_name", "lora_path", "pinned"}."""
    pairs = {}
    for value in values:
        if value.lstrip().startswith("{"):
            name, path, spec = _json_pair(value, "--lora-paths", "lora_name", "lora_path")
            if spec.get("pinned"):
                raise SystemExit(f"--lora-paths: pinning at start-up is not supported ({name}); "
                                 "pin it with POST /v1/pin_lora_adapter once the server runs")
            pairs[name] = path
        elif "=" in value:
            pairs.update(adapter_pairs([value], "--lora-paths"))
        else:
            pairs[Path(value.rstrip(os.sep)).name or value] = value
    return pairs


def _json_pair(value: str, flag: str, name_key: str, path_key: str) -> tuple[str, str, dict]:
    """(name, path, the whole object) of a JSON adapter spec; both keys non-empty strings."""
    spec = _json_object(value, flag)
    name, path = spec.get(name_key), spec.get(path_key)
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise SystemExit(f'{flag} JSON needs "{name_key}" and "{path_key}", got {value!r}')
    return name, path, spec


def _json_object(value: str, flag: str) -> dict:
    try:
        spec = json.loads(value)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: {value!r} is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise SystemExit(f"{flag}: expected a JSON object, got {value!r}")
    return spec


def add_model_flags(p: argparse.ArgumentParser, positional: bool = False) -> None:
    """The model and its adapters: --model (or vLLM's positional MODEL, SGLang's
    --model-path), --adapter NAME=PATH, vLLM's --lora-modules, SGLang's --lora-paths."""
    if positional:
        p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                       help="as --model (vLLM's `vllm serve MODEL`)")
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="a Hugging Face checkpoint directory, or a Hugging Face model id "
                        "resolved through the local Hugging Face cache (downloaded when "
                        "missing; needs huggingface_hub) (default: the bundled demo model and "
                        "its four adapters)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="a PEFT LoRA adapter (directory or Hugging Face id) served as NAME; "
                        "repeatable (default: none)")
    p.add_argument("--lora-modules", action="extend", nargs="+", default=[],
                   metavar="NAME=PATH|JSON",
                   help='vLLM\'s form of --adapter: NAME=PATH or {"name": ..., "path": ...} '
                        "(default: none)")
    p.add_argument("--lora-paths", action="extend", nargs="+", default=[],
                   metavar="[NAME=]PATH|JSON",
                   help="SGLang's form of --adapter: PATH (named after its directory), "
                        'NAME=PATH or {"lora_name": ..., "lora_path": ...} (default: none)')
    p.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM/SGLang compatibility: LoRA is always on")
    p.add_argument("--served-model-name", default=None,
                   help="the base model's name in requests (default: the model directory's "
                        "name; radixlora-demo for the demo)")


def model_and_adapters(args: argparse.Namespace) -> tuple[str | Path, dict[str, str], str | None]:
    """(model directory, adapters by name, served model name) of --model (or MODEL), the
    adapter flags and --served-model-name; without a model, the bundled demo model and its
    adapters. Hugging Face ids are resolved to their snapshot directories."""
    from radixlora.cli.hub import resolve

    positional = getattr(args, "model_arg", None)
    if positional is not None and args.model is not None and positional != args.model:
        raise SystemExit(f"two models given: MODEL {positional!r} and --model {args.model!r}")
    model, served_name = positional or args.model, args.served_model_name
    adapters: dict[str, str] = {}
    for given in (adapter_pairs(args.adapter), lora_modules(getattr(args, "lora_modules", [])),
                  lora_paths(getattr(args, "lora_paths", []))):
        for name, path in given.items():
            if name in adapters and adapters[name] != path:
                raise SystemExit(f"adapter {name!r} is given twice: {adapters[name]} and {path}")
            adapters[name] = path
    if model is None:  # the bundled demo: a small trained model and one adapter per task
        from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

        model, served_name = DEMO_MODEL_DIR, served_name or "radixlora-demo"
        for name, path in DEMO_ADAPTERS.items():
            adapters.setdefault(name, str(path))
    else:
        local = resolve(str(model), "--model")
        if served_name is None and local != model and not Path(str(model)).exists():
            served_name = str(model)  # a Hugging Face id is served under its id, as vLLM does
        model = local
    adapters = {name: str(resolve(path, f"adapter {name}")) for name, path in adapters.items()}
    return model, adapters, served_name


TORCHRUN_ENV = "TORCHELASTIC_RUN_ID"  # torchrun sets it in every process it starts


def add_multinode_flags(p: argparse.ArgumentParser) -> None:
    """SGLang's multi-node tensor-parallel flags; under torchrun its environment gives them."""
    p.add_argument("--nnodes", type=positive(int), default=None, metavar="N",
                   help="nodes the tensor-parallel ranks span, tensor-parallel-size / N on each "
                        "(default 1; under torchrun: its GROUP_WORLD_SIZE)")
    p.add_argument("--node-rank", type=positive(int, allow_zero=True), default=None,
                   metavar="R",
                   help="this node: 0 serves HTTP and schedules, another only runs its worker "
                        "ranks, R * tensor-parallel-size / nnodes onwards (default 0; under "
                        "torchrun: its GROUP_RANK)")
    p.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="where every node's ranks meet: a TCPStore that rank 0 on node 0 hosts "
                        "(needed with --nnodes > 1; default: a file in the server's private "
                        "directory; under torchrun: MASTER_ADDR:MASTER_PORT)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="keep the server's state (snapshots of adapters loaded while serving, "
                        "which every rank reads) in a new private directory in DIR, removed at "
                        "exit; with --nnodes > 1, a DIR every node mounts at the same path "
                        "(default: in the server's private temporary directory)")


def multinode(args: argparse.Namespace, environ=os.environ) -> tuple[int, int, str | None]:
    """(nnodes, node_rank, dist_init_addr): the flags'; under torchrun (one `radixlora serve`
    per node) its environment's, which a flag given too must equal."""
    flags = {"--nnodes": args.nnodes, "--node-rank": args.node_rank,
             "--dist-init-addr": args.dist_init_addr}
    if TORCHRUN_ENV not in environ:
        return args.nnodes or 1, args.node_rank or 0, args.dist_init_addr
    resolved = torchrun_nodes(environ)
    for (flag, value), env_value in zip(flags.items(), resolved):
        if value is not None and value != env_value:
            raise SystemExit(f"{flag} {value} disagrees with torchrun's environment "
                             f"({env_value}); leave it out under torchrun")
    return resolved


def torchrun_nodes(environ) -> tuple[int, int, str | None]:
    """(nnodes, node_rank, dist_init_addr) of the environment torchrun gives its processes:
    GROUP_WORLD_SIZE, GROUP_RANK and MASTER_ADDR:MASTER_PORT (torchrun's own store, which the
    ranks join; with one node they meet in the private directory instead)."""
    if environ.get("LOCAL_WORLD_SIZE", "1") != "1":
        raise SystemExit("under torchrun, run one radixlora serve per node (--nproc-per-node 1)"
                         ": it starts the node's tensor-parallel ranks itself")
    try:
        nnodes, node_rank = int(environ["GROUP_WORLD_SIZE"]), int(environ["GROUP_RANK"])
        addr = f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}" if nnodes > 1 else None
    except (KeyError, ValueError) as e:
        raise SystemExit(f"{TORCHRUN_ENV} is set but torchrun's environment is not "
                         f"complete: {e}") from None
    return nnodes, node_rank, addr
