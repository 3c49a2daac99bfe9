"""SGLang-native /generate: text or input_ids (one or a batch), sampling_params, lora_path per
prompt, stream (cumulative text per event, as SGLang's RuntimeEndpoint expects), logprobs.
With --adapter-failure-policy base, an output served base-only says why in
meta_info["adapter_fallback"], and a non-streaming response carries FALLBACK_HEADER."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request

from radixlora.protocol.common import (
    adapter_field,
    adapter_label,
    prompt_adapters,
    refuse_unsupported,
    stop_list,
)
from radixlora.protocol.sglang import (
    NEUTRAL_GENERATE,
    NEUTRAL_SGL_SAMPLING,
    GenerateRequest,
    SglSamplingParams,
    logprob_options,
    per_prompt,
    prompt_rids,
    prompts_of,
    sampling_params,
)
from radixlora.server.http.bridge import Generation, ProcessBridge, Sample
from radixlora.server.http.common import (
    SSE_DONE,
    EventStream,
    json_answer,
    sse,
    stream_body,
    until_disconnect,
)
from radixlora.server.http.openai_api import FALLBACK_HEADER
from radixlora.server.messages import GenerateReq, ids_to_bytes


class SglangHandlers:
    def __init__(self, runtime: ProcessBridge, model_name: str, vocab_size: int):
        self.runtime = runtime
        self.model_name = model_name
        self.vocab_size = vocab_size

    def generate_reqs(self, req: GenerateRequest) -> tuple[list[GenerateReq], bool]:
        refuse_unsupported(req, NEUTRAL_GENERATE)
        prompts, batched = prompts_of(req)
        count = len(prompts)
        sampling = per_prompt(req.sampling_params or SglSamplingParams(), count,
                               "sampling_params")
        choices = prompt_adapters(self.model_name, self.model_name, req.adapters, req.lora_path,
                                  count=count)
        options = logprob_options(req, count)
        rids = prompt_rids(req.rid, count)
        reqs = []
        for prompt, sp, adapters, (returned, tops, start), rid in zip(
                prompts, sampling, choices, options, rids):
            text, ids = (prompt, None) if isinstance(prompt, str) else (None, ids_to_bytes(prompt))
            if isinstance(sp, SglSamplingParams):
                refuse_unsupported(sp, NEUTRAL_SGL_SAMPLING)
            scored = start if returned and start >= 0 else None
            reqs.append(GenerateReq(
                rid=rid, params=sampling_params(sp, self.vocab_size, tops if returned else None),
                prompt=text,
                input_ids=ids, fill_context=sp.max_new_tokens is None,
                prompt_only=sp.max_new_tokens == 0 and scored is None,
                score_only=sp.max_new_tokens == 0 and scored is not None,
                logprob_start=scored,
                adapters=adapters,
                adapter_param=adapter_field(req),
                stop=stop_list(sp.stop),
                include_stop=bool(sp.no_stop_trim),
                skip_special_tokens=sp.skip_special_tokens is not False,
                token_texts=returned,
            ))
        return reqs, batched

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
        latency = time.monotonic() - start

        def body():
            outs = [meta_output(gen, s, req, latency) for gen in gens
                    for s in sorted(gen.samples.values(), key=lambda s: s.index)]
            return outs if batched or len(outs) > 1 else outs[0]

        headers = {FALLBACK_HEADER: "base"} if any(g.fallback for g in gens) else None
        return await json_answer(body, gens, headers)

    async def _chunks(self, gens: list[Generation], req, start) -> AsyncIterator[bytes]:
        n = gens[0].n
        async for p, out in self.runtime.events(gens):
            sample = gens[p].samples[out.index]
            chunk = meta_output(gens[p], sample, req, time.monotonic() - start)
            chunk["index"] = p * n + out.index
            yield sse(chunk)
        yield SSE_DONE


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
    if gen.base_mismatch:
        meta["adapter_base_mismatch"] = gen.base_mismatch
    if gen.req.score_only:  # max_new_tokens 0: the token sampled to finish the step is dropped
        s = Sample(s.index, finish_reason="length", input_logprobs=s.input_logprobs,
                   input_ids=s.input_ids, input_texts=s.input_texts, input_top=s.input_top)
        meta["finish_reason"], meta["completion_tokens"] = _finish(s), 0
    if gen.req.params.logprobs is not None:  # return_logprob
        texts = bool(req.return_text_in_logprobs)
        meta["input_token_logprobs"] = input_token_logprobs(s, gen.req.logprob_start, texts)
        meta["output_token_logprobs"] = [
            [lp, t, text if texts else None]
            for lp, t, text in zip(s.logprobs, s.token_ids, s.token_texts)
        ]
        meta["input_top_logprobs"] = input_top_logprobs(s, gen.req.logprob_start, texts)
        meta["output_top_logprobs"] = [
            [[lp, t, text if texts else None] for t, lp, text in row] for row in s.top
        ]
    return {"text": s.text, "output_ids": s.token_ids, "meta_info": meta}


def input_token_logprobs(s: Sample, start: int | None, texts: bool) -> list[list]:
    """SGLang's [logprob, token_id, text] per prompt token from logprob_start_len on (none for
    -1); position 0 has no context, so its logprob is None. Text is None unless asked for
    (return_text_in_logprobs)."""
    if start is None:
        return []
    names = s.input_texts if texts else [None] * len(s.input_ids)
    # from position 0, input_ids and input_texts start with the first prompt token, which has
    # no logprob
    lps = ([None] if start == 0 and s.input_ids else []) + s.input_logprobs
    return [[lp, t, name] for lp, t, name in zip(lps, s.input_ids, names)]


def input_top_logprobs(s: Sample, start: int | None, texts: bool) -> list:
    """SGLang's top [logprob, token_id, text] rows per prompt token, as input_token_logprobs
    (None at position 0); [] without top_logprobs_num or prompt logprobs."""
    if start is None or not s.input_top:
        return []
    rows = [[[lp, t, text if texts else None] for t, lp, text in row] for row in s.input_top]
    return ([None] if start == 0 and s.input_ids else []) + rows


def _finish(s: Sample) -> dict | None:
    if s.finish_reason is None:
        return None
    if s.finish_reason == "length":
        return {"type": "length", "length": len(s.token_ids)}
    return {"type": s.finish_reason, "matched": s.matched_stop}
