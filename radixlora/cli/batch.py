"""`radixlora batch` (also `python -m radixlora.cli.batch`): a JSONL file of OpenAI batch requests
run on the in-process Engine or against a server (radixlora.cli.run_batch), resumable."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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


def check_paths(input_path: str, output_path: str) -> None:
    """SystemExit with one line unless the input is a readable file and the output a file that
    can be appended to (checked before any model loads)."""
    source, target = Path(input_path), Path(output_path)
    if not source.is_file():
        raise SystemExit(f"radixlora batch: --input {input_path}: "
                         f"{'is a directory' if source.is_dir() else 'no such file'}")
    if not os.access(source, os.R_OK):
        raise SystemExit(f"radixlora batch: --input {input_path}: not readable")
    if target.is_dir():
        raise SystemExit(f"radixlora batch: --output {output_path}: is a directory")
    folder = target.parent
    if not folder.is_dir():
        raise SystemExit(f"radixlora batch: --output {output_path}: no such directory {folder}")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise SystemExit(f"radixlora batch: --output {output_path}: not writable")


def check_server(url: str) -> None:
    """SystemExit with one line unless a server answers GET /health at `url`."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/health", timeout=10)
    except httpx.HTTPError as e:
        raise SystemExit(f"radixlora batch: --url {url}: no server answers "
                         f"({type(e).__name__}: {e})") from None


def run_from_args(args: argparse.Namespace) -> int:
    """Run the command for parsed flags; the exit status."""
    if args.url and (args.model or args.adapter or args.lora_modules or args.lora_paths):
        raise SystemExit("give either --url or --model/--adapter, not both")
    check_paths(args.input, args.output)
    if args.url:
        check_server(args.url)
    import httpx

    from radixlora.cli.run_batch import run_batch

    target, model_name = args.url, args.served_model_name
    if target is None:
        from radixlora.engine import Engine

        model, adapters, model_name = model_and_adapters(args)
        target = Engine(model, adapters=adapters, **resolved_overrides(args, model))
    try:
        summary = run_batch(
            args.input,
            args.output,
            target,
            progress=not args.no_progress,
            concurrency=args.concurrency,
            model_name=model_name,
        )
    except httpx.HTTPError as e:  # the server went away mid-run; done lines stay done
        raise SystemExit(f"radixlora batch: --url {args.url}: {type(e).__name__}: {e}; "
                         f"run the same command again to resume") from None
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
