"""/v1/responses (OpenAI's Responses API): a request is answered as a chat request
(radixlora.protocol.openai_responses.to_chat), through the chat handler's tokenizing, tool
choice and structured output, and its result is returned as a Response, whole or as the
Responses stream events; kept in the ResponseStore unless `store` is false."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response

from radixlora.protocol.openai_responses import (
    ResponsesRequest,
    call_item,
    input_items,
    message_item,
    new_id,
    now,
    output_items,
    response_logprobs,
    response_object,
    response_usage,
    status_of,
    text_part,
    to_chat,
)
from radixlora.protocol.tools import ToolChoice
from radixlora.server.http.bridge import Generation, ProcessBridge
from radixlora.server.http.common import HttpError, json_response, until_disconnect
from radixlora.server.http.openai_api import (
    OpenAIHandlers,
    as_sample,
    fallback_response,
    sample_chat_logprobs,
    tool_delta,
    usage_of,
)
from radixlora.server.http.response_store import ResponseStore


def event(kind: str, seq: int, **fields) -> bytes:
    """One Responses stream event: its type as the SSE event name and in the data."""
    return (b"event: " + kind.encode() + b"\ndata: "
            + orjson.dumps({"type": kind, "sequence_number": seq, **fields}) + b"\n\n")


class ResponsesHandlers:
    def __init__(self, runtime: ProcessBridge, openai: OpenAIHandlers, store: ResponseStore):
        self.runtime = runtime
        self.openai = openai
        self.store = store

    async def create(self, request: Request, req: ResponsesRequest, owner: str) -> Response:
        history = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id, owner)
            if stored is None:
                raise HttpError(404, f"no stored response {req.previous_response_id!r} (it may "
                                "have expired, been deleted or never been stored)",
                                "response_not_found", "previous_response_id")
            history = stored.conversation
        chat = to_chat(req, history)
        resp_id = new_id("resp")
        gen_req, label, tools = self.openai.chat_req(chat, resp_id)
        gens = self.runtime.submit([gen_req], label, owner)
        turn = Turn(req, resp_id, self.openai.model_of(chat), history + input_items(req), owner,
                    bool(chat.logprobs))
        if req.stream:
            return await self.openai.stream(request, gens, self._events(gens, turn, tools))
        await until_disconnect(request, self.runtime.collect(gens))

        def body() -> dict:
            s = next(iter(gens[0].samples.values()))
            message, finish_reason = tools.message(s.text, s.finish_reason)
            logprobs = response_logprobs(sample_chat_logprobs(s)) if chat.logprobs else None
            output = output_items(message, new_id("msg"), logprobs)
            return self._finished(turn, output, finish_reason, gens)

        return await fallback_response(body, gens)

    def _finished(self, turn: Turn, output: list[dict], finish_reason, gens) -> dict:
        """The final Response, kept when the request asks for it."""
        response = response_object(turn.resp_id, turn.req, turn.model, turn.created, output,
                                   status_of(finish_reason), response_usage(usage_of(gens)))
        if turn.req.store is not False:
            self.store.put(turn.resp_id, turn.owner, response, turn.conversation + output)
        return response

    async def _events(self, gens: list[Generation], turn: Turn,
                      tools: ToolChoice) -> AsyncIterator[bytes]:
        """response.created, in_progress; the message's output_text deltas as they come; then
        each call as a function_call item; response.completed (or incomplete)."""
        seq = Counter()
        start = response_object(turn.resp_id, turn.req, turn.model, turn.created, [],
                                "in_progress", None)
        yield event("response.created", seq(), response=start)
        yield event("response.in_progress", seq(), response=start)
        text, msg_id, sent, streamed, logprobs = "", new_id("msg"), {0: 0}, "", []
        async for _, out in self.runtime.events(gens):
            if tools.mode == "none":
                content, delta, finish_reason = out.text, {}, out.finish_reason
            else:
                text += out.text
                content, delta, finish_reason = tool_delta(tools, text, sent, out)
            step = (response_logprobs(sample_chat_logprobs(as_sample(out)))
                    if turn.logprobs else [])
            logprobs += step
            if content:
                if not streamed:
                    for chunk in _open_message(seq, msg_id):
                        yield chunk
                streamed += content
                yield event("response.output_text.delta", seq(), item_id=msg_id, output_index=0,
                            content_index=0, delta=content, logprobs=step)
            if finish_reason is None:
                continue
            output = [message_item(msg_id, streamed, logprobs)] if streamed else []
            if streamed:
                for chunk in _close_message(seq, msg_id, streamed, logprobs):
                    yield chunk
            for call in delta.get("tool_calls", []):
                item = call_item(call)
                for chunk in _call_events(seq, len(output), item):
                    yield chunk
                output.append(item)
            response = self._finished(turn, output, finish_reason, gens)
            kind = "response.incomplete" if response["status"] == "incomplete" else (
                "response.completed")
            yield event(kind, seq(), response=response)


class Turn:
    """What a response needs besides its result: the request, its ids, the conversation so far."""

    def __init__(self, req: ResponsesRequest, resp_id: str, model: str,
                 conversation: list[dict], owner: str, logprobs: bool):
        self.req, self.resp_id, self.model = req, resp_id, model
        self.conversation, self.owner, self.created = conversation, owner, now()
        self.logprobs = logprobs


class Counter:
    def __init__(self):
        self.n = -1

    def __call__(self) -> int:
        self.n += 1
        return self.n


def _open_message(seq: Counter, msg_id: str):
    item = message_item(msg_id, "", None, status="in_progress")
    item["content"] = []
    yield event("response.output_item.added", seq(), output_index=0, item=item)
    yield event("response.content_part.added", seq(), item_id=msg_id, output_index=0,
                content_index=0, part=text_part(""))


def _close_message(seq: Counter, msg_id: str, text: str, logprobs: list):
    yield event("response.output_text.done", seq(), item_id=msg_id, output_index=0,
                content_index=0, text=text, logprobs=logprobs)
    yield event("response.content_part.done", seq(), item_id=msg_id, output_index=0,
                content_index=0, part=text_part(text, logprobs))
    yield event("response.output_item.done", seq(), output_index=0,
                item=message_item(msg_id, text, logprobs))


def _call_events(seq: Counter, index: int, item: dict):
    yield event("response.output_item.added", seq(), output_index=index,
                item={**item, "arguments": "", "status": "in_progress"})
    yield event("response.function_call_arguments.delta", seq(), item_id=item["id"],
                output_index=index, delta=item["arguments"])
    yield event("response.function_call_arguments.done", seq(), item_id=item["id"],
                output_index=index, name=item["name"], arguments=item["arguments"])
    yield event("response.output_item.done", seq(), output_index=index, item=item)


async def stored_response(store: ResponseStore, resp_id: str, owner: str) -> Response:
    stored = store.get(resp_id, owner)
    if stored is None:
        raise HttpError(404, f"no stored response {resp_id!r}", "response_not_found")
    return json_response(stored.response)


async def delete_response(store: ResponseStore, resp_id: str, owner: str) -> Response:
    if not store.delete(resp_id, owner):
        raise HttpError(404, f"no stored response {resp_id!r}", "response_not_found")
    return json_response({"id": resp_id, "object": "response", "deleted": True})
