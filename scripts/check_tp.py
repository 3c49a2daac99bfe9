"""Tensor-parallel correctness through `radixlora serve`: the same mixed requests (base, single
adapters, weighted stacks) against `--tensor-parallel-size 1` and each N of --sizes, greedy,
with each step's top-2 logprobs.

    python scripts/check_tp.py --sizes 2            # N GPUs: Llama-3-8B-shaped bf16 checkpoint
    python scripts/check_tp.py --sizes 2,4
    python scripts/check_tp.py --tiny --sizes 2     # CPU (gloo): the tiny checkpoint, float32

The checkpoint and 8 PEFT adapters (rank 16, every projection; tiny: rank 8) are
scripts/bench_e2e.py's, written to --work-dir and reused. 64 requests (random prompts of 16-128
token ids, 64 new tokens; tiny: 16 requests of 4-24 ids, 12 tokens), a quarter on the base, half
on one adapter, a quarter on a stack of two, all sent at once to POST /generate.

A request passes when its tokens equal the N = 1 run's; where they part, the step where they do
must be a near tie of the N = 1 run: the two tokens' logprobs there less than --tie-gap apart
(bf16 sums in another order can flip it; a real sharding error moves logprobs by far more). The
check passes when at least --min-equal of the requests are equal and every other one parts at a
near tie. Prints the max |logprob difference| over the steps both runs share, per N; JSON to
$OUT. Exits 1 on a failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e  # noqa: E402

ADAPTERS = 8


@dataclass(frozen=True)
class Scale:
    requests: int
    prompt_lens: tuple[int, int]
    new_tokens: int
    rank: int


FULL = Scale(requests=64, prompt_lens=(16, 128), new_tokens=64, rank=16)
TINY = Scale(requests=16, prompt_lens=(4, 24), new_tokens=12, rank=8)


def request_specs(scale: Scale, vocab: int, seed: int = 0) -> list[dict]:
    """The /generate bodies: request i on the base (i % 4 == 0), a stack of two adapters
    (i % 4 == 3) or one adapter."""
    rng = random.Random(seed)
    specs = []
    for i in range(scale.requests):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(*scale.prompt_lens))]
        body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": scale.new_tokens,
                                    "ignore_eos": True}}
        first, second = f"a{i % ADAPTERS}", f"a{(i + 3) % ADAPTERS}"
        if i % 4 == 3:
            body["adapters"] = [{"name": first, "weight": 1.0}, {"name": second, "weight": 0.5}]
        elif i % 4:
            body["lora_path"] = first
        specs.append(body)
    return specs


async def generate_all(url: str, specs: list[dict]) -> list[dict]:
    """Every request at once; each answer's token ids and, per step, {token id: logprob} of its
    top 2."""
    async with httpx.AsyncClient(base_url=url, timeout=3600.0) as client:
        answers = await asyncio.gather(*(client.post("/generate", json=s) for s in specs))
    out = []
    for answer in answers:
        answer.raise_for_status()
        meta = answer.json()["meta_info"]
        out.append({"tokens": [t[1] for t in meta["output_token_logprobs"]],
                    "logprobs": [t[0] for t in meta["output_token_logprobs"]],
                    "top2": [{t[1]: t[0] for t in step} for step in meta["output_top_logprobs"]]})
    return out


def compare(ref: list[dict], got: list[dict], tie_gap: float) -> dict:
    """Equal requests, and for each other one the step where it parts and the N = 1 run's
    logprob gap there between the two tokens (None: the other token is not in its top 2)."""
    equal, parted, max_diff = 0, [], 0.0
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        step = next((s for s, (a, b) in enumerate(zip(r["tokens"], g["tokens"])) if a != b),
                    None)
        shared = len(r["tokens"]) if step is None else step
        for a, b in zip(r["logprobs"][:shared], g["logprobs"][:shared]):
            max_diff = max(max_diff, abs(a - b))
        if step is None:
            equal += 1
            continue
        top2 = r["top2"][step]
        other = top2.get(g["tokens"][step])
        gap = None if other is None else abs(r["logprobs"][step] - other)
        parted.append({"request": i, "step": step, "gap": gap,
                       "near_tie": gap is not None and gap < tie_gap})
    return {"equal": equal, "requests": len(ref), "parted": parted,
            "max_logprob_diff_shared": max_diff}


def run_size(args, model: Path, adapters: dict[str, Path], size: int, specs: list[dict],
             extra: list[str]) -> list[dict]:
    server = bench_e2e.Server(model, adapters, args.port,
                              [*extra, "--tensor-parallel-size", str(size)],
                              Path(args.work_dir) / f"server-tp{size}.log")
    try:
        ready = server.start(args.ready_timeout)
        bench_e2e.log(f"tensor-parallel size {size}: ready in {ready:.1f} s")
        return asyncio.run(generate_all(server.url, specs))
    finally:
        server.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2", help="comma-separated tensor-parallel sizes > 1")
    bench_e2e.add_server_args(p, "tiny checkpoint and adapters on the CPU (gloo), float32")
    p.add_argument("--requests", type=int, help="how many requests (default 64; tiny 16)")
    p.add_argument("--min-equal", type=float, default=0.95)
    p.add_argument("--tie-gap", type=float, default=1e-2)
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    scale = TINY if args.tiny else FULL
    if args.requests:
        scale = Scale(args.requests, scale.prompt_lens, scale.new_tokens, scale.rank)
    extra = shlex.split(args.extra_serve_args)
    if args.tiny:
        extra += [f for f in ("--device", "cpu", "--dtype", "float32") if f not in extra]
    device = "cpu" if args.tiny else bench_e2e.pick_device(args.gen_device)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model, cfg, adapters = bench_e2e.prepare_files(
        work, args.tiny, {f"a{i}": scale.rank for i in range(ADAPTERS)}, device)
    specs = request_specs(scale, cfg["vocab_size"])
    ref = run_size(args, model, adapters, 1, specs, extra)
    results, failed = {"command": shlex.join([sys.executable, *sys.argv]),
                       "git_commit": bench_e2e.git_commit(), "serve_extra": extra}, False
    for size in sizes:
        report = compare(ref, run_size(args, model, adapters, size, specs, extra), args.tie_gap)
        ok = (report["equal"] >= args.min_equal * report["requests"]
              and all(x["near_tie"] for x in report["parted"]))
        failed |= not ok
        results[f"tp{size}"] = {**report, "ok": ok}
        parted = ", ".join(f"#{x['request']} at step {x['step']} (gap {x['gap']})"
                           for x in report["parted"]) or "none"
        print(f"{'PASS' if ok else 'FAIL'}  tensor-parallel {size} against 1: "
              f"{report['equal']}/{report['requests']} requests equal; parted: {parted}; max "
              f"|logprob diff| over shared steps {report['max_logprob_diff_shared']:.2e}",
              flush=True)
    out = Path(os.environ.get("OUT") or work)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_tp.json").write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
