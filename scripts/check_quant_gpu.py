"""The quantized paths on CUDA in one run (issue 33): correctness checks with PASS/FAIL and the
H200 figures, each measured here.

  pool     resident adapters at equal pool bytes, int8 vs bf16 pool (Llama-3-8B shapes): the
           device bytes of allocated pools against layout.bytes_per_row.
  int8     the Triton LoRA kernels on an int8 pool against the torch backend on the same pool,
           fp32 and bf16, one Llama-3-8B layer with 64 adapters (apply, deferred delta,
           per-segment), plus the fp32 product with v rounded to bf16 (what the expands did
           for every int8 pool on CUDA before the fix); then a tiny fp32 model's greedy tokens
           and logprobs, Triton + graphs vs the torch backend, both on an int8 pool.
  sgmv     one Llama-3-8B layer's LoRA time for the 64-adapter decode batch (64 tokens, 64
           distinct rank-16 adapters), int8 pool vs bf16 pool, against each pool's bytes floor.
  proj     each projection at batch 1 and 32: FP8 W8A8 split into the activation quantization
           (Triton kernel and the torch spelling) and torch._scaled_mm (row-wise scales, the
           same with use_fast_accum, and tensor-wise as a cuBLASLt reference), the FP8 Triton
           GEMV and the NF4 one at batch 1 (radixlora_kernels.quant_gemv, checked against
           the dequantized weight's product), NF4 dequantization alone and + GEMM, the bf16 GEMM
           and the read floors (NF4's also with the bf16 weight it writes and the GEMM reads);
           eager and in a CUDA graph, weights cycled over copies worth 3x the L2 cache, so they
           come from HBM as a model's do.
  decode   the engine's decode step at batch 1 and 32 for a bf16, an NF4 and an FP8 base
           (Llama-3-8B shapes, dummy weights, bench_engine.py's set-up), and the FP8 base with
           the torch-spelling activation quantizer it had before: wall-clock step median and
           graph replay against the weight-read floor and the bf16 base.

    python scripts/check_quant_gpu.py                  # H200: a table; JSON to $OUT
    python scripts/check_quant_gpu.py --only int8,proj  # some sections
    python scripts/check_quant_gpu.py --smoke          # CPU, tiny shapes, Triton interpreted

Floors are bytes / 4.24e12 B/s (bench_engine.HBM_BYTES_PER_S). Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from bench_common import time_us  # noqa: E402
from bench_engine import (  # noqa: E402
    HBM_BYTES_PER_S,
    LLAMA3_8B,
    decode_step_ms,
    graph_replay_ms,
    make_engine,
    model_dir,
)
from bench_engine import SMOKE as ENGINE_SMOKE  # noqa: E402
from bench_sgmv import FULL, build_meta, build_projections, scattered_rows, scenarios  # noqa: E402
from bench_sgmv import SMOKE as SGMV_SMOKE  # noqa: E402
from checkpoints import quantize_fp8_blocks  # noqa: E402

from radixlora.config import ModelConfig  # noqa: E402
from radixlora.lora.layout import bytes_per_row, quantize_rows  # noqa: E402
from radixlora.model import quant_fp8  # noqa: E402
from radixlora.model.quant import NF4_CODE  # noqa: E402
from radixlora.worker.adapter_pool import AdapterPool  # noqa: E402
from radixlora_kernels.lora_ops import TorchLoraBackend, TritonLoraBackend  # noqa: E402
from radixlora_kernels.nf4_dequant import nf4_dequant, nf4_dequant_ref  # noqa: E402
from radixlora_kernels.quant_gemv import fp8_gemv, nf4_gemv  # noqa: E402
from radixlora_kernels.sgmv_grouped import grouped_expand, grouped_shrink, tuning_for_rows  # noqa: E402

INT8_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # max |Triton - torch| / max |torch|
ENGINE_LOGPROB_TOL = 1e-3  # gpu_checks.py's bound for Triton + graphs vs the torch path
FP8_REL_TOL = 0.03  # W8A8 against the dequantized weight's product (relative Frobenius)
GEMV_REL_TOL = 0.01  # the skinny kernels against the same: bf16 rounding and summation order
NF4_BLOCKSIZE = 64
EAGER_REP_MS, GRAPH_REP_MS = 50, 20  # per timing; a graph is replayed 10 times
SECTIONS = ("pool", "int8", "sgmv", "proj", "decode")
# decode bases: (--quantization, FP8 activation quantizer); the last one is the FP8 path as it
# was before the Triton quantizer, nine launches per projection
DECODE_BASES = {"bf16": (None, quant_fp8.quantize_per_token),
                "nf4": ("nf4", quant_fp8.quantize_per_token),
                "fp8": ("fp8", quant_fp8.quantize_per_token),
                "fp8, torch-spelling quantizer": ("fp8", quant_fp8.quantize_per_token_ref)}


class Report:
    """Printed lines, a JSON tree and the checks' verdicts."""

    def __init__(self) -> None:
        self.data: dict = {}
        self.failed: list[str] = []

    def line(self, text: str) -> None:
        print(text, flush=True)

    def write_json(self) -> None:
        if out := os.environ.get("OUT"):
            Path(out).mkdir(parents=True, exist_ok=True)
            Path(out, "check_quant_gpu.json").write_text(json.dumps(self.data, indent=2,
                                                                    default=str))

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.line(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")
        self.data.setdefault("checks", {})[name] = {"ok": ok, "detail": detail}
        if not ok:
            self.failed.append(name)


def attempt(rep: Report, name: str, fn) -> bool:
    """fn(); an exception is printed and recorded as a failed check, and the run goes on (one
    GPU call should bring back every section that works)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rep.check(name, False, f"raised {type(e).__name__}: {e}")
        return False
    return True


def timed(fn, device: str) -> dict:
    """{"eager_us", "graph_us"}: medians as bench_common.time_us measures them (eager with the
    L2 flushed before each call; a CUDA graph of repeated calls), over shorter repetitions:
    its 200 ms ones, ten graph replays each, would take this script's ~150 timings past its
    time budget. Off CUDA: time_us's wall clock, graph None."""
    if device != "cuda":
        eager, graph = time_us(fn, device)
        return {"eager_us": eager, "graph_us": graph}
    eager = triton.testing.do_bench(fn, warmup=10, rep=EAGER_REP_MS, return_mode="median")
    try:
        graph = triton.testing.do_bench_cudagraph(fn, rep=GRAPH_REP_MS, return_mode="median")
    except RuntimeError:
        graph = None
    return {"eager_us": eager * 1e3, "graph_us": None if graph is None else graph * 1e3}


def copies(nbytes: int, device: str) -> int:
    """How many copies of `nbytes` of weights to cycle through so that the back-to-back calls
    of a graph read them from HBM, as a model's layers do: 3x the L2 cache in all (the H200's
    50 MB L2 holds a whole FP8 qkv weight)."""
    if device != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, math.ceil(3 * l2 / nbytes))


def cycling(fn, cases: list):
    """A call of fn(*case) over `cases` in turn: a graph of n calls captures n different ones."""
    turn = itertools.cycle(cases)
    return lambda: fn(*next(turn))


def fmt_us(t: dict) -> str:
    graph = "-" if t["graph_us"] is None else f"{t['graph_us']:.1f}"
    return f"{t['eager_us']:8.1f} / {graph:>7}"


def best_us(t: dict) -> float:
    return t["eager_us"] if t["graph_us"] is None else t["graph_us"]


def floor_us(num_bytes: int) -> float:
    return num_bytes / HBM_BYTES_PER_S * 1e6


# pool ------------------------------------------------------------------------------------------


def pool_bytes(cfg: ModelConfig, dtype: torch.dtype, rows: int, device: str) -> int:
    """Device bytes of an allocated AdapterPool of `rows` rows: A, B and (int8) scales."""
    pool = AdapterPool(cfg, rows, dtype, device, host_bytes=0)
    tensors = [*pool.a_all.values(), *pool.b_all.values(), *pool.qscales_all.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def section_pool(rep: Report, shape: dict, device: str) -> None:
    rep.line("\n== pool: resident adapters at equal pool bytes (Llama-3-8B shapes unless smoke)")
    cfg = ModelConfig.from_hf(shape)
    rows, budget_rows = 64, 2048  # budget: a bf16 pool of 2048 rows, 32 adapters of rank 64
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("int8", torch.int8)):
        measured = pool_bytes(cfg, dtype, rows, device) / rows
        out[name] = {"bytes_per_row": bytes_per_row(cfg, dtype),
                     "allocated_bytes_per_row": measured}
        rep.check(f"pool {name} bytes per row", measured == out[name]["bytes_per_row"],
                  f"allocated {measured:.0f} B, bytes_per_row {out[name]['bytes_per_row']} B")
    budget = budget_rows * out["bf16"]["allocated_bytes_per_row"]
    rep.line(f"  budget {budget / 2**30:.2f} GiB (a bf16 pool of {budget_rows} rows)")
    per_row = {n: o["allocated_bytes_per_row"] for n, o in out.items()}
    for rank in (16, 64):
        fits = {n: int(budget // (rank * row)) for n, row in per_row.items()}
        out[f"rank{rank}_resident"] = fits
        rep.line(f"  rank {rank}: bf16 {fits['bf16']} adapters, int8 {fits['int8']} "
                 f"({fits['int8'] / fits['bf16']:.2f}x)")
    rep.data["pool"] = {"budget_bytes": budget, **out}


# int8 ------------------------------------------------------------------------------------------


def int8_projection(p):
    """(int8 A, int8 B, qscales) of a bench_sgmv Projection, quantized as AdapterPool.pack
    quantizes: A per (slice, row) over in_dim, B per (row, slice) over the slice's columns."""
    qa, a_scales = quantize_rows(p.a_pool.float())
    off = p.out_offsets
    b_parts = [quantize_rows(p.b_pool[:, lo:hi].float()) for lo, hi in zip(off[:-1], off[1:])]
    qb = torch.cat([q for q, _ in b_parts], 1)
    return qa, qb, (a_scales * torch.stack([s for _, s in b_parts])).contiguous()


def layer_case(cfg, dtype: torch.dtype):
    """The 64-adapter decode batch ("distinct" scenario: one token per adapter) on one layer:
    (projections, their int8 pools, grouped meta, per-segment meta)."""
    cfg = dataclasses.replace(cfg, dtype=dtype)
    sc = next(sc for sc in scenarios(cfg) if sc.name == f"distinct r{cfg.rank}")
    adapter_rows = scattered_rows(sc.num_adapters, sc.rank, torch.Generator().manual_seed(0))
    projs = build_projections(cfg, sc.num_adapters * sc.rank + 32, len(sc.sets))
    grouped = build_meta(sc, adapter_rows, cfg.device, 16)
    per_segment = build_meta(sc, adapter_rows, cfg.device, None)
    return sc, projs, [int8_projection(p) for p in projs], grouped, per_segment


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |y - ref|, that over max |ref|)."""
    err = float((y.float() - ref.float()).abs().max())
    return err, err / max(float(ref.float().abs().max()), 1e-30)


def int8_deltas(projs, pools, meta, how: str) -> list[torch.Tensor]:
    """The layer's deltas through the Triton backend on the int8 pools: `apply` into zeros
    of x's dtype, or `deferred` (float32 delta buffer), or `bf16 v` (the fp32 product with v
    rounded to bfloat16, as the CUDA expands did before expand_fp32_dot)."""
    backend, out = TritonLoraBackend(), []
    for p, (qa, qb, qs) in zip(projs, pools, strict=True):
        dtype = p.x.dtype if how == "apply" else torch.float32
        y = torch.zeros(p.x.shape[0], qb.shape[1], dtype=dtype, device=p.x.device)
        if how == "apply":
            backend.apply(p.x, y, qa, qb, p.out_offsets, meta, qs)
        elif how == "deferred":
            backend.deferred_delta(p.x, qa, qb, p.out_offsets, meta, y, qs)
        else:
            g, tuning = meta.groups, tuning_for_rows(meta.max_rows)
            index = (g.num_groups, g.group_indptr, g.token_ids, g.row_indptr, g.row_ids)
            v = grouped_shrink(p.x, qa, *index, g.row_scales, meta.max_rows, tuning=tuning,
                               qscales=qs)
            grouped_expand(v, qb, p.out_offsets, *index, y, tuning=tuning,
                           act_dtype=torch.bfloat16)
        out.append(y)
    return out


def torch_deltas(projs, pools, meta) -> list[torch.Tensor]:
    out = []
    for p, (qa, qb, qs) in zip(projs, pools, strict=True):
        y = torch.zeros(p.x.shape[0], qb.shape[1], dtype=torch.float32, device=p.x.device)
        TorchLoraBackend().apply(p.x, y, qa, qb, p.out_offsets, meta, qs)
        out.append(y)
    return out


def section_int8(rep: Report, sgmv_cfg, smoke: bool) -> None:
    rep.line("\n== int8: Triton LoRA kernels vs the torch backend on the same int8 pool "
             "(max abs err, max rel err)")
    if smoke:
        rep.line("  note: the interpreter multiplies in fp32 whatever the dtypes; the bf16 "
                 "rounding of v (the pre-fix CUDA path) happens on CUDA only")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        _, projs, pools, grouped, per_segment = layer_case(sgmv_cfg, dtype)
        refs = {"grouped": torch_deltas(projs, pools, grouped)}
        refs["per-segment"] = torch_deltas(projs, pools, per_segment)
        cases = [("apply", "grouped", "apply"), ("deferred", "grouped", "deferred"),
                 ("apply", "per-segment", "apply")]
        if dtype == torch.float32:
            cases.append(("bf16 v", "grouped", "bf16 v"))
        for how, meta_name, label in cases:
            meta = grouped if meta_name == "grouped" else per_segment
            worst = max((rel_err(y, r) for y, r in zip(int8_deltas(projs, pools, meta, how),
                                                        refs[meta_name], strict=True)),
                        key=lambda e: e[1])
            key = f"{name} {label} {meta_name}"
            results[key] = {"max_abs": worst[0], "max_rel": worst[1]}
            detail = f"max abs {worst[0]:.3e}, max rel {worst[1]:.3e}"
            if how == "bf16 v":
                rep.line(f"  info  {key} (the pre-fix rounding): {detail}")
            else:
                rep.check(f"int8 {key}", worst[1] <= INT8_TOL[dtype],
                          f"{detail} (tolerance {INT8_TOL[dtype]:g})")
    rep.data["int8"] = results
    engine_logprobs(rep, smoke)


def engine_logprobs(rep: Report, smoke: bool) -> None:
    """gpu_checks.py's tiny fp32 model and adapters, both engines on an int8 pool."""
    from checkpoints import build_tiny_adapter, build_tiny_model

    from radixlora import Engine, SamplingParams

    root = Path(tempfile.mkdtemp(prefix="check-quant-"))
    model = build_tiny_model(root / "model")
    adapters = {f"ad{i}": build_tiny_adapter(model, root / f"ad{i}", rank=r, seed=i)
                for i, r in enumerate((4, 8, 16, 64))}
    specs = [None, "ad0", "ad1", "ad2", "ad3", [("ad0", 1.0), ("ad3", 0.5)],
             [("ad1", -0.5), ("ad2", 2.0), ("ad0", 1.0)], "ad3"]
    prompts = [[5 + i] * (3 + 5 * i) for i in range(len(specs))]
    params = SamplingParams(max_tokens=6 if smoke else 24, temperature=0.0, ignore_eos=True,
                            logprobs=2)
    device = "cpu" if smoke else "cuda"
    common = dict(adapters=adapters, device=device, dtype="float32", page_size=4, kv_pages=512,
                  lora_dtype="int8", warm_up=False)
    reference = Engine(model, attention_backend="torch", lora_backend="torch", cuda_graph=False,
                       overlap_schedule=False, **common)
    fast = Engine(model, lora_backend="triton", **common)
    ref = reference.generate(prompts, params, adapters=specs)
    got = fast.generate(prompts, params, adapters=specs)
    mismatches, worst = 0, 0.0
    for a, b in zip(ref, got, strict=True):
        mismatches += a.outputs[0].token_ids != b.outputs[0].token_ids
        worst = max(worst, *(abs(x - y) for x, y in zip(a.outputs[0].logprobs,
                                                        b.outputs[0].logprobs)))
    rep.data["int8_engine"] = {"mismatched_sequences": mismatches, "max_logprob_diff": worst}
    graphs = "" if smoke else " with CUDA graphs"
    rep.check("int8 engine fp32: Triton vs torch", mismatches == 0 and worst <= ENGINE_LOGPROB_TOL,
              f"tiny fp32 model{graphs}: {mismatches}/{len(specs)} sequences differ, max "
              f"|logprob diff| {worst:.2e} (tolerance {ENGINE_LOGPROB_TOL:g})")


# sgmv ------------------------------------------------------------------------------------------


def section_sgmv(rep: Report, sgmv_cfg) -> None:
    rep.line("\n== sgmv: one layer's LoRA (4 fused projections), 64-adapter decode batch; "
             "us eager / graph")
    sc, projs, pools, meta, _ = layer_case(sgmv_cfg, torch.bfloat16)
    device = sgmv_cfg.device
    distinct_rows = len({int(r) for r in meta.row_ids.tolist()})
    backend, out = TritonLoraBackend(), {}
    variants = {"bf16": [(p.a_pool, p.b_pool, None) for p in projs], "int8": pools}
    for name, tensors in variants.items():
        ys = [torch.zeros(p.x.shape[0], p.out_offsets[-1], dtype=p.x.dtype, device=p.x.device)
              for p in projs]
        read = sum(distinct_rows * (a.shape[0] * a.shape[2] + b.shape[1]) * a.element_size()
                   + (0 if qs is None else distinct_rows * qs.shape[0] * 4)
                   for a, b, qs in tensors)
        layers = [tensors] + [[tuple(None if t is None else t.clone() for t in ts)
                               for ts in tensors] for _ in range(copies(read, device) - 1)]

        def layer(tensors, ys=ys) -> None:
            for p, (a, b, qs), y in zip(projs, tensors, ys, strict=True):
                backend.apply(p.x, y, a, b, p.out_offsets, meta, qs)

        t = timed(cycling(layer, [(ts,) for ts in layers]), device)
        out[name] = {**t, "bytes": read, "floor_us": floor_us(read), "copies": len(layers)}
        rep.line(f"  {sc.name} {name:<5} pool: {fmt_us(t)} us; adapter bytes {read / 1e6:.2f} "
                 f"MB, floor {floor_us(read):.2f} us, x floor {best_us(t) / floor_us(read):.2f}")
        del layers
    ratio = best_us(out["int8"]) / best_us(out["bf16"])
    rep.line(f"  int8 / bf16 time: {ratio:.2f}")
    rep.data["sgmv"] = {"scenario": sc.name, **out, "int8_over_bf16": ratio}


# proj ------------------------------------------------------------------------------------------


def projection_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each fused projection."""
    h, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * inter, h), "down": (h, inter)}


def nf4_weights(shape: tuple[int, int], device: str):
    g = torch.Generator(device=device).manual_seed(0)
    numel = shape[0] * shape[1]
    packed = torch.randint(0, 256, (numel // 2,), dtype=torch.uint8, device=device, generator=g)
    absmax = torch.rand(numel // NF4_BLOCKSIZE, device=device, generator=g) * 0.1
    return packed, absmax, NF4_CODE.to(device)


def check_nf4(rep: Report, name: str, shape, device: str) -> dict:
    packed, absmax, code = nf4_weights(shape, device)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        out = torch.empty(shape, dtype=dtype, device=device)
        nf4_dequant(packed, absmax, code, NF4_BLOCKSIZE, out)
        ref = nf4_dequant_ref(packed, absmax, code, NF4_BLOCKSIZE, shape, dtype)
        rep.check(f"nf4 {name} {dtype}", torch.equal(out, ref), "Triton == torch reference "
                  "bit for bit" if torch.equal(out, ref) else "Triton != torch reference")
    scratch = torch.empty(shape, dtype=torch.bfloat16, device=device)
    w = nf4_dequant_ref(packed, absmax, code, NF4_BLOCKSIZE, shape, torch.bfloat16)
    nf4_bytes = packed.numel() + absmax.numel() * 4
    weights = [(packed, absmax)] + [(packed.clone(), absmax.clone())
                                    for _ in range(copies(nf4_bytes, device) - 1)]

    def dequant(packed, absmax) -> torch.Tensor:
        return nf4_dequant(packed, absmax, code, NF4_BLOCKSIZE, scratch)

    result = {"dequant": timed(cycling(dequant, weights), device),
              "floor_nf4_read_us": floor_us(nf4_bytes),
              "floor_dequant_us": floor_us(nf4_bytes + w.numel() * 2),
              "floor_dequant_gemm_us": floor_us(nf4_bytes + w.numel() * 4)}
    for batch in (1, 32):
        x = torch.randn(batch, shape[1], dtype=torch.bfloat16, device=device)
        result[f"bs{batch}"] = timed(cycling(
            lambda packed, absmax, x=x: F.linear(x, dequant(packed, absmax)), weights), device)
    x = torch.randn(1, shape[1], dtype=torch.bfloat16, device=device)  # nf4_gemv's batch
    check_gemv(rep, f"nf4 {name} bs1 GEMV", F.linear(x, w),
               nf4_gemv(x, packed, absmax, code, NF4_BLOCKSIZE, shape[0]))
    result["gemv_bs1"] = timed(cycling(
        lambda packed, absmax: nf4_gemv(x, packed, absmax, code, NF4_BLOCKSIZE, shape[0]),
        weights), device)
    return result


def check_gemv(rep: Report, name: str, ref: torch.Tensor, y: torch.Tensor) -> None:
    rel = float((y.float() - ref.float()).norm() / ref.float().norm())
    rep.check(name, rel < GEMV_REL_TOL, f"relative error {rel:.4f} against the dequantized "
              f"weight's product (tolerance {GEMV_REL_TOL})")


def fp8_case(shape, device: str):
    g = torch.Generator(device=device).manual_seed(1)
    w = torch.randn(shape, device=device, generator=g) * 0.02
    w8, scale = quant_fp8.quantize_fp8(w)
    return w8, scale, (w8.float() * scale[:, None]).to(torch.bfloat16)


FP8_BLOCK = (128, 128)  # Qwen's and DeepSeek's FP8 checkpoints' weight_block_size


def fp8_block_case(shape, device: str):
    """(W8, scales per row and block of 128 columns, the dequantized bf16 weight)."""
    g = torch.Generator(device=device).manual_seed(1)
    w = (torch.randn(shape, device=device, generator=g) * 0.02).cpu()
    w8, scale, _ = quantize_fp8_blocks(w, FP8_BLOCK)
    linear = quant_fp8.Fp8Linear(shape[1], shape[0], False, torch.bfloat16, FP8_BLOCK)
    linear.load_rows((0, shape[0]), w8, quant_fp8.row_block_scales(scale, shape[0], FP8_BLOCK,
                                                                   shape[1]))
    linear = linear.to(device)
    return linear.weight, linear.weight_scale, linear.dequantized(torch.bfloat16)


def check_fp8_block(rep: Report, name: str, shape, batch: int, device: str, case) -> dict:
    w8, scale, ref_w = case
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(batch, shape[1], dtype=torch.bfloat16, device=device, generator=g)
    check_gemv(rep, f"fp8 {name} bs{batch} W8A16 GEMV, 128 x 128 block scales", F.linear(x, ref_w),
               fp8_gemv(x, w8, scale, scale_k=FP8_BLOCK[1]))
    return {"gemv_block": timed(lambda: fp8_gemv(x, w8, scale, scale_k=FP8_BLOCK[1]), device)}


def check_fp8(rep: Report, name: str, shape, batch: int, device: str, w8, scale,
              ref_w) -> dict:
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(batch, shape[1], dtype=torch.bfloat16, device=device, generator=g)
    y = quant_fp8.fp8_linear_w8a8(x, w8, scale, None)
    ref = F.linear(x, ref_w)
    rel = float((y.float() - ref.float()).norm() / ref.float().norm())
    rep.check(f"fp8 {name} bs{batch} W8A8", rel < FP8_REL_TOL,
              f"relative error {rel:.4f} (tolerance {FP8_REL_TOL})")
    x8, x_scale = quant_fp8.quantize_per_token(x)
    # the reference on the CPU: torch's CUDA division by 448 multiplies by a rounded reciprocal
    ref8, ref_scale = quant_fp8.quantize_per_token_ref(x.cpu())
    same = torch.equal(x8.view(torch.uint8).cpu(), ref8.view(torch.uint8)) and torch.equal(
        x_scale.cpu(), ref_scale)
    rep.check(f"fp8 {name} bs{batch} quantizer", same,
              "Triton == torch spelling (CPU) bit for bit" if same
              else "Triton != torch spelling (CPU)")
    one = torch.ones((), device=device)
    weights = [(w8, scale, ref_w)] + [(w8.clone(), scale.clone(), ref_w.clone())
                                      for _ in range(copies(w8.numel(), device) - 1)]

    def mm(w8, scale, scale_a=x_scale, fast_accum: bool = False) -> torch.Tensor:
        scale_b = one if scale_a is one else scale.view(1, -1)
        return torch._scaled_mm(x8, w8.t(), scale_a=scale_a, scale_b=scale_b,
                                out_dtype=torch.bfloat16, use_fast_accum=fast_accum)

    check_gemv(rep, f"fp8 {name} bs{batch} W8A16 GEMV", ref, fp8_gemv(x, w8, scale))
    fast = mm(w8, scale, fast_accum=True)
    rel_fast = float((fast.float() - ref.float()).norm() / ref.float().norm())
    rep.line(f"  info  fp8 {name} bs{batch} row-wise with use_fast_accum=True: relative error "
             f"{rel_fast:.4f}")
    return {"rel_err": rel, "rel_err_fast_accum": rel_fast, "copies": len(weights),
            "quant_triton": timed(lambda: quant_fp8.quantize_per_token(x), device),
            "quant_torch": timed(lambda: quant_fp8.quantize_per_token_ref(x), device),
            "mm_rowwise": timed(cycling(lambda w, s, _: mm(w, s), weights), device),
            "mm_rowwise_fast_accum": timed(cycling(
                lambda w, s, _: mm(w, s, fast_accum=True), weights), device),
            "mm_tensorwise": timed(cycling(lambda w, s, _: mm(w, s, scale_a=one), weights),
                                   device),
            "w8a8": timed(cycling(lambda w, s, _: quant_fp8.fp8_linear_w8a8(x, w, s, None),
                                  weights), device),
            "gemv": timed(cycling(lambda w, s, _: fp8_gemv(x, w, s), weights), device),
            "bf16_gemm": timed(cycling(lambda w, s, r: F.linear(x, r), weights), device)}


def section_proj(rep: Report, shape: dict, device: str) -> None:
    rep.line("\n== proj: one projection, us eager / graph (graph: what a decode step pays)")
    if device == "cuda" and not quant_fp8.scaled_mm_supported(torch.device(device)):
        rep.line("  note: no FP8 tensor cores here (compute capability < 8.9)")
    out = rep.data["proj"] = {}
    for name, pshape in projection_shapes(shape).items():
        attempt(rep, f"proj {name}", lambda name=name, pshape=pshape: measure_projection(
            rep, out, name, pshape, device))
    print_proj_table(rep, out)


def measure_projection(rep: Report, out: dict, name: str, pshape, device: str) -> None:
    """out[name]: NF4 and FP8 checks and times of one projection, floors."""
    nf4 = check_nf4(rep, name, pshape, device)
    w8, scale, ref_w = fp8_case(pshape, device)
    result = {"shape": list(pshape), "nf4": nf4, "floor_bf16_us": floor_us(ref_w.numel() * 2),
              "floor_fp8_us": floor_us(w8.numel() + scale.numel() * 4)}
    block = fp8_block_case(pshape, device)
    for batch in (1, 32):
        result[f"fp8_bs{batch}"] = check_fp8(rep, name, pshape, batch, device, w8, scale, ref_w)
        result[f"fp8_bs{batch}"] |= check_fp8_block(rep, name, pshape, min(batch, 16), device,
                                                    block)
    out[name] = result


def print_proj_table(rep: Report, out: dict) -> None:
    rows = [("fp8 quantize: Triton kernel", "quant_triton"),
            ("fp8 quantize: torch spelling", "quant_torch"),
            ("fp8 _scaled_mm row-wise scales", "mm_rowwise"),
            ("fp8 _scaled_mm row-wise, fast accum", "mm_rowwise_fast_accum"),
            ("fp8 _scaled_mm tensor-wise (cuBLASLt)", "mm_tensorwise"),
            ("fp8 W8A8 total (fp8_linear_w8a8)", "w8a8"), ("fp8 W8A16 Triton GEMV", "gemv"),
            ("fp8 W8A16 GEMV, 128x128 blocks (bs 1, 16)", "gemv_block"),
            ("bf16 GEMM", "bf16_gemm")]
    for name, o in out.items():
        rep.line(f"  {name} [out, in] = {o['shape']}")
        rep.line(f"    {'us, eager / graph':<40}{'batch 1':>18}  {'batch 32':>18}")
        for label, key in rows:
            rep.line(f"    {label:<40}{fmt_us(o['fp8_bs1'][key])}  {fmt_us(o['fp8_bs32'][key])}")
        nf4 = o["nf4"]
        rep.line(f"    {'nf4 dequant + GEMM':<40}{fmt_us(nf4['bs1'])}  {fmt_us(nf4['bs32'])}")
        rep.line(f"    {'nf4 Triton GEMV (batch 1 only)':<40}{fmt_us(nf4['gemv_bs1'])}")
        rep.line(f"    {'nf4 dequant alone':<40}{fmt_us(nf4['dequant'])}")
        rep.line(f"    floors, us: bf16 read {o['floor_bf16_us']:.2f}, fp8 read "
                 f"{o['floor_fp8_us']:.2f}, nf4 read {nf4['floor_nf4_read_us']:.2f}, nf4 "
                 f"dequant (read nf4 + write bf16) {nf4['floor_dequant_us']:.2f}, nf4 dequant + "
                 f"GEMM {nf4['floor_dequant_gemm_us']:.2f}")


# decode ----------------------------------------------------------------------------------------


def weight_read_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter and buffer once (shared ones
    once), but the embedding table (a step reads its tokens' rows only, unless lm_head is it)
    and the rotary tables."""
    seen, total = set(), 0
    tied = model.lm_head.weight is model.embed_tokens.weight
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in tensors:
        skip = name.startswith("rotary") or (name.startswith("embed_tokens") and not tied)
        if skip or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


def decode_base(shape: dict, device: str, quantization: str | None, smoke: bool) -> dict:
    from radixlora.worker.cuda_graph import GraphKey

    args = SimpleNamespace(device=device, dtype="bfloat16")
    engine = make_engine(model_dir(shape), args, kv_pages=4096 if smoke else 16384,
                         max_running=32, max_batch_tokens=4096, adapter_rows=64, max_rank=16,
                         quantization=quantization)
    weights = weight_read_bytes(engine.runner.model)
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.capture([GraphKey(b, b, 0) for b in (1, 32)])
    rng = np.random.default_rng(0)
    result = {"weight_bytes": weights, "floor_ms": weights / HBM_BYTES_PER_S * 1e3}
    prompt, new = (16, 6) if smoke else (128, 32)
    for batch in (1, 32):
        decode_step_ms(engine, batch, [None], 16, 4, rng)  # compiles, captures extend graphs
        result[f"bs{batch}_step_ms"] = decode_step_ms(engine, batch, [None], prompt, new, rng)
        replay = graph_replay_ms(engine, rows=0, batch=batch) if graphs is not None else None
        result[f"bs{batch}_replay_ms"] = replay
    del engine, graphs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


@contextlib.contextmanager
def fp8_activation_quantizer(quantize):
    """fp8_linear_w8a8 quantizing its activations with `quantize` meanwhile."""
    kernel = quant_fp8.quantize_per_token
    quant_fp8.quantize_per_token = quantize
    try:
        yield
    finally:
        quant_fp8.quantize_per_token = kernel


def section_decode(rep: Report, shape: dict, device: str, smoke: bool) -> None:
    rep.line("\n== decode: engine decode step, dummy weights, no adapter; ms")
    if device != "cuda":
        rep.line("  note: no CUDA graphs here: graph replay not measured; the FP8 bases run "
                 "their dequantized reference (no _scaled_mm), both quantizers unused")
    out = {}
    for base, (quantization, quantizer) in DECODE_BASES.items():
        start = time.perf_counter()

        def run(base=base, quantization=quantization, quantizer=quantizer) -> None:
            with fp8_activation_quantizer(quantizer):
                out[base] = decode_base(shape, device, quantization, smoke)

        if attempt(rep, f"decode {base} base", run):
            out[base]["seconds"] = time.perf_counter() - start
    rep.data["decode"] = out
    if "bf16" not in out:
        return
    for base, r in out.items():
        rep.line(f"  {base}: weights read {r['weight_bytes'] / 1e9:.2f} GB, floor "
                 f"{r['floor_ms']:.3f} ms ({r['seconds']:.0f} s to build and time)")
        for batch in (1, 32):
            step, replay = r[f"bs{batch}_step_ms"], r[f"bs{batch}_replay_ms"]
            base_step = out["bf16"][f"bs{batch}_step_ms"]
            base_replay = out["bf16"][f"bs{batch}_replay_ms"]
            replay_text = "-" if replay is None else (
                f"{replay:.3f} (/ floor {replay / r['floor_ms']:.2f}, / bf16 "
                f"{replay / base_replay:.2f})")
            rep.line(f"    batch {batch:>2}: step {step:.3f} (/ floor {step / r['floor_ms']:.2f}, "
                     f"/ bf16 {step / base_step:.2f}); graph replay {replay_text}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections of {', '.join(SECTIONS)}")
    args = p.parse_args()
    sections = [s for s in args.only.split(",") if s]
    if unknown := [s for s in sections if s not in SECTIONS]:
        p.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    device = "cpu" if args.smoke else "cuda"
    shape = ENGINE_SMOKE if args.smoke else LLAMA3_8B
    sgmv_cfg = SGMV_SMOKE if args.smoke else FULL
    rep = Report()
    env = {"torch": torch.__version__, "device": device, "hbm_bytes_per_s": HBM_BYTES_PER_S}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
    rep.data["env"] = env
    rep.line(f"check_quant_gpu: {env}")
    if args.smoke:
        rep.line("smoke: tiny shapes on the CPU, Triton interpreted; its times mean nothing")
    runs = {"pool": lambda: section_pool(rep, shape, device),
            "int8": lambda: section_int8(rep, sgmv_cfg, args.smoke),
            "sgmv": lambda: section_sgmv(rep, sgmv_cfg),
            "proj": lambda: section_proj(rep, shape, device),
            "decode": lambda: section_decode(rep, shape, device, args.smoke)}
    seconds = rep.data["seconds"] = {}
    start = time.perf_counter()
    for section in sections:
        begin = time.perf_counter()
        torch.manual_seed(0)
        attempt(rep, f"section {section}", runs[section])
        seconds[section] = time.perf_counter() - begin
        seconds["total"] = time.perf_counter() - start
        rep.write_json()  # after every section: a run cut short keeps what it measured
    verdict = "FAIL: " + ", ".join(rep.failed) if rep.failed else "PASS"
    rep.line(f"\n{verdict} ({seconds.get('total', 0.0):.0f} s)")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
