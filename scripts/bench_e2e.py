"""End-to-end serving benchmark: a real checkpoint and real PEFT adapters on disk, a real
`radixlora serve` process, and HTTP clients (scripts/bench_serving.py) driving it.

    python scripts/bench_e2e.py                      # the H200: every workload, b,c,d,e,s,g
    python scripts/bench_e2e.py --workloads c,d      # some of them
    python scripts/bench_e2e.py --tiny               # tiny checkpoint on the CPU, ~1-2 min

Setup. A Llama-3-8B-shaped checkpoint (hidden 4096, 32 layers, 32 heads / 8 KV heads, vocab
128256, bf16) with random N(0, 0.02) weights is written to --work-dir as ~5 GB safetensors
shards + index + config.json + a byte-level BPE tokenizer.json (a smaller learned vocabulary;
ids it lacks decode to nothing), tensor by tensor (generated on the GPU when there is one), and
reused on later runs (a marker file records a complete write). PEFT adapter directories are
written beside it: a0..a7 (rank 16) for c, z0..z99 (ranks 8, 16, 32, 64 in turn) for d and e,
all on q, k, v, o, gate, up, down (bf16; ~16 GB for the 100). Disk: ~33 GB in the work dir,
plus the server's snapshots of the adapters it loads. The server is launched as a user would
(`python -m radixlora.cli serve --model DIR --adapter NAME=DIR ... --enable-admin`, the admin
key in RADIXLORA_ADMIN_API_KEY), default engine flags plus --extra-serve-args, its log in the
work dir; /get_server_info's pool sizing is printed once it is ready.

Workloads (prompts are random token ids; greedy; ignore_eos, so every request generates exactly
its max_tokens; a fresh prompt set per run, so runs do not hit each other's prefix cache):
  b  restarts first: four launches one after another on a compile cache of the benchmark's own
     (--compile-cache-dir in the work dir unless --extra-serve-args gives one): fresh (the
     cache emptied), the same flags, a flag that selects no kernel variant changed
     (--disable-radix-cache), the same flags again; each one's time to ready and the server's
     start-up line (its phase split). Then the benchmark's own launch, its time to ready, and
     the first request after ready (256 tokens in, 64 out, adapter a0) against the median of 5
     repeats of it, each after POST /flush_cache so that it prefills its prompt again as the
     first did; the repeats' one-stream ITL P50.
  c  32 requests (256 in, 64 out), a0..a7 four times each, all sent at once: a warm-up run, then
     5 runs: output tok/s median and spread (max-min)/median. After the server stops, the same
     runs through the in-process radixlora.Engine (same prompts, adapters, parameters, engine
     flags); the ratio HTTP / Engine of the medians.
  d  1000 requests (512 in, 128 out) over z0..z99 picked by Zipf popularity (exponent 1), all
     sent at once (no cap on requests in flight): fixed lengths, then lognormal lengths of the
     same means, then the fixed requests on the base model. A small warm-up run first. With
     --d-json, then the fixed requests again, each constrained to D_JSON_SCHEMA (structured
     output: a JSON array of integers, which no output of 128 tokens completes), and their
     output tok/s over the unconstrained run's.
  e  Poisson arrivals at 70% of d's fixed-length request rate (or --e-rate), min(60 s worth,
     600) requests, d's shapes: TTFT and ITL P50 / P99, and TTFT split between the adapters
     that hold half the requests and the rest. Then "decode step alone": a closed batch of C
     requests sent at once (C = e's requests in flight on average, by Little's law: measured
     request rate x mean end-to-end latency; 16-token prompts, 256 new tokens, the same
     adapter popularity): its ITL P50, and ITL P50(e) / it.

  s  ShareGPT-like burst: 2000 requests whose prompt and output lengths are drawn by
     bench_serving.sharegpt_lengths (lognormal, about 270 / 210 tokens, capped at 2,048 /
     1,024), all sent at once, on the base model, then the same lengths spread uniformly over
     q0..q{N-1} (--s-adapters N: rank-8 adapters on q, k, v, o). After each run, the step
     breakdown from /metrics (radixlora_step_*: decode-only and mixed steps, their count, mean
     ms, requests and tokens per step, and the scheduler's planning time per step). The
     requests go out from --client-processes forked client processes (default 8), each with
     its own event loop, so the inter-token gaps (chunk gaps, itl_ms) are the server's.

  g  goodput: for each rate of --g-rates (default 8, 16, 24, 32, 40 per second), Poisson
     arrivals for 40 s of ShareGPT-like requests, half on the base model and half over q0..q99,
     from the client processes: TTFT and ITL P50 / P90 / P99 and output tok/s per rate, then the
     goodput: the highest rate up to which every rate meets --g-slo (default TTFT P99 <= 300
     ms and ITL P99 <= 100 ms, with no failed request). Each stream gap of 50 ms or more is
     matched against the server's recent steps (/get_server_info) and counted under its cause:
     one long step, steps the stream sat out, or no step at all (a host stall). Steps answered
     late are counted too: when the scheduler takes two steps in less than 2 ms apart, the
     first came back a step late, when the second finished.

  o  open streams: 256 requests (512 in, 128 out) on the base model, all started at once from
     the client processes: TTFT and ITL P50 / P90 / P99, the server's decode-only and mixed
     steps in the run (radixlora_step_*), ITL P50 over the mean decode-only step, and the long
     gaps' causes as in g.

The floor printed beside every run is the time an H200 would need at its peak rates:
  floor_s = prefill FLOPs / peak FLOP/s + decode bytes / peak bytes/s       (800e12, 4.24e12)
  prefill FLOPs = 2 x P x sum(prompt_len)                         P: non-embedding parameters
                + 4 x layers x heads x head_dim x sum(prompt_len^2 / 2)  (LM head included)
                + sum over adapter requests of 2 x rank x sum_proj(in + out) x layers x prompt_len
  decode bytes  = sum over decode steps (all requests in one batch; step s = 1 .. max_out-1
                  runs the requests with output_len > s) of
                  2 x P                                              (bf16 weights)
                + 2 x rank x sum_proj(in + out) x layers for each distinct adapter in the step
                + 2 x layers x kv_heads x head_dim x 2 bytes x sum(prompt_len + s)   (KV read)
computed from every request's actual prompt and output lengths (floor() below).

Output: a table on stdout, and every figure with the config, git commit and command line in
bench_e2e.json ($OUT when set, else the work dir).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import itertools
import json
import os
import random
import re
import resource
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving  # noqa: E402
import checkpoints  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA3_8B = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
)
QWEN3_8B = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096,
    intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
)
GEMMA3_12B = dict(
    model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262208,
    hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, max_position_embeddings=131072,
    rms_norm_eps=1e-6, sliding_window=1024, sliding_window_pattern=6, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=1,
    eos_token_id=2, torch_dtype="bfloat16",
)
# Qwen3-30B-A3B: 128 experts of 768 channels, 8 per token; 61 GB of bf16 weights, more than the
# GPU machine's disk holds beside anything else, so it is served with --load-format dummy (random
# weights of this config, no weight file)
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
)
MODEL_SHAPES = {"llama3-8b": LLAMA3_8B, "qwen3-8b": QWEN3_8B, "gemma3-12b": GEMMA3_12B,
                "qwen3-30b-a3b": QWEN3_30B_A3B}
DUMMY_WEIGHTS = ("qwen3-30b-a3b",)  # shapes served with --load-format dummy
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MARKER = "bench_e2e_complete.json"
SHARD_BYTES = 5 * 10**9
H200_FLOPS = 800e12
H200_BYTES_PER_S = 4.24e12
ALL_WORKLOADS = ("b", "c", "d", "e", "s", "g", "o")


@dataclass(frozen=True)
class Scale:
    """The sizes of every workload (full, or --tiny)."""

    b_in: int
    b_out: int
    b_repeats: int
    c_requests: int
    c_adapters: int
    c_rank: int
    c_in: int
    c_out: int
    c_runs: int
    d_requests: int
    d_adapters: int
    d_in: int
    d_out: int
    d_warmup: int
    e_seconds: float
    e_max_requests: int
    e_closed_in: int
    e_closed_out: int
    s_requests: int
    s_scale: float  # of the ShareGPT-like lengths
    g_rates: tuple[float, ...] = (8.0, 16.0, 24.0, 32.0, 40.0)  # requests per second
    g_seconds: float = 40.0  # of arrivals per rate
    g_adapters: int = 100
    o_streams: int = 256
    o_in: int = 512
    o_out: int = 128


FULL = Scale(b_in=256, b_out=64, b_repeats=5, c_requests=32, c_adapters=8, c_rank=16, c_in=256,
             c_out=64, c_runs=5, d_requests=1000, d_adapters=100, d_in=512, d_out=128,
             d_warmup=32, e_seconds=60.0, e_max_requests=600, e_closed_in=16, e_closed_out=256,
             s_requests=2000, s_scale=1.0)
TINY = Scale(b_in=16, b_out=8, b_repeats=5, c_requests=8, c_adapters=4, c_rank=8, c_in=16,
             c_out=8, c_runs=3, d_requests=16, d_adapters=4, d_in=16, d_out=8, d_warmup=4,
             e_seconds=5.0, e_max_requests=16, e_closed_in=16, e_closed_out=16, s_requests=16,
             s_scale=0.05, g_rates=(1.0, 2.0), g_seconds=4.0, g_adapters=4,
             o_streams=8, o_in=16, o_out=8)
D_RANKS = (8, 16, 32, 64)
S_RANK, S_MODULES = 8, ("q_proj", "k_proj", "v_proj", "o_proj")
S_DISTINCT_WEIGHTS = 1000  # q adapters beyond this share weights (weight_twin)


# ---- the floor ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """The dimensions of a Llama-style model that the floor needs; a mixture of experts has
    `experts` experts of `moe_intermediate` channels in every layer, `top_k` per token."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0

    @classmethod
    def from_config(cls, cfg: dict) -> Shape:
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        return cls(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], heads,
                   cfg.get("num_key_value_heads") or heads,
                   cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg["vocab_size"],
                   experts, cfg.get("num_experts_per_tok", 0) if experts else 0,
                   cfg.get("moe_intermediate_size") or cfg["intermediate_size"] if experts else 0)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each LoRA-targetable projection (a mixture of experts: the
        attention's)."""
        h, i = self.hidden, self.intermediate
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.experts:
            return attention
        return {**attention, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def expert_params(self) -> int:
        """One expert's parameters (gate, up, down) in one layer."""
        return 3 * self.hidden * self.moe_intermediate

    def params(self) -> int:
        """Non-embedding parameters a token is computed with (a mixture of experts: its
        router and top_k experts), the LM head and the norms included."""
        per_layer = sum(i * o for i, o in self.projections().values()) + 2 * self.hidden
        if self.experts:
            per_layer += self.experts * self.hidden + self.top_k * self.expert_params()
        return self.layers * per_layer + self.hidden + self.vocab * self.hidden

    def decode_weight_bytes(self, batch: int) -> int:
        """bf16 weight bytes a decode step of `batch` tokens reads: every weight, but of a
        mixture of experts only the experts some token is routed to (their expected number
        under uniform routing)."""
        if not self.experts:
            return 2 * self.params()
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** batch)
        unrouted = self.params() - self.layers * self.top_k * self.expert_params()
        return int(2 * (unrouted + self.layers * touched * self.expert_params()))

    def lora_in_out(self) -> int:
        """sum over the 7 projections of (in + out): a rank-1 LoRA's parameters per layer."""
        return sum(i + o for i, o in self.projections().values())


@dataclass(frozen=True)
class Planned:
    """One request as the floor sees it; adapter None is the base model."""

    prompt_len: int
    output_len: int
    adapter: str | None = None
    rank: int = 0


def floor(shape: Shape, reqs: list[Planned], peak_flops: float = H200_FLOPS,
          peak_bytes_per_s: float = H200_BYTES_PER_S) -> dict:
    """The peak-rate time of `reqs` (module docstring): prefill compute + decode memory."""
    params = shape.params()
    lora_per_rank = shape.lora_in_out() * shape.layers
    prompt_tokens = sum(r.prompt_len for r in reqs)
    dense = 2 * params * prompt_tokens
    q_width = shape.heads * shape.head_dim
    attention = 4 * shape.layers * q_width * sum(r.prompt_len**2 / 2 for r in reqs)
    lora = sum(2 * r.rank * lora_per_rank * r.prompt_len for r in reqs if r.adapter)
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * 2
    weight_bytes = shape.decode_weight_bytes(len(reqs))
    steps = max((r.output_len for r in reqs), default=1) - 1
    decode_bytes = 0
    for s in range(1, steps + 1):
        active = [r for r in reqs if r.output_len > s]
        adapters = {r.adapter: r.rank for r in active if r.adapter}
        decode_bytes += shape.decode_weight_bytes(len(active))
        decode_bytes += 2 * lora_per_rank * sum(adapters.values())
        decode_bytes += kv_per_token * sum(r.prompt_len + s for r in active)
    prefill_flops = dense + attention + lora
    prefill_s, decode_s = prefill_flops / peak_flops, decode_bytes / peak_bytes_per_s
    return {"floor_s": prefill_s + decode_s, "prefill_s": prefill_s, "decode_s": decode_s,
            "prefill_flops": prefill_flops, "dense_flops": dense, "attention_flops": attention,
            "lora_flops": lora, "decode_bytes": decode_bytes, "decode_steps": steps,
            "weight_bytes_per_step": weight_bytes, "peak_flops": peak_flops,
            "peak_bytes_per_s": peak_bytes_per_s}


# ---- checkpoint and adapters on disk --------------------------------------------------------

def pick_device(name: str) -> str:
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def random_tensor(shape: tuple[int, ...], std: float, gen: torch.Generator, device: str,
                  dtype: torch.dtype) -> torch.Tensor:
    """N(0, std) on `device` (fp32 draw), cast to `dtype`, on the CPU."""
    return (torch.randn(shape, generator=gen, device=device) * std).to(dtype).cpu()


def checkpoint_tensors(shape: Shape, cfg: dict) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, is_norm) of every tensor of the checkpoint of `cfg` (Llama, Qwen3 with
    its q/k norms, Gemma 3 with its sandwich norms too), in file order."""
    gemma, qk_norm = cfg["model_type"].startswith("gemma"), cfg["model_type"] != "llama"
    norms = ["input_layernorm", "post_attention_layernorm"]
    if gemma:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    out = [("model.embed_tokens.weight", (shape.vocab, shape.hidden), False)]
    for layer in range(shape.layers):
        for name, (n_in, n_out) in shape.projections().items():
            block = "self_attn" if name[0] in "qkvo" else "mlp"
            out.append((f"model.layers.{layer}.{block}.{name}.weight", (n_out, n_in), False))
        out += [(f"model.layers.{layer}.{norm}.weight", (shape.hidden,), True) for norm in norms]
        if qk_norm:
            out += [(f"model.layers.{layer}.self_attn.{n}.weight", (shape.head_dim,), True)
                    for n in ("q_norm", "k_norm")]
    out.append(("model.norm.weight", (shape.hidden,), True))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (shape.vocab, shape.hidden), False))
    return out


def plan_shards(tensors, itemsize: int, shard_bytes: int) -> list[list[int]]:
    """Indices of `tensors` per shard: consecutive tensors up to shard_bytes each."""
    shards, size = [[]], 0
    for i, (_, dims, _) in enumerate(tensors):
        nbytes = itemsize * int(torch.Size(dims).numel())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def bench_tokenizer(vocab_size: int):
    """A byte-level BPE learned on random words (its vocabulary is smaller than the model's)."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(4000)]
    texts = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(1500)]
    return checkpoints.build_tokenizer(texts, vocab_size)


def write_checkpoint(path: Path, cfg: dict, device: str, seed: int = 0,
                     shard_bytes: int = SHARD_BYTES, tokenizer_vocab: int = 32000) -> None:
    """cfg's model with random N(0, 0.02) bf16 weights as sharded safetensors, one tensor at a
    time (host memory: one shard), then config.json and tokenizer.json."""
    shape, dtype = Shape.from_config(cfg), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = checkpoint_tensors(shape, cfg)
    norm = 0.0 if cfg["model_type"].startswith("gemma") else 1.0  # Gemma scales by 1 + weight
    shards = plan_shards(tensors, dtype.itemsize, shard_bytes)
    weight_map, total = {}, 0
    for k, indices in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {}
        for i in indices:
            name, dims, is_norm = tensors[i]
            data[name] = (torch.full(dims, norm, dtype=dtype) if is_norm
                          else random_tensor(dims, 0.02, gen, device, dtype))
            weight_map[name] = file
            total += data[name].numel() * dtype.itemsize
        save_file(data, str(path / file), metadata={"format": "pt"})
        log(f"  wrote {file} ({sum(t.numel() for t in data.values()) * 2 / 1e9:.2f} GB)")
        del data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_config(path, cfg, tokenizer_vocab)


def write_config(path: Path, cfg: dict, tokenizer_vocab: int = 32000) -> None:
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    bench_tokenizer(tokenizer_vocab).save(str(path / "tokenizer.json"))


def write_adapter(path: Path, cfg: dict, rank: int, seed: int, device: str = "cpu",
                  dtype: torch.dtype = torch.bfloat16, base_path: str = "",
                  modules: tuple[str, ...] = PROJECTIONS, dora: bool = False) -> Path:
    """A PEFT LoRA directory: rank `rank` on `modules` (default every projection) of every
    layer, random non-zero lora_A ~ N(0, 1/in) and lora_B ~ N(0, 0.01^2), keys as PEFT writes
    them. dora: a DoRA adapter (use_dora), each module's magnitude vector
    0.02 sqrt(in) (1 + N(0, 0.05^2)), about the norms of the checkpoint's N(0, 0.02^2) rows."""
    path.mkdir(parents=True, exist_ok=True)
    shape = Shape.from_config(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for layer in range(shape.layers):
        for name, (n_in, n_out) in shape.projections().items():
            if name not in modules:
                continue
            block = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = random_tensor((rank, n_in), n_in**-0.5, gen,
                                                            device, dtype)
            tensors[f"{key}.lora_B.weight"] = random_tensor((n_out, rank), 0.01, gen, device,
                                                            dtype)
            if dora:
                m = 1 + random_tensor((n_out,), 0.05, gen, device, torch.float32)
                tensors[f"{key}.lora_magnitude_vector"] = (0.02 * n_in**0.5 * m).to(dtype)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
              "lora_dropout": 0.0, "target_modules": list(modules), "bias": "none",
              "use_rslora": False, "use_dora": dora, "base_model_name_or_path": base_path}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def adapter_plan(workloads: set[str], scale: Scale, s_adapters=()) -> dict[str, int]:
    """Adapter name -> rank of the adapters the chosen workloads use."""
    plan = {}
    if workloads & {"b", "c"}:
        count = scale.c_adapters if "c" in workloads else 1
        plan.update({f"a{i}": scale.c_rank for i in range(count)})
    if workloads & {"d", "e"}:
        plan.update({f"z{i}": D_RANKS[i % len(D_RANKS)] for i in range(scale.d_adapters)})
    if "s" in workloads:
        plan.update({f"q{i}": S_RANK for i in range(max(s_adapters, default=0))})
    if "g" in workloads:
        plan.update({f"q{i}": S_RANK for i in range(scale.g_adapters)})
    return plan


def adapter_order(name: str) -> tuple[str, int]:
    """q2 before q10: a weight twin (weight_twin) is written before the adapters that share it."""
    return name[0], int(name[1:])


def weight_twin(name: str) -> str | None:
    """s's q{i} beyond the first S_DISTINCT_WEIGHTS share the weights of q{i mod that} (one
    file on disk, hard-linked), under a config of their own, so each is a distinct adapter
    (its own content hash, loads and pool rows) without 13.6 GB of disk per thousand."""
    if name.startswith("q") and int(name[1:]) >= S_DISTINCT_WEIGHTS:
        return f"q{int(name[1:]) % S_DISTINCT_WEIGHTS}"
    return None


def relabel_adapter(source: Path, path: Path, name: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    target = path / "adapter_model.safetensors"
    target.unlink(missing_ok=True)
    os.link(source / "adapter_model.safetensors", target)
    config = json.loads((source / "adapter_config.json").read_text())
    config["revision"] = name  # a key PEFT writes and serving ignores: a new content hash
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


def adapter_modules(name: str) -> tuple[str, ...]:
    """The projections an adapter of adapter_plan targets: s's q{i} only q, k, v, o."""
    return S_MODULES if name.startswith("q") else PROJECTIONS


def prepare_files(work: Path, tiny: bool, plan: dict[str, int], device: str, dora: bool = False,
                  model_shape: str = "llama3-8b") -> tuple[Path, dict, dict[str, Path]]:
    """The model directory, its config and the adapter directories (dora: d's and e's z{i} as
    DoRA adapters), written unless a complete earlier write (its marker file) is there."""
    model = work / ("tiny-model" if tiny else f"{model_shape}-random")
    marker = model / MARKER
    if not marker.is_file():
        if model.exists():
            shutil.rmtree(model)
        model.mkdir(parents=True)
        start = time.perf_counter()
        if tiny:
            checkpoints.build_tiny_model(model)
        elif model_shape in DUMMY_WEIGHTS:
            log(f"writing the {model_shape} config and tokenizer to {model} (served with "
                "--load-format dummy: random weights, no weight file)")
            write_config(model, MODEL_SHAPES[model_shape])
        else:
            log(f"writing the {model_shape}-shaped checkpoint to {model} (on {device})")
            write_checkpoint(model, MODEL_SHAPES[model_shape], device)
        marker.write_text(json.dumps({"seconds": time.perf_counter() - start}))
        log(f"checkpoint written in {time.perf_counter() - start:.1f} s")
    else:
        log(f"reusing the checkpoint in {model}")
    cfg = json.loads((model / "config.json").read_text())
    adapters = {}
    root = work / ("tiny-adapters" if tiny else f"adapters-{model_shape}")
    s_root = work / ("tiny-s-adapters" if tiny else f"s-adapters-{model_shape}")
    for i, (name, rank) in enumerate(sorted(plan.items(), key=lambda kv: adapter_order(kv[0]))):
        as_dora = dora and name.startswith("z")
        path = (s_root / name if name.startswith("q")
                else root / f"{name}-r{rank}{'-dora' if as_dora else ''}")
        twin = weight_twin(name)
        if not (path / MARKER).is_file() and twin is not None:
            relabel_adapter(adapters[twin], path, name)
        elif not (path / MARKER).is_file():
            write_adapter(path, cfg, rank, seed=1000 + i, device=device, base_path=str(model),
                          modules=adapter_modules(name), dora=as_dora)
        (path / MARKER).write_text("{}")
        adapters[name] = path
    log(f"{len(adapters)} adapters ready under {work}")
    return model, cfg, adapters


# ---- the server -----------------------------------------------------------------------------

def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Server:
    """`python -m radixlora.cli serve ...` in its own process group, its output in a file. The
    admin key (random) goes in RADIXLORA_ADMIN_API_KEY, the --admin-api-key fallback, so that
    it is not on the command line."""

    def __init__(self, model: Path, adapters: dict[str, Path], port: int, extra: list[str],
                 log_path: Path):
        self.cmd = [sys.executable, "-m", "radixlora.cli", "serve", "--model", str(model),
                    "--port", str(port), "--enable-admin"]
        self.admin_key = secrets.token_hex(16)
        for name, path in adapters.items():
            if not name.startswith("q"):
                self.cmd += ["--adapter", f"{name}={path}"]
        s_dirs = {path.parent for name, path in adapters.items() if name.startswith("q")}
        for root in s_dirs:  # s's adapters, as a fleet is served: a watched directory
            self.cmd += ["--adapter-dir", str(root)]
        self.cmd += extra
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.log_offset = 0  # where this launch's lines start in the log

    def start(self, timeout_s: float) -> float:
        """Launch and wait for GET /health to answer 200; returns the seconds it took."""
        try:
            httpx.get(self.url + "/health", timeout=2)
            raise RuntimeError(f"something already answers on {self.url}; pick another --port")
        except httpx.TransportError:
            pass
        log(f"starting: {shlex.join(self.cmd[:10])} ... ({len(self.cmd)} args), "
            f"log {self.log_path}")
        env = dict(os.environ, RADIXLORA_ADMIN_API_KEY=self.admin_key)
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        start = time.perf_counter()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=ROOT, env=env, start_new_session=True)
        while time.perf_counter() - start < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n"
                                   + self.log_tail())
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the server was not ready in {timeout_s} s:\n{self.log_tail()}")

    def phase_line(self) -> str | None:
        """This launch's start-up line (`ready in T s: weights ..., other ...`)."""
        for _ in range(50):  # logged just after /health starts answering
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
            found = re.findall(r"INFO radixlora\.server\.(?:procs\.)?launcher: (ready in .*)",
                               text)
            if found:
                return found[-1]
            time.sleep(0.1)
        return None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def admin(self, method: str, route: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        return httpx.request(method, self.url + route, headers=headers, timeout=60)

    def stop(self, timeout_s: float = 90) -> None:
        """SIGTERM (the server drains and stops its children), then SIGKILL to its process
        group if any of it lingers (its GPU memory must be free for the Engine runs)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and group_alive(self.proc.pid):
            self.proc.poll()
            time.sleep(0.2)
        if group_alive(self.proc.pid):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def sizing_report(info: dict) -> dict:
    """The "sizing" sub-dict of /get_server_info if there is one, else its pool-size keys."""
    def find(node, key):
        if isinstance(node, dict):
            if key in node:
                return node[key]
            for value in node.values():
                found = find(value, key)
                if found is not None:
                    return found
        return None

    sizing = find(info, "sizing")
    if isinstance(sizing, dict):
        return sizing
    words = ("kv", "page", "adapter_rows", "max_running", "max_batch", "max_rank", "max_loras",
             "gpu_memory", "context")
    out = {}
    for section in ("engine", "scheduler"):
        for key, value in (info.get(section) or {}).items():
            if any(w in key for w in words) and not isinstance(value, (dict, list)):
                out[f"{section}.{key}"] = value
    return out


# ---- HTTP workloads -------------------------------------------------------------------------

def client_args(url: str, extra_body: dict | None = None) -> SimpleNamespace:
    """The fields bench_serving's request functions read."""
    return SimpleNamespace(base_url=url, timeout=3600.0, max_concurrency=None, temperature=0.0,
                           ignore_eos=True, extra_body=extra_body)


# d --d-json: every request's output constrained to this schema
D_JSON_SCHEMA = {"type": "array", "items": {"type": "integer"}}


def plan(n: int, input_len: int, output_len: int, adapters: list[str], popularity: str,
         vocab: int, seed: int, len_dist: str = "fixed", rate: float = 0.0):
    """bench_serving.plan_requests for n requests of token-id prompts."""
    spec = SimpleNamespace(num_requests=n, rate=rate, arrival="poisson", popularity=popularity,
                           zipf_s=1.0, input_len=input_len, output_len=output_len,
                           len_dist=len_dist, prompt_kind="ids", vocab_size=vocab)
    return bench_serving.plan_requests(spec, adapters, random.Random(seed))


def warm_client(url: str) -> None:
    """This process's first streamed HTTP exchange, on a route that runs no model step: the
    client's one-time costs (imports and set-up inside httpx and asyncio, about 0.1 s on the
    2-core CPU) then stay out of the first request's TTFT."""
    async def go():
        async with (bench_serving.make_client(client_args(url, None)) as client,
                    client.stream("GET", "/v1/models") as resp):
            async for line in resp.aiter_lines():
                if line:
                    json.loads(line)

    asyncio.run(go())


def drive(url: str, gaps: list[float], specs: list, allow_failed: bool = False,
          extra_body: dict | None = None) -> dict:
    """Send the requests (each body with extra_body's fields); bench_serving's summary. Fails
    loudly on a failed request, unless allow_failed (the summary then counts them, and the
    token check covers the others)."""
    async def go():
        args = client_args(url, extra_body)
        async with bench_serving.make_client(args) as client:
            return await bench_serving.send_requests(client, args, gaps, specs)

    results, duration = asyncio.run(go())
    summary = bench_serving.summarize(results, duration)
    if summary["failed"] and not allow_failed:
        raise RuntimeError(f"{summary['failed']} of {len(specs)} requests failed: "
                           f"{summary['errors']}")
    expected = sum(s.max_tokens for s in specs)
    if summary["output_tokens"] != expected and not summary["failed"]:
        raise RuntimeError(f"got {summary['output_tokens']} output tokens, expected {expected} "
                           "(ignore_eos)")
    return summary


def drive_processes(url: str, specs: list, processes: int, work: Path,
                    arrivals: list[float] | None = None, keep_gaps: bool = False) -> dict:
    """The specs sent from `processes` forked client processes (spec i from process
    i % processes), each with its own event loop, so a stream's chunk gaps measure the server,
    not one client's loop: all at once, or spec i `arrivals[i]` seconds (non-decreasing) after
    a wall-clock instant the processes share. They hand their results back as JSON files;
    bench_serving's summary of all of them, the duration from that instant to the last
    response; with keep_gaps, also every stream's long gaps (Result.long_gaps) in time order."""
    arrivals = arrivals or [0.0] * len(specs)
    start_at = time.time() + 2.0
    paths = [work / f"client-{k}.json" for k in range(processes)]
    pids = []
    for k, path in enumerate(paths):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _client_process(url, specs[k::processes], process_gaps(arrivals, k, processes),
                                start_at, path)
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"client process {pid} failed")
    results, ends = [], []
    for path in paths:
        shard = json.loads(path.read_text())
        results += [bench_serving.Result(**r) for r in shard["results"]]
        ends.append(shard["end"])
        path.unlink()
    summary = bench_serving.summarize(results, max(ends) - start_at)
    summary["client_processes"] = processes
    if keep_gaps:
        summary["long_gaps"] = sorted(g for r in results if r.ok for g in r.long_gaps)
    return summary


def process_gaps(arrivals: list[float], k: int, processes: int) -> list[float]:
    """The gaps between the arrivals of process k's specs (every processes-th from k), the
    first from the shared start."""
    mine = arrivals[k::processes]
    return [t - prev for prev, t in zip([0.0, *mine], mine)]


def _client_process(url: str, specs: list, gaps: list[float], start_at: float,
                    path: Path) -> None:
    async def go():
        args = client_args(url)
        async with bench_serving.make_client(args) as client:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            return await bench_serving.send_requests(client, args, gaps, specs)

    results, _ = asyncio.run(go())
    path.write_text(json.dumps({"results": [dataclasses.asdict(r) for r in results],
                                "end": time.time()}))


def planned(specs, ranks: dict[str, int]) -> list[Planned]:
    return [Planned(len(s.prompt), s.max_tokens, s.adapter if s.adapter in ranks else None,
                    ranks.get(s.adapter, 0)) for s in specs]


def with_floor(summary: dict, specs, ranks: dict[str, int], ctx) -> dict:
    fl = floor(ctx.shape, planned(specs, ranks), ctx.peak_flops, ctx.peak_bw)
    summary["floor"] = fl
    summary["time_over_floor"] = summary["duration_s"] / fl["floor_s"]
    return summary


RESTARTS = (("fresh", (), True), ("same flags", (), False),
            ("--disable-radix-cache", ("--disable-radix-cache",), False),
            ("same flags again", (), False))


B_CACHE = "compile-cache-b"  # b's own compile cache, in the work dir


def with_b_cache(extra: list[str], work: Path) -> list[str]:
    """The serve flags with b's own compile cache, unless they name one."""
    if "--compile-cache-dir" in extra:
        return list(extra)
    return [*extra, "--compile-cache-dir", str(work / B_CACHE)]


def restart_launches(model: Path, adapters: dict[str, Path], port: int, extra: list[str],
                     work: Path, timeout_s: float) -> list[dict]:
    """b's four launches (RESTARTS): each launched, timed to ready and stopped."""
    flags = with_b_cache(extra, work)
    own_cache = "--compile-cache-dir" not in extra  # the user's cache is never emptied
    launches = []
    for label, changed, fresh in RESTARTS:
        if fresh and own_cache:
            shutil.rmtree(work / B_CACHE, ignore_errors=True)
        server = Server(model, adapters, port, [*flags, *changed], work / "server.log")
        try:
            ready = server.start(timeout_s)
            launches.append({"launch": label, "ready_s": ready, "phases": server.phase_line()})
        finally:
            server.stop()
        log(f"b: {label}: {launches[-1]['phases'] or f'ready in {ready:.1f} s'}")
    return launches


def workload_b(ctx) -> dict:
    """The first request after ready vs the median of repeats, each after a cache flush."""
    s = ctx.scale
    _, specs = plan(1, s.b_in, s.b_out, ["a0"], "uniform", ctx.vocab, seed=11)
    warm_client(ctx.url)
    first = drive(ctx.url, [0.0], specs)
    repeats = []
    for _ in range(s.b_repeats):
        ctx.server.admin("POST", "/flush_cache").raise_for_status()
        repeats.append(drive(ctx.url, [0.0], specs))
    steady = statistics.median(r["duration_s"] for r in repeats)
    steady_ttft = statistics.median(r["ttft_ms"]["p50"] for r in repeats)
    steady_itl = statistics.median(r["itl_ms"]["p50"] for r in repeats)
    out = {"time_to_ready_s": ctx.ready_s, "first_s": first["duration_s"],
           "first_ttft_ms": first["ttft_ms"]["p50"], "steady_s": steady,
           "steady_ttft_ms": steady_ttft, "steady_itl_ms": steady_itl,
           "repeats_s": [r["duration_s"] for r in repeats],
           "first_over_steady": first["duration_s"] / steady}
    out["floor"] = floor(ctx.shape, planned(specs, ctx.ranks), ctx.peak_flops, ctx.peak_bw)
    out["steady_over_floor"] = steady / out["floor"]["floor_s"]
    return out


def c_prompt_sets(ctx) -> list[list]:
    """The c requests of the warm-up and each measured run: a0..a{n-1} round robin."""
    s = ctx.scale
    names = [f"a{i}" for i in range(s.c_adapters)]
    sets = []
    for run in range(s.c_runs + 1):
        _, specs = plan(s.c_requests, s.c_in, s.c_out, names, "distinct", ctx.vocab,
                        seed=100 + run)
        sets.append(specs)
    return sets


def spread(values: list[float]) -> tuple[float, float]:
    median = statistics.median(values)
    return median, (max(values) - min(values)) / median


def workload_c(ctx) -> dict:
    """c over HTTP: a warm-up run, then the measured runs, all requests of a run at once."""
    sets = c_prompt_sets(ctx)
    drive(ctx.url, [0.0] * len(sets[0]), sets[0])
    runs = [drive(ctx.url, [0.0] * len(specs), specs) for specs in sets[1:]]
    tok_s = [r["output_token_throughput"] for r in runs]
    median, rel = spread(tok_s)
    fl = floor(ctx.shape, planned(sets[1], ctx.ranks), ctx.peak_flops, ctx.peak_bw)
    seconds = [r["duration_s"] for r in runs]
    return {"http_tok_s": tok_s, "http_tok_s_median": median, "http_spread": rel,
            "http_seconds": seconds, "ttft_ms": [r["ttft_ms"] for r in runs],
            "itl_ms": [r["itl_ms"] for r in runs], "floor": fl,
            "http_median_over_floor": statistics.median(seconds) / fl["floor_s"]}


def engine_overrides(extra: list[str]) -> dict:
    """The engine flags among --extra-serve-args, as Engine overrides (the server's parser)."""
    from radixlora.cli.flags import add_engine_flags
    from radixlora.cli.flags import engine_overrides as overrides

    parser = argparse.ArgumentParser(add_help=False)
    add_engine_flags(parser)
    known, _ = parser.parse_known_args(extra)
    return overrides(known)


def workload_c_engine(ctx, model: Path, adapters: dict[str, Path]) -> dict:
    """c's runs through the in-process Engine: one engine.generate per run."""
    from radixlora import Engine, SamplingParams

    s = ctx.scale
    names = [f"a{i}" for i in range(s.c_adapters)]
    overrides = engine_overrides(ctx.extra)
    log(f"c: in-process Engine (overrides {overrides})")
    engine = Engine(model, adapters={n: adapters[n] for n in names}, **overrides)
    params = SamplingParams(max_tokens=s.c_out, temperature=0.0, ignore_eos=True)
    tok_s, seconds = [], []
    for run, specs in enumerate(c_prompt_sets(ctx)):
        start = time.perf_counter()
        outs = engine.generate([sp.prompt for sp in specs], params,
                               adapters=[sp.adapter for sp in specs])
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if run:
            tok_s.append(tokens / elapsed)
            seconds.append(elapsed)
    del engine
    median, rel = spread(tok_s)
    return {"engine_tok_s": tok_s, "engine_tok_s_median": median, "engine_spread": rel,
            "engine_seconds": seconds}


def workload_s_engine(ctx, model: Path) -> dict:
    """s's base run through the in-process Engine: the same requests, submitted at once."""
    from radixlora import Engine, SamplingParams

    overrides = engine_overrides(ctx.extra)
    log(f"s: in-process Engine (overrides {overrides})")
    engine = Engine(model, **overrides)
    specs = sharegpt_specs(ctx, [], seed=401)
    for k, sp in enumerate(specs):
        params = SamplingParams(max_tokens=sp.max_tokens, temperature=0.0, ignore_eos=True)
        engine.submit(sp.prompt, params, cache_salt=f"s-{k}")
    start = time.perf_counter()
    while engine.scheduler.has_work():
        engine.step()
    elapsed = time.perf_counter() - start
    tokens = sum(sp.max_tokens for sp in specs)
    del engine
    return {"engine_seconds": elapsed, "engine_tok_s": tokens / elapsed}


def workload_d(ctx) -> dict:
    """A warm-up, then fixed lengths, lognormal lengths and the fixed requests on the base."""
    s = ctx.scale
    names = [f"z{i}" for i in range(s.d_adapters)]
    gaps, specs = plan(s.d_warmup, s.d_in, s.d_out, names, "zipf", ctx.vocab, seed=200)
    drive(ctx.url, gaps, specs)
    out, sent = {}, {}
    for dist, seed in (("fixed", 201), ("lognormal", 202)):
        gaps, sent[dist] = plan(s.d_requests, s.d_in, s.d_out, names, "zipf", ctx.vocab, seed,
                                len_dist=dist)
        log(f"d: {dist} lengths, {len(sent[dist])} requests at once")
        out[dist] = with_floor(drive(ctx.url, gaps, sent[dist]), sent[dist], ctx.ranks, ctx)
    base = [bench_serving.RequestSpec(ctx.base_name, sp.prompt, sp.max_tokens)
            for sp in sent["fixed"]]
    log(f"d: base model only, {len(base)} requests at once")
    out["base"] = with_floor(drive(ctx.url, [0.0] * len(base), base), base, ctx.ranks, ctx)
    if ctx.d_json:
        log(f"d: the fixed requests again, each constrained to {D_JSON_SCHEMA}")
        fixed = sent["fixed"]
        json_mode = {"structured_outputs": {"json": D_JSON_SCHEMA}}
        out["fixed_json"] = with_floor(drive(ctx.url, [0.0] * len(fixed), fixed,
                                             extra_body=json_mode), fixed, ctx.ranks, ctx)
        out["json_over_fixed"] = (out["fixed_json"]["output_token_throughput"]
                                  / out["fixed"]["output_token_throughput"])
    return out


def d_rate_probe(ctx) -> float:
    """d's fixed-length request rate, for e when d was not run."""
    s = ctx.scale
    names = [f"z{i}" for i in range(s.d_adapters)]
    gaps, specs = plan(s.d_requests, s.d_in, s.d_out, names, "zipf", ctx.vocab, seed=201)
    return drive(ctx.url, gaps, specs)["request_throughput"]


def workload_e(ctx, d_rate: float | None, rate: float | None = None) -> dict:
    """Poisson arrivals at `rate` (default 70% of d_rate), then a closed batch at their mean
    concurrency."""
    s = ctx.scale
    names = [f"z{i}" for i in range(s.d_adapters)]
    rate = rate or 0.7 * d_rate
    n = max(1, min(s.e_max_requests, round(rate * s.e_seconds)))
    gaps, specs = plan(n, s.d_in, s.d_out, names, "zipf", ctx.vocab, seed=300, rate=rate)
    log(f"e: {n} requests, Poisson at {rate:.2f}/s")
    poisson = with_floor(drive(ctx.url, gaps, specs), specs, ctx.ranks, ctx)
    # Little's law over the run's window: requests in flight = throughput x mean latency
    concurrency = poisson["request_throughput"] * poisson["mean_e2e_s"]
    batch = max(1, round(concurrency))
    gaps, closed_specs = plan(batch, s.e_closed_in, s.e_closed_out, names, "zipf", ctx.vocab,
                              seed=301)
    log(f"e: closed batch of {batch} (Little's law: {concurrency:.1f} in flight)")
    closed = with_floor(drive(ctx.url, gaps, closed_specs), closed_specs, ctx.ranks, ctx)
    return {"rate": rate, "d_rate": d_rate, "requests": n, "poisson": poisson,
            "little_concurrency": concurrency, "closed_batch": batch, "closed": closed,
            "itl_p50_over_closed": poisson["itl_ms"]["p50"] / closed["itl_ms"]["p50"]}


STEP_SERIES = {"steps": "radixlora_steps_total", "seconds": "radixlora_step_seconds_total",
               "plan_seconds": "radixlora_step_plan_seconds_total",
               "tokens": "radixlora_step_tokens_total", "requests": "radixlora_step_requests_total"}


def step_totals(url: str) -> dict[str, dict[str, float]]:
    """kind -> the server's cumulative step totals (StepTotals' fields) from /metrics, read
    after the scheduler's next stats report (every 0.5 s) so that they hold every step so far."""
    time.sleep(1.0)
    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, dict[str, float]] = {}
    for field, series in STEP_SERIES.items():
        for kind, value in re.findall(rf'^{series}{{kind="(\w+)"}} (\S+)$', text, re.M):
            out.setdefault(kind, {})[field] = float(value)
    return out


def wait_validated(url: str, timeout_s: float = 1800.0) -> int:
    """Until /v1/models lists no adapter still `validating` (--adapter-dir validates what it
    listed at start in the background): the bursts measure serving, not first validation.
    Returns the adapters listed."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        cards = httpx.get(url + "/v1/models", timeout=60).json()["data"]
        waiting = sum(c.get("status") == "validating" for c in cards)
        if not waiting:
            log(f"s: {len(cards) - 1} adapters validated "
                f"({time.perf_counter() - started:.0f} s waited)")
            return len(cards) - 1
        time.sleep(2.0)
    raise RuntimeError(f"adapters still validating after {timeout_s:.0f} s")


def wait_host_tier(url: str, adapters: int, poke: bench_serving.RequestSpec, settle_s: float = 10.0,
                   timeout_s: float = 600.0) -> None:
    """Until the worker's host tier holds `adapters` adapters, or holds no more after settle_s
    (it is full): the worker reads registered adapters into it in the background, and a burst
    that ran meanwhile would share the host with those reads. The tier's size reaches /metrics
    with each step's result, so `poke` (a one-token request) runs a step every poll."""
    started = last_change = time.perf_counter()
    held = -1.0
    while time.perf_counter() - started < timeout_s:
        drive(url, [0.0], [poke])
        text = httpx.get(url + "/metrics", timeout=30).text
        found = re.search(r"^radixlora_host_adapters (\S+)$", text, re.M)
        now = float(found.group(1)) if found else 0.0
        if now != held:
            held, last_change = now, time.perf_counter()
        if held >= adapters or time.perf_counter() - last_change > settle_s:
            log(f"s: {held:.0f} adapters in the host tier "
                f"({time.perf_counter() - started:.0f} s waited)")
            return
        time.sleep(1.0)
    raise RuntimeError(f"host tier still filling after {timeout_s:.0f} s")


POOL_SERIES = {"resident": "radixlora_resident_adapters",
               "loads": "radixlora_adapter_loads_total",
               "evictions": "radixlora_adapter_evictions_total"}


def pool_counts(url: str) -> dict[str, float]:
    """The adapter pool's residents now and its cumulative loads and evictions, from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for field, series in POOL_SERIES.items():
        found = re.search(rf"^{series} (\S+)$", text, re.M)
        out[field] = float(found.group(1)) if found else None
    return out


def pool_delta(before: dict, after: dict, steps: dict) -> dict:
    """What a run did to the pool (resident at its end; loads and evictions during it) and its
    mean running batch (requests per step over every kind of step)."""
    n = sum(k["steps"] for k in steps.values())
    requests = sum((k["mean_requests"] or 0) * k["steps"] for k in steps.values())
    return {"resident": after["resident"],
            **{f: after[f] - before[f] if None not in (after[f], before[f]) else None
               for f in ("loads", "evictions")},
            "mean_running": requests / n if n else None}


def step_breakdown(before: dict, after: dict) -> dict[str, dict]:
    """Per kind of step, what a run added: steps, mean ms (time held in the pipeline), mean
    planning ms, mean requests and tokens per step."""
    out = {}
    for kind, totals in after.items():
        d = {f: v - before.get(kind, {}).get(f, 0.0) for f, v in totals.items()}
        n = d.get("steps", 0.0)
        out[kind] = {"steps": int(n), "seconds": d.get("seconds", 0.0),
                     "mean_ms": 1e3 * d["seconds"] / n if n else None,
                     "mean_plan_ms": 1e3 * d["plan_seconds"] / n if n else None,
                     "mean_requests": d["requests"] / n if n else None,
                     "mean_tokens": d["tokens"] / n if n else None}
    return out


def sharegpt_specs(ctx, adapters: list[str], seed: int, n: int | None = None,
                   base_share: float = 0.0) -> list:
    """s's requests (n, default s_requests): ShareGPT-like lengths, token-id prompts, adapters
    uniform (or the base); with base_share, that share of them (every other one for 0.5) on
    the base model."""
    rng = random.Random(seed)
    specs, on_adapters = [], 0
    for k in range(ctx.scale.s_requests if n is None else n):
        prompt_len, output_len = bench_serving.sharegpt_lengths(rng, ctx.scale.s_scale)
        prompt = bench_serving.make_prompt(rng, prompt_len, "ids", ctx.vocab)
        name = ctx.base_name
        if adapters and on_adapters < (1 - base_share) * (k + 1):
            name, on_adapters = adapters[on_adapters % len(adapters)], on_adapters + 1
        specs.append(bench_serving.RequestSpec(name, prompt, output_len))
    return specs


def parse_slo(text: str) -> dict[str, float]:
    """"ttft_p99=300,itl_p99=100" -> {"ttft_p99": 300.0, "itl_p99": 100.0} (milliseconds)."""
    slo = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        metric, _, pct = key.strip().partition("_")
        if not sep or metric not in ("ttft", "itl") or pct not in ("p50", "p90", "p99"):
            raise argparse.ArgumentTypeError(f"expected e.g. ttft_p99=300,itl_p99=100, got "
                                             f"{part!r}")
        slo[key.strip()] = float(value)
    return slo


def meets(run: dict, slo: dict[str, float]) -> bool:
    """Every SLO bound holds for a run (bench_serving's summary), and no request failed."""
    for key, bound in slo.items():
        metric, pct = key.split("_")
        value = run[f"{metric}_ms"][pct]
        if value is None or value > bound:
            return False
    return not run["failed"]


def goodput(runs: dict[float, dict], slo: dict[str, float]) -> float | None:
    """The highest rate below which every measured rate meets the SLO (None if the lowest
    misses): a rate that meets it only above one that missed is noise, not capacity."""
    best = None
    for rate in sorted(runs):
        if not meets(runs[rate], slo):
            break
        best = rate
    return best


GAP_CAUSES = ("one long step", "steps it sat out", "no step (a host stall)")


def gap_cause(end: float, gap: float, steps: list[list[float]]) -> tuple[str, float]:
    """(cause, the tokens of its longest step) of one stream gap [end - gap, end] from the
    server's recent steps ([fold time, seconds, requests, tokens], fold times in order, a step
    running over [fold - seconds, fold]): one step covering at least half of
    it; else steps covering at least half of it between them, none of which carried the
    stream's token; else no step ran for most of it, a stall outside the step loop (the
    scheduler's, the api's or the tokenizer's host work, a collection, the network)."""
    start = end - gap
    first = bisect.bisect_left(steps, [start])
    covered, longest, step_tokens = 0.0, 0.0, 0.0
    for fold, seconds, _, tokens in steps[first:]:
        overlap = min(fold, end) - max(fold - seconds, start)
        if fold - seconds >= end:
            break
        if overlap > 0:
            covered += overlap
            if overlap > longest:
                longest, step_tokens = overlap, tokens
    if longest >= gap / 2:
        return GAP_CAUSES[0], step_tokens
    return (GAP_CAUSES[1] if covered >= gap / 2 else GAP_CAUSES[2]), step_tokens


def write_gap_trace(ctx, name: str, gaps: list[list[float]], steps: list[list[float]]) -> None:
    """The raw long gaps and the server's recent steps of a run, in the work directory as
    <name>_gaps.json, for reading a tail's causes step by step."""
    (ctx.work / f"{name}_gaps.json").write_text(json.dumps({"gaps": gaps, "steps": steps}))


def gap_causes(gaps: list[list[float]], steps: list[list[float]]) -> dict:
    """Per cause (gap_cause) of the long stream gaps: how many, their share of all long-gap
    time, and for long steps their mean tokens (a mixed step's prompt tokens and decodes)."""
    steps = sorted(steps)
    total = sum(gap for _, gap in gaps) or 1.0
    out = {c: {"gaps": 0, "time_share": 0.0, "mean_step_tokens": None} for c in GAP_CAUSES}
    long_steps: list[float] = []
    for end, gap in gaps:
        cause, tokens = gap_cause(end, gap, steps)
        out[cause]["gaps"] += 1
        out[cause]["time_share"] += gap / total
        if cause == GAP_CAUSES[0]:
            long_steps.append(tokens)
    out[GAP_CAUSES[0]]["mean_step_tokens"] = statistics.fmean(long_steps) if long_steps else None
    return out


TOGETHER_S = 0.002  # a step taken in this soon after the one before came back with it


def answered_together(steps: list[list[float]], run: dict) -> dict:
    """Of the run's steps (the last of the server's recent steps, as many as run["steps"]
    counts): those taken in within TOGETHER_S of the step before. That step was answered late,
    about when this one finished on the device, so each of its streams waited about one step
    more. Their count and the mean ms of the steps answered late (one replica's steps)."""
    n = sum(kind["steps"] for kind in run["steps"].values())
    mine = sorted(steps)[-n:] if n else []
    late = [prev[1] for prev, step in zip(mine, mine[1:]) if step[0] - prev[0] < TOGETHER_S]
    return {"count": len(late), "mean_late_ms": 1e3 * statistics.fmean(late) if late else None}


def workload_g(ctx) -> dict:
    """Goodput: for each rate, Poisson arrivals for g_seconds of ShareGPT-like requests, half
    on the base model and half over g_adapters rank-8 q/k/v/o adapters, streamed from the
    client processes; TTFT and ITL P50 / P90 / P99 and output tok/s per rate, then the highest
    rate that meets the SLO."""
    s = ctx.scale
    adapters = [f"q{i}" for i in range(s.g_adapters)]
    wait_validated(ctx.url)
    warm = sharegpt_specs(ctx, adapters, seed=500, n=32, base_share=0.5)
    drive(ctx.url, [0.0] * len(warm), warm)
    runs = {}
    for k, rate in enumerate(ctx.g_rates):
        n = max(1, round(rate * s.g_seconds))
        rng = random.Random(600 + k)
        arrivals = list(itertools.accumulate(bench_serving.arrival_gaps(n, rate, "poisson", rng)))
        specs = sharegpt_specs(ctx, adapters, seed=700 + k, n=n, base_share=0.5)
        log(f"g: {n} requests, Poisson at {rate:g}/s")
        before = step_totals(ctx.url)
        run = drive_processes(ctx.url, specs, ctx.client_processes, ctx.work, arrivals,
                              keep_gaps=True)
        run["steps"] = step_breakdown(before, step_totals(ctx.url))
        steps = ctx.server.admin("GET", "/get_server_info").json()["scheduler"]["recent_steps"]
        write_gap_trace(ctx, f"g{rate:g}", run["long_gaps"], steps)
        run["gap_causes"] = gap_causes(run.pop("long_gaps"), steps)
        run["answered_together"] = answered_together(steps, run)
        runs[rate] = run
        if not meets(run, ctx.g_slo) and k + 1 < len(ctx.g_rates):
            log(f"g: {rate:g}/s misses the SLO; higher rates are still measured")
    return {"slo": ctx.g_slo, "runs": {str(r): v for r, v in runs.items()},
            "goodput": goodput(runs, ctx.g_slo)}


def workload_o(ctx, round_index: int = 0) -> dict:
    """o_streams base-model requests started at once: their TTFT and ITL, the run's steps, and
    ITL P50 over the mean decode-only step. Each round its own prompts (no cache hits), of
    the same lengths."""
    s = ctx.scale
    _, specs = plan(s.o_streams, s.o_in, s.o_out, [ctx.base_name], "uniform", ctx.vocab,
                    seed=800)
    if round_index:
        rng = random.Random(810 + round_index)
        specs = [dataclasses.replace(sp, prompt=[rng.randrange(3, ctx.vocab) for _ in sp.prompt])
                 for sp in specs]
    _, warm = plan(1, s.o_in, s.o_out, [ctx.base_name], "uniform", ctx.vocab, seed=799)
    drive(ctx.url, [0.0], warm)
    before = step_totals(ctx.url)
    run = drive_processes(ctx.url, specs, ctx.client_processes, ctx.work, keep_gaps=True)
    run["steps"] = step_breakdown(before, step_totals(ctx.url))
    steps = ctx.server.admin("GET", "/get_server_info").json()["scheduler"]["recent_steps"]
    write_gap_trace(ctx, f"o{round_index + 1}", run["long_gaps"], steps)
    run["gap_causes"] = gap_causes(run.pop("long_gaps"), steps)
    run["answered_together"] = answered_together(steps, run)
    decode_ms = (run["steps"].get("decode") or {}).get("mean_ms")
    run["itl_p50_over_decode_step"] = (run["itl_ms"]["p50"] / decode_ms
                                       if decode_ms and run["itl_ms"]["p50"] else None)
    return run


def workload_s(ctx, counts: list[int]) -> dict:
    """The burst on the base model, then over the first N q adapters for each N of `counts`;
    after each, the step breakdown and the adapter pool's residents, loads and evictions."""
    warm = sharegpt_specs(ctx, [], seed=400)[:32]
    drive(ctx.url, [0.0] * len(warm), warm)
    out = {}
    runs = [("base", [])] + [(f"{n} adapters", [f"q{i}" for i in range(n)]) for n in counts]
    wait_host_tier(ctx.url, wait_validated(ctx.url), dataclasses.replace(warm[0], max_tokens=1))
    for name, adapters in runs:
        specs = sharegpt_specs(ctx, adapters, seed=401)
        log(f"s: {len(specs)} requests at once, {name}")
        before, pool_before = step_totals(ctx.url), pool_counts(ctx.url)
        run = drive_processes(ctx.url, specs, ctx.client_processes, ctx.work)
        if run["output_tokens"] != sum(sp.max_tokens for sp in specs) and not run["failed"]:
            raise RuntimeError(f"s {name}: {run['output_tokens']} output tokens, expected "
                               f"{sum(sp.max_tokens for sp in specs)} (ignore_eos)")
        out[name] = with_floor(run, specs, ctx.ranks, ctx)
        out[name]["steps"] = step_breakdown(before, step_totals(ctx.url))
        out[name]["pool"] = pool_delta(pool_before, pool_counts(ctx.url), out[name]["steps"])
        out[name]["mean_prompt"] = statistics.fmean(len(sp.prompt) for sp in specs)
        out[name]["mean_output"] = statistics.fmean(sp.max_tokens for sp in specs)
    return out


# ---- report ---------------------------------------------------------------------------------

def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:.4g}"
    return str(value)


def run_rows(name: str, r: dict) -> list[tuple[str, str]]:
    fl = r["floor"]
    return [
        (f"{name}: total s", fmt(r["duration_s"])),
        (f"{name}: output tok/s", fmt(r["output_token_throughput"])),
        (f"{name}: TTFT P50 / P99 ms", f"{fmt(r['ttft_ms']['p50'])} / {fmt(r['ttft_ms']['p99'])}"),
        (f"{name}: ITL P50 / P99 ms", f"{fmt(r['itl_ms']['p50'])} / {fmt(r['itl_ms']['p99'])}"),
        (f"{name}: floor s (prefill + decode)",
         f"{fmt(fl['floor_s'])} ({fmt(fl['prefill_s'])} + {fmt(fl['decode_s'])})"),
        (f"{name}: time / floor", fmt(r["time_over_floor"])),
    ]


def gap_rows(name: str, causes: dict, together: dict | None) -> list[tuple[str, str]]:
    rows = [(f"{name}: gaps >= {1e3 * bench_serving.LONG_GAP_S:g} ms from {cause}: count, "
             "share of their time, mean step tokens",
             f"{c['gaps']}, {fmt(c['time_share'])}, {fmt(c['mean_step_tokens'])}")
            for cause, c in causes.items()]
    if together is not None:
        rows.append((f"{name}: steps answered late, with the next (count, mean ms)",
                     f"{together['count']}, {fmt(together['mean_late_ms'])}"))
    return rows


def o_rows(name: str, o: dict) -> list[tuple[str, str]]:
    return [(f"{name}: {o['requests']} streams at once: TTFT P50 / P90 / P99 ms", "/".join(
                fmt(o["ttft_ms"][p]) for p in ("p50", "p90", "p99"))),
            (f"{name}: ITL P50 / P90 / P99 ms", "/".join(
                fmt(o["itl_ms"][p]) for p in ("p50", "p90", "p99"))),
            (f"{name}: output tok/s; failed", f"{fmt(o['output_token_throughput'])}; "
                                              f"{o['failed']}"),
            (f"{name}: ITL P50 / mean decode-only step", fmt(o["itl_p50_over_decode_step"]))
            ] + gap_rows(name, o["gap_causes"], o.get("answered_together")) + [
            (f"{name}: {kind} steps (mean ms, plan ms, requests, tokens)",
             f"{k['steps']} ({fmt(k['mean_ms'])}, {fmt(k['mean_plan_ms'])}, "
             f"{fmt(k['mean_requests'])}, {fmt(k['mean_tokens'])})")
            for kind, k in o["steps"].items()]


def rows(results: dict) -> list[tuple[str, str]]:
    out = [("time to ready s", fmt(results.get("time_to_ready_s"))),
           ("server's start-up line", results.get("startup_phases") or "-")]
    out += [(f"b launch, {r['launch']}", r["phases"] or f"ready in {fmt(r['ready_s'])} s")
            for r in results.get("restarts", [])]
    b = results.get("b")
    if b:
        out += [("b: first request s (TTFT ms)",
                 f"{fmt(b['first_s'])} ({fmt(b['first_ttft_ms'])})"),
                ("b: steady median s (TTFT ms)",
                 f"{fmt(b['steady_s'])} ({fmt(b['steady_ttft_ms'])})"),
                ("b: first / steady", fmt(b["first_over_steady"])),
                ("b: one-stream ITL P50 ms (median of the repeats)", fmt(b["steady_itl_ms"])),
                ("b: floor s", fmt(b["floor"]["floor_s"])),
                ("b: steady / floor", fmt(b["steady_over_floor"]))]
    c = results.get("c")
    if c:
        out += [("c: HTTP tok/s median (spread)",
                 f"{fmt(c['http_tok_s_median'])} ({fmt(c['http_spread'])})"),
                ("c: floor s", fmt(c["floor"]["floor_s"])),
                ("c: HTTP median time / floor", fmt(c["http_median_over_floor"]))]
        if "engine_tok_s_median" in c:
            out += [("c: Engine tok/s median (spread)",
                     f"{fmt(c['engine_tok_s_median'])} ({fmt(c['engine_spread'])})"),
                    ("c: HTTP / Engine", fmt(c["http_over_engine"]))]
    d = results.get("d")
    if d:
        for key in ("fixed", "lognormal", "base", "fixed_json"):
            if key in d:
                out += run_rows(f"d {key}", d[key])
        if "json_over_fixed" in d:
            out.append(("d: fixed with a JSON schema / without (target >= 0.9)",
                        fmt(d["json_over_fixed"])))
    g = results.get("g")
    if g:
        for rate, r in g["runs"].items():
            out += [(f"g {rate}/s: TTFT P50 / P90 / P99 ms", "/".join(
                        fmt(r["ttft_ms"][p]) for p in ("p50", "p90", "p99"))),
                    (f"g {rate}/s: ITL P50 / P90 / P99 ms", "/".join(
                        fmt(r["itl_ms"][p]) for p in ("p50", "p90", "p99"))),
                    (f"g {rate}/s: output tok/s; failed", f"{fmt(r['output_token_throughput'])}; "
                                                          f"{r['failed']}"),
                    (f"g {rate}/s: meets the SLO", str(meets(r, g["slo"])))]
            out += gap_rows(f"g {rate}/s", r.get("gap_causes") or {},
                            r.get("answered_together"))
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slo"].items())
        out.append((f"g: goodput, req/s ({slo})", fmt(g["goodput"])))
    rounds = [k for k in results if re.fullmatch(r"o\d*", k)]
    for name in sorted(rounds, key=lambda k: int(k[1:] or 1)):
        out += o_rows(name, results[name])
    for name, r in (results.get("s") or {}).items():
        out += run_rows(f"s {name}", r)
        out += [(f"s {name}: failed requests", f"{r['failed']} {r['errors'] or ''}")]
        if "engine_tok_s" in r:
            out += [(f"s {name}: Engine tok/s; HTTP / Engine",
                     f"{fmt(r['engine_tok_s'])}; {fmt(r['http_over_engine'])}")]
        pool = r.get("pool") or {}
        out += [(f"s {name}: adapters resident, loads, evictions; mean running batch",
                 f"{fmt(pool.get('resident'))}, {fmt(pool.get('loads'))}, "
                 f"{fmt(pool.get('evictions'))}; {fmt(pool.get('mean_running'))}")]
        if name != "base" and "base" in results["s"]:
            out += [(f"s {name}: tok/s against base", fmt(
                r["output_token_throughput"] / results["s"]["base"]["output_token_throughput"]))]
        steps = sum(k["steps"] for k in r["steps"].values())
        if steps and r["itl_ms"]["p50"] is not None:
            step_ms = 1e3 * sum(k["seconds"] for k in r["steps"].values()) / steps
            decode_ms = (r["steps"].get("decode") or {}).get("mean_ms")
            out += [(f"s {name}: ITL P50 / mean step (step ms; decode step ms)",
                     f"{fmt(r['itl_ms']['p50'] / step_ms)} ({fmt(step_ms)}; "
                     f"{fmt(decode_ms)})")]
        for kind, k in r["steps"].items():
            out.append((f"s {name}: {kind} steps (mean ms, plan ms, requests, tokens)",
                        f"{k['steps']} ({fmt(k['mean_ms'])}, {fmt(k['mean_plan_ms'])}, "
                        f"{fmt(k['mean_requests'])}, {fmt(k['mean_tokens'])})"))
    e = results.get("e")
    if e:
        source = "70% of d" if e["d_rate"] else "--e-rate"
        out += [(f"e: rate req/s ({source})", fmt(e["rate"])),
                ("e: requests", str(e["requests"]))]
        out += run_rows("e Poisson", e["poisson"])
        for label, t in e["poisson"]["ttft_ms_by_popularity"].items():
            out.append((f"e: TTFT P50 / P99 ms, {t['adapters']} {label} adapters",
                        f"{fmt(t['p50'])} / {fmt(t['p99'])} ({t['requests']} requests)"))
        out += [("e: Little's-law concurrency", fmt(e["little_concurrency"])),
                ("e: closed batch ITL P50 ms", fmt(e["closed"]["itl_ms"]["p50"])),
                ("e: ITL P50 / closed batch", fmt(e["itl_p50_over_closed"]))]
    return out


def print_table(results: dict, peak_flops: float, peak_bw: float) -> None:
    print()
    print(f"floor = prefill FLOPs / {peak_flops:.3g} FLOP/s + decode bytes / {peak_bw:.3g} B/s "
          "(module docstring: dense + attention + LoRA FLOPs; weights + distinct adapters + "
          "KV bytes per decode step)")
    table = rows(results)
    width = max(len(label) for label, _ in table)
    for label, value in table:
        print(f"{label:<{width}}  {value}")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def raise_fd_limit() -> None:
    """1000 requests at once need 1000 sockets here and in the server (which inherits this)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ---- main -----------------------------------------------------------------------------------

def add_server_args(p: argparse.ArgumentParser, tiny_help: str) -> None:
    """The flags of the files written and the server started (shared by bench_many_adapters)."""
    p.add_argument("--work-dir", default="/tmp/radixlora-bench-e2e",
                   help="checkpoint and adapters, reused by later runs and by the other "
                        "end-to-end benchmark")
    p.add_argument("--tiny", action="store_true", help=tiny_help)
    p.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama3-8b",
                   help="the random checkpoint's shape and family (default llama3-8b)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--extra-serve-args", default="",
                   help="more `radixlora serve` flags, one shell-quoted string")
    p.add_argument("--gen-device", default="auto",
                   help="where random weights are drawn (auto: cuda if available)")


def positive_list(kind):
    """An argparse type: comma-separated positive numbers of `kind`, distinct, ascending."""
    def parse(value: str) -> list:
        try:
            out = sorted({kind(v) for v in value.split(",") if v.strip()})
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, got {value!r}"
                                             ) from None
        if not out or out[0] <= 0:
            raise argparse.ArgumentTypeError(f"expected numbers > 0, got {value!r}")
        return out
    return parse


counts, rates = positive_list(int), positive_list(float)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS),
                   help="comma-separated subset of b,c,d,e,s,g,o")
    add_server_args(p, "tiny checkpoint and adapters, scaled-down workloads, on the CPU")
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    p.add_argument("--peak-flops", type=float, default=H200_FLOPS,
                   help="peak dense bf16 FLOP/s of the floor (H200: 800e12)")
    p.add_argument("--peak-bw", type=float, default=H200_BYTES_PER_S,
                   help="peak memory bytes/s of the floor (H200: 4.24e12)")
    p.add_argument("--skip-engine", action="store_true",
                   help="c, s: no in-process Engine runs")
    p.add_argument("--client-processes", type=int, default=8,
                   help="s: client processes sending the burst (each its own event loop)")
    p.add_argument("--s-adapters", type=counts, default=None, metavar="N[,N...]",
                   help="s: a run over the first N rank-8 q/k/v/o adapters for each N, after "
                        "the base run (default 100; --tiny 4), e.g. 100,1000,5000")
    p.add_argument("--g-rates", type=rates, default=None, metavar="R[,R...]",
                   help="g: Poisson request rates per second (default 8,16,24,32,40; --tiny 1,2)")
    p.add_argument("--o-rounds", type=int, default=1,
                   help="o's rounds on one launch, each reported: the first pays whatever a "
                        "server does on first use, a later one shows the steady state")
    p.add_argument("--g-slo", type=parse_slo, default=parse_slo("ttft_p99=300,itl_p99=100"),
                   metavar="SLO", help="g: the service level a rate must meet, in ms (default "
                                       "ttft_p99=300,itl_p99=100)")
    p.add_argument("--d-json", action="store_true",
                   help="d: also run the fixed requests with a JSON schema on each (structured "
                        "output) and report their output tok/s over the unconstrained run's")
    p.add_argument("--dora", action="store_true",
                   help="d, e: the z{i} adapters are DoRA adapters (use_dora), same shapes")
    p.add_argument("--e-rate", type=float, default=None,
                   help="e: Poisson arrivals per second (default: 70%% of d's fixed-length "
                        "request rate, measured first when d is not run)")
    args = p.parse_args(argv)
    if args.s_adapters is None:
        args.s_adapters = [4 if args.tiny else 100]
    args.workload_set = set(args.workloads.split(","))
    unknown = args.workload_set - set(ALL_WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from b,c,d,e,s,g,o")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    raise_fd_limit()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    scale = TINY if args.tiny else FULL
    extra = shlex.split(args.extra_serve_args)
    if args.model_shape in DUMMY_WEIGHTS and not args.tiny:
        extra += ["--load-format", "dummy"]
    if args.tiny and "--device" not in extra:
        extra += ["--device", "cpu"]
    device = "cpu" if args.tiny else pick_device(args.gen_device)
    ranks = adapter_plan(args.workload_set, scale, args.s_adapters)
    model, cfg, adapters = prepare_files(work, args.tiny, ranks, device, args.dora,
                                         args.model_shape)
    results: dict = {
        "command": shlex.join([sys.executable, *sys.argv]), "git_commit": git_commit(),
        "config": {"args": {k: v for k, v in vars(args).items() if k != "workload_set"},
                   "scale": dataclasses.asdict(scale),
                   "model": cfg, "adapter_ranks": ranks, "serve_extra": extra},
    }
    # b's launches fill their own compile cache; the benchmark's own launch then starts warm
    serve_extra = with_b_cache(extra, work) if "b" in args.workload_set else extra
    server = Server(model, adapters, args.port, serve_extra, work / "server.log")
    ctx = SimpleNamespace(scale=scale, shape=Shape.from_config(cfg), vocab=cfg["vocab_size"],
                          url=server.url, server=server, ranks=ranks, extra=extra,
                          peak_flops=args.peak_flops, peak_bw=args.peak_bw,
                          client_processes=args.client_processes, work=work,
                          d_json=args.d_json, g_rates=args.g_rates or list(scale.g_rates),
                          g_slo=args.g_slo, o_rounds=args.o_rounds)
    if "b" in args.workload_set:
        results["restarts"] = restart_launches(model, adapters, args.port, extra, work,
                                               args.ready_timeout)
    try:
        ctx.ready_s = results["time_to_ready_s"] = server.start(args.ready_timeout)
        log(f"ready in {ctx.ready_s:.1f} s")
        results["startup_phases"] = server.phase_line()
        log(f"server's start-up line: {results['startup_phases']}")
        info = server.admin("GET", "/get_server_info")
        results["sizing"] = sizing_report(info.json()) if info.status_code == 200 else {}
        log(f"server sizing: {json.dumps(results['sizing'])}")
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        ctx.base_name = next(m["id"] for m in models if m.get("parent") is None)
        run_http_workloads(args, ctx, results)
    finally:
        server.stop()
    if "s" in args.workload_set and not args.skip_engine:
        base = results["s"]["base"]
        base.update(workload_s_engine(ctx, model))
        base["http_over_engine"] = base["output_token_throughput"] / base["engine_tok_s"]
    if "c" in args.workload_set and not args.skip_engine:
        results["c"].update(workload_c_engine(ctx, model, adapters))
        results["c"]["http_over_engine"] = (results["c"]["http_tok_s_median"]
                                            / results["c"]["engine_tok_s_median"])
    out_dir = Path(os.environ.get("OUT") or work)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_e2e.json").write_text(json.dumps(results, indent=2))
    print_table(results, args.peak_flops, args.peak_bw)
    log(f"JSON: {out_dir / 'bench_e2e.json'}")


def run_http_workloads(args, ctx, results: dict) -> None:
    chosen = args.workload_set
    if "b" in chosen:
        log("b: warm start")
        results["b"] = workload_b(ctx)
    if "c" in chosen:
        log("c: pipeline over HTTP")
        results["c"] = workload_c(ctx)
    if "d" in chosen:
        log("d: saturation")
        results["d"] = workload_d(ctx)
    if "s" in chosen:
        log("s: ShareGPT-like burst")
        results["s"] = workload_s(ctx, args.s_adapters)
    if "g" in chosen:
        log("g: goodput over Poisson rates")
        results["g"] = workload_g(ctx)
    for k in range(ctx.o_rounds if "o" in chosen else 0):
        log(f"o: streams started at once, round {k + 1} of {ctx.o_rounds}")
        results["o" if k == 0 else f"o{k + 1}"] = workload_o(ctx, k)
    if "e" in chosen:
        if args.e_rate:
            d_rate = None
        elif "d" in results:
            d_rate = results["d"]["fixed"]["request_throughput"]
        else:
            log("e: measuring d's fixed-length request rate first")
            d_rate = d_rate_probe(ctx)
        results["e"] = workload_e(ctx, d_rate, args.e_rate)


if __name__ == "__main__":
    main()
