"""Command line: `radixlora serve` (the multi-process HTTP/ZeroMQ server; with no model, the
bundled demo), `radixlora demo` (the demo through the offline Engine) and `radixlora batch` (a
JSONL file of OpenAI batch requests: radixlora.cli.batch). The flags the commands that build an
Engine share are in radixlora.cli.flags. torch and the runtime are imported only once the flags
are parsed, so `--help`, `--version` and flag errors answer at once."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys
from pathlib import Path

from radixlora import __version__
from radixlora.cli.flags import (
    HelpFormatter,
    add_engine_flags,
    add_model_flags,
    add_multinode_flags,
    engine_overrides,
    model_and_adapters,
    multinode,
    positive,
    resolved_overrides,
)
from radixlora.protocol.tools import PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
log = logging.getLogger("radixlora.cli")


class StartError(Exception):
    """A start-up failure found before any process starts: printed as one line."""


def demo(args: argparse.Namespace) -> None:
    """The bundled demo through the offline Engine: one prompt, every adapter set, one batch."""
    from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR, format_prompt
    from radixlora.engine import Engine
    from radixlora.sampling_params import SamplingParams

    engine = Engine(DEMO_MODEL_DIR, adapters=DEMO_ADAPTERS)
    prompt = format_prompt(args.text)
    specs = [None, *DEMO_ADAPTERS, [("upper", 1.0), ("reverse", 1.0)]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    outs = engine.generate([prompt] * len(specs), params, adapters=specs)
    print(f"prompt: {prompt!r}  (bundled demo model; one batched forward per step)")
    for out in outs:
        print(f"  [{out.adapters:>14}] {out.outputs[0].text.strip()}")


def check_port(host: str, port: int, flag: str) -> None:
    """Fail now, before anything loads, if host:port cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise StartError(f"port {port} on {host} is already in use; choose another "
                                 f"with {flag}") from e
            raise StartError(f"cannot listen on {host}:{port}: {e.strerror or e}; choose "
                             f"another {flag}") from e


def check_device(overrides: dict) -> None:
    if overrides.get("device") != "cuda":
        return
    import torch

    if torch.version.cuda is None:
        raise StartError(f"--device cuda: torch {torch.__version__} is a build without CUDA; "
                         "use --device cpu (or auto)")
    if not torch.cuda.is_available():
        raise StartError("--device cuda: no CUDA device is visible; use --device cpu (or auto)")


def check_replicas(overrides: dict, replicas: int) -> None:
    """On CUDA, replica i runs on device i: there must be as many devices as replicas."""
    if replicas == 1 or overrides.get("device") == "cpu":
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (overrides.get("device") == "cuda" or count) and count < replicas:
        raise StartError(f"--data-parallel-size {replicas} needs {replicas} CUDA devices "
                         f"(replica i runs on device i), {count} visible; use fewer replicas or "
                         "--device cpu")


def serve(args: argparse.Namespace) -> None:
    from radixlora.server.ipc import setup_logging

    setup_logging(args.log_level, "api")
    try:
        server_args = prepare(args)
    except StartError as e:
        raise SystemExit(f"radixlora serve: error: {e}") from None
    except SystemExit as e:  # a flag's value (adapter spec, model path) is wrong
        if isinstance(e.code, str):
            raise SystemExit(f"radixlora serve: error: {e.code}") from None
        raise
    from radixlora.server.procs.launcher import serve as run_server

    raise SystemExit(run_server(server_args))


def prepare(args: argparse.Namespace):
    """The ServerArgs of the flags, every check that can be made before a process starts
    made: the flags' values, the model's config, the adapters' paths, the device, and last the
    ports, so that a wrong flag is reported as such whatever else listens."""
    log.info("radixlora %s: checking the flags and ports", __version__)
    from radixlora.config import EngineConfig, ModelConfig
    from radixlora.errors import RadixLoraError

    try:
        EngineConfig(**engine_overrides(args))
    except ValueError as e:
        raise StartError(_flag_hint(str(e))) from e
    nodes = multinode(args)
    for flag, field, env in KEY_SOURCES:
        key = getattr(args, field)
        if key is not None and not key.strip():
            raise StartError(f"{flag} is empty: give a key, or leave the flag out to serve "
                             "without one")
        if key is None and env in os.environ and not os.environ[env].strip():
            raise StartError(f"{env} is set but empty (an unset variable in `{env}=$KEY`?): "
                             "give a key, or unset it to serve without one")
    if args.adapter_dir is not None and not os.path.isdir(args.adapter_dir):
        raise StartError(f"--adapter-dir {args.adapter_dir} is not a directory")
    if args.state_dir is not None and not os.path.isdir(args.state_dir):
        raise StartError(f"--state-dir {args.state_dir} is not a directory")
    if args.otlp_traces_endpoint:
        from radixlora.server.http.tracing import check_available

        try:
            check_available()
        except RadixLoraError as e:
            raise StartError(str(e)) from e
    model, adapters, served_name = model_and_adapters(args)
    log.info("model %s, adapters: %s", model, ", ".join(sorted(adapters)) or "none")
    try:
        model_cfg = ModelConfig.from_dir(model)
        overrides = resolved_overrides(args, model)
        check_device(overrides)
        check_replicas(overrides, args.data_parallel_size)
        server_args = _server_args(args, model, adapters, served_name, overrides, nodes)
        engine = server_args.engine_config()
        engine.max_context(model_cfg.served(engine))
    except (ValueError, RadixLoraError) as e:
        raise StartError(_flag_hint(str(e))) from e
    from radixlora.sched.adapter_choice import check_adapter_name

    served = server_args.served_model(engine)
    from radixlora.lora.header import check_header  # torch-free, as the api process stays
    for name, path in adapters.items():
        try:
            check_adapter_name(name, frozenset({server_args.model_name}))
        except RadixLoraError as e:
            raise StartError(f"{e} (an adapter's name: --adapter, --lora-modules or "
                             "--lora-paths NAME=PATH)") from e
        try:  # its config and safetensors header, before any process loads the model
            check_header(name, path, served, engine.max_rank)
        except RadixLoraError as e:
            raise StartError(str(e)) from e
    if nodes[1] == 0:  # a node > 0 serves neither HTTP nor ZeroMQ clients
        check_port(args.host, args.port, "--port")
        if args.zmq_client_port is not None:
            check_port("127.0.0.1", args.zmq_client_port, "--zmq-client-port")
    return server_args


# EngineConfig/ServerArgs messages name the field; the flag that sets it fixes it
FIELD_FLAGS = {"context_length": "--context-length", "gpu_memory_utilization":
               "--gpu-memory-utilization", "no config.json": "--model"}


def _flag_hint(message: str) -> str:
    for field, flag in FIELD_FLAGS.items():
        if field in message and flag not in message:
            return f"{message} (set by {flag})"
    return message


def _server_args(args: argparse.Namespace, model, adapters: dict[str, str], served_name,
                 engine: dict, nodes: tuple[int, int, str | None]):
    from radixlora.server.args import ServerArgs

    return ServerArgs(
        model=str(model),
        adapters=adapters,
        served_model_name=served_name,
        tokenizer=tokenizer_dir(args),
        chat_template=chat_template_source(args.chat_template),
        host=args.host,
        port=args.port,
        zmq_client_port=args.zmq_client_port,
        engine=engine,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=nodes[0],
        node_rank=nodes[1],
        dist_init_addr=nodes[2],
        state_root=args.state_dir,
        data_parallel_size=args.data_parallel_size,
        router_policy=args.router_policy,
        vllm_metric_names=args.vllm_metric_names,
        drain_timeout_s=args.drain_timeout,
        step_timeout_s=args.step_timeout,
        watchdog_timeout_s=args.watchdog_timeout,
        ready_timeout_s=args.ready_timeout,
        log_level=args.log_level,
        log_requests=args.log_requests,
        stats_interval_s=args.stats_interval,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        adapter_dir=args.adapter_dir,
        adapter_rate=args.adapter_rate,
        adapter_burst=args.adapter_burst,
        adapter_quiet_s=args.adapter_quiet,
        max_swaps_per_s=args.max_swaps_per_s,
        adapter_failure_policy=args.adapter_failure_policy,
        enable_admin=args.enable_admin,
        admin_api_key=key_of(args, "admin_api_key") or None,
        api_key=key_of(args, "api_key"),
        zmq_client_key=key_of(args, "zmq_client_key"),
        allowed_adapter_roots=args.allowed_adapter_root,
        tool_call_parser=args.tool_call_parser,
        max_logprob_entries=args.max_logprob_entries,
        responses_store_bytes=args.responses_store_bytes,
        responses_store_ttl_s=args.responses_store_ttl,
    )


# a key's flag, its field, and the environment variable it is read from without the flag
KEY_SOURCES = (("--api-key", "api_key", "RADIXLORA_API_KEY"),
               ("--admin-api-key", "admin_api_key", "RADIXLORA_ADMIN_API_KEY"),
               ("--zmq-client-key", "zmq_client_key", "RADIXLORA_ZMQ_CLIENT_KEY"))


def key_of(args: argparse.Namespace, field: str) -> str:
    """A key from its flag, else its environment variable ("" for none; prepare() refused an
    empty one)."""
    env = next(e for _, f, e in KEY_SOURCES if f == field)
    return getattr(args, field) or os.environ.get(env, "")


def tokenizer_dir(args: argparse.Namespace) -> str:
    """--tokenizer resolved to a directory holding a tokenizer.json ("" without the flag)."""
    if args.tokenizer is None:
        return ""
    from radixlora.cli.hub import resolve

    path = Path(resolve(args.tokenizer, "--tokenizer"))
    if not (path / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer {args.tokenizer}: no tokenizer.json in {path}")
    return str(path)


def chat_template_source(value: str | None) -> str:
    """--chat-template's template text: a file's, else the value itself if it is a template;
    "" without the flag. A template that does not compile stops the launch."""
    if value is None:
        return ""
    path = Path(value)
    if path.is_file():
        source = path.read_text()
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise SystemExit(f"--chat-template {value}: no such file, and not a Jinja template")
    import jinja2

    from radixlora.text.chat import ChatTemplate

    try:
        ChatTemplate(source)
    except jinja2.TemplateError as e:
        raise SystemExit(f"--chat-template: the template does not compile: {e}") from None
    return source


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", formatter_class=HelpFormatter,
                       help="serve a model and its adapters over HTTP and ZeroMQ",
                       description="Serve a model and its LoRA adapters (OpenAI, SGLang and "
                                   "ZeroMQ APIs). Without a model: the bundled demo.")
    add_model_flags(p, positional=True)
    p.add_argument("--adapter-dir", default=None,
                   help="watch DIR (registry process): every sub-directory is an adapter named "
                        "after it, hot-swapped as it is added, rewritten or deleted (default: "
                        "none)")
    p.add_argument("--adapter-rate", type=positive(float, allow_zero=True), default=1.0,
                   help="new adapters admitted per second from --adapter-dir (token bucket)")
    p.add_argument("--adapter-burst", type=positive(int), default=1,
                   help="new adapters --adapter-dir may admit at once (the bucket's size)")
    p.add_argument("--adapter-quiet", type=positive(float, allow_zero=True), default=0.5,
                   help="seconds --adapter-dir must be quiet before a change is examined")
    p.add_argument("--max-swaps-per-s", type=positive(float, allow_zero=True), default=10.0,
                   help="hard cap on adapter loads into the device pool, in full-size swaps (an "
                        "adapter of --max-lora-rank on every module) per second; smaller "
                        "adapters cost their share of the bytes (0: none)")
    p.add_argument("--adapter-failure-policy", choices=("reject", "base"), default="reject",
                   help="a request naming an unknown or rejected adapter: reject it (404), or "
                        "serve it with the base model and say so")
    p.add_argument("--enable-admin", action="store_true",
                   help="enable POST /v1/{load,unload,pin,unpin}_lora_adapter, /flush_cache, "
                        "/get_server_info (off by default)")
    p.add_argument("--admin-api-key", default=None,
                   help="Bearer key of the admin endpoints (default: $RADIXLORA_ADMIN_API_KEY)")
    p.add_argument("--api-key", default=None,
                   help="clients must send Authorization: Bearer KEY on every endpoint but "
                        "/health, /metrics and /version (default: $RADIXLORA_API_KEY, else "
                        "no key)")
    p.add_argument("--allowed-adapter-root", action="append", default=[], metavar="DIR",
                   help="directory the admin endpoints may load adapters from; repeatable "
                        "(default: none, so HTTP loads are refused)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP address to bind")
    p.add_argument("--port", type=port_number, default=30000, help="HTTP port")
    p.add_argument("--zmq-client-port", type=port_number, default=None,
                   help="tcp://127.0.0.1:PORT for ZeroMQ clients (default: an ipc:// socket)")
    p.add_argument("--zmq-client-key", default=None,
                   help="ZeroMQ clients must send this key (RuntimeClient(api_key=KEY)) "
                        "(default: $RADIXLORA_ZMQ_CLIENT_KEY, else the --api-key, else none)")
    p.add_argument("--max-logprob-entries", type=positive(int), default=None, metavar="N",
                   help="logprob entries (a token's logprob, or one of its top alternatives) "
                        "one request may return, over its prompts, samples and prompt and "
                        "output tokens (default: the context length x 21, one full context "
                        "with 20 top logprobs)")
    p.add_argument("--responses-store-bytes", type=positive(int, allow_zero=True),
                   default=256 << 20, metavar="BYTES",
                   help="memory of the api process that stored /v1/responses may take (their "
                        "JSON size; the least recently used go first; 0: store none)")
    p.add_argument("--responses-store-ttl", type=positive(float), default=3600.0,
                   metavar="SECONDS",
                   help="how long a stored /v1/responses response can be read back or continued "
                        "with previous_response_id")
    p.add_argument("--drain-timeout", type=positive(float, allow_zero=True), default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--step-timeout", type=positive(float), default=600.0,
                   help="seconds one worker step may take before the worker counts as hung")
    p.add_argument("--tensor-parallel-size", "--tp-size", "-tp", type=positive(int), default=1,
                   metavar="N", help="worker processes, one per device (gloo ranks on the CPU), "
                                     "each holding 1/N of the model's heads and rows")
    add_multinode_flags(p)
    p.add_argument("--data-parallel-size", "--dp-size", "-dp", type=positive(int), default=1,
                   metavar="N", help="replicas (a scheduler and a worker each) behind one api "
                                     "and tokenizer; on CUDA replica i runs on device i, on the "
                                     "CPU every replica uses the CPU")
    p.add_argument("--router-policy", choices=("cache_aware", "round_robin"),
                   default="cache_aware",
                   help="how the replicas share requests: where the request's prefix is cached "
                        "and its adapters run, bounded by load; or in turn")
    p.add_argument("--vllm-metric-names", action="store_true",
                   help="/metrics also exports the queue, KV and LoRA gauges under vLLM's names "
                        "(vllm:num_requests_waiting, vllm:kv_cache_usage_perc, "
                        "vllm:lora_requests_info, ...), which the Gateway API inference "
                        "extension's endpoint picker reads")
    p.add_argument("--ready-timeout", type=positive(float), default=600.0,
                   help="seconds the worker may take to load the model and size its pools, and "
                        "again to warm up (a first start compiles every kernel), before the "
                        "start counts as failed")
    p.add_argument("--watchdog-timeout", type=positive(float), default=30.0,
                   help="seconds a child process may go without a heartbeat before it counts "
                        "as dead (503s, exit; the registry is restarted)")
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, default="info",
                   help="log level of every process")
    p.add_argument("--log-requests", action="store_true",
                   help="log one line per finished request: id, adapter, token counts, finish "
                        "reason, TTFT and total time, never prompt or output text (off by "
                        "default)")
    p.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="send one OpenTelemetry span per request (GenAI attributes, adapter, "
                        "token counts, latencies) over OTLP/HTTP to URL, e.g. "
                        "http://localhost:4318/v1/traces (needs the 'otel' extra; default: "
                        "off)")
    p.add_argument("--stats-interval", type=positive(float, allow_zero=True), default=5.0,
                   metavar="SECONDS",
                   help="while busy, log a stats line (load, KV, radix hits, token rates, "
                        "adapters) every SECONDS (0: off)")
    p.add_argument("--tokenizer", "--tokenizer-path", default=None, metavar="DIR",
                   help="a directory (or Hugging Face id) with the tokenizer.json and chat "
                        "template to use (default: the model's)")
    p.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                   help="a Jinja chat template file, or the template itself (default: the "
                        "tokenizer's chat_template.jinja or tokenizer_config.json)")
    p.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="the model family's tool-call format, for tool_choice \"auto\" (the "
                        "default with tools): hermes (also qwen25, qwen: <tool_call>), "
                        "llama3_json (llama3), mistral ([TOOL_CALLS]); without it only "
                        "\"required\" and named tool_choice are served")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's: accepted; tool_choice \"auto\" is on with --tool-call-parser")
    p.add_argument("--guided-decoding-backend", "--grammar-backend", dest="grammar_backend",
                   choices=GRAMMAR_BACKENDS, default="auto",
                   help="structured output always runs on llguidance; vLLM's `guidance` and "
                        "SGLang's `llguidance` name it")
    add_engine_flags(p)
    add_refused_flags(p)
    p.set_defaults(func=serve)


# vLLM and SGLang flags radixlora has no counterpart for: the flag and the reason, in serve's
# own usage (not argparse's "unrecognized arguments")
REFUSED_FLAGS = {
    ("--pipeline-parallel-size", "-pp"): "pipeline parallelism is not supported; use "
                                         "--tensor-parallel-size or --data-parallel-size",
    ("--fully-sharded-loras",): "not supported: under --tensor-parallel-size each rank holds "
                                "its slice of every adapter already",
    ("--lora-backend",): "not supported: the LoRA kernels are chosen per device (Triton SGMV "
                         "on a GPU, torch on the CPU)",
}
# structured output runs on llguidance: the peers' names for it (and auto) are accepted
GRAMMAR_BACKENDS = ("auto", "guidance", "llguidance")


def add_refused_flags(p: argparse.ArgumentParser) -> None:
    for flags, reason in REFUSED_FLAGS.items():
        p.add_argument(*flags, nargs="?", action=_Refused, reason=reason, help=argparse.SUPPRESS)


class _Refused(argparse.Action):
    def __init__(self, *args, reason: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.reason}")


def port_number(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {value!r}") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {port}")
    return port


def _batch_parser(sub) -> None:
    from radixlora.cli import batch

    p = sub.add_parser("batch", formatter_class=HelpFormatter,
                       help="run a JSONL file of OpenAI batch requests (resumable)")
    batch.add_arguments(p)
    p.set_defaults(func=lambda args: sys.exit(batch.run_from_args(args)))


def _warmup_parser(sub) -> None:
    p = sub.add_parser("warmup", formatter_class=HelpFormatter,
                       help="compile every GPU kernel a model serves with into the compile "
                            "cache, then exit (for container images)",
                       description="Load the model with the given engine flags, compile and "
                                   "warm up everything `radixlora serve` with the same flags "
                                   "would, and keep the compiled kernels in --compile-cache-dir, "
                                   "so that later starts on this machine, or in a container "
                                   "that mounts the directory, compile nothing.")
    add_model_flags(p, positional=True)
    add_engine_flags(p)
    p.set_defaults(func=warmup)


def warmup(args: argparse.Namespace) -> None:
    from radixlora.server.ipc import setup_logging

    setup_logging(getattr(args, "log_level", "info"), "warmup")
    from radixlora.engine import Engine
    from radixlora.worker import compile_cache

    model, _, _ = model_and_adapters(args)
    engine = Engine(model, **resolved_overrides(args, model))
    kernels = engine.runner.kernels
    if kernels is None:
        raise SystemExit("radixlora warmup: nothing to compile on the CPU; run it where the "
                         "server will run, on a GPU")
    root = kernels.path.parents[1]
    modules = compile_cache.write_bytecode(root)
    print(f"compile cache: {root} ({len(kernels.known)} kernel variants in {kernels.path}"
          + (f"; bytecode of {modules} modules" if modules else "") + ")")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlora", formatter_class=HelpFormatter,
                                     description="A multi-LoRA LLM serving runtime.")
    parser.add_argument("--version", action="version", version=f"radixlora {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", formatter_class=HelpFormatter,
                       help="the bundled demo through the offline Engine")
    p.add_argument("--text", default="the red fox ate 42 fish",
                   help="the demo's input text (its 50-word vocabulary and numbers 0-99)")
    p.add_argument("--max-tokens", type=positive(int), default=40, help="tokens per answer")
    p.set_defaults(func=demo)
    _serve_parser(sub)
    _batch_parser(sub)
    _warmup_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)
