"""`radixlora batch` (also `python -m radixlora.cli.batch`): a JSONL file of OpenAI batch requests
run on the in-process Engine or against a server (radixlora.run_batch), resumable."""

from __future__ import annotations

import argparse
import sys

from radixlora.cli.flags import add_engine_flags, engine_overrides, model_and_adapters
from radixlora.engine import Engine
from radixlora.run_batch import DEFAULT_CONCURRENCY, run_batch


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags (shared by `radixlora batch` and `python -m radixlora.cli.batch`)."""
    p.add_argument("--input", required=True, help="JSONL requests (OpenAI batch format)")
    p.add_argument("--output", required=True, help="JSONL results (appended; resumable)")
    p.add_argument(
        "--model",
        default=None,
        help="HF checkpoint directory (default: the bundled demo model and adapters)",
    )
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--url", default=None, help="send the requests to this server instead")
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the base model's name in requests (default: the model directory name)",
    )
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    p.add_argument("--no-progress", action="store_true")
    add_engine_flags(p)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the command for parsed flags; the exit status."""
    if args.url and (args.model or args.adapter):
        raise SystemExit("give either --url or --model/--adapter, not both")
    target, model_name = args.url, args.served_model_name
    if target is None:
        model, adapters, model_name = model_and_adapters(args)
        target = Engine(model, adapters=adapters, **engine_overrides(args))
    summary = run_batch(
        args.input,
        args.output,
        target,
        progress=not args.no_progress,
        concurrency=args.concurrency,
        model_name=model_name,
    )
    print(
        f"{summary.succeeded} succeeded, {summary.failed} failed, {summary.skipped} already "
        f"done; results in {args.output}",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="radixlora batch", description="Run a JSONL file of OpenAI batch requests (resumable)."
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
