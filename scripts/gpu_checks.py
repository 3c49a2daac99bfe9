"""Correctness on a CUDA device (CI has none): the Triton kernels + CUDA-graph decode path with
overlap scheduling give the same tokens and logprobs as the pure-torch reference path without
overlap, over a mixed batch of base, single adapters (DoRA ones too) and stacks on a tiny
random model in fp32,
also with a pool too small for all adapters (loads on the side stream while other requests
decode), with requests ending early on stop tokens while the next step is in flight, and with
48 requests (decode graphs above LORA_DEFER_MAX_TOKENS, whose LoRA is not deferred). Sampling
inside the graphs (seeded temperature, top-k, top-p, min-p and greedy rows in one batch) must
draw the tokens of the torch reference sampler applied to the graph's own logits, and the
reference path's tokens. An FP8 KV pool (--kv-cache-dtype fp8) must give the torch path's tokens
and logprobs too. Then every model family (Qwen3, Gemma 2, Gemma 3 and its multimodal
checkpoint, Phi-3 with partial rotary and longrope, Qwen3-MoE and Mixtral with their grouped
expert GEMMs) on checkpoints saved by transformers, with
PEFT adapters (LoRA, rsLoRA, DoRA, a stack), prompts longer than their sliding windows: the
fast path against the torch path in fp32 (no sequence may differ) and in bf16 (sequences that
differ are counted and reported). Exits non-zero on any fp32 mismatch. With --fp8-block, each
family's checkpoint in FP8 with 128 x 128 block scales (Qwen's FP8 form) in bf16, the fast path
against the torch path on its dequantized twin (differing sequences reported). Transfers staged
in small rings while the device is busy must arrive intact (radixlora_kernels.device).

    python scripts/gpu_checks.py
    python scripts/gpu_checks.py --families   # the families alone, bf16 (a few minutes)
    python scripts/gpu_checks.py --no-families   # all but the families
    python scripts/gpu_checks.py --only-families=qwen3_moe,mixtral   # these, fp32 and bf16
    python scripts/gpu_checks.py --fp8-block  # every family as a block-wise FP8 checkpoint, bf16
    python scripts/gpu_checks.py --fp8-block --only-families=qwen3_moe,mixtral   # FP8 experts
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from checkpoints import (
    FAMILY_TARGETS,
    LANGUAGE_ONLY,
    build_fp8_model,
    build_hf_model,
    build_peft_adapter,
    build_tiny_adapter,
    build_tiny_model,
)

from radixlora import Engine, SamplingParams
from radixlora_kernels.device import StagingRing, to_device, to_host
from radixlora_kernels.sampling import sample_tokens_ref


def checked_graphs(engine: Engine, counts: dict[str, int]) -> None:
    """Wraps the engine's graph replays: each step's in-graph tokens are compared with the
    reference sampler on the logits the same replay produced (a sync per step)."""
    graphs = engine.runner.graphs
    forward = graphs.forward

    def replay(key, host, lora_segments, sampling, resolve=None):
        out = forward(key, host, lora_segments, sampling, resolve)
        rows = sampling.to(out.logits.device)
        ref, _, _ = sample_tokens_ref(out.logits, rows["temperature"], rows["seeds"],
                                      rows["steps"], (rows["top_k"], rows["top_p"], rows["min_p"]))
        counts["rows"] += len(ref)
        counts["hot rows"] += int((rows["temperature"] > 0).sum())
        counts["mismatches"] += int((ref != out.tokens).sum())
        return out

    graphs.forward = replay


def sampling_params(n: int) -> list[SamplingParams]:
    kinds = [dict(temperature=0.0, logprobs=2), dict(temperature=0.8), dict(top_p=0.9),
             dict(temperature=0.7, top_k=5), dict(temperature=1.3, min_p=0.1),
             dict(top_k=20, top_p=0.8, min_p=0.02)]
    return [SamplingParams(max_tokens=24, ignore_eos=True, seed=i, **kinds[i % len(kinds)])
            for i in range(n)]


FAMILIES = ("qwen3", "gemma2", "gemma3_text", "gemma3", "phi3", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def family_adapters(model: Path, root: Path, arch: str) -> dict[str, Path]:
    """A rank-8 LoRA, a rank-4 rsLoRA on half the targets (on an MoE base: PEFT's all-linear,
    the router and the stacked experts too) and a DoRA adapter, made by PEFT."""
    modules = FAMILY_TARGETS.get(arch, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"))
    every = LANGUAGE_ONLY if arch == "gemma3" else list(modules)
    half = LANGUAGE_ONLY if arch == "gemma3" else list(modules[::2])
    specs = {"a": dict(r=8, lora_alpha=16, target_modules=every),
             "b": dict(r=4, lora_alpha=8, use_rslora=True,
                       target_modules="all-linear" if arch in MOE_FAMILIES else half),
             "d": dict(r=4, lora_alpha=8, use_dora=True, target_modules=every)}
    return {name: build_peft_adapter(model, root / f"{arch}-{name}", seed=40 + i, **spec)
            for i, (name, spec) in enumerate(specs.items())}


def family_checks(root: Path, dtypes=("float32", "bfloat16"),
                  families=FAMILIES, fp8_block: bool = False) -> dict[str, dict]:
    """Per family and dtype: sequences whose tokens differ between the fast path (Triton
    kernels, CUDA graphs, overlap) and the torch path, and the largest logprob difference.
    fp8_block: the fast path serves the checkpoint in FP8 with 128 x 128 block scales, the
    torch path its dequantized twin."""
    specs = [None, "a", "b", [("a", 1.0), ("b", 0.5)], "d", None, "a", "d"]
    prompts = [[3 + i] * (9 + 4 * i) for i in range(len(specs))]  # past the 8/16-token windows
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    out = {}
    for arch in families:
        model = build_hf_model(root / arch, arch)
        adapters = family_adapters(model, root, arch)
        ref_model = model
        if fp8_block:
            model, ref_model = build_fp8_model(root / f"{arch}-fp8", model, "block", (128, 128))
        for dtype in dtypes:
            started = time.perf_counter()
            common = dict(adapters=adapters, device="cuda", dtype=dtype, kv_pages=2048,
                          context_length=64 if arch == "phi3" else None)
            reference = Engine(ref_model, attention_backend="torch", lora_backend="torch",
                               cuda_graph=False, overlap_schedule=False, **common)
            ref = reference.generate(prompts, params, adapters=specs)
            fast = Engine(model, warm_up=False, **common).generate(prompts, params, adapters=specs)
            pairs = [(a.outputs[0], b.outputs[0]) for a, b in zip(ref, fast, strict=True)]
            gaps = [parting_gap(a, b) for a, b in pairs if a.token_ids != b.token_ids]
            worst = max(abs(x - y) for a, b in pairs
                        for x, y in zip(a.logprobs[:agreed(a, b)], b.logprobs))
            label = f"{arch} {dtype}{' fp8-block' if fp8_block else ''}"
            out[label] = {"differ": len(gaps), "of": len(ref), "max_logprob": worst,
                          "parting_gaps": gaps}
            print(f"{label}: sequences with different tokens {len(gaps)}/{len(ref)} "
                  f"(the torch path's top-2 logprob gap where each parts: "
                  f"{', '.join(f'{g:.3f}' for g in gaps) or '-'}), max |logprob diff| up to "
                  f"there {worst:.2e} ({time.perf_counter() - started:.0f} s)", flush=True)
    return out


def agreed(a, b) -> int:
    """The steps before two outputs' tokens part: where their logprobs compare."""
    return next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                len(a.token_ids))


def parting_gap(ref, fast) -> float:
    """The reference's top-1 minus top-2 logprob at the step where the fast path chose
    another token: near 0 is a near-tie that rounding in another order can tip."""
    step = agreed(ref, fast)
    top = sorted((lp for _, lp in ref.top_logprobs[step]), reverse=True)
    return top[0] - top[1]


def staging_check(rounds: int = 20, per_round: int = 50) -> dict[str, int]:
    """Transfers staged in small rings while the device is kept busy (a sleep kernel before
    each round), so the rings fill, hand out tensors of their own, and wrap only as the device
    catches up (to the device) or the host has read a region (back): every transfer must
    arrive intact both ways."""
    rng, cuda = np.random.default_rng(0), torch.device("cuda")
    inputs, outputs = StagingRing(1 << 16), StagingRing(1 << 18)
    sent, arrived, returned, staged_back = [], [], [], 0
    for _ in range(rounds):
        torch.cuda._sleep(5_000_000)
        batch = [rng.integers(-(2**40), 2**40, int(rng.integers(1, 2000)))
                 for _ in range(per_round)]
        on_device = [to_device(values, torch.int64, cuda, inputs) for values in batch]
        backs = [to_host([t], outputs) for t in on_device]
        torch.cuda.synchronize()
        for (copies, read) in backs:
            returned.append(copies[0].clone())
            if read is not None:
                staged_back += 1
                read.read = True
        sent += batch
        arrived += on_device
    return {"transfers": len(sent), "staged back in the ring": staged_back,
            "corrupted": sum(not np.array_equal(v, t.cpu().numpy()) or
                             not np.array_equal(v, h.numpy())
                             for v, t, h in zip(sent, arrived, returned))}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", action="store_true",
                   help="the families alone, in bf16 (the dtype they serve in)")
    p.add_argument("--only-families", type=lambda v: tuple(v.split(",")), default=None,
                   metavar="F,...", help=f"these families alone, fp32 and bf16 (of {FAMILIES})")
    p.add_argument("--no-families", action="store_true",
                   help="all but the families: the tiny Llama checks and the staging rings")
    p.add_argument("--fp8-block", action="store_true",
                   help="each family (or those of --only-families) as a block-wise FP8 "
                        "checkpoint, bf16")
    args = p.parse_args(argv)
    unknown = set(args.only_families or ()) - set(FAMILIES)
    if unknown:
        p.error(f"unknown families {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    return args


def main() -> int:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpu-checks-"))
    picked = {"families": args.only_families} if args.only_families else {}
    if args.fp8_block:
        print("families:", family_checks(root, ("bfloat16",), fp8_block=True, **picked))
        return 0
    if args.families or picked:
        dtypes = ("bfloat16",) if args.families else ("float32", "bfloat16")
        print("families:", family_checks(root, dtypes, **picked))
        return 0
    model = build_tiny_model(root / "model")
    adapters = {f"ad{i}": build_tiny_adapter(model, root / f"ad{i}", rank=r, seed=i)
                for i, r in enumerate((4, 8, 16, 64))}
    adapters |= {f"dd{i}": build_tiny_adapter(model, root / f"dd{i}", rank=r, seed=10 + i,
                                              dora=True) for i, r in enumerate((8, 16))}
    specs = [None, "ad0", "ad1", "ad2", "ad3", [("ad0", 1.0), ("ad3", 0.5)],
             [("ad1", -0.5), ("ad2", 2.0), ("ad0", 1.0)], None, "ad3", "dd0", "ad1", None, "ad2",
             "dd1"]
    prompts = [[5 + i] * (3 + 5 * i) for i in range(len(specs))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    stopping = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                              stop_token_ids=tuple(range(100, 160)))
    common = dict(adapters=adapters, device="cuda", dtype="float32", page_size=4, kv_pages=512)
    reference = Engine(model, attention_backend="torch", lora_backend="torch", cuda_graph=False,
                       overlap_schedule=False, **common)
    ref = reference.generate(prompts, params, adapters=specs)
    ref_stopping = reference.generate(prompts, stopping, adapters=specs)
    # more decode tokens than LORA_DEFER_MAX_TOKENS: the graphs whose LoRA is not deferred
    wide_prompts, wide_specs = [[7 + i] * (4 + i % 9) for i in range(48)], (specs * 4)[:48]
    ref_wide = reference.generate(wide_prompts, params, adapters=wide_specs)
    fast_engine = Engine(model, **common)  # warmed up: every graph captured before it serves
    cold = {**common, "warm_up": False}  # graphs captured on first use
    chunked = Engine(model, max_batch_tokens=48, **cold)
    swapping = Engine(model, **{**cold, "adapter_rows": 80})  # 92 rows of LoRA, 26 of DoRA
    engines = (fast_engine, fast_engine, chunked, swapping)  # fresh, cache hits, chunked, swaps
    fast = []
    for engine in engines:
        fast += engine.generate(prompts, params, adapters=specs)
    fast += fast_engine.generate(prompts, stopping, adapters=specs)
    fast += fast_engine.generate(wide_prompts, params, adapters=wide_specs)
    graphs = sum(len(e.runner.graphs.graphs) for e in engines[1:])
    # sampling in the graphs, against the reference sampler on the same logits and against
    # the reference path
    mixed = sampling_params(len(prompts))
    ref_mixed = reference.generate(prompts, mixed, adapters=specs)
    counts = {"rows": 0, "hot rows": 0, "mismatches": 0}
    checked = Engine(model, **cold)
    checked_graphs(checked, counts)
    fast += checked.generate(prompts, mixed, adapters=specs)
    print(f"in-graph sampling vs the reference sampler on the graphs' logits: {counts}")
    # an FP8 KV pool: the kernels' rounding and widening against the torch path's
    fp8 = {**common, "kv_cache_dtype": "fp8"}
    ref_fp8 = Engine(model, attention_backend="torch", lora_backend="torch", cuda_graph=False,
                     overlap_schedule=False, **fp8).generate(prompts, params, adapters=specs)
    fast += Engine(model, **fp8).generate(prompts, params, adapters=specs)
    worst, mismatches = 0.0, 0
    refs = ref * len(engines) + ref_stopping + ref_wide + ref_mixed + ref_fp8
    for a, b in zip(refs, fast, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        mismatches += ta != tb
        worst = max(worst, *(abs(x - y) for x, y in zip(a.outputs[0].logprobs,
                                                        b.outputs[0].logprobs)))
    evictions = swapping.scheduler.residency.num_evictions
    print(f"graphs captured: {graphs}; sequences with different tokens: {mismatches}/{len(fast)}; "
          f"max |logprob diff| {worst:.2e}; evictions in the small pool: {evictions}")
    staging = staging_check()
    print(f"staged transfers while the device is busy: {staging}")
    families = {} if args.no_families else family_checks(root)
    families_ok = all(r["differ"] == 0 and r["max_logprob"] < 1e-3
                      for k, r in families.items() if k.endswith("float32"))
    ok = (mismatches == 0 and worst < 1e-3 and graphs > 0 and evictions > 0
          and counts["mismatches"] == 0 and counts["hot rows"] > 0 and families_ok
          and staging["corrupted"] == 0 and staging["staged back in the ring"] > 0)
    print("gpu checks:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
