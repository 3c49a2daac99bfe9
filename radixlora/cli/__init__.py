"""Command line: `radixlora serve` (the multi-process HTTP/ZeroMQ server; with no --model, the
bundled demo), `radixlora demo` (the demo through the offline Engine) and `radixlora batch` (a
JSONL file of OpenAI batch requests: radixlora.cli.batch). The flags the commands that build an
Engine share are in radixlora.cli.flags."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from radixlora.cli.flags import add_engine_flags, engine_overrides, model_and_adapters
from radixlora.config import ModelConfig
from radixlora.engine import Engine
from radixlora.sampling import SamplingParams


def demo(args: argparse.Namespace) -> None:
    """The bundled demo through the offline Engine: one prompt, every adapter set, one batch."""
    from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR, format_prompt

    engine = Engine(DEMO_MODEL_DIR, adapters=DEMO_ADAPTERS)
    prompt = format_prompt(args.text)
    specs = [None, *DEMO_ADAPTERS, [("upper", 1.0), ("reverse", 1.0)]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    outs = engine.generate([prompt] * len(specs), params, adapters=specs)
    print(f"prompt: {prompt!r}  (bundled demo model; one batched forward per step)")
    for out in outs:
        print(f"  [{out.adapters:>14}] {out.outputs[0].text.strip()}")


def _check_dir(directory: str | None) -> str | None:
    if directory is not None and not Path(directory).is_dir():
        raise SystemExit(f"--adapter-dir {directory} is not a directory")
    return directory


def serve(args: argparse.Namespace) -> None:
    from radixlora.server.launcher import serve as run_server

    model, adapters, served_name = model_and_adapters(args)
    try:
        server_args = _server_args(args, model, adapters, served_name)
        server_args.engine_config().max_context(ModelConfig.from_dir(model))
    except ValueError as e:
        raise SystemExit(str(e)) from e
    raise SystemExit(run_server(server_args))


def _server_args(args: argparse.Namespace, model, adapters: dict[str, str], served_name):
    from radixlora.server.args import ServerArgs

    engine = engine_overrides(args)
    return ServerArgs(
        model=str(model),
        adapters=adapters,
        served_model_name=served_name,
        host=args.host,
        port=args.port,
        zmq_client_port=args.zmq_client_port,
        engine=engine,
        drain_timeout_s=args.drain_timeout,
        step_timeout_s=args.step_timeout,
        watchdog_timeout_s=args.watchdog_timeout,
        log_level=args.log_level,
        log_requests=args.log_requests,
        stats_interval_s=args.stats_interval,
        adapter_dir=_check_dir(args.adapter_dir),
        adapter_rate=args.adapter_rate,
        adapter_burst=args.adapter_burst,
        adapter_quiet_s=args.adapter_quiet,
        max_swaps_per_s=args.max_swaps_per_s,
        adapter_failure_policy=args.adapter_failure_policy,
        enable_admin=args.enable_admin,
        admin_api_key=args.admin_api_key or os.environ.get("RADIXLORA_ADMIN_API_KEY"),
        api_key=args.api_key or os.environ.get("RADIXLORA_API_KEY", ""),
        allowed_adapter_roots=args.allowed_adapter_root,
    )


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model and its adapters over HTTP and ZeroMQ")
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory (default: the bundled demo model and adapters)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--adapter-dir", default=None,
                   help="watch DIR (registry process): every sub-directory is an adapter named "
                        "after it, hot-swapped as it is added, rewritten or deleted")
    p.add_argument("--adapter-rate", type=float, default=1.0,
                   help="new adapters admitted per second from --adapter-dir (token bucket)")
    p.add_argument("--adapter-burst", type=int, default=1)
    p.add_argument("--adapter-quiet", type=float, default=0.5,
                   help="seconds --adapter-dir must be quiet before a change is examined")
    p.add_argument("--max-swaps-per-s", type=float, default=10.0,
                   help="hard cap on adapter loads into the device pool per second (0: none)")
    p.add_argument("--adapter-failure-policy", choices=("reject", "base"), default="reject")
    p.add_argument("--enable-admin", action="store_true",
                   help="enable POST /v1/{load,unload,pin,unpin}_lora_adapter")
    p.add_argument("--admin-api-key", default=None,
                   help="Bearer key of the admin endpoints (or RADIXLORA_ADMIN_API_KEY)")
    p.add_argument("--api-key", default=None,
                   help="clients must send Authorization: Bearer KEY on every endpoint but "
                        "/health and /metrics (or RADIXLORA_API_KEY)")
    p.add_argument("--allowed-adapter-root", action="append", default=[],
                   help="directory the admin endpoints may load adapters from (repeatable)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--zmq-client-port", type=int, default=None,
                   help="tcp://127.0.0.1:PORT for ZeroMQ clients (default: an ipc:// socket)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--step-timeout", type=float, default=600.0,
                   help="seconds one worker step may take before the worker counts as hung")
    p.add_argument("--watchdog-timeout", type=float, default=30.0,
                   help="seconds a child process may go without a heartbeat before it counts "
                        "as dead (503s, exit; the registry is restarted)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-requests", action="store_true",
                   help="log one line per finished request: id, adapter, token counts, finish "
                        "reason, TTFT and total time (never prompt or output text)")
    p.add_argument("--stats-interval", type=float, default=5.0, metavar="SECONDS",
                   help="while busy, log a stats line (load, KV, radix hits, token rates, "
                        "adapters) every SECONDS (0: off)")
    add_engine_flags(p)
    p.set_defaults(func=serve)


def _batch_parser(sub) -> None:
    from radixlora.cli import batch

    p = sub.add_parser("batch", help="run a JSONL file of OpenAI batch requests (resumable)")
    batch.add_arguments(p)
    p.set_defaults(func=lambda args: sys.exit(batch.run_from_args(args)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixlora")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the bundled demo through the offline Engine")
    p.add_argument("--text", default="the red fox ate 42 fish")
    p.add_argument("--max-tokens", type=int, default=40)
    p.set_defaults(func=demo)
    _serve_parser(sub)
    _batch_parser(sub)
    args = parser.parse_args(argv)
    args.func(args)
