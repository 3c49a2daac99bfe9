"""Typed messages between the server processes: msgspec Structs tagged per kind, encoded with
msgpack. Each process has one inbox (a PULL socket) whose union type lists what it accepts;
token id arrays travel as raw little-endian int32 bytes. Nothing is ever pickled.

Channels (sender -> receiver: messages):
  api -> tokenizer:        GenerateReq, AbortReq
  tokenizer -> scheduler:  TokenizedReq, AbortReq
  api -> scheduler:        InfoQuery
  scheduler -> worker:     StepPlan (radixlora/step_plan.py)
  worker -> scheduler:     StepResult
  scheduler -> tokenizer:  TokenBatch, ReqError
  tokenizer -> api:        OutputBatch, ReqError
  scheduler -> api:        InfoReply, SchedulerStats, AdminReply
  api -> scheduler:        AdminReq
  registry -> scheduler, api (PUB/SUB): AdapterEvent
  child -> launcher:       Ready
"""

from __future__ import annotations

import logging

import msgspec

from radixlora.adapters import AdapterChoice as AdapterChoice
from radixlora.sampling import SamplingParams
from radixlora.step_plan import StepPlan, StepResult
from radixlora.step_plan import bytes_to_ids as bytes_to_ids
from radixlora.step_plan import ids_to_bytes as ids_to_bytes

log = logging.getLogger(__name__)


class Message(msgspec.Struct, tag=True, kw_only=True):
    """Base of every message; the class name is its tag."""


# ---- api -> tokenizer ------------------------------------------------------------------------


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


class GenerateReq(Message):
    """One prompt of one HTTP/ZMQ request. Exactly one of prompt, input_ids, messages is set.
    fill_context: params.max_tokens is replaced by what the context leaves after the prompt."""

    rid: str
    params: SamplingParams
    fill_context: bool = False
    prompt_only: bool = False  # tokenize and answer with no tokens (SGLang max_new_tokens=0)
    prompt: str | None = None
    input_ids: bytes | None = None
    messages: list[ChatMessage] | None = None
    adapters: list[AdapterChoice] | None = None
    stop: list[str] = []
    token_texts: bool = False  # attach per-token strings (for logprobs)
    logprob_start: int | None = None  # return the logprobs of prompt tokens from here on
    score_only: bool = False  # max_new_tokens 0 with prompt logprobs: drop the sampled token


class AbortReq(Message):
    rid: str
    index: int | None = None  # one sample of an n > 1 request, or all of them


# ---- tokenizer -> scheduler ------------------------------------------------------------------


class TokenizedReq(Message):
    rid: str
    input_ids: bytes
    params: SamplingParams
    adapters: list[AdapterChoice] | None = None
    logprob_start: int | None = None


# ---- scheduler -> tokenizer -> api -----------------------------------------------------------


class TokenOut(msgspec.Struct, array_like=True):
    rid: str
    index: int
    token_ids: bytes  # int32, new tokens since the last TokenOut of this sample
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    fallback: str | None = None  # why the request is served base-only (policy "base")
    input_logprobs: list[float] = []  # prompt tokens from logprob_start on (first TokenOut)
    input_ids: bytes = b""  # int32: the prompt tokens input_logprobs score


class TokenBatch(Message):
    outputs: list[TokenOut]


class ReqError(Message):
    rid: str
    message: str
    code: str = "invalid_request"
    param: str | None = None
    status: int = 400


class SampleOutput(msgspec.Struct, array_like=True):
    """New output of one sample: text and tokens since the previous SampleOutput."""

    rid: str
    index: int
    text: str
    token_ids: bytes
    logprobs: list[float]
    token_texts: list[str] | None
    top: list[list[tuple[int, float, str]]] | None
    finish_reason: str | None
    matched_stop: str | int | None
    prompt_tokens: int
    cached_tokens: int
    fallback: str | None = None
    input_logprobs: list[float] = []
    input_ids: bytes = b""  # int32 prompt tokens that input_logprobs score


class OutputBatch(Message):
    outputs: list[SampleOutput]


# ---- control ---------------------------------------------------------------------------------


class InfoQuery(Message):
    qid: int
    flush_cache: bool = False


class AdapterInfo(msgspec.Struct, kw_only=True):
    name: str
    adapter_id: str
    path: str
    rank: int


class InfoReply(Message):
    qid: int
    info: dict


class SchedulerStats(Message):
    kv_capacity: int
    kv_used: int
    kv_cached: int
    running: int
    waiting: int
    prompt_tokens: int
    cached_tokens: int
    adapter_loads: int = 0  # cumulative loads into the device pool
    adapter_evictions: int = 0  # cumulative
    adapter_load_seconds: list[float] = []  # worker load latencies since the last stats
    resident_adapters: int = 0
    resident_bytes: int = 0  # device pool bytes of the resident adapters' rows
    host_adapters: int = 0  # adapters in the worker's pinned host tier
    host_bytes: int = 0
    swaps_waiting: int = 0  # requests held back by the swap cap at the last step


class AdapterEvent(Message):
    """One change of the registry's active set. `seq` grows by one per published change and
    survives registry restarts; kind "hello" (a registry that just started and found its
    subscribers) carries the last seq and changes nothing."""

    seq: int
    kind: str  # added | updated | removed | rejected | skipped | hello
    name: str = ""
    adapter_id: str = ""  # content hash (added, updated, removed, skipped)
    path: str = ""  # the immutable content-addressed snapshot (added, updated)
    reason: str = ""  # rejected / skipped: a label for metrics (duplicate_content, bad_rank...)
    message: str = ""  # rejected: the validation error, for people
    at: float = 0.0  # wall-clock time of publication


class AdminReq(Message):
    """load / unload / pin / unpin of one adapter name (POST /v1/*_lora_adapter)."""

    qid: int
    op: str
    name: str
    path: str = ""


class AdminReply(Message):
    qid: int
    status: int = 200
    message: str = ""
    code: str = ""
    info: dict = {}


class Ready(Message):
    proc: str
    pid: int
    info: dict = {}


ApiInbox = OutputBatch | ReqError | InfoReply | SchedulerStats | AdminReply
TokenizerInbox = GenerateReq | AbortReq | TokenBatch | ReqError
SchedulerInbox = TokenizedReq | AbortReq | InfoQuery | StepResult | AdminReq
WorkerInbox = StepPlan
LauncherInbox = Ready


class Codec:
    """msgpack encoder plus a decoder for one inbox type."""

    def __init__(self, inbox_type):
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(inbox_type)

    def encode(self, msg: Message) -> bytes:
        return self.encoder.encode(msg)

    def decode(self, raw: bytes):
        """The message, or None (logged) for bytes that are not a valid message."""
        try:
            return self.decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("dropped %d bytes that are not a valid message: %s", len(raw), e)
            return None
