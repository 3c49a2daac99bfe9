"""Fused elementwise kernels (RMSNorm, add + RMSNorm, rotary on q and k, rotary + KV-cache
store, SiLU-and-mul) and the one-pass sampler (greedy; at temperature 0.8 alone, with top-p 0.9
and with top-k 50; over T rows of Llama-3's 128256 logits) vs the code they replace (eager
torch; for rotary + KV store, the rotary kernel and two index_put copies; for the sampler, its
torch reference), at Llama-3-8B shapes in bf16 for T in {1, 64, 256}.

Every op is first checked against its pure-torch reference, in bf16 and in fp32, with
positions up to 128k (rotary's range reduction); a failing op is not timed. Times are
triton.testing.do_bench medians, eager and under a CUDA graph. Writes $OUT/bench_fused.json when
OUT is set; prints a table last.

    python scripts/bench_fused.py            # GPU
    python scripts/bench_fused.py --smoke    # CPU: tiny shapes under TRITON_INTERPRET=1, fp16
                                             # (the interpreter truncates fp32 -> bf16)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated

import torch  # noqa: E402
import triton  # noqa: E402
from bench_common import time_us  # noqa: E402

from radixlora.config import RopeConfig  # noqa: E402
from radixlora.model.rope import RotaryEmbedding  # noqa: E402
from radixlora_kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from radixlora_kernels.rmsnorm import (  # noqa: E402
    add_delta_ref,
    fused_add_rmsnorm,
    fused_add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_ref,
)
from radixlora_kernels.rotary import (  # noqa: E402
    _rotate_ref,  # noqa: E402
    apply_rotary_,
    apply_rotary_ref,
)
from radixlora_kernels.rotary_kv import rotary_store_kv_, rotary_store_kv_ref  # noqa: E402
from radixlora_kernels.sampling import sample_tokens, sample_tokens_ref  # noqa: E402

EPS = 1e-5
MAX_POSITION = 131072
LLAMA3_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0)
MAX_REL_ERR = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


@dataclass(frozen=True)
class Shape:
    hidden: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class BenchConfig:
    shape: Shape
    tokens: tuple[int, ...]
    dtype: torch.dtype  # timed
    check_dtypes: tuple[torch.dtype, ...]
    device: str


FULL = BenchConfig(Shape(4096, 32, 8, 128, 14336, 128256), (1, 64, 256), torch.bfloat16,
                   (torch.bfloat16, torch.float32), "cuda")
SMOKE = BenchConfig(Shape(96, 4, 2, 16, 48, 300), (1, 7), torch.float16,
                    (torch.float16, torch.float32), "cpu")


@dataclass
class Op:
    """One fused op and the eager code it replaces, over the same inputs."""

    name: str
    fused: Callable[[], object]
    eager: Callable[[], object]
    check: Callable[[], tuple[float, float, bool]]  # (rel err, exact fraction, exact where due)


@dataclass
class Check:
    op: str
    tokens: int
    dtype: str
    rel_err: float
    exact_frac: float
    ok: bool


@dataclass
class Result:
    op: str
    tokens: int
    fused_us: float
    eager_us: float
    fused_graph_us: float | None
    eager_graph_us: float | None

    @property
    def speedup(self) -> float:
        return self.eager_us / self.fused_us


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref| / max |ref|, fraction of bit-equal elements)."""
    out, ref = out.float(), ref.float()
    rel = (out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
    return rel.item(), (out == ref).float().mean().item()


def make_randn(cfg: BenchConfig, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
    gen = torch.Generator(cfg.device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen, device=cfg.device, dtype=torch.float32)
        return (t * scale + shift).to(dtype)

    return randn


def norm_ops(cfg: BenchConfig, tokens: int, dtype: torch.dtype) -> list[Op]:
    randn, hidden = make_randn(cfg, dtype), cfg.shape.hidden
    x, residual = randn(tokens, hidden), randn(tokens, hidden)
    weight = randn(hidden, scale=0.1, shift=1.0)
    out, res_out = torch.empty_like(x), torch.empty_like(x)

    def check_norm() -> tuple[float, float, bool]:
        return (*compare(rmsnorm(x, weight, EPS), rmsnorm_ref(x, weight, EPS)), True)

    def check_add() -> tuple[float, float, bool]:
        normed, new_residual = fused_add_rmsnorm(x, residual, weight, EPS)
        normed_ref, residual_ref = fused_add_rmsnorm_ref(x, residual, weight, EPS)
        delta = randn(tokens, hidden, scale=0.1).float()
        with_delta = fused_add_rmsnorm(x, residual, weight, EPS, delta=delta)
        delta_first = fused_add_rmsnorm(add_delta_ref(x, delta), residual, weight, EPS)
        exact = torch.equal(new_residual, residual_ref) and all(
            map(torch.equal, with_delta, delta_first))
        return (*compare(normed, normed_ref), exact)

    return [
        Op("rmsnorm", lambda: rmsnorm(x, weight, EPS, out=out),
           lambda: rmsnorm_ref(x, weight, EPS), check_norm),
        Op("add+rmsnorm",
           lambda: fused_add_rmsnorm(x, residual, weight, EPS, out=out, residual_out=res_out),
           lambda: fused_add_rmsnorm_ref(x, residual, weight, EPS), check_add),
    ]


def rotary_op(cfg: BenchConfig, tokens: int, dtype: torch.dtype) -> Op:
    s, randn = cfg.shape, make_randn(cfg, dtype)
    q_dim, kv_dim = s.n_q_heads * s.head_dim, s.n_kv_heads * s.head_dim
    qkv = randn(tokens, q_dim + 2 * kv_dim)
    q, k, _ = qkv.split((q_dim, kv_dim, kv_dim), dim=-1)
    q, k = q.view(tokens, s.n_q_heads, s.head_dim), k.view(tokens, s.n_kv_heads, s.head_dim)
    gen = torch.Generator().manual_seed(1)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(cfg.device)
    rope = RotaryEmbedding(s.head_dim, LLAMA3_ROPE).to(cfg.device)
    freqs = positions.float()[:, None] * rope.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()  # the eager path computed these once per step: not timed

    def eager() -> None:
        _rotate_ref(q, cos, sin)
        _rotate_ref(k, cos, sin)

    def check() -> tuple[float, float, bool]:
        q_ref, k_ref = apply_rotary_ref(q, k, positions, rope.inv_freq)
        q_out, k_out = q.clone(), k.clone()
        apply_rotary_(q_out, k_out, positions, rope.inv_freq)
        rel, exact = compare(torch.cat((q_out, k_out), 1), torch.cat((q_ref, k_ref), 1))
        return rel, exact, True

    return Op("rotary q+k", lambda: apply_rotary_(q, k, positions, rope.inv_freq), eager, check)


def rotary_kv_op(cfg: BenchConfig, tokens: int, dtype: torch.dtype) -> Op:
    """Rotary fused with the KV-cache store vs the rotary kernel then two index_put copies."""
    s, randn = cfg.shape, make_randn(cfg, dtype)
    q_dim, kv_dim = s.n_q_heads * s.head_dim, s.n_kv_heads * s.head_dim
    qkv = randn(tokens, q_dim + 2 * kv_dim)
    q, k, v = (t.view(tokens, -1, s.head_dim) for t in qkv.split((q_dim, kv_dim, kv_dim), -1))
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, MAX_POSITION, (tokens,), generator=gen).to(cfg.device)
    slots = 4 * tokens
    loc = torch.randperm(slots, generator=gen)[:tokens].to(cfg.device)
    inv_freq = RotaryEmbedding(s.head_dim, LLAMA3_ROPE).to(cfg.device).inv_freq
    k_cache, v_cache = (randn(slots, s.n_kv_heads, s.head_dim) for _ in range(2))

    def unfused() -> None:
        apply_rotary_(q, k, positions, inv_freq)
        k_cache[loc] = k
        v_cache[loc] = v

    def check() -> tuple[float, float, bool]:
        q_out, kc_out, vc_out = q.clone(), k_cache.clone(), v_cache.clone()
        q_ref, kc_ref, vc_ref = q.clone(), k_cache.clone(), v_cache.clone()
        rotary_store_kv_(q_out, k, v, positions, inv_freq, kc_out, vc_out, loc)
        rotary_store_kv_ref(q_ref, k, v, positions, inv_freq, kc_ref, vc_ref, loc)
        rel, exact = compare(torch.cat((q_out, kc_out[loc]), 1), torch.cat((q_ref, kc_ref[loc]), 1))
        return rel, exact, torch.equal(vc_out, vc_ref) and delta_is_added_first()

    def delta_is_added_first() -> bool:
        deltas = tuple(t.view(tokens, -1, s.head_dim) for t in make_randn(cfg, torch.float32)(
            tokens, q_dim + 2 * kv_dim, scale=0.1).split((q_dim, kv_dim, kv_dim), -1))
        q_out, kc_out, vc_out = q.clone(), k_cache.clone(), v_cache.clone()
        rotary_store_kv_(q_out, k, v, positions, inv_freq, kc_out, vc_out, loc, deltas)
        q_in, k_in, v_in = map(add_delta_ref, (q, k, v), deltas)
        kc_want, vc_want = k_cache.clone(), v_cache.clone()
        rotary_store_kv_(q_in, k_in, v_in, positions, inv_freq, kc_want, vc_want, loc)
        return all(map(torch.equal, (q_out, kc_out, vc_out), (q_in, kc_want, vc_want)))

    def fused() -> None:
        rotary_store_kv_(q, k, v, positions, inv_freq, k_cache, v_cache, loc)

    return Op("rotary+kv", fused, unfused, check)


def silu_op(cfg: BenchConfig, tokens: int, dtype: torch.dtype) -> Op:
    gate_up = make_randn(cfg, dtype)(tokens, 2 * cfg.shape.intermediate, scale=2.0)
    out = torch.empty(tokens, cfg.shape.intermediate, dtype=dtype, device=cfg.device)

    def check() -> tuple[float, float, bool]:
        delta = make_randn(cfg, torch.float32)(*gate_up.shape, scale=0.1)
        exact = torch.equal(silu_and_mul(gate_up, delta=delta),
                            silu_and_mul(add_delta_ref(gate_up, delta)))
        return (*compare(silu_and_mul(gate_up), silu_and_mul_ref(gate_up)), exact)

    return Op("silu*mul", lambda: silu_and_mul(gate_up, out=out),
              lambda: silu_and_mul_ref(gate_up), check)


def sample_ops(cfg: BenchConfig, rows: int, dtype: torch.dtype) -> list[Op]:
    logits = make_randn(cfg, dtype)(rows, cfg.shape.vocab, scale=3.0)
    gen = torch.Generator().manual_seed(3)
    seeds = torch.randint(0, 2**62, (rows,), generator=gen).to(cfg.device)
    steps = torch.randint(0, 4096, (rows,), generator=gen).to(cfg.device)

    def op(name: str, temperature: float, top_k: int = -1, top_p: float = 1.0,
           filter_args: bool = False) -> Op:
        args = (logits, torch.full((rows,), temperature, device=cfg.device), seeds, steps)
        if top_k > 0 or top_p < 1 or filter_args:
            args += ((torch.full((rows,), top_k, device=cfg.device),
                      torch.full((rows,), top_p, device=cfg.device),
                      torch.zeros(rows, device=cfg.device)),)

        def check() -> tuple[float, float, bool]:
            tokens, logprobs, lse = sample_tokens(*args)
            ref_tokens, ref_logprobs, ref_lse = sample_tokens_ref(*args)
            rel, exact = compare(torch.cat((logprobs, lse)), torch.cat((ref_logprobs, ref_lse)))
            return rel, exact, torch.equal(tokens, ref_tokens)

        return Op(name, lambda: sample_tokens(*args), lambda: sample_tokens_ref(*args), check)

    # "as in graphs": filter tensors passed with every row unfiltered, as the decode graphs do
    return [op("sample T=0", 0.0), op("sample T=0 as in graphs", 0.0, filter_args=True),
            op("sample T=0.8", 0.8), op("sample T=0.8 as in graphs", 0.8, filter_args=True),
            op("sample p0.9", 0.8, top_p=0.9), op("sample k50", 0.8, top_k=50)]


def layer_ops(cfg: BenchConfig, tokens: int, dtype: torch.dtype) -> list[Op]:
    ops = norm_ops(cfg, tokens, dtype)
    return [*ops, rotary_op(cfg, tokens, dtype), rotary_kv_op(cfg, tokens, dtype),
            silu_op(cfg, tokens, dtype), *sample_ops(cfg, tokens, dtype)]


def run_check(op: Op, tokens: int, dtype: torch.dtype) -> Check:
    rel, exact, exact_where_due = op.check()
    ok = rel <= MAX_REL_ERR[dtype] and exact_where_due
    return Check(op.name, tokens, str(dtype).removeprefix("torch."), rel, exact, ok)


def time_op(op: Op, tokens: int, device: str) -> Result:
    fused, fused_graph = time_us(op.fused, device)
    eager, eager_graph = time_us(op.eager, device)
    return Result(op.name, tokens, fused, eager, fused_graph, eager_graph)


def layer_total(results: list[Result], tokens: int) -> Result:
    """One decoder layer's elementwise work: add+rmsnorm twice, rotary, silu*mul."""
    weight = {"add+rmsnorm": 2, "rotary q+k": 1, "silu*mul": 1}
    rows = [r for r in results if r.tokens == tokens and r.op in weight]

    def total(attr: str) -> float | None:
        values = [getattr(r, attr) for r in rows]
        return None if None in values else sum(weight[r.op] * v for r, v in zip(rows, values))

    return Result("layer total", tokens, total("fused_us"), total("eager_us"),
                  total("fused_graph_us"), total("eager_graph_us"))


def bench(cfg: BenchConfig) -> tuple[list[Check], list[Result]]:
    checks: list[Check] = []
    results: list[Result] = []
    for tokens in cfg.tokens:
        for dtype in cfg.check_dtypes:
            checks += [run_check(op, tokens, dtype) for op in layer_ops(cfg, tokens, dtype)]
        failed = {c.op for c in checks if c.tokens == tokens and not c.ok}
        timed = [op for op in layer_ops(cfg, tokens, cfg.dtype) if op.name not in failed]
        results += [time_op(op, tokens, cfg.device) for op in timed]
        if not failed:
            results.append(layer_total(results, tokens))
    return checks, results


def _us(value: float | None) -> str:
    return f"{value:9.1f}" if value is not None else f"{'-':>9}"


def format_table(checks: list[Check], results: list[Result]) -> str:
    lines = [f"{'op':<12} {'T':>4} {'dtype':<9} {'rel err':>8} {'exact':>7}  ok"]
    lines += [f"{c.op:<12} {c.tokens:>4} {c.dtype:<9} {c.rel_err:8.1e} {c.exact_frac:7.2%}  "
              f"{'yes' if c.ok else 'NO'}" for c in checks]
    lines.append("")
    lines.append(f"{'op':<12} {'T':>4} {'fused us':>9} {'eager us':>9} {'x':>6} "
                 f"{'graph fused':>11} {'graph eager':>11} {'x':>6}")
    for r in results:
        graph_x = (f"{r.eager_graph_us / r.fused_graph_us:6.2f}"
                   if r.fused_graph_us and r.eager_graph_us else f"{'-':>6}")
        lines.append(f"{r.op:<12} {r.tokens:>4} {_us(r.fused_us)} {_us(r.eager_us)} "
                     f"{r.speedup:6.2f} {_us(r.fused_graph_us):>11} "
                     f"{_us(r.eager_graph_us):>11} {graph_x}")
    return "\n".join(lines)


def environment(cfg: BenchConfig) -> dict:
    env = {"torch": torch.__version__, "triton": triton.__version__, "device": cfg.device}
    if cfg.device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
    return env


def write_json(cfg: BenchConfig, checks: list[Check], results: list[Result]) -> None:
    if not (out_dir := os.environ.get("OUT")):
        return
    config = {**asdict(cfg), "dtype": str(cfg.dtype),
              "check_dtypes": [str(d) for d in cfg.check_dtypes]}
    payload = {"config": config, "env": environment(cfg),
               "checks": [asdict(c) for c in checks],
               "results": [{**asdict(r), "speedup": r.speedup} for r in results]}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    Path(out_dir, "bench_fused.json").write_text(json.dumps(payload, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (interpreter)")
    cfg = SMOKE if parser.parse_args().smoke else FULL
    checks, results = bench(cfg)
    write_json(cfg, checks, results)
    print(format_table(checks, results))
    failed = [f"{c.op} T={c.tokens} {c.dtype}" for c in checks if not c.ok]
    if failed or any(math.isnan(r.fused_us) for r in results):
        raise SystemExit(f"failed correctness, not timed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
