"""What an FP8 KV cache (--kv-cache-dtype fp8) costs in accuracy against the model's own KV
dtype, over a few thousand decode steps.

The bundled demo model (or --model) with its four adapters and the base, over held-out inputs of
its tasks, greedy to each answer's end: first with the full-precision cache, then with FP8 KV.
Reported:
- sequences whose greedy tokens are all the same, and the decode steps that agree before a
  sequence's first different token, over all decode steps;
- teacher-forced: each engine scores the full-precision run's prompts and outputs, and the mean
  and largest absolute difference of the generated tokens' logprobs.

    python3 scripts/check_fp8_kv.py                       # the demo model, on CUDA if there
    python3 scripts/check_fp8_kv.py --inputs 8 --max-tokens 16 --device cpu   # quick, CPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixlora import Engine, SamplingParams  # noqa: E402
from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR, format_prompt  # noqa: E402
from radixlora.demo.tasks import sample_inputs  # noqa: E402


def prefix_agreement(a: list[int], b: list[int]) -> int:
    """Tokens of `a` and `b` that agree before the first that does not."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(engine: Engine, prompts: list[str], routing: list, max_tokens: int) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [o.outputs[0].token_ids for o in engine.generate(prompts, greedy, adapters=routing)]


def compare(args: argparse.Namespace) -> dict:
    inputs = sample_inputs(args.inputs, 2024, heldout=True)
    specs = [None, *DEMO_ADAPTERS] if args.model == str(DEMO_MODEL_DIR) else [None]
    prompts = [format_prompt(text) for text in inputs for _ in specs]
    routing = [spec for _ in inputs for spec in specs]
    kw = dict(device=args.device, dtype=args.dtype, max_running=len(prompts))
    if args.model == str(DEMO_MODEL_DIR):
        kw["adapters"] = DEMO_ADAPTERS
    # both engines live at once; --gpu-memory-utilization counts the memory already in use, so
    # the second one's share is on top of the first one's
    cuda = args.device.startswith("cuda")
    engines = {kv: Engine(args.model, kv_cache_dtype=kv, **kw,
                          **({"gpu_memory_utilization": 0.45 * (i + 1)} if cuda else {}))
               for i, kv in enumerate(("auto", "fp8"))}
    tokens = {kv: run(e, prompts, routing, args.max_tokens) for kv, e in engines.items()}
    full, fp8 = tokens["auto"], tokens["fp8"]
    steps = sum(len(t) for t in full)
    agree = sum(prefix_agreement(a, b) for a, b in zip(full, fp8))
    tokenizer = engines["auto"].tokenizer
    forced = [tokenizer.encode(p) + out for p, out in zip(prompts, full)]
    starts = [len(f) - len(out) for f, out in zip(forced, full)]
    scores = {kv: e.score(forced, starts, adapters=routing) for kv, e in engines.items()}
    diffs = torch.tensor([abs(a - b) for x, y in zip(scores["auto"], scores["fp8"])
                          for a, b in zip(x, y)])
    return {
        "model": args.model, "dtype": args.dtype,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "sequences": len(prompts), "decode_steps": steps,
        "sequences_same": sum(a == b for a, b in zip(full, fp8)),
        "steps_agreeing_before_first_difference": agree,
        "agreement": agree / max(steps, 1),
        "teacher_forced_logprob_diff_mean": diffs.mean().item(),
        "teacher_forced_logprob_diff_max": diffs.max().item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEMO_MODEL_DIR))
    p.add_argument("--inputs", type=int, default=80, help="held-out inputs (x5 requests: the "
                   "base and the four demo adapters)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", help="the model's dtype (its KV's without "
                   "FP8)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    result = compare(args)
    for key, value in result.items():
        print(f"{key:42} {value:.4g}" if isinstance(value, float) else f"{key:42} {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
