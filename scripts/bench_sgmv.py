"""SGMV microbenchmark: LoRA deltas of one Llama-3-8B layer (7 projections, fused as qkv, o,
gate_up, down) for a decode batch, against the adapter-bytes floor and naive baselines: the
grouped path (tokens gathered by distinct adapter set) against one segment per request, for
distinct adapters (target a), batch 1 (target b), zipf-popular adapters (duplicates), stacks,
a 256-token decode batch spread over 8, 64 and 256 rank-8 adapters (how the cost grows with the
distinct adapters in a batch); and the base GEMMs with LoRA, the shrink after each GEMM or
beside it on a side stream.

    python scripts/bench_sgmv.py            # H200: full shapes, bf16
    python scripts/bench_sgmv.py --smoke    # CPU: tiny shapes under TRITON_INTERPRET=1
    python scripts/bench_sgmv.py --scenarios "distinct r16" --sweep expand_stages=2 --repeat 3
        # only target a's layer: the defaults and a GroupedTuning variant, each timed 3 times

Where a CUDA graph's LoRA row bucket (cuda_graph.ROW_BUCKETS) pads a scenario's rows (rank 64 runs
at 128 rows in the engine's graphs), the grouped variants are timed padded too ("rows 128"). Each
variant is checked against TorchLoraBackend (fp32 math) before it is timed. Writes
$OUT/bench_sgmv.json when OUT is set; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

import dataclasses  # noqa: E402
import functools  # noqa: E402
import random  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from bench_common import replace_fields, time_us  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # radixlora without installing
from radixlora.worker.cuda_graph import ROW_BUCKETS, row_bucket  # noqa: E402
from radixlora.worker.lora_context import LoraContext, high_priority_stream  # noqa: E402
from radixlora_kernels.lora_ops import (  # noqa: E402
    GROUP_TOKENS,
    HostGroups,
    LoraBackend,
    LoraBatchMeta,
    LoraGroups,
    TorchLoraBackend,
    TritonLoraBackend,
    sets_of_segments,
)
from radixlora_kernels.sgmv_expand import sgmv_expand  # noqa: E402
from radixlora_kernels.sgmv_grouped import (  # noqa: E402
    BESIDE_GEMM,
    DEFAULT_TUNING,
    GroupedTuning,
    grouped_shrink,
    tuning_for_rows,
)
from radixlora_kernels.sgmv_shrink import sgmv_shrink  # noqa: E402

HBM_BYTES_PER_S = 4.24e12  # measured device-to-device copy on the H200
MAX_REL_ERR = 2e-2
SPARE_ROWS = 32


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    intermediate: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int

    def projections(self) -> list[tuple[str, int, list[int]]]:
        """(name, in_dim, slice widths) of the fused projections."""
        q, kv = self.n_q_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return [
            ("qkv", self.hidden, [q, kv, kv]),
            ("o", q, [self.hidden]),
            ("gate_up", self.hidden, [self.intermediate, self.intermediate]),
            ("down", self.intermediate, [self.hidden]),
        ]


@dataclass(frozen=True)
class BenchConfig:
    shape: LayerShape
    tokens: int
    rank: int
    stack_k: int
    dtype: torch.dtype
    device: str
    zipf_tokens: int
    zipf_adapters: tuple[int, ...]
    spread_tokens: int  # a decode batch spread evenly over each of spread_adapters adapters
    spread_adapters: tuple[int, ...]
    spread_rank: int


FULL = BenchConfig(LayerShape(4096, 14336, 32, 8, 128), 64, 16, 5, torch.bfloat16, "cuda",
                   256, (16, 64), 256, (8, 64, 256), 8)
SMOKE = BenchConfig(LayerShape(64, 96, 4, 2, 16), 6, 4, 3, torch.bfloat16, "cpu", 12, (3, 6),
                    12, (2, 6, 12), 2)

def tunings(*changes: dict) -> list[GroupedTuning]:
    return [dataclasses.replace(DEFAULT_TUNING, **c) for c in changes]


SMALL_BATCH_SWEEP = tunings(BESIDE_GEMM, {"pdl": False}, {"block_n": 256, "expand_stages": 2},
                            {"min_items_per_sm": 0}, {"min_items_per_sm": 8},
                            {"shrink_warps": 4})
GROUP_TOKENS_SWEEP = (32,)
MIXED_GROUP_TOKENS_SWEEP = (64, 256)  # steps with prefill chunks: fewer, longer groups


@dataclass
class Projection:
    name: str
    x: torch.Tensor  # [T, in_dim]
    a_pool: torch.Tensor  # [n_slices, num_rows, in_dim]
    b_pool: torch.Tensor  # [num_rows, out_total]
    out_offsets: list[int]

    def adapter_bytes(self, rows: int) -> int:
        """Bytes of `rows` adapter rows of A (every slice) and B."""
        n_slices, _, in_dim = self.a_pool.shape
        return rows * (n_slices * in_dim + self.b_pool.shape[1]) * self.a_pool.element_size()


@dataclass
class Result:
    scenario: str
    variant: str
    eager_us: float
    graph_us: float | None
    bytes_read: int  # adapter rows (or base weights) the variant must read at least once
    rel_err: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def floor_us(self) -> float:
        return self.bytes_read / HBM_BYTES_PER_S * 1e6


@dataclass
class Scenario:
    name: str
    num_adapters: int
    rank: int
    # adapters (and weights) of each segment
    sets: list[list[tuple[int, float]]]
    seg_lens: list[int] | None = None  # tokens of each segment (None: one each, a decode)

    @property
    def lens(self) -> list[int]:
        return self.seg_lens if self.seg_lens is not None else [1] * len(self.sets)

    @property
    def tokens(self) -> int:
        return sum(self.lens)


def zipf_sets(tokens: int, adapters: int, seed: int) -> list[list[tuple[int, float]]]:
    """One adapter per token, popularity ~ 1 / (i + 1) (zipf 1), in arrival order."""
    rng = random.Random(seed)
    picks = rng.choices(range(adapters), weights=[1 / (i + 1) for i in range(adapters)], k=tokens)
    return [[(a, 1.0)] for a in picks]


def scenarios(cfg: BenchConfig) -> list[Scenario]:
    t, k, zt = cfg.tokens, cfg.stack_k, cfg.zipf_tokens
    weights = [0.2 + 0.8 * i / max(k - 1, 1) for i in range(k)]
    return [
        Scenario(f"distinct r{cfg.rank}", t, cfg.rank, [[(i, 1.0)] for i in range(t)]),
        Scenario(f"batch 1 r{cfg.rank}", 1, cfg.rank, [[(0, 1.0)]]),
        Scenario(f"distinct 8 r{cfg.rank}", 8, cfg.rank, [[(i, 1.0)] for i in range(8)]),
        *(Scenario(f"zipf {zt}x{n} r{cfg.rank}", n, cfg.rank, zipf_sets(zt, n, n))
          for n in cfg.zipf_adapters),
        Scenario(f"identical r{cfg.rank}", t, cfg.rank, [[(0, 1.0)] for _ in range(t)]),
        Scenario(f"stack k={k} r{cfg.rank}", t * k, cfg.rank,
                 [[(i * k + j, weights[j]) for j in range(k)] for i in range(t)]),
        Scenario(f"single r{cfg.rank * k}", t, cfg.rank * k, [[(i, 1.0)] for i in range(t)]),
        *(Scenario(f"spread {n}/{cfg.spread_tokens} r{cfg.spread_rank}", n, cfg.spread_rank,
                   [[(i % n, 1.0)] for i in range(cfg.spread_tokens)])
          for n in cfg.spread_adapters),
        *mixed_scenarios(cfg),
    ]


def mixed_step(name: str, decodes: int, prefill_tokens: int, chunks: int, adapters: int,
               rank: int) -> Scenario:
    """A step of a saturated server: `decodes` one-token segments beside `chunks` prefill
    chunks of `prefill_tokens` tokens in all, segment i on adapter i % adapters."""
    lens = [1] * decodes + [prefill_tokens // chunks + (k < prefill_tokens % chunks)
                            for k in range(chunks)]
    return Scenario(name, adapters, rank, [[(i % adapters, 1.0)] for i in range(len(lens))],
                    lens)


def mixed_scenarios(cfg: BenchConfig) -> list[Scenario]:
    """The step shapes of bench_burst's ShareGPT-like burst, over rank-8 adapters."""
    r = cfg.spread_rank
    if cfg.device == "cpu":
        return [mixed_step("mixed 6+20 x3", 6, 20, 2, 3, r),
                mixed_step("prefill 24/2 x2", 0, 24, 2, 2, r)]
    return [mixed_step("mixed 240+541 x100", 240, 541, 14, 100, r),
            mixed_step("mixed 900+2361 x100", 900, 2361, 44, 100, r),
            mixed_step("prefill 8192/16 x16", 0, 8192, 16, 16, r),
            mixed_step("prefill 2048 x1", 0, 2048, 1, 1, r)]


def scattered_rows(num_adapters: int, rank: int, gen: torch.Generator) -> list[list[int]]:
    """Pool rows of each adapter, scattered as a paged pool leaves them; the pool has
    num_adapters * rank + SPARE_ROWS rows."""
    perm = torch.randperm(num_adapters * rank + SPARE_ROWS, generator=gen).tolist()
    return [perm[i * rank : (i + 1) * rank] for i in range(num_adapters)]


def build_projections(cfg: BenchConfig, num_rows: int, tokens: int) -> list[Projection]:
    gen = torch.Generator(cfg.device).manual_seed(0)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=cfg.device, dtype=torch.float32)
        return (t * std).to(cfg.dtype)

    projs = []
    for name, in_dim, widths in cfg.shape.projections():
        a = randn(len(widths), num_rows, in_dim, std=in_dim**-0.5)
        b = randn(num_rows, sum(widths), std=1 / 8)
        offsets = [sum(widths[:i]) for i in range(len(widths) + 1)]
        projs.append(Projection(name, randn(tokens, in_dim), a, b, offsets))
    return projs


def seg_rows_of(sc: Scenario, adapter_rows: list[list[int]]) -> list[list[int]]:
    return [[r for a, _ in s for r in adapter_rows[a]] for s in sc.sets]


def build_meta(
    sc: Scenario, adapter_rows: list[list[int]], device: str, group_tokens: int | None
) -> LoraBatchMeta:
    """One segment per request; grouped (group_tokens not None): groups of at most
    group_tokens tokens, padded to the token count as a CUDA graph's static buffers are."""
    seg_scales = [[w for a, w in s for _ in adapter_rows[a]] for s in sc.sets]
    seg_lens = sc.lens
    seg_rows = seg_rows_of(sc, adapter_rows)
    meta = LoraBatchMeta.from_segments(seg_lens, seg_rows, seg_scales, device, grouped=False)
    if group_tokens is None:
        return meta
    host = HostGroups.build(seg_lens, sets_of_segments(seg_rows, seg_scales), group_tokens)
    g = host.to_device(seg_rows, seg_scales, device)
    pad = sc.tokens + 1 - g.group_indptr.numel()
    tail = g.group_indptr[-1:].repeat(pad)
    padded = LoraGroups(g.num_groups, torch.cat([g.group_indptr, tail]), g.token_ids,
                        torch.cat([g.row_indptr, g.row_indptr[-1:].repeat(pad)]),
                        g.row_ids, g.row_scales)
    return dataclasses.replace(meta, groups=padded)


def meta_variants(sc, adapter_rows, device, group_tokens) -> dict[int | None, LoraBatchMeta]:
    return {n: build_meta(sc, adapter_rows, device, n) for n in (None, GROUP_TOKENS, *group_tokens)}


def layer_fn(backend: LoraBackend, projs, ys, meta) -> Callable[[], None]:
    def run() -> None:
        for p, y in zip(projs, ys, strict=True):
            backend.apply(p.x, y, p.a_pool, p.b_pool, p.out_offsets, meta)

    return run


class NaiveBmmBackend(LoraBackend):
    """Per-token gather of its adapter rows + torch.bmm (the baseline to beat); needs every
    segment to be one token with the same number of rows."""

    name = "naive-bmm"

    def shrink(self, x, a_pool, meta) -> torch.Tensor:
        rows = meta.row_ids.long().view(meta.num_tokens, -1)  # [T, R]
        scales = meta.row_scales.view(meta.num_tokens, -1, 1).to(x.dtype)
        a_tok = a_pool[:, rows].flatten(0, 1)  # [n_slices * T, R, in_dim]
        x_rep = x.repeat(a_pool.shape[0], 1).unsqueeze(-1)  # [n_slices * T, in_dim, 1]
        return torch.bmm(a_tok, x_rep).view(a_pool.shape[0], meta.num_tokens, -1, 1) * scales

    def expand(self, v, b_pool, out_offsets, meta, y, accumulate=True) -> None:
        if not accumulate:
            y.zero_()
        b_tok = b_pool[meta.row_ids.long().view(meta.num_tokens, -1)]  # [T, R, out_total]
        for i in range(v.shape[0]):
            cols = slice(out_offsets[i], out_offsets[i + 1])
            y[:, cols] += torch.bmm(v[i].transpose(1, 2), b_tok[:, :, cols]).squeeze(1)


def max_rel_err(backend: LoraBackend, projs, meta) -> float:
    worst = 0.0
    for p in projs:
        y = torch.zeros(p.x.shape[0], p.out_offsets[-1], dtype=p.x.dtype, device=p.x.device)
        ref = torch.zeros_like(y, dtype=torch.float32)
        backend.apply(p.x, y, p.a_pool, p.b_pool, p.out_offsets, meta)
        TorchLoraBackend().apply(p.x, ref, p.a_pool, p.b_pool, p.out_offsets, meta)
        err = (y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        worst = max(worst, err.item())
    return worst


def bench_variant(scenario, variant, backend, projs, meta, bytes_read, device) -> Result:
    err = max_rel_err(backend, projs, meta)
    if err > MAX_REL_ERR:  # wrong results are not timed
        return Result(scenario, variant, math.nan, None, bytes_read, err)
    ys = [torch.zeros(p.x.shape[0], p.out_offsets[-1], dtype=p.x.dtype, device=device)
          for p in projs]
    eager, graph = time_us(layer_fn(backend, projs, ys, meta), device)
    print(f"{scenario} / {variant}: eager {eager:.1f} us, graph {graph} us", flush=True)
    return Result(scenario, variant, eager, graph, bytes_read, err)


def tuning_label(t: GroupedTuning) -> str:
    changed = [f"{f.name}={getattr(t, f.name)}" for f in dataclasses.fields(t)
               if getattr(t, f.name) != getattr(DEFAULT_TUNING, f.name)]
    return "grouped " + (",".join(changed) or "default")


def bench_scenario(cfg: BenchConfig, sc: Scenario, sweep: list[GroupedTuning],
                   group_tokens: tuple[int, ...], baselines: bool) -> list[Result]:
    gen = torch.Generator().manual_seed(0)
    adapter_rows = scattered_rows(sc.num_adapters, sc.rank, gen)
    projs = build_projections(cfg, sc.num_adapters * sc.rank + SPARE_ROWS, sc.tokens)
    metas = meta_variants(sc, adapter_rows, cfg.device, group_tokens)
    per_request, grouped = metas[None], metas[GROUP_TOKENS]
    distinct_rows = len({r for rows in seg_rows_of(sc, adapter_rows) for r in rows})
    bytes_read = sum(p.adapter_bytes(distinct_rows) for p in projs)
    variants: list[tuple[str, LoraBackend, LoraBatchMeta]] = [
        ("grouped", TritonLoraBackend(), grouped),
        ("sgmv per-request", TritonLoraBackend(), per_request),
    ]
    variants += [(tuning_label(t), TritonLoraBackend(tuning=t), grouped) for t in sweep]
    graph_rows = row_bucket(ROW_BUCKETS, grouped.max_rows)
    if graph_rows != grouped.max_rows:  # as a CUDA graph's row bucket pads the rows
        padded = dataclasses.replace(grouped, max_rows=graph_rows)
        variants += [(f"{label}, rows {graph_rows}", TritonLoraBackend(tuning=t), padded)
                     for label, t in [("grouped", None)] + [(tuning_label(t), t) for t in sweep]]
    variants += [(f"grouped group_tokens={n}", TritonLoraBackend(), metas[n])
                 for n in group_tokens]
    if baselines:
        variants += [("naive gather+bmm", NaiveBmmBackend(), per_request),
                     ("torch masked", TorchLoraBackend(), per_request)]
    run = [bench_variant(sc.name, v, b, projs, m, bytes_read, cfg.device)
           for v, b, m in variants]
    if baselines:
        run[1].extra = per_kernel_breakdown(projs, per_request, cfg.device)
    return run


def per_kernel_breakdown(projs, meta, device: str) -> dict[str, float]:
    """Eager microseconds of shrink and expand per projection (default split_k)."""
    index = (meta.seg_indptr, meta.row_indptr, meta.row_ids)
    seg_len = {"max_seg_len": meta.max_seg_len}
    out: dict[str, float] = {}
    for p in projs:
        y = torch.zeros(p.x.shape[0], p.out_offsets[-1], dtype=p.x.dtype, device=device)
        shrink = (p.x, p.a_pool, *index, meta.row_scales, meta.max_rows)
        v = sgmv_shrink(*shrink, **seg_len)
        expand = (v, p.b_pool, p.out_offsets, *index, y)
        out[f"{p.name}.shrink"] = time_us(lambda a=shrink: sgmv_shrink(*a, **seg_len), device)[0]
        out[f"{p.name}.expand"] = time_us(lambda a=expand: sgmv_expand(*a, **seg_len), device)[0]
    return out


def bench_with_base(cfg: BenchConfig, sc: Scenario) -> list[Result]:
    """The layer's base GEMMs plus the grouped LoRA deltas through LoraContext.project, as the
    model runs them: added into each GEMM's output after it (eager), or computed beside it on a
    side stream of normal or high priority, the expand after the GEMM, or deferred: the whole
    delta beside the GEMM (CUDA graphs; the deferred variant zeroes its workspace once per layer
    here, once per forward in the engine, and leaves out the consumers that add the deltas).
    Two more split the deferred branch's cost: the side stream's fork and join around a
    one-element kernel, and the shrink alone beside the GEMM."""
    gen = torch.Generator().manual_seed(0)
    adapter_rows = scattered_rows(sc.num_adapters, sc.rank, gen)
    projs = build_projections(cfg, sc.num_adapters * sc.rank + SPARE_ROWS, sc.tokens)
    meta = build_meta(sc, adapter_rows, cfg.device, GROUP_TOKENS)
    weights = [torch.randn(p.out_offsets[-1], p.x.shape[1], dtype=cfg.dtype, device=cfg.device)
               * p.x.shape[1] ** -0.5 for p in projs]
    pool = SimpleNamespace(a=[{p.name: p.a_pool for p in projs}],
                           b=[{p.name: p.b_pool for p in projs}],
                           out_offsets={p.name: p.out_offsets for p in projs})
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    metas = {p.name: meta for p in projs}
    variants = {"base GEMMs only": None,
                "base + LoRA after GEMM": LoraContext(pool, TritonLoraBackend(), metas)}
    if cfg.device == "cuda":
        high = high_priority_stream("cuda")
        for name, side in (("normal", torch.cuda.Stream()), ("high", high)):
            variants[f"base + LoRA beside, {name} prio"] = LoraContext(
                pool, TritonLoraBackend(), metas, side)
        variants["base + deferred LoRA, high prio"] = LoraContext(
            pool, TritonLoraBackend(), metas, high, defer=True)
        tiny, g = torch.zeros(1, device=cfg.device), meta.groups
        index = (g.num_groups, g.group_indptr, g.token_ids, g.row_indptr, g.row_ids)
        side_tuning = tuning_for_rows(meta.max_rows, beside_gemm=True)
        variants["base + fork/join only"] = SideOnly(pool, high, lambda x, name: tiny.add_(1))

        def shrink(x: torch.Tensor, name: str) -> torch.Tensor:
            return grouped_shrink(x, pool.a[0][name], *index, g.row_scales, meta.max_rows,
                                  tuning=side_tuning)

        variants["base + shrink alone beside"] = SideOnly(pool, high, shrink)
    out = []
    for variant, lora in variants.items():
        def run(lora=lora) -> None:
            if lora is not None:
                lora.begin(sc.tokens, cfg.device)
            for p, w in zip(projs, weights, strict=True):
                linear = functools.partial(torch.matmul, other=w.T)
                _ = linear(p.x) if lora is None else lora.project(linear, p.x, 0, p.name)

        eager, graph = time_us(run, cfg.device)
        print(f"{sc.name} / {variant}: eager {eager:.1f} us, graph {graph} us", flush=True)
        out.append(Result(sc.name, variant, eager, graph, weight_bytes))
    return out


class SideOnly(LoraContext):
    """LoraContext's side-stream fork and join around `work(x, group)` instead of the LoRA
    work: parts of what the deferred branch costs."""

    def __init__(self, pool, side_stream, work: Callable[[torch.Tensor, str], object]) -> None:
        super().__init__(pool, None, {}, side_stream)
        self.work = work

    def project(self, linear, x, layer_id, group):
        return self._beside_gemm(linear, x, lambda: self.work(x, group))


def bench_base_gemms(cfg: BenchConfig) -> Result:
    """The layer's 7 base GEMMs (fused as 4), for scale: what the LoRA deltas add to."""
    to = {"dtype": cfg.dtype, "device": cfg.device}
    mats = [(torch.randn(cfg.tokens, i, **to), torch.randn(sum(w), i, **to) * i**-0.5)
            for _, i, w in cfg.shape.projections()]
    weight_bytes = sum(w.numel() * w.element_size() for _, w in mats)
    eager, graph = time_us(lambda: [x @ w.T for x, w in mats], cfg.device)
    return Result("base", "7 base GEMMs", eager, graph, weight_bytes)


def format_table(results: list[Result]) -> str:
    head = f"{'scenario':<16} {'variant':<30} {'eager us':>9} {'graph us':>9} {'MB read':>8} "
    lines = [head + f"{'floor us':>9} {'x floor':>8} {'rel err':>8}"]
    for r in results:
        best = min(t for t in (r.eager_us, r.graph_us) if t is not None)
        graph = f"{r.graph_us:9.1f}" if r.graph_us is not None else f"{'-':>9}"
        err = f"{r.rel_err:8.1e}" if r.rel_err is not None else f"{'-':>8}"
        lines.append(f"{r.scenario:<16} {r.variant:<30} {r.eager_us:9.1f} {graph} "
                     f"{r.bytes_read / 1e6:8.2f} {r.floor_us:9.2f} {best / r.floor_us:8.2f} "
                     f"{err}")
    return "\n".join(lines)


def best_us(results: list[Result], scenario: str, variant: str) -> float:
    r = next(r for r in results if r.scenario == scenario and r.variant == variant)
    return r.graph_us if r.graph_us is not None else r.eager_us


def stack_ratio(results: list[Result], cfg: BenchConfig) -> float:
    def best(scenario: str) -> float:
        return best_us(results, scenario, "grouped")

    return best(f"stack k={cfg.stack_k} r{cfg.rank}") / best(f"single r{cfg.rank * cfg.stack_k}")


def environment(cfg: BenchConfig) -> dict:
    env = {"torch": torch.__version__, "triton": triton.__version__, "device": cfg.device}
    if cfg.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def group_sweep(sc: Scenario) -> tuple[int, ...]:
    return MIXED_GROUP_TOKENS_SWEEP if sc.seg_lens is not None else ()


def bench_selected(cfg: BenchConfig, names: list[str], variants: list[str], repeat: int) -> None:
    """Only the named scenarios: the grouped defaults, one segment per request and each
    GroupedTuning variant ("k=v,..."), every one timed `repeat` times in turn; a table, and
    $OUT/bench_sgmv.json when OUT is set."""
    known = {sc.name: sc for sc in scenarios(cfg)}
    if unknown := [n for n in names if n not in known]:
        raise SystemExit(f"unknown scenario(s) {unknown}; choose from {list(known)}")
    sweep = [replace_fields(DEFAULT_TUNING, v) for v in variants]
    results = [r for name in names for _ in range(repeat)
               for r in bench_scenario(cfg, known[name], sweep, group_sweep(known[name]),
                                       baselines=False)]
    if out_dir := os.environ.get("OUT"):
        payload = {"env": environment(cfg), "hbm_bytes_per_s": HBM_BYTES_PER_S,
                   "results": [{**asdict(r), "floor_us": r.floor_us} for r in results]}
        Path(out_dir, "bench_sgmv.json").write_text(json.dumps(payload, indent=2))
    print(format_table(results))
    if any(math.isnan(r.eager_us) for r in results):
        raise SystemExit(f"rel err > {MAX_REL_ERR}: a variant was not timed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    parser.add_argument("--scenarios", nargs="+", metavar="NAME",
                        help="only these scenarios (no baselines, no base GEMMs)")
    parser.add_argument("--sweep", nargs="*", default=[], metavar="FIELD=N,...",
                        help="with --scenarios: GroupedTuning variants to time too")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --scenarios: time every variant this many times")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if not args.scenarios and (args.sweep or args.repeat != 1):
        parser.error("--sweep and --repeat need --scenarios")
    cfg = SMOKE if args.smoke else FULL
    if args.scenarios:
        bench_selected(cfg, args.scenarios, args.sweep, args.repeat)
        return
    results = [bench_base_gemms(cfg)]
    for i, sc in enumerate(scenarios(cfg)):
        zipf_many = sc.name.startswith("zipf") and sc.num_adapters == max(cfg.zipf_adapters)
        sweep = SMALL_BATCH_SWEEP if i <= 2 or zipf_many else []
        groups = GROUP_TOKENS_SWEEP if zipf_many else group_sweep(sc)
        results += bench_scenario(cfg, sc, sweep, groups, baselines=i == 0)
        if i <= 2 or zipf_many:
            results += bench_with_base(cfg, sc)
    ratio = stack_ratio(results, cfg)
    if out_dir := os.environ.get("OUT"):
        payload = {"config": {**asdict(cfg), "dtype": str(cfg.dtype)}, "env": environment(cfg),
                   "hbm_bytes_per_s": HBM_BYTES_PER_S, "stack_ratio": ratio,
                   "results": [{**asdict(r), "floor_us": r.floor_us} for r in results]}
        Path(out_dir, "bench_sgmv.json").write_text(json.dumps(payload, indent=2))
    kernels = ", ".join(f"{k} {v:.1f}" for k, v in results[2].extra.items())
    print(f"per kernel (per-request), {results[2].scenario}, eager us: {kernels}")
    for name in sorted({r.scenario for r in results[1:]}, key=[r.scenario for r in results].index):
        g, p = best_us(results, name, "grouped"), best_us(results, name, "sgmv per-request")
        print(f"{name}: grouped {g:.1f} us vs per-request {p:.1f} us ({p / g:.2f}x)")
    print(f"stack k={cfg.stack_k} r{cfg.rank} / single r{cfg.rank * cfg.stack_k}: {ratio:.3f} "
          "(target within 10%)")
    print(format_table(results))
    failed = [f"{r.scenario} / {r.variant}" for r in results if math.isnan(r.eager_us)]
    if failed:
        raise SystemExit(f"rel err > {MAX_REL_ERR}, not timed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
