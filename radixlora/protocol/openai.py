"""OpenAI's request shapes (/v1/completions, /v1/chat/completions, with the vLLM and SGLang
extensions radixlora honours), validated with msgspec, and their one translation into
SamplingParams (completion_params, chat_params), tool choices and chat messages."""

from __future__ import annotations

from typing import Any

import msgspec

from radixlora.errors import InvalidRequestError
from radixlora.protocol.common import (
    AdapterRef,
    Int32,
    Int64,
    Strict,
    TokenId,
    build_params,
    logit_bias_pairs,
    prompt_adapters,
    refuse_unsupported,
)
from radixlora.protocol.tools import (
    ToolChoice,
    check_tools,
    named_structure,
    required_structure,
)
from radixlora.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from radixlora.structured import Structure
from radixlora.text.chat import ChatMessage

CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}



class StreamOptions(Strict):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = False  # vLLM: usage so far in every chunk



class _Sampling(Strict):
    """Fields shared by both OpenAI endpoints: OpenAI's, then the extensions radixlora honours
    (top_k, min_p, ignore_eos, stop_token_ids as vLLM and SGLang take them; `adapters`;
    SGLang's `lora_path`; LoRAX's `adapter_id`)."""

    model: str = ""  # "" (left out) or "default": the base model, as in SGLang
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    n: Int32 | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    logit_bias: dict[str, float] | None = None
    min_tokens: Int32 | None = None  # vLLM
    user: str | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    adapters: list[AdapterRef] | None = None
    lora_path: str | list[str | None] | None = None
    adapter_id: str | None = None
    skip_special_tokens: bool = True  # vLLM: special tokens left out of the text
    include_stop_str_in_output: bool = False  # vLLM: the matched stop string ends the text
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs' tokens as "token_id:N"
    # structured output (structure_of): OpenAI's response_format, vLLM's structured_outputs
    # and older guided_* fields, SGLang's regex / ebnf
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # vLLM's: each prompt token's logprob with the k most likely tokens at its position
    prompt_logprobs: Int32 | None = None
    bad_words: list[str] | None = None  # vLLM's: never generated

    def __post_init__(self):
        self.n = 1 if self.n is None else self.n  # null means the default, as at OpenAI
        self.stream = bool(self.stream)



class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list
    max_tokens: Int32 | None = 16
    logprobs: Int32 | None = None
    echo: bool | None = False
    best_of: Int32 | None = None
    suffix: str | None = None



class ContentPart(Strict):
    type: str
    text: str | None = None
    prompt_cache_breakpoint: dict | None = None  # every prefix is cached anyway
    image_url: object = None
    input_audio: object = None
    file: object = None
    refusal: object = None



class FunctionCallIn(Strict):
    name: str
    arguments: str = "{}"



class ToolCallIn(Strict):
    """A call in an assistant message of the conversation (OpenAI's shape)."""

    function: FunctionCallIn
    id: str | None = None
    type: str = "function"
    index: Int32 | None = None



class ChatMessageIn(Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    function_call: object = None
    refusal: object = None
    audio: object = None



class ChatRequest(_Sampling, kw_only=True):
    messages: list[ChatMessageIn]
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    logprobs: bool | None = False
    top_logprobs: Int32 | None = None
    parallel_tool_calls: bool | None = None  # with tool_choice required: one call, or many
    # vLLM's: template variables, the generation prompt, continuing the last message
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None  # None: not continue_final_message
    continue_final_message: bool = False
    prompt_cache_key: str | None = None  # every prefix is cached, whatever the key
    safety_identifier: str | None = None
    tools: list[dict[str, Any]] | None = None  # radixlora.protocol.tools
    tool_choice: str | dict[str, Any] | None = None
    # accepted only at the value that asks for nothing radixlora lacks (NEUTRAL_CHAT)
    functions: object = None
    function_call: object = None
    audio: object = None
    modalities: object = None
    metadata: object = None
    moderation: object = None
    prediction: object = None
    prompt_cache_options: object = None
    prompt_cache_retention: object = None
    reasoning_effort: object = None
    service_tier: object = None
    store: object = None
    verbosity: object = None
    web_search_options: object = None



# Fields of OpenAI's chat spec radixlora cannot honour, with the values that ask for nothing
# (None is always one): anything else is a 400 unsupported_parameter naming the field.
NEUTRAL_CHAT: dict[str, tuple] = {
    "functions": ([],),
    "function_call": ("none",),
    "audio": (),
    "modalities": (["text"],),
    "metadata": ({},),
    "moderation": (),
    "prediction": (),
    "prompt_cache_options": (),
    "prompt_cache_retention": ("in_memory",),
    "reasoning_effort": ("none",),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "verbosity": (),
    "web_search_options": (),
}

NEUTRAL_MESSAGE: dict[str, tuple] = {"function_call": (), "refusal": (), "audio": ()}



def request_adapters(req: _Sampling, base_name: str, count: int = 1):
    """The adapter choice of each of the `count` prompts of an OpenAI request."""
    return prompt_adapters(req.model, base_name, req.adapters, req.lora_path, req.adapter_id,
                           count)



def _common(req: _Sampling, vocab_size: int, max_tokens, logprobs) -> SamplingParams:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true",
                                  param="stream_options")
    if req.prompt_logprobs is not None:  # the k of both: the response shows what was asked
        if not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"prompt_logprobs must be between 0 and "
                                      f"{MAX_TOP_LOGPROBS}", param="prompt_logprobs")
        if req.stream:
            raise InvalidRequestError("prompt_logprobs is not returned when streaming",
                                      param="prompt_logprobs")
        logprobs = max(logprobs or 0, req.prompt_logprobs)
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
        min_tokens=req.min_tokens,
        logit_bias=logit_bias_pairs(req.logit_bias),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        structure=structure_of(req),
        bad_words=tuple(req.bad_words) if req.bad_words else None,
    )



def structure_of(req: _Sampling) -> Structure | None:
    """The one structured-output constraint of an OpenAI-style request, whichever field gave
    it; two of them are a 400."""
    found = [(name, value) for name in STRUCTURE_FIELDS
             if (value := getattr(req, name)) is not None]
    found = [(n, v) for n, v in found if not (n == "response_format" and _plain_text(v))]
    if len(found) > 1:
        raise InvalidRequestError(f"{found[0][0]} and {found[1][0]} both constrain the output: "
                                  "give one", param=found[1][0])
    if not found:
        return None
    name, value = found[0]
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    kind = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar", "regex": "regex", "ebnf": "grammar"}[name]
    return Structure(kind, _text(value), param=name)



STRUCTURE_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar", "regex", "ebnf")

VLLM_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice",
                   "grammar": "grammar"}



def _plain_text(response_format: dict) -> bool:
    return response_format.get("type") == "text"



def _text(value) -> str:
    """A schema, pattern, choice list or grammar as Structure holds it (JSON for the first
    and the third when given as objects)."""
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()



def _response_format(value: dict) -> Structure:
    kind = value.get("type")
    if kind == "json_object":
        return Structure("json_object", param="response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequestError("response_format.json_schema must be an object with a "
                                      "`schema` object", param="response_format")
        schema = spec.get("schema", {"type": "object"})
        return Structure("json_schema", _text(schema), param="response_format",
                         strict=bool(spec.get("strict")))
    raise InvalidRequestError(f"response_format type {kind!r} is not supported (text, "
                              "json_object, json_schema)", param="response_format",
                              code="unsupported_parameter")



def _structured_outputs(value: dict) -> Structure:
    """vLLM's structured_outputs: one of json, regex, choice, grammar, json_object."""
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    if given.keys() == {"json_object"}:
        return Structure("json_object", param="structured_outputs")
    if len(given) != 1 or next(iter(given)) not in VLLM_STRUCTURED:
        raise InvalidRequestError("structured_outputs takes exactly one of json, regex, "
                                  "choice, grammar, json_object", param="structured_outputs")
    key, spec = next(iter(given.items()))
    return Structure(VLLM_STRUCTURED[key], _text(spec), param=f"structured_outputs.{key}")



def completion_params(req: CompletionRequest, vocab_size: int) -> SamplingParams:
    """With echo, max_tokens 0 scores the prompt only: one token is sampled to finish the step
    and dropped (GenerateReq.score_only / prompt_only); echo streams too (its first chunk
    holds the prompt)."""
    if req.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix",
                                  code="unsupported_parameter")
    if req.best_of not in (None, 1, req.n):
        raise InvalidRequestError("best_of is not supported", param="best_of",
                                  code="unsupported_parameter")
    max_tokens = 1 if echo_only(req) else req.max_tokens
    return _common(req, vocab_size, max_tokens, req.logprobs)



def echo_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the prompt (and its logprobs) only, as OpenAI's legacy API."""
    return bool(req.echo) and req.max_tokens == 0



def chat_params(req: ChatRequest, vocab_size: int,
                tool_parser: str | None = None) -> tuple[SamplingParams, ToolChoice]:
    """The request's SamplingParams and how its output becomes tool calls; tool_parser: the
    launch's --tool-call-parser."""
    refuse_unsupported(req, NEUTRAL_CHAT)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs"
        )
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens
    params = _common(req, vocab_size, max_tokens, logprobs)
    tools = tool_choice(req, tool_parser)
    if tools.structure is None:
        return params, tools
    if params.structure is not None:
        raise InvalidRequestError(f"tool_choice {tools.mode!r} and {params.structure.param} "
                                  "both constrain the output: give one", param="tool_choice")
    return msgspec.structs.replace(params, structure=tools.structure), tools



def tool_choice(req: ChatRequest, tool_parser: str | None) -> ToolChoice:
    choice, tools = req.tool_choice, req.tools or []
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return ToolChoice()
    schemas = check_tools(tools)
    if choice is None or choice == "auto":
        return ToolChoice("auto", parser=tool_parser)
    if choice == "none":
        return ToolChoice()
    if choice == "required":
        parallel = req.parallel_tool_calls is not False
        return ToolChoice("required", structure=required_structure(schemas, parallel))
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                  '{"type": "function", "function": {"name": ...}}',
                                  param="tool_choice")
    return ToolChoice("named", name=name, structure=named_structure(schemas, name))



def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    if not messages:
        raise InvalidRequestError("messages is empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError(f"unknown role {m.role!r}", param="messages")
        refuse_unsupported(m, NEUTRAL_MESSAGE, f"messages[{i}].")
        calls = None
        if m.tool_calls is not None:
            calls = [{"id": c.id or f"call_{i}_{k}", "type": c.type,
                      "function": {"name": c.function.name, "arguments": c.function.arguments}}
                     for k, c in enumerate(m.tool_calls)]
        out.append(ChatMessage(role=m.role, content=_content_text(m.content, i), name=m.name,
                               tool_calls=calls, tool_call_id=m.tool_call_id))
    return out



def _content_text(content: str | list[ContentPart] | None, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise InvalidRequestError(
                f"content parts of type {part.type!r} are not supported (text only)",
                param=f"messages[{i}].content", code="unsupported_parameter",
            )
        texts.append(part.text)
    return "".join(texts)
