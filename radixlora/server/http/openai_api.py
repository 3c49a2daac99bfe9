"""OpenAI-compatible /v1/completions and /v1/chat/completions (streaming or not)."""

from __future__ import annotations

import logging
import secrets
import string
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from radixlora.protocol.common import adapter_field, adapter_label, completion_prompts, stop_list
from radixlora.protocol.openai import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    chat_params,
    completion_params,
    echo_only,
    request_adapters,
)
from radixlora.protocol.responses import (
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    response_head,
    usage,
)
from radixlora.protocol.tools import ToolChoice
from radixlora.sched.adapter_choice import BASE_ALIAS
from radixlora.server.http.bridge import Generation, ProcessBridge, Sample
from radixlora.server.http.common import (
    SSE_DONE,
    EventStream,
    json_answer,
    sse,
    stream_body,
    until_disconnect,
)
from radixlora.server.messages import ChatOptions, GenerateReq, SampleOutput, ids_to_bytes

log = logging.getLogger(__name__)


class OpenAIHandlers:
    def __init__(self, runtime: ProcessBridge, model_name: str, vocab_size: int,
                 tool_parser: str | None = None):
        self.runtime = runtime
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.tool_parser = tool_parser  # --tool-call-parser, or found in the chat template
        self._warned_no_parser = False

    # ---- /v1/completions ---------------------------------------------------------------------

    def completion_reqs(self, req: CompletionRequest, rid: str) -> tuple[list[GenerateReq], str]:
        params = completion_params(req, self.vocab_size)
        prompts = completion_prompts(req.prompt)
        choices = request_adapters(req, self.model_name, len(prompts))
        stops = stop_list(req.stop)
        only = echo_only(req)
        scored = bool(req.echo) and req.logprobs is not None or req.prompt_logprobs is not None
        reqs = []
        for p, (prompt, adapters) in enumerate(zip(prompts, choices)):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, ids_to_bytes(prompt))
            reqs.append(GenerateReq(
                rid=f"{rid}-{p}", params=params, fill_context=req.max_tokens is None, prompt=text,
                input_ids=ids, adapters=adapters, adapter_param=adapter_field(req), stop=stops,
                echo=bool(req.echo),
                logprob_start=0 if scored else None, prompt_only=only and not scored,
                score_only=only and scored,
                include_stop=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                token_texts=req.logprobs is not None or scored,
                token_ids_as_texts=req.return_tokens_as_token_ids,
            ))
        return reqs, batch_label(choices)

    async def completions(self, request: Request, req: CompletionRequest, owner: str):
        head = response_head("cmpl", "text_completion", self.model_of(req))
        reqs, label = self.completion_reqs(req, head["id"])
        gens = self.runtime.submit(reqs, label, owner)
        if req.stream:
            return await self.stream(request, gens, self._completion_chunks(gens, head, req))
        await until_disconnect(request, self.runtime.collect(gens))

        def body() -> dict:
            prompts = completion_prompts(req.prompt)
            choices = [
                _completion_choice(req, prompts[p], p * req.n + s.index, s)
                for p, gen in enumerate(gens)
                for s in sorted(gen.samples.values(), key=lambda s: s.index)
            ]
            return {**head, "choices": choices, "usage": usage_of(gens, dropped=echo_only(req))}

        return await fallback_response(body, gens)

    async def _completion_chunks(self, gens, head, req) -> AsyncIterator[bytes]:
        """With echo, each choice's first chunk starts with its prompt (and with logprobs the
        prompt's tokens, gathered until its first output token), as the finished response
        does (_completion_choice)."""
        prompts = completion_prompts(req.prompt) if req.echo else []
        offsets: dict[int, int] = {}
        echoing: dict[int, Sample] = {}  # echoed choices' events until their first chunk
        async for p, out in self.runtime.events(gens):
            index = p * req.n + out.index
            first = req.echo and index not in offsets
            if first:
                whole = echoing.setdefault(index, Sample(out.index))
                whole.add(out, [])
                if not (whole.logprobs or whole.text or whole.finish_reason):
                    continue
                del echoing[index]
            sample = whole if first else as_sample(out)
            shown = Sample(out.index, finish_reason=sample.finish_reason and "length") if (
                echo_only(req)) else sample
            text, logprobs = shown.text, None
            if first:
                prompt = prompts[p]
                text = (prompt if isinstance(prompt, str) else sample.prompt_text or "") + text
            if req.logprobs is not None:
                logprobs = (_echo_logprobs(sample, shown, req.logprobs) if first
                            else _completion_logprobs(shown, offsets.get(index, 0)))
            if logprobs is not None:  # offsets follow the tokens' strings, as when whole
                base = 0 if first else offsets.get(index, 0)
                offsets[index] = base + sum(len(t) for t in logprobs["tokens"])
            else:
                offsets[index] = offsets.get(index, 0) + len(text)
            choice = completion_choice(index, text, logprobs, shown.finish_reason)
            yield sse({**head, **fallback_fields(gens), "choices": [choice],
                       **obfuscation(req, text), **continuous_usage(req, gens)})
        if include_usage(req):
            yield sse({**head, "choices": [], "usage": usage_of(gens)})
        yield SSE_DONE

    # ---- /v1/chat/completions ----------------------------------------------------------------

    def model_of(self, req) -> str:
        """The response's model: the request's, or the base's name when it named none."""
        return self.model_name if req.model in ("", BASE_ALIAS) else req.model

    def chat_req(self, req: ChatRequest, rid: str) -> tuple[GenerateReq, str, ToolChoice]:
        params, tools = chat_params(req, self.vocab_size, self.tool_parser)
        if tools.mode == "auto" and tools.parser is None and not self._warned_no_parser:
            self._warned_no_parser = True
            log.warning('tool_choice "auto": the chat template shows no tool-call format radixlora '
                        "parses, so outputs are returned as content; launch with "
                        "--tool-call-parser to name one")
        choices = request_adapters(req, self.model_name)[0]
        max_tokens = req.max_tokens if req.max_completion_tokens is None else (
            req.max_completion_tokens)
        gen = GenerateReq(
            rid=rid, params=params, fill_context=max_tokens is None,
            messages=chat_messages(req.messages),
            chat=ChatOptions(add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message,
                             template_kwargs=req.chat_template_kwargs or {},
                             tools=req.tools or None),
            adapters=choices, adapter_param=adapter_field(req), stop=stop_list(req.stop),
            include_stop=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            token_texts=bool(req.logprobs) or req.prompt_logprobs is not None,
            token_ids_as_texts=req.return_tokens_as_token_ids,
            logprob_start=None if req.prompt_logprobs is None else 0,
        )
        return gen, adapter_label(choices), tools

    async def chat(self, request: Request, req: ChatRequest, owner: str):
        head = response_head("chatcmpl", "chat.completion", self.model_of(req))
        gen_req, label, tools = self.chat_req(req, head["id"])
        gens = self.runtime.submit([gen_req], label, owner)
        if req.stream:
            head["object"] = "chat.completion.chunk"
            return await self.stream(request, gens, self._chat_chunks(gens, head, req, tools))
        await until_disconnect(request, self.runtime.collect(gens))

        def body() -> dict:
            choices = []
            for s in sorted(gens[0].samples.values(), key=lambda s: s.index):
                message, finish_reason = tools.message(s.text, s.finish_reason)
                choices.append(chat_choice(s.index, message, sample_chat_logprobs(s) if req.logprobs
                                           else None, finish_reason))
            out = {**head, "choices": choices, "usage": usage_of(gens)}
            if req.prompt_logprobs is not None:  # vLLM: one list for the request's one prompt
                out["prompt_logprobs"] = vllm_prompt_logprobs(
                    next(iter(gens[0].samples.values())), req.prompt_logprobs)
            return out

        return await fallback_response(body, gens)

    async def _chat_chunks(self, gens, head, req, tools: ToolChoice) -> AsyncIterator[bytes]:
        """Content as it comes; with tools, content that may be a call is held back, and the
        calls come as one tool_calls delta when the sample ends."""
        texts: dict[int, str] = {}  # with tools: each sample's text so far
        sent: dict[int, int] = {}  # and how many of its characters went out as content
        async for _, out in self.runtime.events(gens):
            if out.index not in sent:
                texts[out.index], sent[out.index] = "", 0
                first = {"index": out.index, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None}
                yield sse({**head, "choices": [first], **continuous_usage(req, gens)})
            if tools.mode == "none":
                content, delta, finish_reason = out.text, {}, out.finish_reason
            else:
                texts[out.index] += out.text
                content, delta, finish_reason = tool_delta(tools, texts[out.index], sent,
                                                            out)
            if content:
                delta = {"content": content, **delta}
            logprobs = sample_chat_logprobs(as_sample(out)) if req.logprobs else None
            choice = {"index": out.index, "delta": delta, "logprobs": logprobs,
                      "finish_reason": finish_reason}
            yield sse({**head, **fallback_fields(gens), "choices": [choice],
                       **obfuscation(req, content), **continuous_usage(req, gens)})
        if include_usage(req):
            yield sse({**head, "choices": [], "usage": usage_of(gens)})
        yield SSE_DONE

    # ---- shared ------------------------------------------------------------------------------

    async def stream(self, request: Request, gens: list[Generation], chunks):
        """Wait for the first chunk before answering 200, so that errors found by the tokenizer
        or scheduler (unknown adapter, context length) are still proper 4xx responses."""
        first = await until_disconnect(request, chunks.__anext__())
        return EventStream(stream_body(first, chunks))


def batch_label(choices: list) -> str:
    """The metrics label of a request's prompts: their adapter label, or "mixed"."""
    labels = {adapter_label(c) for c in choices}
    return labels.pop() if len(labels) == 1 else "mixed"


def include_usage(req) -> bool:
    return req.stream_options is not None and bool(req.stream_options.include_usage)


def continuous_usage(req, gens: list[Generation]) -> dict:
    """stream_options.continuous_usage_stats (vLLM): the usage so far in every chunk."""
    if req.stream_options is None or not req.stream_options.continuous_usage_stats:
        return {}
    return {"usage": usage_of(gens)}


OBFUSCATION_CHARS = string.ascii_letters + string.digits


def obfuscation(req, text: str) -> dict:
    """stream_options.include_obfuscation: random characters that pad each chunk's text to a
    multiple of 64 characters plus 1-15 (OpenAI's side-channel mitigation)."""
    if req.stream_options is None or not req.stream_options.include_obfuscation:
        return {}
    pad = -len(text) % 64 + secrets.randbelow(15) + 1
    return {"obfuscation": "".join(secrets.choice(OBFUSCATION_CHARS) for _ in range(pad))}


FALLBACK_FINGERPRINT = "radixlora-base-fallback"
FALLBACK_HEADER = "x-radixlora-adapter-fallback"


def fallback_fields(gens: list[Generation]) -> dict:
    """Policy "base": a request whose adapter was unavailable says it was served base-only;
    --qlora-mismatch serve: one whose adapters run on another weight format than they were
    trained on says which."""
    fields = {}
    reason = next((g.fallback for g in gens if g.fallback), None)
    if reason is not None:
        fields |= {"system_fingerprint": FALLBACK_FINGERPRINT, "adapter_fallback": reason}
    mismatch = next((g.base_mismatch for g in gens if g.base_mismatch), None)
    if mismatch is not None:
        fields["adapter_base_mismatch"] = mismatch
    return fields


async def fallback_response(body: Callable[[], dict], gens: list[Generation]):
    """The answer body() makes (json_answer), with the fallback fields and header."""
    fields = fallback_fields(gens)
    headers = {FALLBACK_HEADER: "base"} if "adapter_fallback" in fields else None
    return await json_answer(lambda: {**body(), **fields}, gens, headers)


def as_sample(out: SampleOutput) -> Sample:
    sample = Sample(out.index)
    sample.add(out, [])
    return sample


def tool_delta(tools: ToolChoice, text: str, sent: dict[int, int], out: SampleOutput
                ) -> tuple[str, dict, str | None]:
    """(content, delta, finish_reason) of a chunk of a request with tools: the text that is
    surely content (ToolChoice.streamable) as it comes, and when the sample ends the rest of
    the content and its calls."""
    delta, finish_reason = {}, out.finish_reason
    if finish_reason is None:
        upto = max(tools.streamable(text), sent[out.index])
    else:
        message, finish_reason = tools.message(text, finish_reason)
        upto = len(text)
        if "tool_calls" in message:
            upto = max(tools.streamable(text), sent[out.index])
            delta["tool_calls"] = [{"index": k, **call}
                                   for k, call in enumerate(message["tool_calls"])]
    content, sent[out.index] = text[sent[out.index]:upto], upto
    return content, delta, finish_reason


def vllm_prompt_logprobs(s: Sample, k: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then for each token a map from
    token id to {logprob, rank, decoded_token}: the token itself and the k most likely at its
    position (rank 1 the likeliest; the token's own rank when it is one of them, else null)."""
    out: list[dict | None] = [None]
    rows = zip(s.input_ids[1:], s.input_texts[1:], s.input_logprobs,
               s.input_top or [[]] * len(s.input_logprobs))
    for token, text, logprob, top in rows:
        ranked = {tid: (rank, lp, t) for rank, (tid, lp, t) in enumerate(top[:k], start=1)}
        entry = {str(tid): {"logprob": lp, "rank": rank, "decoded_token": t}
                 for tid, (rank, lp, t) in ranked.items()}
        rank = ranked[token][0] if token in ranked else None
        entry[str(token)] = {"logprob": logprob, "rank": rank, "decoded_token": text}
        out.append(entry)
    return out


def _completion_choice(req: CompletionRequest, prompt: str | list[int], index: int,
                       s: Sample) -> dict:
    """One choice of a finished completion; with echo, the prompt's text (and with logprobs
    its tokens, the first one's logprob null, as OpenAI's legacy API) comes first, and with
    max_tokens 0 only the prompt (the token sampled to finish the step is dropped)."""
    out = Sample(s.index, finish_reason="length") if echo_only(req) else s
    logprobs = None
    if req.logprobs is not None:
        logprobs = _echo_logprobs(s, out, req.logprobs) if req.echo else _completion_logprobs(s)
    text = out.text
    if req.echo:
        text = (prompt if isinstance(prompt, str) else s.prompt_text or "") + text
    choice = completion_choice(index, text, logprobs, out.finish_reason)
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(s, req.prompt_logprobs)
    return choice


def _echo_logprobs(s: Sample, out: Sample, k: int) -> dict:
    """The prompt's tokens (s.input_*, scored from position 0) then the output's."""
    logprobs = completion_logprobs(s.input_texts + out.token_texts,
                                   [None, *s.input_logprobs, *out.logprobs], [])
    if k:
        prompt_top = [{text: lp for _, lp, text in row} for row in s.input_top]
        logprobs["top_logprobs"] = [None, *prompt_top, *(dict(row) for row in _top(out))]
    return logprobs


def usage_of(gens: list[Generation], dropped: bool = False) -> dict:
    """dropped: each sample's sampled token was dropped (echo with max_tokens 0)."""
    completion = 0 if dropped else sum(len(s.token_ids) for g in gens for s in g.samples.values())
    return usage(
        sum(g.prompt_tokens for g in gens), completion, sum(g.cached_tokens for g in gens)
    )


def _top(s: Sample) -> list[list[tuple[str, float]]]:
    return [[(text, lp) for _, lp, text in row] for row in s.top]


def _completion_logprobs(s: Sample, offset: int = 0) -> dict:
    return completion_logprobs(s.token_texts, s.logprobs, _top(s), offset)


def sample_chat_logprobs(s: Sample) -> dict:
    return chat_logprobs(s.token_texts, s.logprobs, _top(s))
