"""A full burst through the offline Engine, step by step: where a saturated engine's time goes.

    python scripts/bench_burst.py                          # H200: 2,000 ShareGPT-like requests
    python scripts/bench_burst.py --adapters 0,100 --max-running 256,1024
    python scripts/bench_burst.py --parts steps,gemm       # only the synthetic parts
    python scripts/bench_burst.py --model-shape qwen3-30b-a3b --parts steps
    python scripts/bench_burst.py --smoke                  # tiny shapes on the CPU

Setup: bench_engine's Llama-3-8B-shaped model (or --model-shape, bench_e2e's shapes) with
random bf16 weights (load_format="dummy"),
default engine config (pools sized from GPU memory, graphs captured at start), and for
`--adapters N` N random rank-8 adapters on q, k, v, o that start in the host tier.

Parts (--parts):
  steps  Synthetic steps of the shapes the burst runs, each timed alone (CUDA events around the
         launch, median of 5 after a warm-up) and profiled once (kernel time by kind):
         "decode N": N decodes at 400 tokens of context (N = 64, 176, 256, 512, 1,024; a CUDA
         graph where one fits), against their bytes floor (the weights they touch, of an MoE
         only the experts their tokens are routed to under uniform routing, and their KV, at
         --peak-bw); "mixed 254": 240 decodes at 400 tokens of context beside 14 prefill
         chunks of 541 tokens in all; "mixed 944": 900 decodes beside 2,361 prefill tokens;
         "prefill 8192". "..., N adapters": request k on rank-8 q/k/v/o adapter set k % N, each
         set on pool rows of its own (a many-adapter burst's steps; a decode floor adds the
         distinct rows' bytes). Mixed steps run with the mixed-batch attention split (decodes
         to the decode kernel, extends over their tiles) and without it (every request through
         the extend kernel's grid). Steps whose KV or adapter rows do not fit the pools are
         left out.
  gemm   torch.matmul TFLOP/s of the four projections of a layer at the token counts above.
  burst  --requests requests with ShareGPT-like lengths (bench_serving.sharegpt_lengths:
         lognormal, about 270 prompt / 210 output tokens on average, capped at 2,048 / 1,024),
         random token ids, greedy, ignore_eos, all submitted at once, for each --adapters count
         (requests uniform over the adapters) and --max-running value ("default": the sized
         limit; another value replaces the scheduler's limit for that run; batches above the
         largest graph run eagerly). Prints output tok/s, the floor (bench_e2e.floor), and a
         step breakdown: decode-only and mixed steps (count, mean ms between plans, mean
         requests and tokens per step), and where the host spends a step (plan, launch, wait
         for the device, fold) against the device's busy time per step (CUDA events).

Output: a table on stdout; every figure in bench_burst.json ($OUT when set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import replace_fields  # noqa: E402
from bench_e2e import (  # noqa: E402
    H200_BYTES_PER_S,
    H200_FLOPS,
    MODEL_SHAPES,
    Planned,
    Shape,
    floor,
)
from bench_engine import QKVO, SMOKE, model_dir, random_adapter  # noqa: E402
from bench_serving import sharegpt_lengths  # noqa: E402

from radixlora import Engine, SamplingParams  # noqa: E402
from radixlora.step_plan import GroupRows, PlanItem, StepPlan, ids_to_bytes  # noqa: E402
from radixlora.worker import cuda_graph  # noqa: E402
from radixlora.worker.model_runner import PROFILE_PARAMS  # noqa: E402
from radixlora_kernels import sgmv_grouped  # noqa: E402

KERNEL_KINDS = (  # (kind, substrings of the kernel's name), first match wins
    ("moe", ("_grouped_gemm", "_align", "topk", "_row_shrink", "_row_expand", "_block_")),
    ("attention", ("_extend_kernel", "_decode_split", "_decode_merge")),
    ("lora", ("sgmv", "grouped", "shrink", "expand")),
    ("sampling", ("sampl", "_draw", "argmax", "softmax", "gumbel", "lse")),
    ("norm/rope/act", ("rmsnorm", "rotary", "silu", "_act", "rope")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90")),
    ("copy", ("memcpy", "memset", "copy", "index", "gather", "scatter", "fill", "cat")),
)


# ---- workload -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    adapter: str | None


def burst_requests(n: int, vocab: int, adapters: list[str], seed: int,
                   scale: float = 1.0) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt_len, output_len = sharegpt_lengths(rng, scale)
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        out.append(Request(prompt, output_len, rng.choice(adapters) if adapters else None))
    return out


# ---- per-step timing -------------------------------------------------------------------------

@dataclasses.dataclass
class StepRecord:
    requests: int
    tokens: int
    decode_only: bool
    planned_at: float  # host clock when planning began
    plan_s: float
    launch_s: float
    start_event: object = None  # CUDA events around the step's device work
    done_event: object = None


class StepLog:
    """Wraps the engine's plan, launch and collect calls to time each step on both clocks."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.steps: list[StepRecord] = []
        self.wait_s = 0.0
        self.calls_s = 0.0
        self.cuda = engine.runner.device.type == "cuda"
        loop, executor, runner = engine.loop, engine.executor, engine.runner
        self._next_plan, self._submit = loop.next_plan, executor.submit
        self._collect, self._launch = executor.collect, runner.launch
        loop.next_plan, executor.submit = self._timed_plan, self._timed_submit
        executor.collect, runner.launch = self._timed_collect, self._timed_launch

    def close(self) -> None:
        engine = self.engine
        engine.loop.next_plan, engine.executor.submit = self._next_plan, self._submit
        engine.executor.collect, engine.runner.launch = self._collect, self._launch

    def _timed_plan(self):
        start = time.perf_counter()
        plan = self._next_plan()
        if plan is not None:
            lens = [i.extend_len for i in plan.items]
            self.steps.append(StepRecord(len(lens), sum(lens), max(lens) == 1, start,
                                         time.perf_counter() - start, 0.0))
        return plan

    def _timed_submit(self, plan):
        start = time.perf_counter()
        self._submit(plan)
        self.steps[-1].launch_s = time.perf_counter() - start

    def _timed_launch(self, plan, loads=()):
        record = self.steps[-1]
        if self.cuda:
            record.start_event = torch.cuda.Event(enable_timing=True)
            record.start_event.record()
        launched = self._launch(plan, loads)
        if self.cuda:
            record.done_event = torch.cuda.Event(enable_timing=True)
            record.done_event.record()
        return launched

    def _timed_collect(self, keep, done_too=False):
        start = time.perf_counter()
        out = self._collect(keep, done_too)
        self.wait_s += time.perf_counter() - start
        return out

    def device_ms(self) -> list[float | None]:
        """Each step's device time: from its start (or the previous step's end, if later)
        to its end, so a step queued behind another is not charged for the wait."""
        if not self.cuda or not self.steps or self.steps[0].done_event is None:
            return [None] * len(self.steps)
        ref = self.steps[0].start_event
        out, last_end = [], 0.0
        for s in self.steps:
            if s.done_event is None or s.start_event is None:
                out.append(None)
                continue
            begin, end = ref.elapsed_time(s.start_event), ref.elapsed_time(s.done_event)
            out.append(end - max(begin, last_end))
            last_end = end
        return out


def summarize_steps(log: StepLog, wall_s: float) -> dict:
    steps = log.steps
    between = [b.planned_at - a.planned_at for a, b in zip(steps, steps[1:])] + [None]
    device = log.device_ms()
    out = {}
    for kind, pick in (("decode", lambda s: s.decode_only), ("mixed", lambda s: not s.decode_only)):
        rows = [(s, b, d) for s, b, d in zip(steps, between, device) if pick(s)]
        timed = [b for _, b, _ in rows if b is not None]
        dev = [d for _, _, d in rows if d is not None]
        out[kind] = {
            "steps": len(rows),
            "mean_ms": 1e3 * statistics.fmean(timed) if timed else None,
            "total_s": sum(timed),
            "mean_requests": statistics.fmean(s.requests for s, _, _ in rows) if rows else None,
            "mean_tokens": statistics.fmean(s.tokens for s, _, _ in rows) if rows else None,
            "mean_device_ms": statistics.fmean(dev) if dev else None,
            "mean_plan_ms": 1e3 * statistics.fmean(s.plan_s for s, _, _ in rows) if rows else None,
            "mean_launch_ms": (1e3 * statistics.fmean(s.launch_s for s, _, _ in rows)
                               if rows else None),
        }
    busy = [d for d in device if d is not None]
    out["host"] = {"plan_s": sum(s.plan_s for s in steps),
                   "launch_s": sum(s.launch_s for s in steps), "wait_s": log.wait_s,
                   "device_busy_s": sum(busy) / 1e3 if busy else None, "wall_s": wall_s}
    return out


# ---- the burst -------------------------------------------------------------------------------

def run_burst(engine: Engine, reqs: list[Request], max_running: int | None) -> dict:
    sched = engine.scheduler
    default_running = sched.config.max_running
    if max_running is not None:  # the running limit alone: pools and graphs stay as sized
        sched.config = dataclasses.replace(sched.config, max_running=max_running)
    try:
        for i, r in enumerate(reqs):
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            engine.submit(r.prompt, params, adapters=r.adapter, cache_salt=f"burst-{i}")
        log = StepLog(engine)
        start = time.perf_counter()
        try:
            while sched.has_work():
                engine.step()
            if log.cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        finally:
            log.close()
    finally:
        sched.config = dataclasses.replace(sched.config, max_running=default_running)
    tokens = sum(r.max_tokens for r in reqs)
    return {"requests": len(reqs), "output_tokens": tokens, "seconds": wall,
            "tok_s": tokens / wall, "max_running": sched.config.max_running
            if max_running is None else max_running, "steps": summarize_steps(log, wall)}


def burst_floor(shape: Shape, reqs: list[Request], rank: int, peak_bw: float) -> dict:
    planned = [Planned(len(r.prompt), r.max_tokens, r.adapter, rank if r.adapter else 0)
               for r in reqs]
    return floor(shape, planned, peak_bytes_per_s=peak_bw)


# ---- synthetic steps -------------------------------------------------------------------------

def synthetic_plan(decodes: int, context: int, prefills: list[int], sets: int = 0,
                   rank: int = 8, groups: tuple[str, ...] = ("qkv", "o")) -> StepPlan:
    """`decodes` one-token requests over `context` cached tokens beside fresh prefill chunks;
    with `sets`, request k on adapter set k % sets, set s on its own `rank` pool rows
    (s * rank, ...) in each of `groups` (distinct rows: the step reads every set's bytes)."""
    lens = [(1, context)] * decodes + [(n, 0) for n in prefills]
    items = [PlanItem(n, start, True, PROFILE_PARAMS, k, 0, 1 + k % sets if sets else 0)
             for k, (n, start) in enumerate(lens)]
    adapter_sets = [{}] + [
        {g: GroupRows(list(range(s * rank, (s + 1) * rank)), [1.0] * rank) for g in groups}
        for s in range(sets)]
    tokens = sum(i.extend_len for i in items)
    slots = 1 + np.arange(sum(i.start + i.extend_len for i in items))
    return StepPlan(step=0, items=items, input_ids=ids_to_bytes(np.full(tokens, 7)),
                    kv_slots=ids_to_bytes(slots), adapter_sets=adapter_sets)


def split_prefill(tokens: int, chunks: int) -> list[int]:
    base = [tokens // chunks] * chunks
    for k in range(tokens % chunks):
        base[k] += 1
    return base


SYNTHETIC = {  # name: (decodes, their context, prefill chunks, rank-8 q/k/v/o adapter sets)
    **{f"decode {n}": (n, 400, [], 0) for n in (64, 176, 256, 512, 1024)},
    # a many-adapter burst's decode steps: 176 requests over 100 adapters (or each its own)
    "decode 176, 100 adapters": (176, 400, [], 100),
    "decode 176, 176 adapters": (176, 400, [], 176),
    "mixed 254": (240, 400, split_prefill(541, 14), 0),
    "mixed 944": (900, 400, split_prefill(2361, 44), 0),
    "mixed 944, 100 adapters": (900, 400, split_prefill(2361, 44), 100),
    "prefill 8192": (0, 0, split_prefill(8192, 16), 0),
}


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_step(runner, plan: StepPlan) -> dict:
    """Kernel time by kind (ms) of one launch of `plan`, and the 12 longest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.finish(runner.launch(plan))
        torch.cuda.synchronize()
    by_kind, by_name = defaultdict(float), defaultdict(float)
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us and e.key not in ("", None):
            by_kind[kernel_kind(e.key)] += us / 1e3
            by_name[e.key] += us / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {"by_kind_ms": dict(by_kind), "total_ms": sum(by_kind.values()),
            "top": [(name[:80], ms) for name, ms in top]}


def time_step(runner, plan: StepPlan, repeats: int = 5) -> dict:
    """Median wall ms of launch + finish, and median device ms (events), after a warm-up."""
    runner.finish(runner.launch(plan))
    walls, device = [], []
    for _ in range(repeats):
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        launched = runner.launch(plan)
        launch_ms = 1e3 * (time.perf_counter() - t)
        if runner.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        runner.finish(launched)
        walls.append(1e3 * (time.perf_counter() - t))
        if runner.device.type == "cuda":
            end.synchronize()
            device.append(start.elapsed_time(end))
    return {"wall_ms": statistics.median(walls), "launch_ms": launch_ms,
            "device_ms": statistics.median(device) if device else None}


def fill_kv(runner, slots: int) -> None:
    """Random keys and values in the first `slots` slots of every layer (not zeros)."""
    gen = torch.Generator(device=runner.device).manual_seed(0)
    for cache in (*runner.kv_pool.k_cache, *runner.kv_pool.v_cache):
        cache[:slots].normal_(generator=gen)


def decode_floors_ms(shape: Shape, decodes: int, context: int, peak_bw: float,
                     peak_flops: float) -> tuple[float, float]:
    """(bytes, FLOPs) floors of a decode-only step in ms: the weights it touches and its KV at
    peak_bw; its projections' and attention's FLOPs at peak_flops (past about 200 tokens a
    dense 8B model's decode step is bound by the FLOPs on an H100)."""
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2 * decodes * (context + 1)
    attention = 4 * shape.layers * shape.heads * shape.head_dim * (context + 1) * decodes
    flops = 2 * shape.params() * decodes + attention
    return (1e3 * (shape.decode_weight_bytes(decodes) + kv) / peak_bw,
            1e3 * flops / peak_flops)


def adapter_rows_fit(pool, plan: StepPlan) -> bool:
    """Every row of the plan's adapter sets exists in the pool's group."""
    return all(g in pool.group_rows and max(r.rows) < pool.group_rows[g]
               for aset in plan.adapter_sets for g, r in aset.items())


def adapter_bytes(pool, plan: StepPlan) -> int:
    """Bytes of the distinct pool rows the plan's adapter sets read (A and B, every layer)."""
    total = 0
    for g in pool.groups:
        rows = {r for aset in plan.adapter_sets if g in aset for r in aset[g].rows}
        a, b = pool.a_all[g], pool.b_all[g]
        per_row = (a[:, :, 0].numel() + b[:, 0].numel()) * a.element_size()
        total += len(rows) * per_row
    return total


def synthetic_steps(engine: Engine, shape: Shape, peak_bw: float, peak_flops: float) -> dict:
    runner, backend = engine.runner, engine.runner.attn_backend
    split = getattr(backend, "_split", None)  # the Triton backend's
    slots = engine.config.kv_pages * engine.config.page_size
    plans = {name: synthetic_plan(*spec) for name, spec in SYNTHETIC.items()}
    plans = {name: p for name, p in plans.items() if len(p.kv_slots) // 4 < slots
             and adapter_rows_fit(runner.adapter_pool, p)}
    fill_kv(runner, max(len(p.kv_slots) // 4 for p in plans.values()) + 1)
    out = {}
    for name, plan in plans.items():
        decodes, context, prefills, _ = SYNTHETIC[name]
        mixed = split is not None and bool(prefills)
        variants = (("split", split), ("extend only", lambda *a: None)) if mixed else (("", None),)
        for variant, fn in variants:
            if fn is not None:
                backend._split = fn
            try:
                timing = time_step(runner, plan)
                prof = profile_step(runner, plan) if runner.device.type == "cuda" else {}
            finally:
                if fn is not None:
                    backend._split = split
            floors = ((None, None) if prefills else
                      decode_floors_ms(shape, decodes, context, peak_bw, peak_flops))
            if floors[0] is not None:
                floors = (floors[0] + 1e3 * adapter_bytes(runner.adapter_pool, plan) / peak_bw,
                          floors[1])
            out[f"{name}, {variant}" if variant else name] = {**timing, **prof,
                                         "tokens": sum(i.extend_len for i in plan.items),
                                         "floor_ms": floors[0], "flops_floor_ms": floors[1]}
    return out


def gemm_rates(engine: Engine, token_counts=(781, 3261, 8192)) -> dict:
    """TFLOP/s of each projection's GEMM (x @ W.T) at each token count, bf16."""
    from bench_common import time_us

    cfg, dev = engine.model_cfg, engine.runner.device
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}
    dtype = engine.runner.dtype
    out = {}
    for m in token_counts:
        for name, (k, n) in shapes.items():
            x = torch.randn(m, k, device=dev, dtype=dtype)
            w = torch.randn(n, k, device=dev, dtype=dtype)
            eager, _ = time_us(lambda x=x, w=w: x @ w.T, dev.type)
            out[f"{name} M={m}"] = {"us": eager, "tflops": 2 * m * k * n / eager / 1e6}
    return out


# ---- main ------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--parts", default="steps,gemm,burst")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--adapters", default="0", help="comma-separated adapter counts")
    p.add_argument("--max-running", default="default", help="comma-separated: default or N")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama3-8b",
                   help="the random checkpoint's shape and family (bench_e2e's)")
    p.add_argument("--peak-bw", type=float, default=H200_BYTES_PER_S,
                   help="memory bytes/s of the floors (H200: 4.24e12)")
    p.add_argument("--peak-flops", type=float, default=H200_FLOPS,
                   help="dense bf16 FLOP/s of the decode steps' FLOPs floor (H200: 800e12)")
    p.add_argument("--graph-buckets", default="", metavar="B,...",
                   help="experiment: decode batch buckets added to cuda_graph.BATCH_BUCKETS "
                        "(captured up to the engine's max_running)")
    p.add_argument("--grouped-tuning", default="", metavar="FIELD=N,...",
                   help="experiment: GroupedTuning fields of the grouped LoRA kernels (e.g. "
                        "col_chunk=1024), set before the engine captures its graphs")
    args = p.parse_args()
    if args.grouped_tuning:
        for name in ("DEFAULT_TUNING", "WIDE_ROWS_TUNING"):
            setattr(sgmv_grouped, name, replace_fields(getattr(sgmv_grouped, name),
                                                       args.grouped_tuning))
    if args.graph_buckets:
        extra = {int(b) for b in args.graph_buckets.split(",")}
        cuda_graph.BATCH_BUCKETS = tuple(sorted(set(cuda_graph.BATCH_BUCKETS) | extra))
    parts = set(args.parts.split(","))
    config = MODEL_SHAPES[args.model_shape]
    shape, kw = (SMOKE, {"device": "cpu", "dtype": "float32"}) if args.smoke else (config, {})
    if args.smoke:
        args.requests = min(args.requests, 24)
        SYNTHETIC.update({name: (min(d, 8), min(c, 40), p[:2], min(a, 4))
                          for name, (d, c, p, a) in SYNTHETIC.items()})
    dims = Shape.from_config(shape)
    results: dict = {"argv": sys.argv, "commit": os.popen("git rev-parse --short HEAD").read()
                     .strip()}
    out_dir = Path(os.environ.get("OUT", "."))
    started = time.perf_counter()
    engine = Engine(model_dir(shape), load_format="dummy", **kw)
    results["start_s"] = time.perf_counter() - started
    results["config"] = {k: getattr(engine.config, k) for k in
                         ("kv_pages", "max_running", "max_batch_tokens", "adapter_rows")}
    results["graph_buckets"] = cuda_graph.batch_buckets(engine.config.max_running)
    print(f"engine ready in {results['start_s']:.1f} s: {results['config']}", flush=True)

    def save():
        (out_dir / "bench_burst.json").write_text(json.dumps(results, indent=1, default=str))

    if "steps" in parts:
        results["steps"] = synthetic_steps(engine, dims, args.peak_bw, args.peak_flops)
        save()
        print_steps(results["steps"])
    if "gemm" in parts and engine.runner.device.type == "cuda":
        results["gemm"] = gemm_rates(engine)
        save()
        for name, r in results["gemm"].items():
            print(f"  gemm {name:16s} {r['us']:9.1f} us {r['tflops']:6.0f} TFLOP/s")
    if "burst" in parts:
        results["bursts"] = {}
        for count in map(int, args.adapters.split(",")):
            names = add_adapters(engine, count)
            reqs = burst_requests(args.requests, engine.model_cfg.vocab_size, names, args.seed,
                                  scale=0.05 if args.smoke else 1.0)
            fl = burst_floor(dims, reqs, 8, args.peak_bw)
            for mr in args.max_running.split(","):
                key = f"adapters {count}, max_running {mr}"
                r = run_burst(engine, reqs, None if mr == "default" else int(mr))
                r["floor_s"] = fl["floor_s"]
                results["bursts"][key] = r
                save()
                print_burst(key, r)
    save()


def add_adapters(engine: Engine, count: int) -> list[str]:
    names = []
    for k in range(count):
        name = f"burst{k}"
        if name not in engine.adapters:
            engine.add_adapter(random_adapter(engine.model_cfg, name, 8, QKVO, 1000 + k, "cpu"))
        names.append(name)
    return names


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_steps(steps: dict) -> None:
    for name, r in steps.items():
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r.get("by_kind_ms", {}).items(),
                                                          key=lambda kv: -kv[1]))
        floor = (f"  floors: bytes {r['floor_ms']:.2f} ms = {r['device_ms'] / r['floor_ms']:.2f}x,"
                 f" FLOPs {r['flops_floor_ms']:.2f} ms"
                 if r.get("floor_ms") and r["device_ms"] else "")
        print(f"  step {name:28s} {r['tokens']:5d} tok  wall {_f(r['wall_ms'])} ms  device "
              f"{_f(r['device_ms'])} ms  launch {_f(r['launch_ms'])} ms{floor}  [{kinds}]",
              flush=True)
        for kname, ms in r.get("top", []):
            print(f"      {ms:8.2f} ms  {kname}")


def print_burst(key: str, r: dict) -> None:
    s = r["steps"]
    print(f"burst [{key}]: {r['requests']} requests, {r['output_tokens']} output tokens in "
          f"{r['seconds']:.1f} s = {r['tok_s']:.0f} tok/s; floor {r['floor_s']:.1f} s "
          f"({r['seconds'] / r['floor_s']:.2f}x)", flush=True)
    for kind in ("decode", "mixed"):
        k = s[kind]
        print(f"  {kind:6s} steps {k['steps']:5d}  mean {_f(k['mean_ms'])} ms (device "
              f"{_f(k['mean_device_ms'])}, plan {_f(k['mean_plan_ms'], 2)}, launch "
              f"{_f(k['mean_launch_ms'], 2)})  {_f(k['mean_requests'])} requests "
              f"{_f(k['mean_tokens'])} tokens  {k['total_s']:.1f} s in all")
    h = s["host"]
    print(f"  host: plan {h['plan_s']:.1f} s, launch {h['launch_s']:.1f} s, wait "
          f"{h['wait_s']:.1f} s; device busy {_f(h['device_busy_s'])} s of {h['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
