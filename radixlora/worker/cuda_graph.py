"""CUDA graphs for decode steps and short extends. Each (batch bucket, token bucket, LoRA row
bucket) gets one graph, all captured at start-up by capture_all (ModelRunner.warm_up; without
warm-up, each on first use), holding the forward and the sampler; every input of a step (token
ids, positions, KV slots, attention and LoRA metadata, each row's sampling parameters) lives in
static buffers refilled before replay, so a step costs one host-to-device copy, one scatter
kernel and one graph launch instead of ~1,000 kernel launches. A decode graph (one token per
request) uses the split-K decode kernel; an extend graph (short prompts or cache hits, mixed
with decodes) the extend one.

Padding requests decode token 0 at position 0 into the reserved KV slot 0 over a one-token
context with no adapter rows; padding tokens past the last request belong to no segment. The
graph samples padding rows greedily (no noise computed); their outputs are never read.

LoRA runs the grouped SGMV path under every graph: the step's tokens grouped by distinct adapter
set (padding and base-only requests belong to no group), so the rows live in the group buffers
and the per-segment metadata carries none; graphs therefore need the Triton LoRA backend. On CUDA
each projection's LoRA work that reads only x is captured on a side stream, a parallel branch of
the graph beside the base GEMM (EngineConfig.lora_side_stream): the shrink, or in buckets of at
most LORA_DEFER_MAX_TOKENS tokens the whole delta, deferred to the kernel that reads the
projection's output (LoraContext). The GEMMs of graphs of up to CUBLASLT_MAX_TOKENS tokens are
captured through cublasLt."""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from radixlora.config import EXPERT_GROUPS
from radixlora.model.forward_batch import ForwardBatch
from radixlora.sampling_params import GREEDY
from radixlora.worker.attention import TritonAttentionMeta
from radixlora.worker.lora_context import LoraContext, LoraSegments, high_priority_stream
from radixlora.worker.sampler import ROW_DTYPES, ROW_FIELDS, SamplingBatch, draw
from radixlora_kernels.device import ALIGN_WORDS, staged, staging_ring
from radixlora_kernels.lora_ops import HostGroups, LoraBatchMeta, LoraGroups, indptr
from radixlora_kernels.scatter_words import scatter_words

# Decode batches above 256 replay graphs too: at 1,024 running requests on an H200 a graph step
# took 13.2 ms against 20.5 ms eager, whose kernel launches outlast the device work.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 384, 512, 768,
                 1024)
EXTEND_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512)
MAX_EXTEND_BATCH = 16
ROW_BUCKETS = (0, 16, 32, 128, 512)
# Deferred deltas take the expand off the critical path but cost a float32 write and read of
# every projection output: a win where launches dominate, a loss where bytes do.
LORA_DEFER_MAX_TOKENS = 32
# Graphs of at most this many tokens capture their GEMMs through cublasLt, whose heuristics pick
# faster kernels at those sizes on the H200; larger graphs keep torch's default, cuBLAS.
CUBLASLT_MAX_TOKENS = 32
SAMPLER_ROW_BYTES = 32  # a graph's sampled token, its logprob and log-sum-exp, per request row


@dataclass
class GraphOutputs:
    """What a graph step leaves on the device, one row per request."""

    logits: torch.Tensor  # [batch, vocab] of each request's last token
    tokens: torch.Tensor  # [batch] int64, sampled inside the graph
    logprobs: torch.Tensor  # [batch] the tokens' logprobs under softmax(logits)
    lse: torch.Tensor  # [batch] log-sum-exp of the logits

    def __getitem__(self, rows) -> GraphOutputs:
        return GraphOutputs(self.logits[rows], self.tokens[rows], self.logprobs[rows],
                            self.lse[rows])


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    outputs: GraphOutputs


@dataclass(frozen=True)
class GraphKey:
    batch: int
    tokens: int
    rows: int  # LoRA row bucket of the grouped path (0: none)
    # some request has a DoRA adapter: the graph also scales the projections (LoraContext);
    # such graphs are captured on first use, so LoRA-only serving never waits for them
    dora: bool = False
    # some request adapts an MoE base's experts: only these graphs launch the expert LoRA
    # kernels, so a pool with expert rows costs the other batches nothing (graph_keys)
    experts: bool = False

    @property
    def decode(self) -> bool:
        return self.tokens == self.batch


def batch_buckets(max_batch: int) -> list[int]:
    return [b for b in BATCH_BUCKETS if b <= max_batch] or [1]


def row_buckets(max_rows: int) -> list[int]:
    return sorted({r for r in ROW_BUCKETS if r < max_rows} | {max_rows})


def row_bucket(buckets: Sequence[int], rows: int) -> int:
    """The smallest of the sorted `buckets` that holds `rows` rank rows (at least 1), or the
    largest when none does."""
    return buckets[min(bisect.bisect_left(buckets, max(rows, 1)), len(buckets) - 1)]


def graph_keys(max_batch: int, max_rows: int, experts: bool = False) -> list[GraphKey]:
    """Every graph serving can replay (what key_for can return): each decode bucket, and each
    extend batch bucket with each token bucket above it, for each LoRA row bucket; with
    `experts` (the pool holds expert rows), each LoRA graph's twin for batches that adapt the
    experts."""
    buckets = batch_buckets(max_batch)
    keys = [GraphKey(b, b, r) for b in buckets for r in row_buckets(max_rows)]
    keys += [GraphKey(b, t, r) for b in buckets if b <= MAX_EXTEND_BATCH
             for t in EXTEND_TOKEN_BUCKETS if t > b for r in row_buckets(max_rows)]
    return keys + [GraphKey(k.batch, k.tokens, k.rows, experts=True)
                   for k in keys if experts and k.rows]


def graph_reserve(config, model_cfg, dtype: torch.dtype, decode_activation: int) -> int:
    """Bytes the graphs will hold, estimated before they are captured: one logits buffer that
    every graph writes (StaticInputs.logits), the sampler's values of each graph's request rows
    in the shared pool, and the activations of the largest graph (those of the largest decode
    step)."""
    experts = any(g in EXPERT_GROUPS and config.holds(g) for g in model_cfg.lora_groups)
    keys = graph_keys(config.max_running, config.max_rank * config.max_stacked, experts)
    logits = batch_buckets(config.max_running)[-1] * model_cfg.vocab_size * dtype.itemsize
    return logits + sum(k.batch for k in keys) * SAMPLER_ROW_BYTES + decode_activation


class StaticInputs:
    """Static input buffers of every graph and the bucketing rules; device-agnostic, so the
    padding logic runs (and is tested) on the CPU too through static_forward()."""

    def __init__(self, runner, max_batch: int, max_context: int, max_rows: int):
        if runner.lora_backend.name != "triton":
            raise ValueError("cuda_graph needs lora_backend triton (or auto on CUDA)")
        self.runner = runner
        self.groups = groups = runner.adapter_pool.groups  # the module groups the pool holds
        self.experts = any(g in EXPERT_GROUPS for g in groups)
        # CudaGraphRunner: the side stream of the LoRA work, by whether the bucket defers
        self.lora_streams: dict[bool, torch.cuda.Stream] = {}
        self.max_batch, self.max_rows = max_batch, max_rows
        self.buckets = batch_buckets(max_batch)
        self.extend_buckets = [b for b in self.buckets if b <= MAX_EXTEND_BATCH]
        self.row_buckets = row_buckets(max_rows)
        dev, n = runner.device, self.buckets[-1]
        t = max(n, EXTEND_TOKEN_BUCKETS[-1])
        rows = t * self.row_buckets[-1] + 1
        i32, i64 = torch.int32, torch.int64
        self.inputs = PackedInputs(
            {
                "input_ids": (t, i64),
                "positions": (t, i64),
                "out_cache_loc": (t, i64),
                "logits_indices": (n, i64),
                "qo_indptr": (n + 1, i32),
                "kv_indptr": (n + 1, i32),
                "kv_indices": (n * max_context, i32),
                "num_groups": (1, i32),
                "group_indptr": (t + 1, i32),  # groups never outnumber tokens
                "group_tokens": (t, i32),
                **{f"row_indptr.{g}": (t + 1, i32) for g in groups},
                **{f"row_ids.{g}": (rows, i32) for g in groups},
                **{f"row_scales.{g}": (rows, torch.float32) for g in groups},
                **{f"magnitude_rows.{g}": (t, i32) for g in groups},
                **{f"sample.{name}": (n, ROW_DTYPES[name]) for name in ROW_FIELDS},
            },
            dev,
        )
        views = self.inputs.views
        self.input_ids, self.positions = views["input_ids"], views["positions"]
        self.out_cache_loc, self.logits_indices = views["out_cache_loc"], views["logits_indices"]
        self.qo_indptr, self.kv_indptr = views["qo_indptr"], views["kv_indptr"]
        self.kv_indices, self.num_groups = views["kv_indices"], views["num_groups"]
        self.group_indptr, self.group_tokens = views["group_indptr"], views["group_tokens"]
        self.row_indptr = {g: views[f"row_indptr.{g}"] for g in groups}
        self.row_ids = {g: views[f"row_ids.{g}"] for g in groups}
        self.row_scales = {g: views[f"row_scales.{g}"] for g in groups}
        self.magnitude_rows = {g: views[f"magnitude_rows.{g}"] for g in groups}
        self.sampling = {name: views[f"sample.{name}"] for name in ROW_FIELDS}
        for buffer in (self.logits_indices, self.qo_indptr, self.kv_indptr):
            buffer.copy_(torch.arange(len(buffer)))
        self.token_seg = torch.zeros(t, dtype=i32, device=dev)
        self.no_seg_rows = torch.zeros(n + 1, dtype=i32, device=dev)
        self.no_rows = torch.zeros(0, dtype=i32, device=dev)
        # every graph's logits: graphs replay one at a time and each step reads its logits (in
        # stream order) before the next replay, so one buffer serves them all (one per graph
        # would keep batch x vocabulary values for each of some 200 graphs)
        self.logits = torch.empty(n, runner.cfg.vocab_size, dtype=runner.dtype, device=dev)

    def key_for(self, qo_lens: list[int], max_rows: int, has_lora: bool,
                dora: bool = False, experts: bool = False) -> GraphKey | None:
        """The graph a batch replays into, or None when it needs the eager path (dora: some
        request has a DoRA adapter; experts: some request adapts the experts)."""
        batch, tokens = len(qo_lens), sum(qo_lens)
        if batch > self.buckets[-1] or max_rows > self.row_buckets[-1]:
            return None
        rows = row_bucket(self.row_buckets, max_rows) if has_lora else 0
        bucket = self.buckets[bisect.bisect_left(self.buckets, batch)]
        if tokens == batch:
            return GraphKey(bucket, bucket, rows, dora, experts)
        if batch > self.extend_buckets[-1]:
            return None
        bucket = self.extend_buckets[bisect.bisect_left(self.extend_buckets, batch)]
        need = tokens + bucket - batch  # padding requests take one token each
        if need > EXTEND_TOKEN_BUCKETS[-1]:
            return None
        token_bucket = EXTEND_TOKEN_BUCKETS[bisect.bisect_left(EXTEND_TOKEN_BUCKETS, need)]
        return GraphKey(bucket, max(token_bucket, bucket + 1), rows, dora, experts)

    def key_groups(self, key: GraphKey) -> tuple[str, ...]:
        """The pool's module groups whose LoRA the graph of `key` runs: the expert groups only
        in the graphs of batches that adapt the experts."""
        return tuple(g for g in self.groups if key.experts or g not in EXPERT_GROUPS)

    def all_keys(self) -> list[GraphKey]:
        """graph_keys of this runner's buckets and pool."""
        return graph_keys(self.max_batch, self.max_rows, self.experts)

    def static_forward(self, key: GraphKey, host: dict, lora_segments, sampling: SamplingBatch,
                       resolve=None) -> GraphOutputs:
        """What a graph replay computes, run eagerly."""
        self._fill(key, host, lora_segments, sampling, resolve)
        return self._run(key)[: len(host["qo_lens"])]

    def _run(self, key: GraphKey) -> GraphOutputs:
        """The forward and the sampler over the static buffers (what a graph captures)."""
        logits = self.runner.model(self._static_batch(key), self.logits[: key.batch])
        rows = {name: buffer[: key.batch] for name, buffer in self.sampling.items()}
        return GraphOutputs(logits, *draw(logits, rows))

    def _fill(self, key: GraphKey, host: dict, lora_segments, sampling: SamplingBatch,
              resolve=None) -> None:
        """Copy a batch (with one sampling row per request) into the static buffers; `resolve`
        replaces placeholder ids in place."""
        qo_lens = host["qo_lens"]
        pad_reqs = key.batch - len(qo_lens)
        pad_tokens = key.tokens - sum(qo_lens) - pad_reqs
        qo = np.concatenate([qo_lens, np.ones(pad_reqs, np.int64)])
        kv = np.concatenate([host["kv_lens"], np.ones(pad_reqs, np.int64)])
        parts = {
            "input_ids": _pad(host["input_ids"], pad_reqs + pad_tokens),
            "positions": _pad(host["positions"], pad_reqs + pad_tokens),
            "out_cache_loc": _pad(host["out_cache_loc"], pad_reqs + pad_tokens),
            "qo_indptr": indptr(qo),
            "kv_indptr": indptr(kv),
            "logits_indices": np.cumsum(qo) - 1,
            "kv_indices": _pad(host["kv_indices"], pad_reqs),
        }
        if lora_segments is not None and key.rows:
            parts.update(_group_parts(qo_lens, lora_segments, self.key_groups(key)))
        if key.dora:
            parts.update(_magnitude_parts(qo_lens, lora_segments, key.tokens,
                                          self.key_groups(key)))
        parts.update(_sampling_parts(sampling, key.batch))
        self.inputs.send(parts)
        if resolve is not None:
            resolve(self.input_ids[: len(host["input_ids"])])

    def _static_batch(self, key: GraphKey) -> ForwardBatch:
        b, t, rows = key.batch, key.tokens, key.rows
        attn = TritonAttentionMeta(
            self.qo_indptr[: b + 1], self.kv_indptr[: b + 1], self.kv_indices, t - b + 1, key.decode
        )
        lora = None
        if rows:
            n = t * rows + 1
            metas = {
                g: LoraBatchMeta(
                    self.qo_indptr[: b + 1],
                    self.no_seg_rows[: b + 1],
                    self.no_rows,
                    self.no_rows.float(),
                    self.token_seg[:t],
                    self.no_rows,
                    rows,
                    t - b + 1,
                    LoraGroups(
                        self.num_groups,
                        self.group_indptr[: t + 1],
                        self.group_tokens[:t],
                        self.row_indptr[g][: t + 1],
                        self.row_ids[g][:n],
                        self.row_scales[g][:n],
                    ),
                    self.magnitude_rows[g][:t] if key.dora else None,
                )
                for g in self.key_groups(key)
            }
            defer = t <= LORA_DEFER_MAX_TOKENS
            lora = LoraContext(
                self.runner.adapter_pool, self.runner.lora_backend, metas,
                self.lora_streams.get(defer), defer,
            )
        return ForwardBatch(
            self.input_ids[:t],
            self.positions[:t],
            self.out_cache_loc[:t],
            self.logits_indices[:b],
            self.runner.attn_backend,
            attn,
            lora,
        )

    def _reset_inputs(self, key: GraphKey) -> None:
        """Safe contents for warm-up and capture: padding requests only."""
        self._fill(
            key,
            {
                "qo_lens": [],
                "kv_lens": np.zeros(0, np.int64),
                "input_ids": np.zeros(0),
                "positions": np.zeros(0),
                "out_cache_loc": np.zeros(0),
                "kv_indices": np.zeros(0),
            },
            None,
            SamplingBatch.build([], [], []),
        )
        self.num_groups.zero_()


class CudaGraphRunner(StaticInputs):
    def __init__(
        self,
        runner,
        max_batch: int,
        max_context: int,
        max_rows: int,
        lora_side_stream: bool = True,
    ):
        super().__init__(runner, max_batch, max_context, max_rows)
        self.graphs: dict[GraphKey, _Graph] = {}
        self.warmed: GraphKey | None = None  # capture_next's eager pass ran for it
        self.pool = torch.cuda.graph_pool_handle()
        if lora_side_stream:
            # high priority where the side branch is the whole delta, normal beside the large
            # buckets' GEMMs; a captured graph drops both (torch instantiates it without
            # cudaGraphInstantiateFlagUseNodePriority)
            self.lora_streams = {True: high_priority_stream(runner.device),
                                 False: torch.cuda.Stream(runner.device)}

    def forward(self, key: GraphKey, host: dict, lora_segments, sampling: SamplingBatch,
                resolve=None) -> GraphOutputs:
        """Replays key's graph. Its outputs stay valid until the next replay of any graph (the
        logits buffer is shared): read them in stream order before that (copies and kernels
        queued behind the replay)."""
        entry = self.graphs.get(key) or self._capture(key)  # capture resets the buffers
        self._fill(key, host, lora_segments, sampling, resolve)
        entry.graph.replay()
        return entry.outputs[: len(host["qo_lens"])]

    def reset(self) -> None:
        """Drop every captured graph (recaptured on use) with the memory pool they shared."""
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()

    def capture_decode(self) -> None:
        """Capture every decode graph now (extend graphs are captured on first use)."""
        self.capture([k for k in self.all_keys() if k.decode])

    def capture_all(self) -> None:
        """Capture every graph serving can replay, largest first (smaller ones reuse the
        pool's memory)."""
        self.capture(self.all_keys())

    def startup_keys(self) -> list[GraphKey]:
        """The graphs to capture before serving when the rest may wait (capture_next): every
        decode bucket, and the extends of one request (a lone prompt's prefill), with no
        adapter and with adapters up to the row bucket of the largest rank given at start (the
        first LoRA bucket when none was given); not the larger row buckets, which high ranks
        and stacks need, nor the expert-adapter twins, which would double them."""
        rows = row_bucket(self.row_buckets, self.runner.config.start_adapter_rank or 1)
        return [k for k in self.all_keys()
                if (k.decode or k.batch == 1) and not k.experts and k.rows <= rows]

    def pending(self) -> list[GraphKey]:
        """The graphs serving can replay that are not captured yet, smallest first."""
        keys = [k for k in self.all_keys() if k not in self.graphs]
        return sorted(keys, key=lambda k: (k.batch, k.tokens, k.rows))

    def capture_next(self) -> bool:
        """One idle turn on the pending graphs (the server calls this when idle): the next
        one's eager pass, or, the turn after, its capture, so that a request arriving meanwhile
        waits for half a capture at most; whether any turn remains."""
        keys = self.pending()
        if not keys:
            return False
        key = keys[0]
        if self.warmed != key:
            self.warmed = key
            self._reset_inputs(key)
            with blas_library("cublaslt" if key.tokens <= CUBLASLT_MAX_TOKENS else None):
                self._warm_pass(key)
            return True
        self.warmed = None
        self._capture(key, warm=False)
        return len(keys) > 1

    def dry_run(self) -> None:
        """Run the forward of every graph capture_all would capture, once each, eagerly (under
        KernelCache.dry_run, to find the kernel variants they launch)."""
        for key in self.all_keys():
            self._reset_inputs(key)
            with blas_library("cublaslt" if key.tokens <= CUBLASLT_MAX_TOKENS else None):
                self._run(key)

    def capture(self, keys: list[GraphKey]) -> None:
        todo = sorted((k for k in keys if k not in self.graphs),
                      key=lambda k: (k.tokens, k.batch, k.rows), reverse=True)
        for key in tqdm(todo, desc="capturing CUDA graphs", unit="graph", disable=not todo):
            self._capture(key)

    def _capture(self, key: GraphKey, warm: bool = True) -> _Graph:
        """warm: run the eager pass first (capture_next ran it in an earlier turn otherwise)."""
        self._reset_inputs(key)
        with blas_library("cublaslt" if key.tokens <= CUBLASLT_MAX_TOKENS else None):
            if warm:
                self._warm_pass(key)
            return self._capture_graph(key)

    def _warm_pass(self, key: GraphKey) -> None:
        """The forward once eagerly on a side stream: it compiles or loads kernels and
        initialises cuBLAS, which a capture must not do."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run(key)
        torch.cuda.current_stream().wait_stream(stream)

    def _capture_graph(self, key: GraphKey) -> _Graph:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the executor's disk reads may pin host memory on their threads meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = self._run(key)
        entry = _Graph(graph, outputs)
        self.graphs[key] = entry
        return entry


@contextlib.contextmanager
def blas_library(library: str | None):
    """GEMMs launched inside use `library` ("cublas", "cublaslt"; None: unchanged), as a graph
    captured inside keeps them; torch's process-wide preference is restored after."""
    saved = torch.backends.cuda.preferred_blas_library()
    try:
        if library is not None:
            with contextlib.suppress(RuntimeError):  # a build without it keeps its default
                torch.backends.cuda.preferred_blas_library(library)
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(saved)


_NUMPY_DTYPES = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


class PackedInputs:
    """Static buffers that are views of one int32 word array, so that a step's inputs reach the
    device in one host-to-device copy (packed with a table of where each part goes) and one
    scatter kernel, not one copy per buffer."""

    ALIGN = ALIGN_WORDS  # every view starts 16-byte aligned, whatever its dtype

    def __init__(self, parts: dict[str, tuple[int, torch.dtype]], device) -> None:
        self.offsets: dict[str, int] = {}
        self.capacity: dict[str, int] = {}
        self.dtypes: dict[str, type] = {}
        size = 0
        for name, (n, dtype) in parts.items():
            self.offsets[name], self.capacity[name] = size, n * dtype.itemsize // 4
            self.dtypes[name] = _NUMPY_DTYPES[dtype]
            size += -(-self.capacity[name] // self.ALIGN) * self.ALIGN
        self.words = torch.zeros(size, dtype=torch.int32, device=device)
        self.inbox = torch.zeros(size + 3 * len(parts), dtype=torch.int32, device=device)
        self.views = {
            name: self.words[o : o + self.capacity[name]].view(parts[name][1])
            for name, o in self.offsets.items()
        }

    def send(self, values: dict[str, np.ndarray]) -> None:
        """Write each part's values at the start of its buffer (the rest keeps its contents),
        in stream order."""
        payload = [
            np.ascontiguousarray(v, dtype=self.dtypes[k]).reshape(-1).view(np.int32)
            for k, v in values.items()
        ]
        table = np.zeros((len(values), 3), np.int32)
        src = table.size
        for row, (name, words) in enumerate(zip(values, payload)):
            if len(words) > self.capacity[name]:
                raise ValueError(
                    f"{name}: {len(words)} words exceed its buffer ({self.capacity[name]})"
                )
            table[row] = src, self.offsets[name], len(words)
            src += len(words)
        # pinned, so the copy is queued behind the step in flight, not waited on
        cuda = self.words.is_cuda
        with staged(src, torch.int32, staging_ring() if cuda else None,
                    torch.cuda.current_stream(self.words.device) if cuda else None) as packed:
            np.concatenate([table.reshape(-1), *payload], out=packed.numpy())
            self.inbox[:src].copy_(packed, non_blocking=True)
        scatter_words(self.inbox, self.words, len(values), max(map(len, payload), default=0))


def _group_parts(qo_lens: list[int], lora_segments: LoraSegments,
                 pool_groups: Sequence[str]) -> dict[str, np.ndarray]:
    """The LoRA group buffers' contents of a batch (no rows in the groups no request uses)."""
    groups = HostGroups.build(qo_lens, lora_segments.request_sets)
    parts = {
        "num_groups": np.array([groups.num_groups]),
        "group_indptr": groups.group_indptr,
        "group_tokens": groups.token_ids,
    }
    unused = ([[]] * len(qo_lens),) * 2
    for group in pool_groups:
        row_indptr, row_ids, row_scales = groups.rows(*lora_segments.get(group, unused))
        parts[f"row_indptr.{group}"] = row_indptr
        parts[f"row_ids.{group}"] = row_ids
        parts[f"row_scales.{group}"] = row_scales
    return parts


def _magnitude_parts(qo_lens: list[int], lora_segments: LoraSegments | None,
                     tokens: int, pool_groups: Sequence[str]) -> dict[str, np.ndarray]:
    """Each token's DoRA magnitude row per group, -1 for the rest and for padding."""
    lens = np.asarray(qo_lens, np.int64)
    parts = {}
    for group in pool_groups:
        rows = np.full(tokens, -1, np.int32)
        per_request = (lora_segments.magnitudes.get(group) if lora_segments is not None
                       else None)
        if per_request is not None:
            rows[: lens.sum()] = np.repeat(np.asarray(per_request, np.int32), lens)
        parts[f"magnitude_rows.{group}"] = rows
    return parts


def _sampling_parts(sampling: SamplingBatch, batch: int) -> dict[str, np.ndarray]:
    """Sampling rows padded to the bucket with greedy rows (whose noise is never computed)."""
    pad = batch - len(sampling.temperature)
    fill = SamplingBatch.build([GREEDY] * pad, [0] * pad, [0] * pad).rows()
    return {f"sample.{name}": np.concatenate([values, fill[name]])
            for name, values in sampling.rows().items()}


def _pad(values: np.ndarray, n: int) -> np.ndarray:
    return np.concatenate([np.asarray(values), np.zeros(n, np.int64)])

