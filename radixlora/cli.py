"""Command line: `radixlora demo` (offline Engine on a tiny random checkpoint) and `radixlora serve`
(the multi-process HTTP/ZeroMQ server, radixlora.server)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from radixlora.engine import Engine
from radixlora.sampling import SamplingParams
from radixlora.tiny import build_tiny_adapter, build_tiny_model


def demo(args: argparse.Namespace) -> None:
    root = Path(args.workdir or tempfile.mkdtemp(prefix="radixlora-demo-"))
    model = build_tiny_model(root / "model")
    adapters = {
        "support": build_tiny_adapter(model, root / "support", rank=8, seed=1),
        "legal": build_tiny_adapter(model, root / "legal", rank=16, seed=2),
    }
    engine = Engine(model, adapters=adapters)
    prompt = "A radix cache shares prefix KV"
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    specs = [None, "support", "legal", [("legal", 0.5), ("support", 1.0)]]
    outs = engine.generate([prompt] * len(specs), params, adapters=specs)
    print(
        f"model: tiny random Llama in {root} (outputs are random text: the point is that each "
        "adapter set changes them, in one batched forward)"
    )
    for out in outs:
        print(f"  [{out.adapters:>22}] {prompt!r} -> {out.outputs[0].text!r}")


ENGINE_FLAGS = ("kv_pages", "page_size", "adapter_rows", "max_rank", "max_stacked", "max_running",
                "max_batch_tokens", "device", "dtype")


def _adapter_pairs(values: list[str]) -> dict[str, str]:
    pairs = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--adapter expects NAME=PATH, got {value!r}")
        pairs[name] = path
    return pairs


def _adapter_dir(directory: str) -> dict[str, str]:
    root = Path(directory)
    if not root.is_dir():
        raise SystemExit(f"--adapter-dir {directory} is not a directory")
    return {d.name: str(d) for d in sorted(root.iterdir()) if (d / "adapter_config.json").is_file()}


def serve(args: argparse.Namespace) -> None:
    from radixlora.server.args import ServerArgs
    from radixlora.server.launcher import serve as run_server

    adapters = _adapter_dir(args.adapter_dir) if args.adapter_dir else {}
    adapters.update(_adapter_pairs(args.adapter))
    model = args.model
    if model is None:
        root = Path(tempfile.mkdtemp(prefix="radixlora-tiny-"))
        model = str(build_tiny_model(root / "model"))
        adapters.setdefault("support", str(build_tiny_adapter(model, root / "support", 8, 1)))
        adapters.setdefault("legal", str(build_tiny_adapter(model, root / "legal", 16, 2)))
    engine = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    server_args = ServerArgs(
        model=str(model),
        adapters=adapters,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        zmq_client_port=args.zmq_client_port,
        engine=engine,
        drain_timeout_s=args.drain_timeout,
        step_timeout_s=args.step_timeout,
        log_level=args.log_level,
    )
    raise SystemExit(run_server(server_args))


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model and its adapters over HTTP and ZeroMQ")
    p.add_argument("--model", default=None,
                   help="HF checkpoint directory (default: a tiny random demo model)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--adapter-dir", default=None,
                   help="serve every PEFT adapter directory inside DIR, named after it")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--zmq-client-port", type=int, default=None,
                   help="tcp://127.0.0.1:PORT for ZeroMQ clients (default: an ipc:// socket)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--step-timeout", type=float, default=600.0,
                   help="seconds one worker step may take before the worker counts as hung")
    p.add_argument("--log-level", default="info")
    for flag in ENGINE_FLAGS:
        kind = str if flag in ("device", "dtype") else int
        p.add_argument("--" + flag.replace("_", "-"), type=kind, default=None)
    p.set_defaults(func=serve)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixlora")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the offline Engine on a tiny random model with 2 adapters")
    p.add_argument("--workdir", default=None)
    p.add_argument("--max-tokens", type=int, default=12)
    p.set_defaults(func=demo)
    _serve_parser(sub)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
