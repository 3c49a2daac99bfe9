"""Benchmark the paged attention kernels at Llama-3-8B shapes (32 q heads, 8 kv heads, D=128, bf16).

Each case is checked against the pure-torch reference before it is timed (on the GPU,
triton.testing.do_bench_cudagraph, median: device time of the kernels without the host's launch
cost, as in the engine's CUDA graphs). Decode reports achieved bandwidth against the H200's
4.24 TB/s; extend reports TFLOP/s. Results go to $OUT/bench_attention.json when OUT is set.

    python scripts/bench_attention.py                 # GPU
    python scripts/bench_attention.py --sweep-decode  # GPU: decode launch settings at c2/c3 shapes
    python scripts/bench_attention.py --smoke         # tiny shapes, CPU, TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from radixlora_kernels.attention_decode import (  # noqa: E402
    DEFAULT_DECODE_TUNING,
    DecodeTuning,
    decode_attention,
    decode_attention_ref,
    default_num_splits,
)
from radixlora_kernels.attention_extend import extend_attention, extend_attention_ref  # noqa: E402

PEAK_BYTES_PER_S = 4.24e12


@dataclass(frozen=True)
class Shape:
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str
    page_size: int


@dataclass
class Result:
    op: str
    batch: int
    prefix_len: int
    new_len: int
    num_splits: int
    ms: float
    max_err: float
    gb_per_s: float | None = None
    pct_peak_bw: float | None = None
    tflop_per_s: float | None = None


@dataclass
class Paged:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor


def _indptr(lens: list[int], device: str) -> torch.Tensor:
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def make_paged(kv_lens: list[int], shape: Shape, gen: torch.Generator) -> Paged:
    """A KV pool whose pages are handed out in shuffled order, as a free list would after churn."""
    ps = shape.page_size
    pages_per_req = [triton.cdiv(n, ps) for n in kv_lens]
    order = torch.randperm(sum(pages_per_req), generator=gen)
    slots, first = [], 0
    for n, n_pages in zip(kv_lens, pages_per_req, strict=True):
        pages = order[first : first + n_pages]
        slots.append((pages[:, None] * ps + torch.arange(ps)).flatten()[:n])
        first += n_pages
    pool = (sum(pages_per_req) * ps, shape.n_kv_heads, shape.head_dim)
    k_cache = torch.randn(pool, generator=gen).to(shape.dtype).to(shape.device)
    v_cache = torch.randn(pool, generator=gen).to(shape.dtype).to(shape.device)
    kv_indices = torch.cat(slots).to(torch.int32).to(shape.device)
    return Paged(k_cache, v_cache, _indptr(kv_lens, shape.device), kv_indices)


def time_ms(fn: Callable[[], object], smoke: bool) -> float:
    if not smoke:
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    err = (out.float() - ref.float()).abs().max().item()
    if not err <= tol:
        raise RuntimeError(f"{name}: max abs error {err:.3e} > {tol:.1e} vs the torch reference")
    return err


def bench_decode(batch: int, ctx: int, shape: Shape, smoke: bool, tol: float,
                 splits: int | None = None, tuning: DecodeTuning = DEFAULT_DECODE_TUNING) -> Result:
    gen = torch.Generator().manual_seed(batch * 100003 + ctx)
    paged = make_paged([ctx] * batch, shape, gen)
    q = torch.randn(batch, shape.n_q_heads, shape.head_dim, generator=gen).to(shape.dtype)
    q = q.to(shape.device)
    o = torch.empty_like(q)
    scale = shape.head_dim**-0.5
    args = (q, paged.k_cache, paged.v_cache, o, paged.kv_indptr, paged.kv_indices, scale)
    splits = splits or default_num_splits(batch, shape.n_kv_heads, q.device)
    decode_attention(*args, num_splits=splits, tuning=tuning)
    ref = decode_attention_ref(q, paged.k_cache, paged.v_cache, *args[4:])
    err = check(f"decode b={batch} ctx={ctx}", o, ref, tol)
    ms = time_ms(lambda: decode_attention(*args, num_splits=splits, tuning=tuning), smoke)
    kv_bytes = 2 * batch * ctx * shape.n_kv_heads * shape.head_dim * paged.k_cache.element_size()
    bytes_moved = kv_bytes + 4 * batch * ctx + 2 * q.numel() * q.element_size()
    bw = bytes_moved / (ms * 1e-3)
    return Result(
        "decode", batch, ctx - 1, 1, splits, ms, err,
        gb_per_s=bw / 1e9, pct_peak_bw=100 * bw / PEAK_BYTES_PER_S,
    )


def causal_flops(batch: int, prefix: int, new: int, shape: Shape) -> float:
    visible_pairs = batch * (new * prefix + new * (new + 1) // 2)
    return 4.0 * visible_pairs * shape.n_q_heads * shape.head_dim


def bench_extend(batch: int, prefix: int, new: int, shape: Shape, smoke: bool, tol: float):
    gen = torch.Generator().manual_seed(batch * 7919 + prefix + new)
    paged = make_paged([prefix + new] * batch, shape, gen)
    q = torch.randn(batch * new, shape.n_q_heads, shape.head_dim, generator=gen).to(shape.dtype)
    q = q.to(shape.device)
    o = torch.empty_like(q)
    qo_indptr = _indptr([new] * batch, shape.device)
    meta = (qo_indptr, paged.kv_indptr, paged.kv_indices, shape.head_dim**-0.5)
    args = (q, paged.k_cache, paged.v_cache, o, *meta)
    extend_attention(*args, max_qo_len=new)
    ref = extend_attention_ref(q, paged.k_cache, paged.v_cache, *meta)
    err = check(f"extend b={batch} prefix={prefix} new={new}", o, ref, tol)
    ms = time_ms(lambda: extend_attention(*args, max_qo_len=new), smoke)
    tflops = causal_flops(batch, prefix, new, shape) / (ms * 1e-3) / 1e12
    return Result("extend", batch, prefix, new, 0, ms, err, tflop_per_s=tflops)


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[Result]) -> str:
    head = f"{'op':<7}{'batch':>6}{'prefix':>8}{'new':>6}{'splits':>7}{'ms':>10}"
    head += f"{'GB/s':>9}{'%4.24TB/s':>10}{'TFLOP/s':>9}{'max_err':>10}"
    rows = [head, "-" * len(head)]
    for r in results:
        rows.append(
            f"{r.op:<7}{r.batch:>6}{r.prefix_len:>8}{r.new_len:>6}{r.num_splits:>7}{r.ms:>10.4f}"
            f"{_fmt(r.gb_per_s, '.0f'):>9}{_fmt(r.pct_peak_bw, '.1f'):>10}"
            f"{_fmt(r.tflop_per_s, '.1f'):>9}{r.max_err:>10.2e}"
        )
    return "\n".join(rows)


def plan(smoke: bool) -> tuple[Shape, list[tuple[int, int]], list[tuple[int, int, int]], float]:
    """(shape, decode (batch, ctx) cases, extend (batch, prefix, new) cases, tolerance)."""
    if smoke:
        # fp16: the interpreter's tl.dot is wrong for bf16 (triton-lang/triton#11584).
        shape = Shape(4, 2, 16, torch.float16, "cpu", page_size=4)
        return shape, [(1, 20), (3, 70)], [(1, 0, 40), (2, 24, 9)], 2e-3
    shape = Shape(32, 8, 128, torch.bfloat16, "cuda", page_size=16)
    # (256, 576): target c2's decode batch (256 requests, prompt 512, mid-way through 128 tokens)
    decode = [(b, ctx) for ctx in (512, 4096) for b in (1, 32, 64)] + [(256, 576)]
    return shape, decode, [(1, 0, 2048), (4, 1536, 512)], 2e-2


def sweep_decode(shape: Shape, smoke: bool, tol: float) -> None:
    """Decode launch settings at c2's batch (256 x 576) and c3's (32 x 288): splits x keys per
    step x warps x pipeline stages, ms and % of peak bandwidth per setting, best last."""
    cases = [(2, 40)] if smoke else [(256, 576), (32, 288)]
    grid = [(32, 2, 2)] if smoke else [
        (n, w, st) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    for batch, ctx in cases:
        default = default_num_splits(batch, shape.n_kv_heads, torch.device(shape.device))
        rows = []
        for splits in sorted({default, 2 * default}):
            for block_n, warps, stages in grid:
                tuning = DecodeTuning(block_n, warps, stages)
                r = bench_decode(batch, ctx, shape, smoke, tol, splits, tuning)
                rows.append((r.ms, splits, tuning, r.pct_peak_bw))
                print(f"decode b={batch} ctx={ctx} splits={splits} {tuning}: {r.ms:.4f} ms "
                      f"{r.pct_peak_bw:.1f}%", flush=True)
        best = min(rows, key=lambda row: row[0])
        print(f"best b={batch} ctx={ctx}: splits={best[1]} {best[2]} {best[0]:.4f} ms "
              f"{best[3]:.1f}%", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    parser.add_argument("--sweep-decode", action="store_true", help="decode launch settings")
    cli = parser.parse_args()
    shape, decode_cases, extend_cases, tol = plan(cli.smoke)
    if cli.sweep_decode:
        sweep_decode(shape, cli.smoke, tol)
        return
    if not cli.smoke:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {triton.__version__}", flush=True)
    results = []
    for batch, ctx in decode_cases:
        results.append(bench_decode(batch, ctx, shape, cli.smoke, tol))
        print(f"decode b={batch} ctx={ctx}: {results[-1].ms:.4f} ms", flush=True)
    for batch, prefix, new in extend_cases:
        results.append(bench_extend(batch, prefix, new, shape, cli.smoke, tol))
        print(f"extend b={batch} prefix={prefix} new={new}: {results[-1].ms:.4f} ms", flush=True)
    write_json(results, shape, cli.smoke)
    print(table(results))


def write_json(results: list[Result], shape: Shape, smoke: bool) -> None:
    out_dir = os.environ.get("OUT")
    if not out_dir:
        return
    meta = {**asdict(shape), "dtype": str(shape.dtype), "smoke": smoke}
    meta |= {"torch": torch.__version__, "triton": triton.__version__}
    if not smoke:
        meta["gpu"] = torch.cuda.get_device_name()
    payload = {"shape": meta, "peak_bytes_per_s": PEAK_BYTES_PER_S}
    payload["results"] = [asdict(r) for r in results]
    with open(os.path.join(out_dir, "bench_attention.json"), "w") as f:
        json.dump(payload, f, indent=2)


if __name__ == "__main__":
    main()
