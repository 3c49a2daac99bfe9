"""End-to-end benchmark of "thousands of adapters": a real checkpoint and N real PEFT adapter
directories on disk, one `radixlora serve --adapter-dir` process, HTTP clients
(scripts/bench_serving.py) driving it.

    python scripts/bench_many_adapters.py                        # the H200: s, c, start
    python scripts/bench_many_adapters.py --s-counts 5,1000,2000 # ~73 GB free: not on 64 GiB
    python scripts/bench_many_adapters.py --start-flags          # also N --adapter flags
    python scripts/bench_many_adapters.py --tiny                 # tiny model on the CPU

Setup. bench_e2e.py's Llama-3-8B-shaped random bf16 checkpoint (~16 GB; the same directory and
completion marker, so with the default --work-dir the two benchmarks share it) and N adapter
directories m00000..m{N-1}: rank 8 on q, k, v, o only (bf16, 13.6 MB each at the 8B shape),
lora_A ~ N(0, 1/in), lora_B ~ N(0, 0.01^2), distinct random content each (the registry would
serve equal content as one adapter). N is the largest count any chosen workload uses. Each
adapter's tensors are one random draw (on the GPU when there is one) cut into the tensors,
written as one safetensors file by a pool of threads; adapters are kept across runs in
WORK/many-adapters/pool and hard-linked into WORK/many-adapters/serve, which holds exactly the
N adapters the server is given. Disk: the checkpoint, N adapters, and twice N more in the
server's state directory (the registry snapshots each adapter it publishes with the adapter
packed for the pool beside it; under the temporary directory): the free space of both file
systems is checked before anything is written, and a count that does not fit is refused (1000
adapters need ~57 GB with the checkpoint, 2000 ~98).

The server is launched as a user would: `python -m radixlora.cli serve --model DIR
--adapter-dir WORK/many-adapters/serve --adapter-burst N --enable-admin` (the admission bucket
takes a directory full at start-up at once only with that burst; the default is 1 per second),
default engine flags plus --extra-serve-args (so the swap cap, --max-swaps-per-s, is its default
10 adapter loads into the device pool per second; "--max-swaps-per-s 0" lifts it), the adapter
hash cache in a fresh empty directory (a cold start; --hash-cache-dir to keep one), the log in
the work dir. Every workload runs on that one launch; runs start once /v1/models lists all N
adapters.

Workloads (prompts are random token ids; greedy; ignore_eos, so every request generates exactly
its max_tokens; a fresh prompt set per run, so runs do not hit each other's prefix cache):
  s      S-LoRA's S1: 512 requests (256 in, 64 out), all sent at once, each on an adapter drawn
         uniformly from the first N' of the directory, for each N' of --s-counts (default 5,
         1000), after one warm-up run (64 requests on the first N'). Output tok/s of each and
         its ratio to the smallest N' (targets: 1000 >= 0.9x, 2000 >= 0.85x), with the
         adapter loads into the device pool during the run (/metrics). Also the host tier's
         budget (GET /get_server_info "sizing" -> host_adapter_bytes; on the CPU the engine's
         resolved host_adapter_bytes) and how many of these adapters it holds: host bytes over
         an adapter's packed size (as a load moves it: rank rows of the q/k/v/o groups in the
         pool dtype, about the file's size) and over its file size.
  c      latency under churn: Poisson arrivals at 70% of the request rate of s's run over 1000
         adapters (measured first, the same way, if s did not run), min(600, 60 s worth)
         requests of s's shape, uniform over 1000 adapters; then the same arrival times over
         5 adapters. TTFT P99 of each and their ratio (target <= 2x).
  start  from the launch: the worker's "weights loaded" log line (its timestamp), GET /health
         answering 200, the first successful 1-token completion on the first adapter (one tiny
         request every 0.5 s from the launch; HTTP only opens at ready), one such request on
         the last adapter sent at ready (it waits for that adapter's validation), and
         /v1/models listing all N adapters, then all N as "ready" (polled every 0.5 s).
         Targets: all N listed within 5 s of ready, all N servable within 30 s of it.
         --start-flags: a second launch with the same adapters as N `--adapter NAME=PATH`
         flags instead, the same figures.

Output: a table on stdout, and every figure with the config, git commit and command line in
bench_many_adapters.json ($OUT when set, else the work dir).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_e2e  # noqa: E402
import checkpoints  # noqa: E402
from bench_e2e import LLAMA3_8B, Shape, drive, fmt, log, plan  # noqa: E402

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
ALL_WORKLOADS = ("s", "c", "start")
POOL_MARKER = ".bench_many_adapters.json"  # a dot name: the registry ignores it
S_TARGETS = {1000: 0.9, 2000: 0.85}  # output tok/s over the smallest count's
C_TARGET = 2.0  # TTFT P99 over many adapters / over few
START_LISTED_TARGET_S = 5.0  # ready -> every adapter in /v1/models
START_SERVABLE_TARGET_S = 30.0  # ready -> every adapter validated and served
POLL_S = 0.5
STATS_SETTLE_S = 1.0  # the scheduler sends /metrics' adapter gauges every 0.5 s
WEIGHTS_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[worker\] \w+ [\w.]+: weights loaded in ")
METRICS = ("radixlora_adapter_loads_total", "radixlora_adapter_evictions_total",
           "radixlora_host_adapters", "radixlora_host_adapter_bytes", "radixlora_resident_adapters")


@dataclass(frozen=True)
class Scale:
    """The sizes of every workload (full, or --tiny)."""

    s_counts: tuple[int, ...]
    rank: int
    s_requests: int
    s_in: int
    s_out: int
    s_warmup: int
    c_many: int
    c_few: int
    c_seconds: float
    c_max_requests: int
    disk_margin: int  # bytes left free on each file system


FULL = Scale(s_counts=(5, 1000), rank=8, s_requests=512, s_in=256, s_out=64, s_warmup=64,
             c_many=1000, c_few=5, c_seconds=60.0, c_max_requests=600, disk_margin=2 * 10**9)
TINY = Scale(s_counts=(2, 24), rank=8, s_requests=8, s_in=16, s_out=8, s_warmup=4, c_many=24,
             c_few=2, c_seconds=2.0, c_max_requests=10, disk_margin=64 * 2**20)


# ---- adapters on disk -----------------------------------------------------------------------

# a snapshot holds the adapter's files and the adapter packed for the pool (bf16: as large)
SNAPSHOT_COPIES = 2


def adapter_name(i: int) -> str:
    return f"m{i:05d}"


def adapter_layout(shape: Shape, rank: int, projections=QKVO
                   ) -> list[tuple[str, tuple[int, int], float]]:
    """(PEFT key, dims, std) of every tensor of a rank-`rank` adapter on `projections`, in file
    order."""
    out = []
    dims = shape.projections()
    for layer in range(shape.layers):
        for name in projections:
            n_in, n_out = dims[name]
            block = "self_attn" if name[0] in "qkvo" else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            out.append((f"{key}.lora_A.weight", (rank, n_in), n_in**-0.5))
            out.append((f"{key}.lora_B.weight", (n_out, rank), 0.01))
    return out


def safetensors_header(layout, itemsize: int, dtype: str) -> bytes:
    """The safetensors header (length prefix included) of `layout`'s tensors stored back to
    back in file order, padded with spaces to a multiple of 8 bytes as safetensors writes it."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, dims, _ in layout:
        nbytes = itemsize * math.prod(dims)
        entries[key] = {"dtype": dtype, "shape": list(dims), "data_offsets": [offset,
                                                                              offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text


def adapter_file_bytes(shape: Shape, rank: int) -> int:
    layout = adapter_layout(shape, rank)
    return len(safetensors_header(layout, 2, "BF16")) + 2 * sum(math.prod(d) for _, d, _ in layout)


def write_fast_adapter(path: Path, layout, header: bytes, config: bytes, seed: int,
                       device: str) -> None:
    """One adapter: a single N(0, 1) draw of all its values on `device`, each tensor's span
    scaled to its std, cast to bf16 and written after `header` in one write. Staged in a dot
    directory and renamed into place, so `path` exists only complete."""
    gen = torch.Generator(device=device).manual_seed(seed)
    total = sum(math.prod(dims) for _, dims, _ in layout)
    values = torch.randn(total, generator=gen, device=device)
    offset = 0
    for _, dims, std in layout:
        n = math.prod(dims)
        values[offset:offset + n].mul_(std)
        offset += n
    data = values.to(torch.bfloat16).cpu().view(torch.uint8).numpy()
    staging = path.parent / f".{path.name}.tmp"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    with open(staging / "adapter_model.safetensors", "wb") as f:
        f.write(header)
        f.write(data)
    (staging / "adapter_config.json").write_bytes(config)
    os.rename(staging, path)


def write_pool(pool: Path, cfg: dict, model: Path, count: int, rank: int, device: str,
               workers: int) -> float:
    """Adapters m00000..m{count-1} in `pool`, written unless there already (earlier runs);
    returns the seconds spent writing."""
    shape = Shape.from_config(cfg)
    identity = {"shape": dataclasses.asdict(shape), "rank": rank, "projections": list(QKVO)}
    marker = pool / POOL_MARKER
    if pool.exists() and (not marker.is_file() or json.loads(marker.read_text()) != identity):
        log(f"{pool} holds other adapters; rewriting it")
        shutil.rmtree(pool)
    pool.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(identity))
    for entry in pool.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
            shutil.rmtree(entry)
    todo = [i for i in range(count) if not (pool / adapter_name(i)).is_dir()]
    if not todo:
        log(f"reusing {count} adapters in {pool}")
        return 0.0
    layout = adapter_layout(shape, rank)
    header = safetensors_header(layout, 2, "BF16")
    config = json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank,
                         "lora_alpha": rank, "lora_dropout": 0.0, "target_modules": list(QKVO),
                         "bias": "none", "use_rslora": False,
                         "base_model_name_or_path": str(model)}, indent=2).encode()
    log(f"writing {len(todo)} adapters to {pool} on {device}, {workers} threads")
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as threads:
        futures = [threads.submit(write_fast_adapter, pool / adapter_name(i), layout, header,
                                  config, 10_000 + i, device) for i in todo]
        for future in tqdm(as_completed(futures), total=len(futures), unit="adapter",
                           file=sys.stdout, mininterval=1.0):
            future.result()
    seconds = time.perf_counter() - start
    log(f"{len(todo)} adapters written in {seconds:.1f} s")
    return seconds


def flush_writes() -> float:
    """Write the page cache's dirty pages to disk (the checkpoint and adapters just written), so
    the server's start is not measured against the write-back of the benchmark's own files: a
    user's adapters are on disk long before the server starts. Seconds it took."""
    start = time.perf_counter()
    os.sync()
    seconds = time.perf_counter() - start
    log(f"files flushed to disk in {seconds:.1f} s")
    return seconds


def link_serve_dir(pool: Path, serve: Path, count: int) -> dict[str, Path]:
    """`serve` holding exactly adapters 0..count-1 of `pool`, as hard links (a copy where the
    file system has none)."""
    if serve.exists():
        shutil.rmtree(serve)
    serve.mkdir(parents=True)
    out = {}
    for i in range(count):
        name = adapter_name(i)
        (serve / name).mkdir()
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            try:
                os.link(pool / name / file, serve / name / file)
            except OSError:
                shutil.copy2(pool / name / file, serve / name / file)
        out[name] = serve / name
    return out


def disk_needs(work: Path, ckpt_bytes: int, have: int, count: int, adapter_bytes: int
               ) -> dict[int, list]:
    """File system -> [a path on it, bytes `count` adapters need there]: the work dir the
    checkpoint (0 if written) and the adapters not yet written (`have` are), the temporary
    directory (the server's state directory) a snapshot of every adapter with its packed copy
    (about as large: SNAPSHOT_COPIES)."""
    needs: dict[int, list] = {}
    for path, nbytes in ((work, ckpt_bytes + max(0, count - have) * adapter_bytes),
                         (Path(tempfile.gettempdir()), SNAPSHOT_COPIES * count * adapter_bytes)):
        needs.setdefault(os.stat(path).st_dev, [path, 0])[1] += nbytes
    return needs


def check_disk(work: Path, ckpt_bytes: int, have: int, count: int, adapter_bytes: int,
               margin: int) -> dict:
    """Refuse (SystemExit) unless every file system disk_needs names has room for `count`
    adapters and `margin` bytes more; what was checked."""
    def fits(n: int) -> bool:
        return all(nbytes + margin <= shutil.disk_usage(path).free
                   for path, nbytes in disk_needs(work, ckpt_bytes, have, n, adapter_bytes
                                                  ).values())

    needs = disk_needs(work, ckpt_bytes, have, count, adapter_bytes)
    report = {str(path): {"need_bytes": nbytes, "free_bytes": shutil.disk_usage(path).free}
              for path, nbytes in needs.values()}
    if not fits(count):
        lo, hi = 0, count  # the largest count that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        detail = "; ".join(f"{path} needs {r['need_bytes'] / 1e9:.1f} GB + {margin / 1e9:.1f} "
                           f"GB kept free and has {r['free_bytes'] / 1e9:.1f} GB free"
                           for path, r in report.items())
        parts = [f"checkpoint {ckpt_bytes / 1e9:.1f} GB"] if ckpt_bytes else []
        parts += [f"{max(0, count - have)} adapters to write in {work}",
                  f"{count} server snapshots (with packed copies) under "
                  f"{tempfile.gettempdir()}"]
        raise SystemExit(
            f"not enough disk for {count} adapters of {adapter_bytes / 1e6:.3g} MB "
            f"({', '.join(parts)}): {detail}. At most {lo} adapters fit; lower --s-counts / "
            "--c-counts")
    return report


def checkpoint_bytes(cfg: dict) -> int:
    """bf16 bytes of the checkpoint write_checkpoint writes (embedding included)."""
    shape = Shape.from_config(cfg)
    return 2 * (shape.params() + shape.vocab * shape.hidden)


# ---- the server -----------------------------------------------------------------------------

class Launch(bench_e2e.Server):
    """bench_e2e.Server launched without waiting for ready (the start polls run from the
    launch), the adapter hash cache in `cache_dir`, its own log file."""

    def __init__(self, model: Path, adapters: dict[str, Path], port: int, extra: list[str],
                 log_path: Path, cache_dir: Path):
        super().__init__(model, adapters, port, extra, log_path)
        self.cache_dir = cache_dir
        self.launched = 0.0

    def launch(self) -> None:
        try:
            httpx.get(self.url + "/health", timeout=2)
            raise RuntimeError(f"something already answers on {self.url}; pick another --port")
        except httpx.TransportError:
            pass
        self.log_path.unlink(missing_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        log(f"starting: {shlex.join(self.cmd[:12])} ... ({len(self.cmd)} args), "
            f"log {self.log_path}")
        env = dict(os.environ, RADIXLORA_ADMIN_API_KEY=self.admin_key,
                   RADIXLORA_CACHE_DIR=str(self.cache_dir))
        self.launched = time.time()
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=bench_e2e.ROOT, env=env, start_new_session=True)

    def weights_loaded_s(self) -> float:
        """Seconds from the launch to the worker's "weights loaded" line (its timestamp)."""
        for line in self.log_path.read_text(errors="replace").splitlines():
            match = WEIGHTS_LINE.match(line)
            if match:
                stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                return stamp - self.launched
        raise RuntimeError(f"no 'weights loaded' line in {self.log_path}")


def poll_start(server: Launch, first: str, names: set[str], vocab: int, timeout_s: float
               ) -> dict:
    """From the launch until every name is servable: seconds to /health 200 (polled every
    0.1 s), to the first 200 of a 1-token completion on `first` (polled every POLL_S) and on
    the last name (one request sent at ready, which waits for that adapter), and to
    /v1/models listing every name (any status) and every name as "ready" (polled every
    POLL_S)."""
    prompt = [random.Random(7).randrange(3, vocab) for _ in range(4)]
    last = max(names)
    out: dict = {"ready_s": None, "first_s": None, "listed_s": None, "servable_s": None,
                 "last_s": None}
    attempts, next_poll, last_request = 0, 0.0, None
    pool = ThreadPoolExecutor(1)
    with httpx.Client(base_url=server.url, timeout=120) as client:
        def complete(model: str) -> bool:
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
            return client.post("/v1/completions", json=body).status_code == 200

        def answered_last() -> float:
            if not complete(last):
                raise RuntimeError(f"the request on {last} sent at ready failed")
            return time.time() - server.launched

        while any(v is None for v in out.values()):
            now = time.time() - server.launched
            if now > timeout_s:
                raise RuntimeError(f"start: not done in {timeout_s} s ({out}):\n"
                                   + server.log_tail())
            if server.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {server.proc.returncode}:\n"
                                   + server.log_tail())
            if out["ready_s"] is None:
                try:
                    if client.get("/health", timeout=2).status_code == 200:
                        out["ready_s"] = time.time() - server.launched
                        last_request = pool.submit(answered_last)
                except httpx.HTTPError:
                    pass
            if last_request is not None and last_request.done():
                out["last_s"] = last_request.result()
            if now >= next_poll:
                next_poll = now + POLL_S
                if out["first_s"] is None:
                    attempts += 1
                    try:
                        if complete(first):
                            out["first_s"] = time.time() - server.launched
                    except httpx.HTTPError:
                        pass
                if out["servable_s"] is None:
                    try:
                        cards = client.get("/v1/models").json()["data"]
                    except (httpx.HTTPError, ValueError, KeyError):
                        cards = []
                    status = {c["id"]: c.get("status", "ready") for c in cards}
                    at = time.time() - server.launched
                    if out["listed_s"] is None and names <= status.keys():
                        out["listed_s"] = at
                    if all(status.get(n) == "ready" for n in names):
                        out["servable_s"] = at
            time.sleep(0.1)
    pool.shutdown()
    out["first_attempts"] = attempts
    out["weights_loaded_s"] = server.weights_loaded_s()
    out["adapters"] = len(names)
    out["last_name"] = last
    for key in ("first", "last", "listed", "servable"):
        out[f"{key}_after_ready_s"] = out[f"{key}_s"] - out["ready_s"]
    out["listed_within_target"] = out["listed_after_ready_s"] <= START_LISTED_TARGET_S
    out["servable_within_target"] = out["servable_after_ready_s"] <= START_SERVABLE_TARGET_S
    return out


def scrape(url: str) -> dict[str, float]:
    """The METRICS samples of GET /metrics, by name without the prefix and _total."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            out[name.removeprefix("radixlora_").removesuffix("_total")] = float(value)
    return out


def host_tier(info: dict, cfg: dict, rank: int, file_bytes: int) -> dict:
    """The host tier's budget and how many of the benchmark's adapters it holds."""
    sizing = info.get("sizing") or {}
    engine = info.get("engine") or {}
    budget = sizing.get("host_adapter_bytes") or engine.get("host_adapter_bytes")
    dtype = engine.get("dtype") or "auto"
    if dtype == "auto":
        dtype = cfg.get("torch_dtype") or "float32"
    shape = Shape.from_config(cfg)
    # packed as the pool loads it: rank rows of the q/k/v/o groups only, in the pool dtype
    in_out = sum(i + o for m, (i, o) in shape.projections().items() if m in QKVO)
    packed = rank * shape.layers * in_out * getattr(torch, dtype).itemsize
    return {"host_adapter_bytes": budget, "adapter_packed_bytes": packed,
            "adapter_file_bytes": file_bytes,
            "holds_adapters": budget // packed if budget else None,
            "holds_adapters_by_file_size": budget // file_bytes if budget else None,
            "from": "sizing" if sizing.get("host_adapter_bytes") else "engine"}


# ---- workloads ------------------------------------------------------------------------------

def run_measured(ctx, gaps, specs) -> dict:
    """drive() with the adapter gauges of /metrics before and after."""
    before = scrape(ctx.url)
    summary = drive(ctx.url, gaps, specs)
    time.sleep(STATS_SETTLE_S)
    after = scrape(ctx.url)
    summary["adapter_loads"] = after.get("adapter_loads", 0) - before.get("adapter_loads", 0)
    summary["adapter_evictions"] = (after.get("adapter_evictions", 0)
                                    - before.get("adapter_evictions", 0))
    summary["host_adapters_after"] = after.get("host_adapters")
    summary["distinct_adapters"] = len({sp.adapter for sp in specs})
    summary.pop("per_adapter", None)  # one count per adapter: thousands of keys
    return summary


def s_run(ctx, count: int, n: int, seed: int) -> dict:
    names = [adapter_name(i) for i in range(count)]
    gaps, specs = plan(n, ctx.scale.s_in, ctx.scale.s_out, names, "uniform", ctx.vocab, seed)
    return run_measured(ctx, gaps, specs)


def workload_s(ctx, counts: list[int]) -> dict:
    s = ctx.scale
    log(f"s: warm-up, {s.s_warmup} requests over {counts[0]} adapters")
    warmup = s_run(ctx, counts[0], s.s_warmup, seed=500)
    runs = {}
    for k, count in enumerate(counts):
        log(f"s: {s.s_requests} requests at once over {count} adapters")
        runs[count] = s_run(ctx, count, s.s_requests, seed=501 + k)
    base = runs[counts[0]]["output_token_throughput"]
    for count, run in runs.items():
        run["ratio_to_smallest"] = run["output_token_throughput"] / base
        run["target"] = S_TARGETS.get(count)
    return {"warmup": warmup, "smallest": counts[0], "runs": runs}


def workload_c(ctx, rate_source: float) -> dict:
    s = ctx.scale
    rate = 0.7 * rate_source
    n = max(1, min(s.c_max_requests, round(rate * s.c_seconds)))
    out = {"rate": rate, "source_rate": rate_source, "requests": n}
    gaps = None
    for key, count, seed in (("many", s.c_many, 601), ("few", s.c_few, 602)):
        names = [adapter_name(i) for i in range(count)]
        drawn, specs = plan(n, s.s_in, s.s_out, names, "uniform", ctx.vocab, seed, rate=rate)
        gaps = drawn if gaps is None else gaps  # both runs: the first run's arrivals
        log(f"c: {n} requests, Poisson at {rate:.2f}/s, over {count} adapters")
        out[key] = run_measured(ctx, gaps, specs)
        out[key]["adapters"] = count
    out["ttft_p99_ratio"] = out["many"]["ttft_ms"]["p99"] / out["few"]["ttft_ms"]["p99"]
    out["target"] = C_TARGET
    return out


# ---- report ---------------------------------------------------------------------------------

def target_mark(ok: bool | None) -> str:
    return "" if ok is None else (" (meets target)" if ok else " (misses target)")


def start_rows(label: str, st: dict) -> list[tuple[str, str]]:
    n = st["adapters"]
    return [
        (f"{label}: launch -> weights loaded s", fmt(st["weights_loaded_s"])),
        (f"{label}: launch -> ready s", fmt(st["ready_s"])),
        (f"{label}: ready -> all {n} listed s (target <= {START_LISTED_TARGET_S:g})",
         fmt(st["listed_after_ready_s"]) + target_mark(st["listed_within_target"])),
        (f"{label}: ready -> all {n} servable s (target <= {START_SERVABLE_TARGET_S:g})",
         fmt(st["servable_after_ready_s"]) + target_mark(st["servable_within_target"])),
        (f"{label}: ready -> first request on {n}'s first adapter answered s",
         fmt(st["first_after_ready_s"])),
        (f"{label}: ready -> a request on the last adapter, sent at ready, answered s",
         fmt(st["last_after_ready_s"])),
    ]


def rows(results: dict) -> list[tuple[str, str]]:
    files = results["files"]
    out = [("adapters (rank, modules, MB each)",
            f"{files['adapters']} (rank {files['rank']}, q/k/v/o, "
            f"{files['adapter_file_bytes'] / 1e6:.3g} MB)"),
           ("adapters written s", fmt(files["write_s"]))]
    if "start" in results:
        out += start_rows("start --adapter-dir", results["start"])
    host = results.get("host_tier")
    if host and host["host_adapter_bytes"]:
        out += [("host tier GiB (adapters held: packed / by file size)",
                 f"{host['host_adapter_bytes'] / 2**30:.2f} ({host['holds_adapters']} / "
                 f"{host['holds_adapters_by_file_size']})")]
    s = results.get("s")
    if s:
        for count, run in s["runs"].items():
            target = run["target"]
            ratio = fmt(run["ratio_to_smallest"])
            if target is not None:
                ratio += f", target >= {target}" + target_mark(run["ratio_to_smallest"] >= target)
            out += [(f"s N'={count}: output tok/s (ratio to N'={s['smallest']})",
                     f"{fmt(run['output_token_throughput'])} ({ratio})"),
                    (f"s N'={count}: TTFT P50 / P99 ms",
                     f"{fmt(run['ttft_ms']['p50'])} / {fmt(run['ttft_ms']['p99'])}"),
                    (f"s N'={count}: distinct adapters / pool loads",
                     f"{run['distinct_adapters']} / {fmt(run['adapter_loads'])}")]
    c = results.get("c")
    if c:
        out += [("c: rate req/s (70%), requests", f"{fmt(c['rate'])}, {c['requests']}"),
                (f"c: TTFT P99 ms over {c['many']['adapters']} / {c['few']['adapters']} adapters",
                 f"{fmt(c['many']['ttft_ms']['p99'])} / {fmt(c['few']['ttft_ms']['p99'])}"),
                (f"c: TTFT P99 ratio (target <= {C_TARGET:g})",
                 fmt(c["ttft_p99_ratio"]) + target_mark(c["ttft_p99_ratio"] <= C_TARGET))]
    if "start_flags" in results:
        out += start_rows("start --adapter flags", results["start_flags"])
    return out


def print_table(results: dict) -> None:
    print()
    table = rows(results)
    width = max(len(label) for label, _ in table)
    for label, value in table:
        print(f"{label:<{width}}  {value}")


# ---- main -----------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS),
                   help="comma-separated subset of s,c,start")
    bench_e2e.add_server_args(p, "tiny checkpoint, 24 adapters, scaled-down workloads, on "
                                 "the CPU")
    p.add_argument("--s-counts", type=bench_e2e.counts, default=None,
                   help="s: adapter counts N' (default 5,1000; --tiny 2,24)")
    p.add_argument("--c-counts", type=bench_e2e.counts, default=None,
                   help="c: MANY,FEW adapters (default 1000,5; --tiny 24,2)")
    p.add_argument("--start-flags", action="store_true",
                   help="start: a second launch with N --adapter flags")
    p.add_argument("--write-threads", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--hash-cache-dir", default=None,
                   help="RADIXLORA_CACHE_DIR of the server (default: a fresh empty one per "
                        "launch, a cold start)")
    p.add_argument("--ready-timeout", type=float, default=1800.0,
                   help="seconds from a launch until every adapter is listed")
    args = p.parse_args(argv)
    args.workload_set = set(args.workloads.split(","))
    unknown = args.workload_set - set(ALL_WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; choose from s,c,start")
    scale = TINY if args.tiny else FULL
    args.counts = args.s_counts or list(scale.s_counts)
    c_counts = args.c_counts or [scale.c_few, scale.c_many]
    if len(c_counts) != 2:
        p.error("--c-counts takes MANY,FEW (two different counts)")
    args.scale = dataclasses.replace(scale, c_few=c_counts[0], c_many=c_counts[1])
    return args


def adapter_count(args) -> int:
    """The adapters in the served directory: the largest count a chosen workload uses."""
    counts = []
    if args.workload_set != {"c"}:  # s, and start (the directory s uses)
        counts += args.counts
    if "c" in args.workload_set:
        counts.append(args.scale.c_many)
    return max(counts)


def main(argv=None) -> None:
    args = parse_args(argv)
    bench_e2e.raise_fd_limit()
    scale, chosen = args.scale, args.workload_set
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    extra = shlex.split(args.extra_serve_args)
    if args.tiny and "--device" not in extra:
        extra += ["--device", "cpu"]
    device = "cpu" if args.tiny else bench_e2e.pick_device(args.gen_device)
    count = adapter_count(args)
    cfg = dict(checkpoints.TINY_CONFIG) if args.tiny else LLAMA3_8B
    shape = Shape.from_config(cfg)
    root = work / ("tiny-many-adapters" if args.tiny else "many-adapters")
    model_dir = work / ("tiny-model" if args.tiny else "llama3-8b-random")
    file_bytes = adapter_file_bytes(shape, scale.rank)
    have = sum((root / "pool" / adapter_name(i)).is_dir() for i in range(count))
    disk = check_disk(work, 0 if (model_dir / bench_e2e.MARKER).is_file()
                      else checkpoint_bytes(cfg), have, count, file_bytes, scale.disk_margin)
    model, cfg, _ = bench_e2e.prepare_files(work, args.tiny, {}, device)
    write_s = write_pool(root / "pool", cfg, model, count, scale.rank, device, args.write_threads)
    adapters = link_serve_dir(root / "pool", root / "serve", count)
    names = sorted(adapters)
    sync_s = flush_writes()
    results: dict = {
        "command": shlex.join([sys.executable, *sys.argv]), "git_commit": bench_e2e.git_commit(),
        "config": {"args": {k: v for k, v in vars(args).items()
                            if k not in ("workload_set", "scale")},
                   "scale": dataclasses.asdict(scale), "model": cfg, "serve_extra": extra},
        "files": {"adapters": count, "rank": scale.rank, "modules": list(QKVO),
                  "adapter_file_bytes": file_bytes, "write_s": write_s, "sync_s": sync_s,
                  "disk": disk},
    }
    dir_extra = ["--adapter-dir", str(root / "serve"), "--adapter-burst", str(count), *extra]
    server = Launch(model, {}, args.port, dir_extra, work / "server-many-dir.log",
                    cache_dir(args, work, "dir"))
    ctx = SimpleNamespace(scale=scale, vocab=cfg["vocab_size"], url=server.url)
    try:
        server.launch()
        started = poll_start(server, names[0], set(names), ctx.vocab, args.ready_timeout)
        log(f"all {count} adapters listed {started['listed_s']:.1f} s and servable "
            f"{started['servable_s']:.1f} s after the launch")
        if "start" in chosen:
            results["start"] = started
        info = server.admin("GET", "/get_server_info")
        info.raise_for_status()
        results["sizing"] = info.json().get("sizing")
        results["host_tier"] = host_tier(info.json(), cfg, scale.rank, file_bytes)
        run_http_workloads(args, ctx, results)
    finally:
        server.stop()
        cleanup_cache(args, server)
    if "start" in chosen and args.start_flags:
        flags = Launch(model, adapters, args.port, extra, work / "server-many-flags.log",
                       cache_dir(args, work, "flags"))
        try:
            flags.launch()
            results["start_flags"] = poll_start(flags, names[0], set(names), ctx.vocab,
                                                args.ready_timeout)
        finally:
            flags.stop()
            cleanup_cache(args, flags)
    out_dir = Path(os.environ.get("OUT") or work)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_many_adapters.json").write_text(json.dumps(results, indent=2))
    print_table(results)
    log(f"JSON: {out_dir / 'bench_many_adapters.json'}")


def cache_dir(args, work: Path, label: str) -> Path:
    if args.hash_cache_dir:
        return Path(args.hash_cache_dir)
    path = work / f"hash-cache-{label}"
    if path.exists():
        shutil.rmtree(path)
    return path


def cleanup_cache(args, server: Launch) -> None:
    if not args.hash_cache_dir:
        shutil.rmtree(server.cache_dir, ignore_errors=True)


def run_http_workloads(args, ctx, results: dict) -> None:
    chosen = args.workload_set
    if "s" in chosen:
        results["s"] = workload_s(ctx, args.counts)
    if "c" in chosen:
        runs = results.get("s", {}).get("runs", {})
        if ctx.scale.c_many in runs:
            rate = runs[ctx.scale.c_many]["request_throughput"]
        else:
            log(f"c: measuring the request rate over {ctx.scale.c_many} adapters first")
            rate = s_run(ctx, ctx.scale.c_many, ctx.scale.s_requests, seed=599)[
                "request_throughput"]
        results["c"] = workload_c(ctx, rate)


if __name__ == "__main__":
    main()
