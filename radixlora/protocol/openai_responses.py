"""OpenAI's Responses API (/v1/responses): the request shape, its one translation into a chat
request (input items -> messages, flat function tools -> chat tools, text.format ->
response_format), and the response object, output items and stream events built from a chat
result. A response chained by previous_response_id continues the stored conversation: the
earlier input items, then the earlier output items, then the new input."""

from __future__ import annotations

import secrets
import time
from typing import Any

from radixlora.errors import InvalidRequestError
from radixlora.protocol.common import AdapterRef, Int32, Strict, refuse_unsupported
from radixlora.protocol.openai import ChatMessageIn, ChatRequest, FunctionCallIn, ToolCallIn

INPUT_ROLES = {"user", "system", "developer", "assistant"}
TEXT_PARTS = {"input_text", "output_text", "text"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(Strict):
    model: str = ""
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: Int32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Int32 | None = None
    include: list[str] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None  # every prefix is cached, whatever the key
    safety_identifier: str | None = None
    # radixlora's adapter choice, as on the chat endpoint
    adapters: list[AdapterRef] | None = None
    lora_path: str | None = None
    adapter_id: str | None = None
    # accepted only at the value that asks for nothing radixlora lacks (NEUTRAL_RESPONSES)
    background: bool | None = None
    conversation: object = None
    max_tool_calls: object = None
    prompt: object = None
    reasoning: object = None
    service_tier: str | None = None
    stream_options: object = None
    truncation: str | None = None


NEUTRAL_RESPONSES: dict[str, tuple] = {
    "background": (False,),
    "conversation": (),
    "max_tool_calls": (),
    "prompt": (),
    "reasoning": ({},),
    "service_tier": ("auto", "default"),
    "stream_options": ({},),
    "truncation": ("disabled",),
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# ---- request -> chat request ------------------------------------------------------------------


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        if not req.input and req.previous_response_id is None:
            raise InvalidRequestError("input is empty", param="input")
        return [{"type": "message", "role": "user", "content": req.input}] if req.input else []
    return list(req.input)


def to_chat(req: ResponsesRequest, history: list[dict]) -> ChatRequest:
    """The chat request that answers `req` after the stored conversation `history`."""
    refuse_unsupported(req, NEUTRAL_RESPONSES)
    _check_include(req.include)
    items = history + input_items(req)
    messages = ([ChatMessageIn(role="system", content=req.instructions)]
                if req.instructions else []) + item_messages(items, len(history))
    if not messages:
        raise InvalidRequestError("input is empty", param="input")
    logprobs = req.top_logprobs is not None or LOGPROBS_INCLUDE in (req.include or [])
    return ChatRequest(
        model=req.model, messages=messages, temperature=req.temperature, top_p=req.top_p,
        max_completion_tokens=req.max_output_tokens, logprobs=logprobs,
        top_logprobs=req.top_logprobs if logprobs else None, user=req.user,
        tools=chat_tools(req.tools), tool_choice=chat_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls, response_format=text_format(req.text),
        adapters=req.adapters, lora_path=req.lora_path, adapter_id=req.adapter_id,
        prompt_cache_key=req.prompt_cache_key, safety_identifier=req.safety_identifier,
    )


def _check_include(include: list[str] | None) -> None:
    for i, value in enumerate(include or []):
        if value != LOGPROBS_INCLUDE:
            raise InvalidRequestError(f"include {value!r} is not supported (only "
                                      f"{LOGPROBS_INCLUDE!r})", param=f"include[{i}]",
                                      code="unsupported_parameter")


def item_messages(items: list[dict], first_new: int = 0) -> list[ChatMessageIn]:
    """Input items as chat messages: messages, function calls (consecutive calls and the
    assistant message before them make one assistant turn) and their outputs (tool messages).
    `first_new`: the index of the request's own first item (errors name input[i] from it)."""
    messages: list[ChatMessageIn] = []
    for i, item in enumerate(items):
        where = f"input[{i - first_new}]" if i >= first_new else "previous_response_id"
        if not isinstance(item, dict):
            raise InvalidRequestError("an input item must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = ToolCallIn(id=_text(item, "call_id", where), function=FunctionCallIn(
                name=_text(item, "name", where), arguments=_text(item, "arguments", where)))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessageIn(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(ChatMessageIn(role="tool", tool_call_id=_text(item, "call_id", where),
                                          content=_parts_text(output, f"{where}.output")))
        else:
            raise InvalidRequestError(f"input items of type {kind!r} are not supported "
                                      "(message, function_call, function_call_output)",
                                      param=f"{where}.type", code="unsupported_parameter")
    return messages


def _message(item: dict, where: str) -> ChatMessageIn:
    role = item.get("role")
    if role not in INPUT_ROLES:
        raise InvalidRequestError(f"unknown role {role!r}", param=f"{where}.role")
    return ChatMessageIn(role=role, content=_parts_text(item.get("content"), f"{where}.content"))


def _parts_text(content, where: str) -> str:
    """A string, or the text of a list of text parts; other parts (images, files) are 400s."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError("content must be a string or a list of parts", param=where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"content parts of type {kind!r} are not supported "
                                      "(text only)", param=f"{where}[{k}]",
                                      code="unsupported_parameter")
        texts.append(part["text"])
    return "".join(texts)


def _text(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{key} must be a string", param=f"{where}.{key}")
    return value


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools as chat tools ({"type", "function": {...}})."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise InvalidRequestError(f"tools of type {tool.get('type')!r} are not supported "
                                      "(function only)", param=f"tools[{i}].type",
                                      code="unsupported_parameter")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict):
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or '
                                  '{"type": "function", "name": ...}', param="tool_choice")
    return choice


def text_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format."""
    if not text:
        return None
    if text.get("verbosity") not in (None, "medium"):
        raise InvalidRequestError("text.verbosity is not supported", param="text.verbosity",
                                  code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequestError(f"text.format of type {fmt.get('type')!r} is not supported",
                              param="text.format.type", code="unsupported_parameter")


# ---- chat result -> response ------------------------------------------------------------------


def message_item(item_id: str, text: str, logprobs: list | None, status="completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text, logprobs)]}


def text_part(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(call: dict, status="completed") -> dict:
    """A chat tool call ({"id", "function": {"name", "arguments"}}) as a function_call item."""
    function = call["function"]
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"], "status": status}


def output_items(message: dict, msg_id: str, logprobs: list | None) -> list[dict]:
    """The assistant message of a chat result as output items: its text, then its calls."""
    items = []
    if message.get("content"):
        items.append(message_item(msg_id, message["content"], logprobs))
    items += [call_item(c) for c in message.get("tool_calls", [])]
    return items


def response_logprobs(chat_logprobs: dict | None) -> list | None:
    """Chat logprobs ({"content": [...]}) as output_text logprobs (the same entries)."""
    return None if chat_logprobs is None else chat_logprobs["content"]


def response_usage(usage: dict) -> dict:
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": usage["prompt_tokens_details"],
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def response_object(resp_id: str, req: ResponsesRequest, model: str, created: int,
                    output: list[dict], status: str, usage: dict | None) -> dict:
    """The Response: `status` in_progress, completed or incomplete (cut by max_output_tokens)."""
    return {
        "id": resp_id, "object": "response", "created_at": created, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "model": model, "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "store": req.store is not False,
        "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
        "top_p": req.top_p, "top_logprobs": req.top_logprobs, "truncation": "disabled",
        "usage": usage, "user": req.user, "metadata": req.metadata or {},
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def now() -> int:
    return int(time.time())
