"""SGLang-native /generate: text or input_ids (one or a batch), sampling_params, lora_path per
prompt, stream (cumulative text per event, as SGLang's RuntimeEndpoint expects), logprobs.
With --adapter-failure-policy base, an output served base-only says why in
meta_info["adapter_fallback"], and a non-streaming response carries FALLBACK_HEADER."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request

from radixlora.errors import InvalidRequestError
from radixlora.sampling import MAX_TOP_LOGPROBS
from radixlora.server.bridge import Generation, ProcessBridge, Sample
from radixlora.server.http import (
    SSE_DONE,
    EventStream,
    json_response,
    sse,
    stream_body,
    until_disconnect,
)
from radixlora.server.messages import AdapterChoice, GenerateReq, ids_to_bytes
from radixlora.server.openai_api import FALLBACK_HEADER
from radixlora.server.protocol import (
    GenerateRequest,
    SglSamplingParams,
    adapter_label,
    build_params,
    check_penalties,
    completion_prompts,
    stop_list,
)


class SglangHandlers:
    def __init__(self, runtime: ProcessBridge, model_name: str, vocab_size: int):
        self.runtime = runtime
        self.model_name = model_name
        self.vocab_size = vocab_size

    def generate_reqs(self, req: GenerateRequest) -> tuple[list[GenerateReq], bool]:
        prompts, batched = _prompts(req)
        count = len(prompts)
        sampling = _per_prompt(req.sampling_params or SglSamplingParams(), count,
                               "sampling_params")
        loras = _per_prompt(req.lora_path, count, "lora_path")
        stack = _stack(req)
        rids = _rids(req.rid, count)
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS}",
                param="top_logprobs_num",
            )
        start = max(req.logprob_start_len, 1) if req.return_logprob and (
            req.logprob_start_len >= 0) else None
        reqs = []
        for prompt, sp, lora, rid in zip(prompts, sampling, loras, rids):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, ids_to_bytes(prompt))
            reqs.append(GenerateReq(
                rid=rid, params=self._params(sp, req), prompt=text, input_ids=ids,
                prompt_only=sp.max_new_tokens == 0 and start is None,
                score_only=sp.max_new_tokens == 0 and start is not None,
                logprob_start=start,
                adapters=stack or ([AdapterChoice(lora)] if lora else None),
                stop=stop_list(sp.stop),
                token_texts=req.return_logprob,
            ))
        return reqs, batched

    def _params(self, sp: SglSamplingParams, req: GenerateRequest):
        for name in ("regex", "json_schema", "ebnf"):
            if getattr(sp, name) is not None:
                raise InvalidRequestError(f"{name} is not supported", param=name,
                                          code="unsupported_parameter")
        check_penalties(frequency_penalty=sp.frequency_penalty,
                        presence_penalty=sp.presence_penalty,
                        repetition_penalty=sp.repetition_penalty)
        return build_params(
            self.vocab_size,
            max_tokens=sp.max_new_tokens or 1,  # 0: prompt only, answered by the tokenizer
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
            n=sp.n,
            stop_token_ids=tuple(sp.stop_token_ids or ()),
            ignore_eos=sp.ignore_eos,
            logprobs=req.top_logprobs_num if req.return_logprob else None,
        )

    async def generate(self, request: Request, req: GenerateRequest, owner: str):
        reqs, batched = self.generate_reqs(req)
        labels = {adapter_label(r.adapters) for r in reqs}
        gens = self.runtime.submit(reqs, labels.pop() if len(labels) == 1 else "mixed", owner)
        start = time.monotonic()
        if req.stream:
            chunks = self._chunks(gens, req, start)
            first = await until_disconnect(request, chunks.__anext__())
            return EventStream(stream_body(first, chunks))
        await until_disconnect(request, self.runtime.collect(gens))
        outs = [
            meta_output(gen, s, req, time.monotonic() - start)
            for gen in gens
            for s in sorted(gen.samples.values(), key=lambda s: s.index)
        ]
        headers = {FALLBACK_HEADER: "base"} if any(g.fallback for g in gens) else None
        return json_response(outs if batched or len(outs) > 1 else outs[0], headers=headers)

    async def _chunks(self, gens: list[Generation], req, start) -> AsyncIterator[bytes]:
        n = gens[0].n
        async for p, out in self.runtime.events(gens):
            sample = gens[p].samples[out.index]
            chunk = meta_output(gens[p], sample, req, time.monotonic() - start)
            chunk["index"] = p * n + out.index
            yield sse(chunk)
        yield SSE_DONE


def _prompts(req: GenerateRequest) -> tuple[list, bool]:
    if (req.text is None) == (req.input_ids is None):
        raise InvalidRequestError("give exactly one of text and input_ids", param="text")
    if req.text is not None:
        if isinstance(req.text, str):
            return [req.text], False
        return completion_prompts(req.text), True
    prompts = completion_prompts(req.input_ids, "input_ids")
    return prompts, bool(req.input_ids) and isinstance(req.input_ids[0], list)


def _stack(req: GenerateRequest) -> list[AdapterChoice] | None:
    """`adapters` ([{"name", "weight"}], as on /v1/completions) stacks adapters for every
    prompt; it excludes lora_path."""
    if req.adapters is None:
        return None
    if req.lora_path is not None:
        raise InvalidRequestError("name adapters either in lora_path or in adapters, not both",
                                  param="adapters")
    return [AdapterChoice(a.name, a.weight) for a in req.adapters]


def _per_prompt(value, count: int, param: str) -> list:
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise InvalidRequestError(f"{param}: {len(value)} entries for {count} prompts",
                                  param=param)
    return value


def _rids(rid, count: int) -> list[str]:
    if rid is None:
        base = uuid.uuid4().hex
        return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
    rids = _per_prompt(rid, count, "rid")
    if any(not r for r in rids):
        raise InvalidRequestError("request ids must be non-empty strings", param="rid")
    return rids


def meta_output(gen: Generation, s: Sample, req: GenerateRequest, latency: float) -> dict:
    rid = gen.req.rid if gen.n == 1 else f"{gen.req.rid}-{s.index}"
    meta = {
        "id": rid,
        "finish_reason": _finish(s),
        "prompt_tokens": gen.prompt_tokens,
        "completion_tokens": len(s.token_ids),
        "cached_tokens": gen.cached_tokens,
        "e2e_latency": latency,
    }
    if gen.fallback:
        meta["adapter_fallback"] = gen.fallback
    if gen.req.score_only:  # max_new_tokens 0: the token sampled to finish the step is dropped
        s = Sample(s.index, finish_reason="length", input_logprobs=s.input_logprobs,
                   input_ids=s.input_ids)
        meta["finish_reason"], meta["completion_tokens"] = _finish(s), 0
    if req.return_logprob:
        meta["input_token_logprobs"] = input_token_logprobs(s, req.logprob_start_len)
        meta["output_token_logprobs"] = [
            [lp, t, text] for lp, t, text in zip(s.logprobs, s.token_ids, s.token_texts)
        ]
        meta["output_top_logprobs"] = [[[lp, t, text] for t, lp, text in row] for row in s.top]
    return {"text": s.text, "output_ids": s.token_ids, "meta_info": meta}


def input_token_logprobs(s: Sample, start_len: int) -> list[list]:
    """SGLang's [logprob, token_id, text] per prompt token from logprob_start_len on; position 0
    has no context, so its logprob is None."""
    entries = [[lp, t, None] for lp, t in zip(s.input_logprobs, s.input_ids)]
    return ([[None, None, None]] if start_len == 0 else []) + entries


def _finish(s: Sample) -> dict | None:
    if s.finish_reason is None:
        return None
    if s.finish_reason == "length":
        return {"type": "length", "length": len(s.token_ids)}
    return {"type": s.finish_reason, "matched": s.matched_stop}
