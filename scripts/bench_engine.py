"""End-to-end engine benchmarks on a Llama-3-8B-shaped model with random bf16 weights
(load_format="dummy") and random in-memory adapters: targets b, c1, c2, c3, d, e of docs/PERF.md.

    python scripts/bench_engine.py              # on the H200; prints a table, JSON to $OUT
    python scripts/bench_engine.py --smoke      # tiny shapes on the CPU, checks the script runs
    python scripts/bench_engine.py --only-be    # only targets b and e (--only-c: only c)

Timing: wall clock around engine.step(). With overlap scheduling (the default) a step launches
the next plan and then waits for the previous one's sampled tokens, so in steady state a step
takes max(device time, host time); "no overlap" rows fold each step in before planning the next.
Medians over steps; throughput over whole runs. Adapters start in the pinned host tier, packed in
pool layout (S-LoRA's setting: all adapters in host memory); copies into the device pool are
timed, the one-time packing of fp32 PEFT weights is not (bench_adapter_load.py measures it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_common import replace_fields

from radixlora import Engine, SamplingParams
from radixlora.config import GROUP_OF, ModelConfig
from radixlora.lora.adapter import LoraAdapter
from radixlora.lora.layout import load_bytes
from radixlora.worker import cuda_graph
from radixlora_kernels.sgmv_grouped import DEFAULT_TUNING, GroupedTuning

LLAMA3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 tie_word_embeddings=False, eos_token_id=128001, torch_dtype="bfloat16")
SMOKE = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
# the floors' bandwidth: the device-to-device copy bandwidth measured on the H200 (--peak-bw)
HBM_BYTES_PER_S = 4.24e12


def random_adapter(cfg: ModelConfig, name: str, rank: int, modules, seed: int,
                   device) -> LoraAdapter:
    gen = torch.Generator(device=device).manual_seed(seed)
    weights, group_ranks = {}, {}
    for layer in range(cfg.num_layers):
        for module in modules:
            in_dim, out_dim = cfg.module_shape(module)
            a = torch.randn(rank, in_dim, generator=gen, device=device) / in_dim**0.5
            b = torch.randn(out_dim, rank, generator=gen, device=device) * 0.01
            weights[(layer, module)] = (a.cpu(), b.cpu())
            group_ranks[GROUP_OF[module]] = rank
    return LoraAdapter(name, "<random>", f"random-{name}-{seed}-{rank}", rank, group_ranks,
                       weights)


def model_dir(shape: dict) -> Path:
    path = Path(tempfile.mkdtemp(prefix="bench-engine-"))
    (path / "config.json").write_text(json.dumps(shape))
    return path


def make_engine(path: Path, args, **kw) -> Engine:
    """Without the start-up warm-up: the figures come from second rounds, and the decode graphs
    are captured (and timed) by main."""
    return Engine(path, load_format="dummy", device=args.device, dtype=args.dtype,
                  warm_up=False, **kw)


def run_until_done(engine: Engine) -> list[tuple[float, int, bool, float]]:
    """(seconds, batch size, decode-only, byte floor in seconds) of every step until the engine
    is idle. The floor reads the weights, every running request's KV and the pool rows of each
    distinct adapter in the batch once. With overlap scheduling a call's time is charged to the
    step it waits for, launched by the previous call (the first decode call waits for the
    prefill)."""
    steps = []
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.runner.model.parameters())
    cfg, pool = engine.model_cfg, engine.runner.adapter_pool
    dtype_bytes = engine.runner.dtype.itemsize
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    launched = None  # with overlap, a call folds (waits for) the step the previous call launched
    while engine.scheduler.has_work():
        running = list(engine.scheduler.running)
        decode_only = bool(running) and all(r.remaining_prefill == 1 for r in running) and not (
            engine.scheduler.waiting)
        adapters = {a.adapter_id: a for r in running for a in r.adapter_set.adapters}
        adapter_bytes = sum(load_bytes(cfg, pool.dtype, a.group_ranks, a.dora_groups)
                            for a in adapters.values())
        floor = (weight_bytes + kv_bytes * sum(r.kv_len for r in running)
                 + adapter_bytes) / HBM_BYTES_PER_S
        start = time.perf_counter()
        engine.step()
        now = (len(running), decode_only, floor)
        folded = launched if engine.config.overlap_schedule and launched is not None else now
        steps.append((time.perf_counter() - start, *folded))
        launched = now
    return steps


def submit_random(engine: Engine, n: int, specs, prompt_len: int, new_tokens: int, rng) -> None:
    """n greedy requests of random prompts (salted: no cache hits), adapters round-robin over
    specs, each generating exactly new_tokens."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model_cfg.vocab_size
    for i in range(n):
        engine.submit(rng.integers(3, vocab, prompt_len).tolist(), params,
                      adapters=specs[i % len(specs)], cache_salt=str(rng.integers(1 << 30)))


def decode_step_ms(engine: Engine, batch: int, specs, prompt_len: int, new_tokens: int,
                   rng) -> float:
    submit_random(engine, batch, specs, prompt_len, new_tokens, rng)
    steps = run_until_done(engine)
    decode = [s for s, b, d, _ in steps if d and b == batch]
    return 1e3 * statistics.median(decode)


def graph_replay_ms(engine: Engine, rows: int, batch: int = 1, dora: bool = False) -> float:
    """Device time of one decode graph alone (no host work), median of 50 replays (dora: the
    graph of a batch with DoRA adapters)."""
    graphs = engine.runner.graphs
    if graphs is None:
        return float("nan")
    from radixlora.worker.cuda_graph import GraphKey

    entry = graphs.graphs.get(GraphKey(batch, batch, rows, dora))
    if entry is None:
        return float("nan")
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        entry.graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def throughput(engine: Engine, n: int, specs, prompt_len: int, new_tokens: int, rng) -> dict:
    """Tokens/s of n requests over `specs`, measured on the second of two identical rounds
    (fresh prompts): the first compiles kernels, captures graphs and loads the adapters."""
    for _ in range(2):
        submit_random(engine, n, specs, prompt_len, new_tokens, rng)
        start = time.perf_counter()
        steps = run_until_done(engine)
    elapsed = time.perf_counter() - start
    decode = [(s, f) for s, _, d, f in steps if d]
    return {"tok_per_s": n * new_tokens / elapsed, "seconds": elapsed,
            "mean_decode_step_ms": 1e3 * statistics.fmean(s for s, _ in decode),
            "mean_decode_floor_ms": 1e3 * statistics.fmean(f for _, f in decode),
            "decode_s": sum(s for s, _ in decode),
            "other_s": sum(s for s, _, d, _ in steps if not d), "steps": len(steps),
            "decode_steps": len(decode)}


def zipf_specs(names: list[str], n: int, alpha: float, rng) -> list[str]:
    weights = 1.0 / np.arange(1, len(names) + 1) ** alpha
    picks = rng.choice(len(names), size=n, p=weights / weights.sum())
    return [names[i] for i in picks]


def ttft_hit_vs_miss(engine: Engine, names: list[str], system_len: int, rng) -> dict:
    vocab = engine.model_cfg.vocab_size
    system = rng.integers(3, vocab, system_len).tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    miss, hit = [], []
    for name in names:
        for _ in range(3):
            start = time.perf_counter()
            req = engine.submit(system + rng.integers(3, vocab, 16).tolist(), params,
                                adapters=name)[0]
            while not req.output_ids:
                engine.step()
            (hit if req.cached_tokens else miss).append(time.perf_counter() - start)
            run_until_done(engine)
    return {"ttft_miss_ms": 1e3 * statistics.median(miss),
            "ttft_hit_ms": 1e3 * statistics.median(hit)}


def parse_tuning(text: str) -> GroupedTuning:
    """"pdl=0,block_n=256" -> DEFAULT_TUNING with those fields (ints; bools as 0/1)."""
    return replace_fields(DEFAULT_TUNING, text)


def main() -> None:
    global HBM_BYTES_PER_S
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--peak-bw", type=float, default=HBM_BYTES_PER_S, metavar="B/S",
                   help="bytes per second the floors divide by (default the H200's 4.24e12; "
                        "an H100's: 3.35e12)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--only-c", action="store_true", help="only the 256-request runs (c)")
    only.add_argument("--only-be", action="store_true", help="only the small-batch steps (b, e)")
    p.add_argument("--no-lora-side-stream", dest="lora_side_stream", action="store_false",
                   help="LoRA work on the compute stream in the graphs, not beside the GEMMs")
    p.add_argument("--grouped-tuning", default="", metavar="K=V,...",
                   help="GroupedTuning fields of the non-deferred grouped kernels")
    p.add_argument("--lora-defer-max-tokens", type=int, metavar="N",
                   help="defer the LoRA deltas of graphs of up to N tokens (default: "
                        f"{cuda_graph.LORA_DEFER_MAX_TOKENS})")
    p.add_argument("--cublaslt-max-tokens", type=int, metavar="N",
                   help="capture the GEMMs of graphs of up to N tokens through cublasLt "
                        f"(default: {cuda_graph.CUBLASLT_MAX_TOKENS}; 0: none)")
    args = p.parse_args()
    HBM_BYTES_PER_S = args.peak_bw
    if args.cublaslt_max_tokens is not None:
        cuda_graph.CUBLASLT_MAX_TOKENS = args.cublaslt_max_tokens
    if args.lora_defer_max_tokens is not None:
        cuda_graph.LORA_DEFER_MAX_TOKENS = args.lora_defer_max_tokens
    shape = SMOKE if args.smoke else LLAMA3_8B
    scale = 8 if args.smoke else 1  # fewer requests / tokens in smoke mode
    rng = np.random.default_rng(0)
    path = model_dir(shape)
    results: dict = {}
    # b and e decode at most 32 requests: a small KV pool leaves an 80 GB card room for the
    # two engines bench_small_batches builds beside this one
    kv_pages = 20_000 if args.smoke or args.only_be else 200_000
    kw = dict(kv_pages=kv_pages, max_running=256 // scale,
              max_batch_tokens=8192, adapter_rows=2048 if not args.smoke else 1024, max_rank=64,
              max_adapter_sets_per_batch=128, lora_side_stream=args.lora_side_stream)
    engine = make_engine(path, args, **kw)
    if args.grouped_tuning:
        engine.runner.lora_backend.tuning = parse_tuning(args.grouped_tuning)
    cfg, dev = engine.model_cfg, engine.runner.device
    start = time.perf_counter()
    if engine.runner.graphs is not None:
        engine.runner.graphs.capture_decode()
    results["graph_capture_s"] = time.perf_counter() - start
    results["cublaslt_max_tokens"] = cuda_graph.CUBLASLT_MAX_TOKENS
    weight_bytes = sum(t.numel() * t.element_size() for t in engine.runner.model.parameters())
    results["weight_bytes"] = weight_bytes
    results["peak_bw"] = HBM_BYTES_PER_S
    results["floor_decode_ms"] = 1e3 * weight_bytes / HBM_BYTES_PER_S
    if not args.only_c:
        bench_small_batches(engine, path, args, kw, scale, rng, results)
    if not args.only_be:
        bench_throughput(engine, cfg, dev, scale, rng, results, with_d=not args.only_c)
    report(results)


def bench_small_batches(engine: Engine, path: Path, args, kw: dict, scale: int, rng,
                        results: dict) -> None:
    """Targets b and e."""
    one = random_adapter(engine.model_cfg, "one", 16, ALL7, 1, engine.runner.device)
    engine.add_adapter(one)
    decode_step_ms(engine, 1, [None], 32, 8, rng)  # warm-up / compile
    decode_step_ms(engine, 1, ["one"], 32, 8, rng)
    results["b_base_bs1_ms"] = decode_step_ms(engine, 1, [None], 128, 64 // scale, rng)
    overlapped = engine.config
    engine.config = dataclasses.replace(overlapped, overlap_schedule=False)
    results["b_base_bs1_no_overlap_ms"] = decode_step_ms(engine, 1, [None], 128, 64 // scale,
                                                         rng)
    engine.config = overlapped
    results["b_one_adapter_bs1_ms"] = decode_step_ms(engine, 1, ["one"], 128, 64 // scale, rng)
    results["b_graph_replay_bs1_ms"] = graph_replay_ms(engine, rows=0)
    results["b_graph_replay_bs1_adapter_ms"] = graph_replay_ms(engine, rows=32)
    results["e_no_adapter_bs32_ms"] = decode_step_ms(engine, 32, [None], 128, 64 // scale, rng)
    serial = make_engine(path, args, **{**kw, "kv_pages": 20_000, "lora_side_stream": False})
    serial.add_adapter(one)
    decode_step_ms(serial, 1, ["one"], 32, 8, rng)
    results["b_one_adapter_bs1_no_side_stream_ms"] = decode_step_ms(serial, 1, ["one"], 128,
                                                                    64 // scale, rng)
    del serial
    bare = make_engine(path, args, **{**kw, "adapter_rows": 16, "kv_pages": 20_000})
    if bare.runner.graphs is not None:
        bare.runner.graphs.capture_decode()
    decode_step_ms(bare, 32, [None], 32, 8, rng)
    results["e_lora_disabled_bs32_ms"] = decode_step_ms(bare, 32, [None], 128, 64 // scale, rng)


def bench_throughput(engine: Engine, cfg: ModelConfig, dev, scale: int, rng, results: dict,
                     with_d: bool) -> None:
    """Targets c1-c3 (and d on the same adapters)."""
    overlapped = engine.config
    s1 = [random_adapter(cfg, f"s1-{i}", 8, QKVO, 100 + i, dev) for i in range(100 // scale)]
    z64 = [random_adapter(cfg, f"z-{i}", 16, ALL7, 300 + i, dev) for i in range(64 // scale)]
    for adapter in s1 + z64:
        engine.add_adapter(adapter)
        engine.runner.adapter_pool.packed(adapter)  # in the host tier, as in S-LoRA's setting
    n, prompt_len, new = 256 // scale, 512 // scale, 128 // scale
    results["c_base"] = throughput(engine, n, [None], prompt_len, new, rng)
    engine.config = dataclasses.replace(overlapped, overlap_schedule=False)
    results["c_base_no_overlap"] = throughput(engine, n, [None], prompt_len, new, rng)
    engine.config = overlapped
    results["c1_s1"] = throughput(engine, n, zipf_specs([a.name for a in s1], n, 1.0, rng),
                                  prompt_len, new, rng)
    results["c2_zipf64"] = throughput(engine, n, zipf_specs([a.name for a in z64], n, 1.0, rng),
                                      prompt_len, new, rng)
    peer_specs = [a.name for a in z64[:8]]
    peer = throughput(engine, 32, peer_specs, 256 // scale, 64 // scale, rng)
    results["c3_peer_shape_8_adapters_bs32"] = peer
    engine.config = dataclasses.replace(overlapped, overlap_schedule=False)  # steps timed apart
    for key, c3_specs in (("c3_no_overlap", peer_specs), ("c3_base_no_overlap", [None])):
        results[key] = throughput(engine, 32, c3_specs, 256 // scale, 64 // scale, rng)
    engine.config = overlapped
    if with_d:
        results["d"] = ttft_hit_vs_miss(engine, [a.name for a in z64[:10]], 2048 // scale, rng)


def report(r: dict) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_engine.json").write_text(json.dumps(r, indent=2))
    rows = [(name, value) for name, value in report_rows(r) if value is not None]
    for name, value in rows:
        print(f"{name:<36}{value:>12.3f}")


def report_rows(r: dict) -> list[tuple[str, float | None]]:
    """(label, value) rows; None where the run did not measure it (--only-c, --only-be)."""
    def get(*keys):
        value = r
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def ratio(a, b):
        return None if a is None or b is None else a / b

    return [
        ("graph capture s", get("graph_capture_s")),
        (f"b floor (weights / {get('peak_bw') / 1e12:.2f} TB/s) ms", get("floor_decode_ms")),
        ("b base bs1 decode step ms", get("b_base_bs1_ms")),
        ("b ratio to floor", ratio(get("b_base_bs1_ms"), get("floor_decode_ms"))),
        ("b base bs1 no overlap ms", get("b_base_bs1_no_overlap_ms")),
        ("b graph replay only bs1 ms", get("b_graph_replay_bs1_ms")),
        ("b one adapter bs1 ms", get("b_one_adapter_bs1_ms")),
        ("b graph replay only bs1 adapter ms", get("b_graph_replay_bs1_adapter_ms")),
        ("b adapter / base", ratio(get("b_one_adapter_bs1_ms"), get("b_base_bs1_ms"))),
        ("b one adapter bs1, LoRA not beside GEMM ms",
         get("b_one_adapter_bs1_no_side_stream_ms")),
        ("e no-adapter batch bs32 ms", get("e_no_adapter_bs32_ms")),
        ("e LoRA-disabled engine bs32 ms", get("e_lora_disabled_bs32_ms")),
        ("c base tok/s", get("c_base", "tok_per_s")),
        ("c base tok/s, no overlap", get("c_base_no_overlap", "tok_per_s")),
        ("c1 S1 tok/s", get("c1_s1", "tok_per_s")),
        ("c1 S1 / base", ratio(get("c1_s1", "tok_per_s"), get("c_base", "tok_per_s"))),
        ("c2 zipf64 tok/s", get("c2_zipf64", "tok_per_s")),
        ("c2 / base tok/s", ratio(get("c2_zipf64", "tok_per_s"), get("c_base", "tok_per_s"))),
        ("c2 mean decode step ms", get("c2_zipf64", "mean_decode_step_ms")),
        ("c2 mean decode byte floor ms", get("c2_zipf64", "mean_decode_floor_ms")),
        ("c2 step / floor", ratio(get("c2_zipf64", "mean_decode_step_ms"),
                                  get("c2_zipf64", "mean_decode_floor_ms"))),
        ("c base mean decode step ms", get("c_base", "mean_decode_step_ms")),
        ("c3 peer shape tok/s (peer 94.7)", get("c3_peer_shape_8_adapters_bs32", "tok_per_s")),
        ("c3 seconds", get("c3_peer_shape_8_adapters_bs32", "seconds")),
        ("c3 of which decode-only steps s", get("c3_peer_shape_8_adapters_bs32", "decode_s")),
        ("c3 mean decode step ms",
         get("c3_peer_shape_8_adapters_bs32", "mean_decode_step_ms")),
        ("c3 no overlap: tok/s", get("c3_no_overlap", "tok_per_s")),
        ("c3 no overlap: prefill steps s", get("c3_no_overlap", "other_s")),
        ("c3 no overlap: mean decode step ms", get("c3_no_overlap", "mean_decode_step_ms")),
        ("c3 base only, no overlap: tok/s", get("c3_base_no_overlap", "tok_per_s")),
        ("c3 base only, no overlap: prefill s", get("c3_base_no_overlap", "other_s")),
        ("c3 base only, no overlap: decode ms",
         get("c3_base_no_overlap", "mean_decode_step_ms")),
        ("d TTFT miss ms", get("d", "ttft_miss_ms")),
        ("d TTFT hit ms", get("d", "ttft_hit_ms")),
        ("d speedup", ratio(get("d", "ttft_miss_ms"), get("d", "ttft_hit_ms"))),
    ]


if __name__ == "__main__":
    main()
