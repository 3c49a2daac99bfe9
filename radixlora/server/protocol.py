"""Request schemas of the HTTP APIs (OpenAI and SGLang-native), validated with msgspec, and
their translation into GenerateReqs. Everything a user can get wrong is rejected here or in the
tokenizer/scheduler with an InvalidRequestError naming the field."""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from radixlora.errors import InvalidRequestError
from radixlora.sampling import MAX_TOP_LOGPROBS, SamplingParams
from radixlora.server.messages import AdapterChoice, ChatMessage

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_PROMPTS = 64
MAX_INT = 2**31 - 1
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}

# Every integer is range-checked while decoding, before anything converts it to a fixed-width
# type (int32 token arrays, int64 sampler rows): out of range is a 400 naming the field.
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=MAX_INT)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class AdapterRef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    weight: float = 1.0


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by both OpenAI endpoints."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    n: Int32 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    adapters: list[AdapterRef] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    echo: bool = False
    best_of: Int32 | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessageIn]
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool = False
    top_logprobs: Int32 | None = None
    tools: list | None = None
    response_format: dict | None = None


class SglSamplingParams(msgspec.Struct, kw_only=True):
    max_new_tokens: Int32 = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int32 = -1
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: Int32 = 1
    ignore_eos: bool = False
    sampling_seed: Int64 | None = None
    seed: Int64 | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list | None = None
    sampling_params: SglSamplingParams | list[SglSamplingParams] | None = None
    lora_path: str | list[str | None] | None = None
    adapters: list[AdapterRef] | None = None  # radixlora: a weighted stack for every prompt
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: Int32 = 0
    logprob_start_len: Int32 = -1
    rid: str | list[str] | None = None


class AbortRequest(msgspec.Struct, kw_only=True):
    rid: str


# ---- shared checks ---------------------------------------------------------------------------


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}", param="stop"
        )
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                f"stop strings must be 1-{MAX_STOP_CHARS} characters", param="stop"
            )
    return stops


def check_penalties(**values: float | None) -> None:
    for name, value in values.items():
        if value is None:
            continue
        if not math.isfinite(value):
            raise InvalidRequestError(f"{name} must be a finite number", param=name)
        neutral = 1.0 if name == "repetition_penalty" else 0.0
        if value != neutral:
            raise InvalidRequestError(f"{name} is not supported yet", param=name,
                                      code="unsupported_parameter")


def adapter_choices(model: str, base_name: str, adapters: list[AdapterRef] | None):
    """`model` is the base name, "BASE:ADAPTER" or "ADAPTER"; `adapters` stacks weighted ones
    (then `model` must name the base)."""
    if not model:
        raise InvalidRequestError("model must name the base model or an adapter", param="model")
    named = None
    if model.startswith(base_name + ":"):
        named = model[len(base_name) + 1 :]
        if not named:
            raise InvalidRequestError(f"{model!r} names no adapter after ':'", param="model")
    elif model != base_name:
        named = model
    if adapters is not None:
        if named is not None:
            raise InvalidRequestError(
                "name adapters either in `model` or in `adapters`, not both", param="adapters"
            )
        if not adapters:
            return None
        return [AdapterChoice(a.name, a.weight) for a in adapters]
    return [AdapterChoice(named)] if named is not None else None


def adapter_label(choices: list[AdapterChoice] | None) -> str:
    if not choices:
        return "base"
    return "+".join(c.name if c.weight == 1.0 else f"{c.name}*{c.weight:g}" for c in choices)


def build_params(vocab_size: int, **fields) -> SamplingParams:
    """SamplingParams from request fields (None = default), validated; max_tokens None is
    checked as 1 and resolved after tokenization (GenerateReq.fill_context)."""
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.setdefault("max_tokens", 1)
    params = SamplingParams(**fields)
    params.validate(vocab_size)
    return params


def _common(req: _Sampling, vocab_size: int, max_tokens, logprobs) -> SamplingParams:
    if req.logit_bias:
        raise InvalidRequestError("logit_bias is not supported", param="logit_bias",
                                  code="unsupported_parameter")
    check_penalties(presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty)
    return build_params(
        vocab_size,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        n=req.n,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )


def completion_params(req: CompletionRequest, vocab_size: int) -> SamplingParams:
    if req.echo:
        raise InvalidRequestError("echo is not supported", param="echo",
                                  code="unsupported_parameter")
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix",
                                  code="unsupported_parameter")
    if req.best_of not in (None, 1, req.n):
        raise InvalidRequestError("best_of is not supported", param="best_of",
                                  code="unsupported_parameter")
    return _common(req, vocab_size, req.max_tokens, req.logprobs)


def chat_params(req: ChatRequest, vocab_size: int) -> SamplingParams:
    if req.tools or req.response_format:
        param = "tools" if req.tools else "response_format"
        raise InvalidRequestError(f"{param} is not supported", param=param,
                                  code="unsupported_parameter")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    return _common(req, vocab_size, max_tokens, logprobs)


def completion_prompts(prompt: str | list, param: str = "prompt") -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token id lists; token
    ids must fit int32 (the vocabulary check comes later, in the tokenizer)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("the prompt is empty", param=param)
    if all(_is_int(t) for t in prompt):
        return [_token_ids(prompt, param)]
    if all(isinstance(p, str) for p in prompt) or all(
        isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt
    ):
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request",
                                      param=param)
        return [p if isinstance(p, str) else _token_ids(p, param) for p in prompt]
    raise InvalidRequestError(
        f"{param} must be a string, a list of strings, a list of token ids or a list of token "
        "id lists",
        param=param,
    )


def _is_int(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _token_ids(ids: list[int], param: str) -> list[int]:
    if any(not 0 <= t <= MAX_INT for t in ids):
        raise InvalidRequestError(f"token ids in {param} must be between 0 and {MAX_INT}",
                                  param=param)
    return ids


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    if not messages:
        raise InvalidRequestError("messages is empty", param="messages")
    out = []
    for m in messages:
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(f"unknown role {m.role!r}", param="messages")
        out.append(ChatMessage(role=m.role, content=_content_text(m.content)))
    return out


def _content_text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(
                f"content parts of type {part.type!r} are not supported (text only)",
                param="messages",
            )
        texts.append(part.text)
    return "".join(texts)
