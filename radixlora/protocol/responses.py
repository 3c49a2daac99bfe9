"""OpenAI response bodies of /v1/completions and /v1/chat/completions, built from plain values:
one set of builders for the HTTP server (radixlora.server.http.openai_api) and the batch
runner (radixlora.cli.run_batch). A `top` row is one generated token's alternatives, (token
text, logprob)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

TopRow = Sequence[tuple[str, float]]


def response_head(prefix: str, kind: str, model: str) -> dict:
    """id, object and creation time of a response (or of each chunk of a stream)."""
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, message: str | dict, logprobs: dict | None, finish_reason) -> dict:
    """message: the content, or the whole assistant message (with tool calls)."""
    if isinstance(message, str):
        message = {"role": "assistant", "content": message}
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason}


def completion_logprobs(
    token_texts: list[str], logprobs: list[float], top: Sequence[TopRow], offset: int = 0
) -> dict:
    """/v1/completions logprobs; `offset`: the text offset of the first token."""
    offsets = []
    for text in token_texts:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": token_texts,
        "token_logprobs": logprobs,
        "top_logprobs": [dict(row) for row in top] if top else None,
        "text_offset": offsets,
    }


def chat_logprobs(token_texts: list[str], logprobs: list[float], top: Sequence[TopRow]) -> dict:
    tops = top or [[] for _ in token_texts]
    return {
        "content": [
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": tlp, "bytes": list(t.encode())} for t, tlp in row
                ],
            }
            for text, lp, row in zip(token_texts, logprobs, tops)
        ]
    }
