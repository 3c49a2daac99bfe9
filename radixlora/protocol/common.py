"""What the OpenAI and SGLang request shapes share: strict request objects (an undeclared field
is a 400 naming it), range-checked integer types, and the checks both translations into
SamplingParams use (stop strings, unsupported fields, adapter choices, prompts, logit bias).
Everything a user can get wrong is rejected here or in the tokenizer/scheduler with an
InvalidRequestError naming the field."""

from __future__ import annotations

from typing import Annotated

import msgspec

from radixlora.errors import InvalidRequestError
from radixlora.sampling_params import SamplingParams
from radixlora.sched.adapter_choice import BASE_ALIAS, AdapterChoice

MAX_STOP_STRINGS = 16

MAX_STOP_CHARS = 256

MAX_PROMPTS = 64

MAX_INT = 2**31 - 1

# Every integer is range-checked while decoding, before anything converts it to a fixed-width
# type (int32 token arrays, int64 sampler rows): out of range is a 400 naming the field.
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=MAX_INT)]

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]

TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]



class Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request object: a field it does not declare is a 400 `unknown_parameter` listing every
    such name (`unknown_fields`), never dropped."""



class AdapterRef(Strict):
    name: str
    weight: float = 1.0



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



def refuse_unsupported(obj, neutral: dict[str, tuple], prefix: str = "") -> None:
    """A 400 unsupported_parameter for the first field of `neutral` set to a value other than
    null or one of its neutral values."""
    for name, values in neutral.items():
        value = getattr(obj, name)
        if value is not None and not any(_same(value, v) for v in values):
            raise InvalidRequestError(f"{prefix}{name} is not supported", param=prefix + name,
                                      code="unsupported_parameter")



def _same(value, neutral) -> bool:
    return type(value) is type(neutral) and value == neutral



def unknown_fields(raw: bytes, schema) -> list[str]:
    """The names (dotted paths for nested objects) in the JSON body `raw` that `schema` and the
    objects in it do not declare; empty when `raw` is not JSON."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return []
    found: list[str] = []
    _unknown(value, msgspec.inspect.type_info(schema), "", found)
    return found



def _unknown(value, info, path: str, found: list[str]) -> None:
    if isinstance(info, msgspec.inspect.UnionType):
        for option in info.types:
            if isinstance(value, dict) and isinstance(option, msgspec.inspect.StructType) or (
                    isinstance(value, list) and isinstance(option, msgspec.inspect.ListType)):
                _unknown(value, option, path, found)
                return
    elif isinstance(info, msgspec.inspect.StructType) and isinstance(value, dict):
        fields = {f.encode_name: f.type for f in info.fields}
        for name, item in value.items():
            if name not in fields:
                found.append(path + name)
            else:
                _unknown(item, fields[name], f"{path}{name}.", found)
    elif isinstance(info, msgspec.inspect.ListType) and isinstance(value, list):
        for i, item in enumerate(value):
            _unknown(item, info.item_type, f"{path.rstrip('.')}[{i}].", found)



def adapter_field(req) -> str:
    """The field of a request (OpenAI's or SGLang's /generate) that named its adapters, which
    an error about them names as its param."""
    if getattr(req, "adapters", None):
        return "adapters"
    if getattr(req, "lora_path", None) is not None:
        return "lora_path"
    if getattr(req, "adapter_id", None) is not None:
        return "adapter_id"
    return "model"



def prompt_adapters(model: str, base_name: str, adapters: list[AdapterRef] | None,
                    lora_path: str | list[str | None] | None = None,
                    adapter_id: str | None = None, count: int = 1,
                    ) -> list[list[AdapterChoice] | None]:
    """The adapter choice of each of `count` prompts. `model` is the base name, "BASE:ADAPTER"
    or "ADAPTER"; `adapters` stacks weighted ones for every prompt (then `model` must name the
    base); SGLang's `lora_path` names one adapter (null: the base) for every prompt or, as a
    list, for each; LoRAX's `adapter_id` names one. Fields that name different adapters for
    one prompt are a 400 naming the later field."""
    if not model or model == BASE_ALIAS:  # no model, or SGLang's "default": the base
        model = base_name
    named, source = None, "model"
    if model.startswith(base_name + ":"):
        named = model[len(base_name) + 1 :]
        if not named:
            raise InvalidRequestError(f"{model!r} names no adapter after ':'", param="model")
    elif model != base_name:
        named = model
    if adapter_id is not None:
        if not adapter_id:
            raise InvalidRequestError("adapter_id must name an adapter", param="adapter_id")
        if named is not None and named != adapter_id:
            raise InvalidRequestError(
                f"model names adapter {named!r} and adapter_id names {adapter_id!r}: name one",
                param="adapter_id")
        named, source = adapter_id, "adapter_id"
    per_prompt = [named] * count
    if lora_path is not None:
        paths = lora_path if isinstance(lora_path, list) else [lora_path] * count
        if len(paths) != count:
            raise InvalidRequestError(
                f"lora_path: {len(paths)} entries for {count} prompts", param="lora_path")
        if any(p == "" for p in paths):
            raise InvalidRequestError("lora_path entries must be adapter names or null",
                                      param="lora_path")
        if named is not None and any(p != named for p in paths):
            raise InvalidRequestError(
                f"{source} names adapter {named!r} and lora_path names "
                f"{next(p for p in paths if p != named)!r}: name one", param="lora_path")
        per_prompt = paths
    if adapters is not None:
        if any(p is not None for p in per_prompt) or lora_path is not None:
            field = source if lora_path is None else "lora_path"
            raise InvalidRequestError(
                f"name adapters either in `{field}` or in `adapters`, not both",
                param="adapters")
        stack = [AdapterChoice(a.name, a.weight) for a in adapters] or None
        return [stack] * count
    return [[AdapterChoice(p)] if p is not None else None for p in per_prompt]



def adapter_label(choices: list[AdapterChoice] | None) -> str:
    if not choices:
        return "base"
    return "+".join(c.name if c.weight == 1.0 else f"{c.name}*{c.weight:g}" for c in choices)



def build_params(vocab_size: int, **fields) -> SamplingParams:
    """SamplingParams from request fields (None = default), validated; max_tokens None is
    checked as max(1, min_tokens) and resolved after tokenization (GenerateReq.fill_context)."""
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.setdefault("max_tokens", max(1, fields.get("min_tokens", 0)))
    params = SamplingParams(**fields)
    params.validate(vocab_size)
    return params



def logit_bias_pairs(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's logit_bias (token ids as JSON object keys) as SamplingParams takes it."""
    if not bias:
        return None
    try:
        return tuple((int(token), value) for token, value in bias.items())
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids (integers as strings)",
                                  param="logit_bias") from None



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
