"""What the worker executes, and what it answers: the one step-plan type of the runtime. The
offline Engine and the scheduler process build it the same way (BatchPlan.to_step_plan) and hand
it to a StepExecutor, in process or over ZeroMQ; token id arrays travel as raw little-endian
int32 bytes, so a plan encodes to msgpack without copies of its arrays into lists."""

from __future__ import annotations

import sys

import msgspec
import numpy as np

from radixlora.sampling_params import SamplingParams


def ids_to_bytes(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def bytes_to_ids(raw: bytes) -> np.ndarray:
    if len(raw) % 4:
        raise ValueError(f"an int32 array needs a multiple of 4 bytes, got {len(raw)}")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


def bytes_to_id_list(raw: bytes) -> list[int]:
    """bytes_to_ids(raw).tolist() without numpy's cost per call: the api and tokenizer
    processes turn a few ids of every request into a list at every step."""
    if sys.byteorder != "little" or len(raw) % 4:
        return bytes_to_ids(raw).tolist()  # (raises on a partial id)
    return memoryview(raw).cast("i").tolist()


class PlanItem(msgspec.Struct, array_like=True):
    """One request's share of a step: its tokens are the next extend_len ids of
    StepPlan.input_ids, its KV slots the next start + extend_len of StepPlan.kv_slots."""

    extend_len: int  # tokens whose KV this step computes
    start: int  # position of the first of them
    sample: bool  # this step completes the request's fill, so it samples a token
    params: SamplingParams
    seed: int
    out_index: int  # index in the request's output of the token sampled (its noise step)
    adapter_set: int  # index into StepPlan.adapter_sets
    score_from: int = 0  # positions score_from, ... of this chunk predict the prompt's score_ids
    score_ids: bytes | None = None  # int32
    # a sampling item with penalties (sampling.penalized): its output tokens known when the
    # step was planned (int32; a pending newest one is this item's last input token, a
    # placeholder), and with a repetition penalty its prompt tokens
    output_ids: bytes | None = None
    prompt_ids: bytes | None = None
    # structured output: the tokens this item may sample, a little-endian int32 bitmask of
    # ceil(vocab / 32) words (radixlora.structured)
    allowed: bytes | None = None
    # structured output whose newest token was still being sampled when the step was planned:
    # its mask comes in the step's StepMasks, and the worker samples the step only then
    late_mask: bool = False
    # bad words: the tokens this item may not sample (int32), found by the scheduler
    banned: bytes | None = None


class AdapterLoad(msgspec.Struct, array_like=True):
    """Write an adapter version into pool rows before the step runs."""

    adapter_id: str  # content hash; weights read from disk must still hash to it
    name: str
    path: str
    rows: bytes  # int32 pool rows, one per rank row


class GroupRows(msgspec.Struct, array_like=True):
    """An adapter set's pool rows in one module group and the weight of each row; magnitude:
    the pool row of a DoRA adapter's scales in this group (-1: none; radixlora.worker.dora)."""

    rows: list[int]
    scales: list[float]
    magnitude: int = -1


class StepPlan(msgspec.Struct, tag=True, kw_only=True):
    step: int
    items: list[PlanItem]
    # int32, every item's extend ids in plan order; -1 - i: the i-th token sampled by the
    # previous step (not known when this one was planned)
    input_ids: bytes = b""
    kv_slots: bytes = b""  # int32, every item's KV slots of positions [0, start + extend_len)
    adapter_loads: list[AdapterLoad] = []
    # loads for requests not in this step, done after adapter_loads and never waited for by
    # this step; the executor may defer one whose adapter is not in its host tier (see
    # radixlora.worker.executor)
    prefetch_loads: list[AdapterLoad] = []
    # per adapter set of the step: module group -> its rows; {} is the base model
    adapter_sets: list[dict[str, GroupRows]] = []
    # registered adapters to read into the host tier in the background while it has room,
    # ahead of any request (rows unused); the executor keeps reading them between steps
    host_reads: list[AdapterLoad] = []


class StepMasks(msgspec.Struct, tag=True, kw_only=True):
    """The masks of a step's late_mask items, sent once the step before it is folded: one
    row per late_mask item in plan order, each row a mask as PlanItem.allowed, the rows
    concatenated into one buffer."""

    step: int
    words: bytes = b""  # int32, [late items, ceil(vocab / 32)]


class StepResult(msgspec.Struct, tag=True, kw_only=True):
    step: int
    token_ids: bytes = b""  # int32, one per sampled item in plan order
    logprobs: list[float] = []
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    failed_adapters: dict[str, str] = {}  # adapter id -> reason; the step did not run
    invalid_adapters: list[str] = []  # of failed_adapters, those whose own content is at fault
    error: str | None = None  # the step did not run
    load_seconds: list[float] = []  # one per adapter load of the step
    input_logprobs: list[list[float]] | None = None  # per plan item: scored prompt tokens
    # per plan item, per scored prompt token: the most likely tokens (item's params.logprobs)
    input_top_ids: list[list[list[int]]] | None = None
    input_top_logprobs: list[list[list[float]]] | None = None
    host_adapters: int = 0  # the executor's host tier after the step
    host_bytes: int = 0
    # adapters that entered / left the host tier since the previous result
    # (HostAdapterCache.drain_changes): the scheduler's view of what loads without a disk read
    host_added: list[str] = []
    host_dropped: list[str] = []
    # adapters of prefetch loads still being read from disk (or waiting for a reader) when
    # the result was made: a step that reads their rows would wait for the read
    unread_adapters: list[str] = []

    def top(self) -> list[list[tuple[int, float]]] | None:
        if self.top_ids is None:
            return None
        return [list(zip(i, lp)) for i, lp in zip(self.top_ids, self.top_logprobs)]

    def input_top(self) -> list[list[list[tuple[int, float]]]] | None:
        if self.input_top_ids is None:
            return None
        return [[list(zip(i, lp)) for i, lp in zip(ids, lps)]
                for ids, lps in zip(self.input_top_ids, self.input_top_logprobs)]


class StepTotals(msgspec.Struct, array_like=True):
    """Cumulative totals of one kind of step ("decode": every request adds one token;
    "mixed": any prompt tokens): steps folded, seconds they held the pipeline (from the
    previous fold, or from when they were planned if the pipeline was idle, to their fold),
    seconds spent planning them, their tokens and requests."""

    steps: int = 0
    seconds: float = 0.0
    plan_seconds: float = 0.0
    tokens: int = 0
    requests: int = 0
