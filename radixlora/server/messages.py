"""Typed messages between the server processes: msgspec Structs tagged per kind, encoded with
msgpack. Each process has one inbox (a PULL socket) whose union type lists what it accepts;
token id arrays travel as raw little-endian int32 bytes. Nothing is ever pickled.

Channels (sender -> receiver: messages):
  api -> tokenizer:        GenerateReq, AbortReq
  tokenizer -> scheduler:  TokenizedReq, AbortReq
  api -> scheduler:        InfoQuery
  scheduler -> worker:     StepPlan, StepMasks (radixlora/step_plan.py)
  worker -> scheduler:     StepResult
  scheduler -> tokenizer:  TokenBatch, ReqError
  tokenizer -> api:        OutputBatch, ReqError
  scheduler -> api:        InfoReply, SchedulerStats, AdminReply (with data-parallel
                           replicas, each replica's scheduler on its own api socket)
  api -> scheduler:        AdminReq
  tokenizer -> api:        RouterStats (data-parallel replicas: the router's report)
  registry -> scheduler, api (PUB/SUB): AdapterEvent
  child -> launcher:       Ready, then a Heartbeat about every second

Every message is validated where it is received: msgspec.Meta constraints on the fields
(bounded int32 arrays, non-negative counts, enums as Literals) when it is decoded, then the
message's validate() (what Meta cannot express: int32 arrays a multiple of 4 bytes, one prompt
form). A message failing either is dropped with a log line, or answered with a ReqError where
it carries a request id (Codec.decode's `reject`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec

from radixlora.sampling_params import SamplingParams
from radixlora.sched.adapter_choice import AdapterChoice as AdapterChoice
from radixlora.step_plan import StepMasks, StepPlan, StepResult, StepTotals
from radixlora.step_plan import bytes_to_id_list as bytes_to_id_list
from radixlora.step_plan import bytes_to_ids as bytes_to_ids
from radixlora.step_plan import ids_to_bytes as ids_to_bytes
from radixlora.text.chat import ChatMessage as ChatMessage

log = logging.getLogger(__name__)

DROP_LOG_BURST = 20
DROP_LOG_WINDOW_S = 10.0
MAX_IDS = 1 << 24  # int32 values in one array of one message
MAX_MESSAGE_BYTES = 4 * MAX_IDS + (1 << 20)  # the largest message the client endpoint takes
Int32Array = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_IDS)]
Count = Annotated[int, msgspec.Meta(ge=0)]
HttpStatus = Annotated[int, msgspec.Meta(ge=100, le=599)]
# worker-tp<r>: rank r > 0 of a tensor-parallel worker (rank 0 is the worker)
ProcName = Annotated[
    str, msgspec.Meta(pattern=r"^(tokenizer|scheduler|registry|worker(-tp[1-9][0-9]{0,2})?)$")
]


class InvalidMessage(ValueError):
    def __init__(self, param: str, reason: str):
        super().__init__(f"{param}: {reason}")
        self.param = param
        self.reason = reason


def check_int32(raw: bytes | None, param: str) -> None:
    if raw is not None and len(raw) % 4:
        raise InvalidMessage(param, f"an int32 array needs a multiple of 4 bytes, "
                                    f"got {len(raw)}")


class Message(msgspec.Struct, tag=True, kw_only=True):
    """Base of every message; the class name is its tag."""

    def validate(self) -> None:
        """What the field types cannot express; raises InvalidMessage."""


# ---- api -> tokenizer ------------------------------------------------------------------------


class ChatOptions(msgspec.Struct, kw_only=True):
    """How a chat request's messages are rendered (vLLM's fields of the same names)."""

    add_generation_prompt: bool | None = None  # None: not continue_final_message
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = {}  # chat_template_kwargs: more template variables
    tools: list[dict[str, Any]] | None = None  # the request's tools, for the template


class GenerateReq(Message):
    """One prompt of one HTTP/ZMQ request. Exactly one of prompt, input_ids, messages is set.
    fill_context: params.max_tokens is replaced by what the context leaves after the prompt."""

    rid: str
    params: SamplingParams
    fill_context: bool = False
    prompt_only: bool = False  # tokenize and answer with no tokens (SGLang max_new_tokens=0)
    prompt: str | None = None
    input_ids: Int32Array | None = None
    messages: list[ChatMessage] | None = None
    adapters: list[AdapterChoice] | None = None
    adapter_param: str = "model"  # the request field that named the adapters (for errors)
    stop: list[str] = []
    include_stop: bool = False  # the matched stop string ends the text (else cut before)
    skip_special_tokens: bool = True  # special tokens left out of the text
    chat: ChatOptions | None = None  # with messages: how they are rendered
    token_texts: bool = False  # attach per-token strings (for logprobs)
    token_ids_as_texts: bool = False  # those strings as "token_id:N" (return_tokens_as_token_ids)
    logprob_start: Count | None = None  # return the logprobs of prompt tokens from here on
    score_only: bool = False  # max_new_tokens 0 with prompt logprobs: drop the sampled token
    echo: bool = False  # /v1/completions echo: a token-id prompt's text comes back decoded
    data_parallel_rank: Count | None = None  # run on this replica (None: the router picks)
    request_prompts: Count = 1  # the prompts of its client request (which share its limits)

    def validate(self) -> None:
        check_int32(self.input_ids, "input_ids")
        forms = [f for f in ("prompt", "input_ids", "messages") if getattr(self, f) is not None]
        if len(forms) > 1:
            raise InvalidMessage(forms[1], f"give one of prompt, input_ids, messages, not {forms}")


class AbortReq(Message):
    rid: str
    index: Count | None = None  # one sample of an n > 1 request, or all of them


# ---- tokenizer -> scheduler ------------------------------------------------------------------


class TokenizedReq(Message):
    rid: str
    input_ids: Int32Array
    params: SamplingParams
    adapters: list[AdapterChoice] | None = None
    logprob_start: Count | None = None
    adapter_param: str = "model"  # GenerateReq.adapter_param

    def validate(self) -> None:
        check_int32(self.input_ids, "input_ids")


# ---- scheduler -> tokenizer -> api -----------------------------------------------------------


class TokenOut(msgspec.Struct, array_like=True):
    rid: str
    index: Count
    token_ids: Int32Array  # new tokens since the last TokenOut of this sample
    logprobs: list[float]
    top: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    prompt_tokens: Count
    cached_tokens: Count
    fallback: str | None = None  # why the request is served base-only (policy "base")
    input_logprobs: list[float] = []  # prompt tokens from logprob_start on (first TokenOut)
    input_ids: Int32Array = b""  # the prompt tokens input_logprobs score
    # with the first token: time.monotonic() (one clock for every process of the host) of the
    # request's first admission, so the api can tell time queued from time in prefill
    scheduled_at: float = 0.0
    # with the first token: its adapters served on another weight format than they were
    # trained on (--qlora-mismatch serve), "name: why; ..."
    base_mismatch: str = ""
    # with input_logprobs, when params.logprobs > 0: each scored prompt token's most likely
    input_top: list[list[tuple[int, float]]] = []


class TokenBatch(Message):
    outputs: list[TokenOut]

    def validate(self) -> None:
        for out in self.outputs:
            check_int32(out.token_ids, "token_ids")
            check_int32(out.input_ids, "input_ids")


class ReqError(Message):
    rid: str
    message: str
    code: str = "invalid_request"
    param: str | None = None
    status: HttpStatus = 400


class SampleOutput(msgspec.Struct, array_like=True):
    """New output of one sample: text and tokens since the previous SampleOutput."""

    rid: str
    index: Count
    text: str
    token_ids: Int32Array
    logprobs: list[float]
    token_texts: list[str] | None
    top: list[list[tuple[int, float, str]]] | None
    finish_reason: str | None
    matched_stop: str | int | None
    prompt_tokens: Count
    cached_tokens: Count
    fallback: str | None = None
    input_logprobs: list[float] = []
    input_ids: Int32Array = b""  # prompt tokens that input_logprobs score
    input_texts: list[str] | None = None  # input_ids' strings (with token_texts)
    scheduled_at: float = 0.0  # as in TokenOut: with the first output
    base_mismatch: str = ""  # as in TokenOut: with the first output
    input_top: list[list[tuple[int, float, str]]] | None = None  # as top, for input_ids
    prompt_text: str | None = None  # echo of a token-id prompt: its text, with the first output


class OutputBatch(Message):
    outputs: list[SampleOutput]

    def validate(self) -> None:
        for out in self.outputs:
            check_int32(out.token_ids, "token_ids")
            check_int32(out.input_ids, "input_ids")


# ---- control ---------------------------------------------------------------------------------


class InfoQuery(Message):
    qid: Count
    flush_cache: bool = False


class AdapterInfo(msgspec.Struct, kw_only=True):
    name: str
    adapter_id: str
    path: str
    rank: int


class InfoReply(Message):
    qid: Count
    info: dict


class SchedulerStats(Message):
    kv_capacity: Count
    kv_used: Count
    kv_cached: Count
    running: Count
    waiting: Count
    prompt_tokens: Count
    cached_tokens: Count
    adapter_loads: Count = 0  # cumulative loads into the device pool
    adapter_evictions: Count = 0  # cumulative
    adapter_load_seconds: list[float] = []  # worker load latencies since the last stats
    resident_adapters: Count = 0
    resident_bytes: Count = 0  # device pool bytes of the resident adapters' rows
    host_adapters: Count = 0  # adapters in the worker's pinned host tier
    host_bytes: Count = 0
    swaps_waiting: Count = 0  # requests held back by the swap cap at the last step
    adapter_load_failures: Count = 0  # cumulative adapter versions the worker failed to load
    max_loras: Count = 0  # --max-loras (lora_requests_info's max_lora)
    running_adapters: list[str] = []  # adapter names of the running requests, sorted, distinct
    waiting_adapters: list[str] = []  # and of the waiting ones
    running_per_adapter: dict[str, Count] = {}  # adapter name -> its running requests
    waiting_per_adapter: dict[str, Count] = {}  # and its waiting ones
    resident_rows: dict[str, Count] = {}  # adapter name -> device pool rows it holds
    # adapter name -> device pool bytes its rows hold in the groups it adapts
    resident_adapter_bytes: dict[str, Count] = {}
    registered: list[str] | None = None  # served adapter names; None: as in the previous stats
    step_totals: dict[str, StepTotals] = {}  # "decode" / "mixed" -> cumulative (StepLoop)


class RouterStats(Message):
    """The data-parallel router's state (radixlora.server.procs.router.Router.snapshot)."""

    policy: str
    outstanding: list[Count]  # samples sent to each replica and not finished
    tree_tokens: list[Count]  # tokens of each replica in the router's prefix tree
    decisions: dict[str, Count]  # "replica:reason" -> requests routed so (cumulative)


class AdapterEvent(Message):
    """One change of the registry's active set. `seq` grows by one per published change and
    survives registry restarts; kind "hello" (a registry that just started and found its
    subscribers) carries the last seq and changes nothing; kind "listed" names the adapters
    found in the directory at start that are still being validated (each is later added or
    rejected)."""

    seq: Count
    kind: Literal["added", "updated", "removed", "rejected", "skipped", "hello", "listed"]
    name: str = ""
    names: list[str] = []  # listed
    adapter_id: str = ""  # content hash (added, updated, removed, skipped)
    path: str = ""  # the immutable content-addressed snapshot (added, updated)
    reason: str = ""  # rejected / skipped: a label for metrics (duplicate_content, bad_rank...)
    message: str = ""  # rejected: the validation error, for people
    at: float = 0.0  # wall-clock time of publication


class AdapterWanted(Message):
    """A scheduler holds a request for a listed adapter: the registry examines it next."""

    name: str


class AdminReq(Message):
    """load / unload / pin / unpin of one adapter name (POST /v1/*_lora_adapter)."""

    qid: Count
    op: Literal["load", "unload", "pin", "unpin"]
    name: str
    path: str = ""
    replace: bool = False  # a load may replace an adapter given at start (--adapter)


class AdminReply(Message):
    qid: Count
    status: HttpStatus = 200
    message: str = ""
    code: str = ""
    param: str = "lora_name"  # the request field an error is about
    info: dict = {}


class Ready(Message):
    proc: ProcName
    pid: Count
    info: dict = {}


class Sized(Message):
    """The worker's pools and batch limits are resolved (info as in its Ready), before its
    warm-up: the other processes may start with them meanwhile."""

    proc: ProcName
    pid: Count
    info: dict = {}


class Heartbeat(Message):
    """A child's main loop is turning: sent about every second from that loop (never from a
    side thread), so a process stopped or stuck in one message falls silent. `progress` is a
    counter of its work (steps, messages, events) for the launcher's log line."""

    proc: ProcName
    pid: Count
    progress: Count = 0


ApiInbox = OutputBatch | ReqError | InfoReply | SchedulerStats | AdminReply | RouterStats
TokenizerInbox = GenerateReq | AbortReq | TokenBatch | ReqError
SchedulerInbox = TokenizedReq | AbortReq | InfoQuery | StepResult | AdminReq
WorkerInbox = StepPlan | StepMasks
LauncherInbox = Ready | Sized | Heartbeat


def validate_plan(plan: StepPlan) -> None:
    """A StepPlan's arrays and indices agree with each other (the worker adds the ranges it
    knows: vocabulary, KV slots)."""
    if plan.step < 0:
        raise InvalidMessage("step", f"must be >= 0, got {plan.step}")
    check_int32(plan.input_ids, "input_ids")
    check_int32(plan.kv_slots, "kv_slots")
    extend = slots = 0
    for item in plan.items:
        if min(item.extend_len, item.start, item.out_index, item.score_from) < 0:
            raise InvalidMessage("items", "negative length, position or index")
        if not 0 <= item.adapter_set < max(1, len(plan.adapter_sets)):
            raise InvalidMessage("items", f"adapter set {item.adapter_set} out of range")
        check_int32(item.score_ids, "score_ids")
        extend += item.extend_len
        slots += item.start + item.extend_len
    if 4 * extend != len(plan.input_ids) or 4 * slots != len(plan.kv_slots):
        raise InvalidMessage("items", "extend lengths and positions disagree with the arrays")
    for load in plan.adapter_loads:
        check_int32(load.rows, "adapter_loads.rows")
    for groups in plan.adapter_sets:
        if any(len(g.rows) != len(g.scales) or min(g.rows, default=0) < 0 or g.magnitude < -1
               for g in groups.values()):
            raise InvalidMessage("adapter_sets", "rows and scales disagree or a row is negative")


def validate_result(result: StepResult) -> None:
    if result.step < 0:
        raise InvalidMessage("step", f"must be >= 0, got {result.step}")
    check_int32(result.token_ids, "token_ids")
    if len(result.logprobs) > len(result.token_ids) // 4:
        raise InvalidMessage("logprobs", "more logprobs than sampled tokens")


def validate(msg) -> None:
    """Raise InvalidMessage unless msg is consistent (its fields' types and Meta are already
    enforced by the decoder)."""
    if isinstance(msg, StepPlan):
        validate_plan(msg)
    elif isinstance(msg, StepMasks):
        if msg.step < 0:
            raise InvalidMessage("step", f"must be >= 0, got {msg.step}")
    elif isinstance(msg, StepResult):
        validate_result(msg)
    else:
        msg.validate()


class Codec:
    """msgpack encoder plus a decoder for one inbox type."""

    def __init__(self, inbox_type):
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(inbox_type)
        self.drops = DropLog()

    def encode(self, msg: Message) -> bytes:
        return self.encoder.encode(msg)

    def decode(self, raw: bytes, reject: Callable[[ReqError], None] | None = None):
        """The message, or None (logged) for bytes that are not a valid message. A message
        that decodes but fails validation is answered through `reject` with a ReqError when
        it carries a request id, else dropped."""
        try:
            msg = self.decoder.decode(raw)
        except msgspec.ValidationError as e:  # well-formed msgpack, not a valid message
            self.drops.log(f"dropped {len(raw)} bytes that are not a valid message: {e}")
            rid = _rid_of(raw)
            if reject is not None and rid is not None:
                reject(ReqError(rid=rid, message=f"invalid message: {e}"))
            return None
        except msgspec.DecodeError as e:
            self.drops.log(f"dropped {len(raw)} bytes that are not msgpack: {e}")
            return None
        try:
            validate(msg)
        except InvalidMessage as e:
            self.drops.log(f"dropped an invalid {type(msg).__name__}: {e}")
            rid = getattr(msg, "rid", None)
            if reject is not None and isinstance(rid, str):
                reject(ReqError(rid=rid, message=f"invalid message: {e}", param=e.param))
            return None
        return msg


class DropLog:
    """Warnings about dropped messages, at most DROP_LOG_BURST per DROP_LOG_WINDOW_S; the rest
    are counted and the count is logged with the next warning, so a flood cannot fill the log."""

    def __init__(self):
        self.window_start = 0.0
        self.logged = 0
        self.suppressed = 0

    def log(self, line: str) -> None:
        now = time.monotonic()
        if now - self.window_start >= DROP_LOG_WINDOW_S:
            self.window_start, self.logged = now, 0
        if self.logged >= DROP_LOG_BURST:
            self.suppressed += 1
            return
        self.logged += 1
        if self.suppressed:
            line += f" ({self.suppressed} more dropped without a log line)"
            self.suppressed = 0
        log.warning("%s", line)


def _rid_of(raw: bytes) -> str | None:
    """The request id of well-formed msgpack that is not a valid message, if it has one."""
    try:
        fields = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    rid = fields.get("rid") if isinstance(fields, dict) else None
    return rid if isinstance(rid, str) else None
