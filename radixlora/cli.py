"""Command line: `radixlora demo` (offline Engine on a tiny random checkpoint)."""

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixlora")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the offline Engine on a tiny random model with 2 adapters")
    p.add_argument("--workdir", default=None)
    p.add_argument("--max-tokens", type=int, default=12)
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
