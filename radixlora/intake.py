"""Request intake shared by the offline Engine, the tokenizer and scheduler processes and the
batch-file runner: the context rule that turns an omitted max_tokens into what the context
leaves after the prompt."""

from __future__ import annotations

import msgspec

from radixlora.config import EngineConfig, ModelConfig
from radixlora.errors import InvalidRequestError
from radixlora.sampling import SamplingParams


def max_total_tokens(model_cfg: ModelConfig, config: EngineConfig) -> int:
    """Prompt + output tokens one request may hold: the model's context, capped by the KV pool
    (one page stays free so a full-length request can always be admitted)."""
    return min(model_cfg.max_position, (config.kv_pages - 1) * config.page_size)


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
