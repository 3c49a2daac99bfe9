"""A request's token limits, checked where the prompt is tokenized (the tokenizer process, the
Engine, offline batches) without the scheduler's imports: the context a request may fill, and
a prompt of token ids."""

from __future__ import annotations

import msgspec
import numpy as np

from radixlora.config import EngineConfig, ModelConfig
from radixlora.errors import InvalidRequestError
from radixlora.sampling_params import SamplingParams


def max_total_tokens(model_cfg: ModelConfig, config: EngineConfig) -> int:
    """Prompt + output tokens one request may hold: the context length, capped by the KV pool
    (one page stays free so a full-length request can always be admitted)."""
    return min(config.max_context(model_cfg), (config.kv_pages - 1) * config.page_size)


def fill_context(params: SamplingParams, prompt_len: int, max_total: int,
                 param: str = "prompt") -> SamplingParams:
    """params with max_tokens set to the room the context leaves after the prompt."""
    room = max_total - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"the prompt ({prompt_len} tokens) leaves no room to generate "
            f"(at most {max_total} tokens in total)",
            param=param,
            code="context_length_exceeded",
        )
    return msgspec.structs.replace(params, max_tokens=room)


def check_prompt_ids(ids, vocab_size: int) -> np.ndarray:
    """A flat prompt of token ids in [0, vocab_size), as int32."""
    try:
        ids = np.asarray(ids)
    except (ValueError, TypeError):
        ids = np.zeros((0, 0))
    if ids.ndim != 1 or (len(ids) and not np.issubdtype(ids.dtype, np.integer)):
        raise InvalidRequestError(
            "a prompt must be a string or a flat list of token ids", param="prompt"
        )
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size})", param="prompt")
    return ids.astype(np.int32)
