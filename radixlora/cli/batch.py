"""`radixlora batch` (also `python -m radixlora.cli.batch`): a JSONL file of OpenAI batch requests
run on the in-process Engine or against a server (radixlora.cli.run_batch), resumable."""

from __future__ import annotations

import argparse
import sys

from radixlora.cli.flags import (
    HelpFormatter,
    add_engine_flags,
    add_model_flags,
    model_and_adapters,
    positive,
    resolved_overrides,
)

DEFAULT_CONCURRENCY = 64  # requests in flight against a server (radixlora.cli.run_batch's default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's flags (shared by `radixlora batch` and `python -m radixlora.cli.batch`)."""
    p.add_argument("--input", required=True, help="JSONL requests (OpenAI batch format)")
    p.add_argument("--output", required=True, help="JSONL results (appended; resumable)")
    add_model_flags(p)
    p.add_argument("--url", default=None,
                   help="send the requests to this server instead (default: run them here)")
    p.add_argument("--concurrency", type=positive(int), default=DEFAULT_CONCURRENCY,
                   help="requests in flight at once")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_flags(p)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the command for parsed flags; the exit status."""
    if args.url and (args.model or args.adapter or args.lora_modules or args.lora_paths):
        raise SystemExit("give either --url or --model/--adapter, not both")
    from radixlora.cli.run_batch import run_batch

    target, model_name = args.url, args.served_model_name
    if target is None:
        from radixlora.engine import Engine

        model, adapters, model_name = model_and_adapters(args)
        target = Engine(model, adapters=adapters, **resolved_overrides(args, model))
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
        prog="radixlora batch", formatter_class=HelpFormatter,
        description="Run a JSONL file of OpenAI batch requests (resumable).")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
