"""SGLang's native request shapes (/generate, /abort_request), validated with msgspec, and
their one translation into SamplingParams (sampling_params), with the per-prompt options a
batch of prompts may give one value or a list for (logprob_options, prompt_rids)."""

from __future__ import annotations

import uuid

import msgspec

from radixlora.errors import InvalidRequestError
from radixlora.protocol.common import (
    AdapterRef,
    Int32,
    Int64,
    Strict,
    TokenId,
    build_params,
    completion_prompts,
    logit_bias_pairs,
)
from radixlora.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from radixlora.structured import Structure


class SglSamplingParams(Strict):
    """SGLang's sampling_params; null means the default, as in SGLang."""

    max_new_tokens: Int32 | None = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    n: Int32 | None = None
    ignore_eos: bool | None = None
    sampling_seed: Int64 | None = None
    seed: Int64 | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    spaces_between_special_tokens: bool | None = None  # only matters when they are kept
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None  # the matched stop string ends the text
    # accepted only at the value that asks for nothing radixlora lacks (NEUTRAL_SGL_SAMPLING)
    min_new_tokens: Int32 | None = None
    logit_bias: dict[str, float] | None = None
    regex: str | None = None  # structured output (sgl_structure)
    json_schema: str | None = None
    ebnf: str | None = None
    stop_regex: object = None
    structural_tag: object = None
    beam_width: object = None
    stream_interval: object = None
    custom_params: object = None
    watermark: object = None



NEUTRAL_SGL_SAMPLING: dict[str, tuple] = {
    "stop_regex": ([], ""),
    "structural_tag": (),
    "beam_width": (),
    "stream_interval": (1,),
    "custom_params": ({},),
    "watermark": (),
}



class GenerateRequest(Strict):
    """SGLang's /generate body (GenerateReqInput). The logprob options may be one value for
    every prompt or a list with one per prompt, as in SGLang."""

    text: str | list[str] | None = None
    input_ids: list | None = None
    sampling_params: SglSamplingParams | list[SglSamplingParams] | None = None
    lora_path: str | list[str | None] | None = None
    adapters: list[AdapterRef] | None = None  # radixlora: a weighted stack for every prompt
    stream: bool | None = False
    return_logprob: bool | list[bool] | None = None
    top_logprobs_num: Int32 | list[Int32] | None = None
    logprob_start_len: Int32 | list[Int32] | None = None
    return_text_in_logprobs: bool | None = False
    rid: str | list[str] | None = None
    # accepted only at the value that asks for nothing radixlora lacks (NEUTRAL_GENERATE)
    log_metrics: object = None  # metrics count every request
    token_ids_logprob: object = None
    input_embeds: object = None
    image_data: object = None
    video_data: object = None
    audio_data: object = None
    modalities: object = None
    return_hidden_states: object = None
    return_routed_experts: object = None
    return_entropy: object = None
    return_prompt_token_ids: object = None
    return_sampling_mask: object = None
    session_params: object = None
    custom_logit_processor: object = None
    lora_id: object = None
    priority: object = None
    background: object = None



NEUTRAL_GENERATE: dict[str, tuple] = {
    "log_metrics": (True,),
    "token_ids_logprob": (),
    "input_embeds": (),
    "image_data": (),
    "video_data": (),
    "audio_data": (),
    "modalities": (),
    "return_hidden_states": (False,),
    "return_routed_experts": (False,),
    "return_entropy": (False,),
    "return_prompt_token_ids": (False,),
    "return_sampling_mask": (False,),
    "session_params": (),
    "custom_logit_processor": (),
    "lora_id": (),
    "priority": (),
    "background": (False,),
}



class AbortRequest(msgspec.Struct, kw_only=True):
    rid: str



def sgl_structure(sp: SglSamplingParams) -> Structure | None:
    """SGLang's regex / json_schema / ebnf sampling parameter; two of them are a 400."""
    found = [(name, value) for name, value in (("regex", sp.regex),
                                               ("json_schema", sp.json_schema),
                                               ("ebnf", sp.ebnf)) if value is not None]
    if len(found) > 1:
        raise InvalidRequestError(f"sampling_params.{found[0][0]} and {found[1][0]} both "
                                  "constrain the output: give one",
                                  param=f"sampling_params.{found[1][0]}")
    if not found:
        return None
    name, value = found[0]
    kind = {"regex": "regex", "json_schema": "json_schema", "ebnf": "grammar"}[name]
    return Structure(kind, value, param=f"sampling_params.{name}")


def sampling_params(sp: SglSamplingParams, vocab_size: int,
                    logprobs: int | None) -> SamplingParams:
    """The one translation of SGLang's sampling_params into SamplingParams (logprobs:
    top_logprobs_num when return_logprob, else None)."""
    return build_params(
        vocab_size,
        # 0: prompt only, answered by the tokenizer; None: what the context leaves
        max_tokens=sp.max_new_tokens or None,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
        n=sp.n,
        stop_token_ids=tuple(sp.stop_token_ids or ()),
        ignore_eos=sp.ignore_eos,
        logprobs=logprobs,
        min_tokens=sp.min_new_tokens,
        logit_bias=logit_bias_pairs(sp.logit_bias),
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        structure=sgl_structure(sp),
    )


def prompts_of(req: GenerateRequest) -> tuple[list, bool]:
    """The prompts of a /generate body (text or token ids, one or a batch), and whether it was
    a batch."""
    if (req.text is None) == (req.input_ids is None):
        raise InvalidRequestError("give exactly one of text and input_ids", param="text")
    if req.text is not None:
        if isinstance(req.text, str):
            return [req.text], False
        return completion_prompts(req.text), True
    prompts = completion_prompts(req.input_ids, "input_ids")
    return prompts, bool(req.input_ids) and isinstance(req.input_ids[0], list)


def logprob_options(req: GenerateRequest, count: int) -> list[tuple[bool, int, int]]:
    """(return_logprob, top_logprobs_num, logprob_start_len) of each prompt: each option is one
    value or a list with one per prompt, as in SGLang; -1 (the default) scores no prompt
    token."""
    returned = per_prompt(req.return_logprob, count, "return_logprob")
    tops = per_prompt(req.top_logprobs_num, count, "top_logprobs_num")
    starts = per_prompt(req.logprob_start_len, count, "logprob_start_len")
    out = []
    for r, top, start in zip(returned, tops, starts):
        top = top or 0
        start = -1 if start is None else start
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs_num must be between 0 and {MAX_TOP_LOGPROBS}",
                param="top_logprobs_num",
            )
        if start < -1:
            raise InvalidRequestError("logprob_start_len must be -1 or a prompt position",
                                      param="logprob_start_len")
        out.append((bool(r), top, start))
    return out


def per_prompt(value, count: int, param: str) -> list:
    """One value for each of `count` prompts: `value` for all, or the list giving each its own."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise InvalidRequestError(f"{param}: {len(value)} entries for {count} prompts",
                                  param=param)
    return value


def prompt_rids(rid, count: int) -> list[str]:
    """Each prompt's request id: the ones given, else a fresh one (suffixed -i in a batch)."""
    if rid is None:
        base = uuid.uuid4().hex
        return [base] if count == 1 else [f"{base}-{i}" for i in range(count)]
    rids = per_prompt(rid, count, "rid")
    if any(not r for r in rids):
        raise InvalidRequestError("request ids must be non-empty strings", param="rid")
    return rids
