"""vLLM's utility endpoints: POST /tokenize (a prompt, or chat messages through the chat
template, to the ids generation would see), POST /detokenize (ids to text) and GET /version.
The api process loads its own copy of the tokenizer on the first call; every call's work
(template, tokenizer, token strings) runs on a thread, off the event loop, and a prompt that
cannot fit in the context is refused from its length, as generation refuses it."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from radixlora import __version__
from radixlora.errors import InvalidRequestError
from radixlora.protocol.common import Strict, TokenId
from radixlora.protocol.openai import ChatMessageIn, chat_messages
from radixlora.server.args import ServerArgs
from radixlora.server.http.common import Access, HttpError, json_response, read_json
from radixlora.text.chat import ChatTemplate
from radixlora.text.tokenizer import Tokenizer


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # as /v1/chat/completions takes them
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    tokens: list[TokenId]
    model: str | None = None


class UtilityHandlers:
    def __init__(self, args: ServerArgs, access: Access, vocab_size: int, max_model_len: int):
        self.args = args
        self.access = access
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.lock = threading.Lock()
        self._loaded: tuple[Tokenizer, ChatTemplate] | None = None

    def _tokenizer(self) -> tuple[Tokenizer, ChatTemplate]:
        with self.lock:
            if self._loaded is None:
                tokenizer = Tokenizer.from_dir(self.args.tokenizer_dir)
                if tokenizer is None:
                    raise HttpError(400, "this model has no tokenizer.json", "no_tokenizer")
                self._loaded = tokenizer, ChatTemplate.from_dir(self.args.tokenizer_dir,
                                                                self.args.chat_template)
            return self._loaded

    async def tokenize(self, request: Request) -> Response:
        self.access.identity(request)
        body = await read_json(request, TokenizeRequest, self.args.max_body_bytes)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give either prompt or messages", param="prompt")
        messages = None if body.messages is None else chat_messages(body.messages)
        return json_response(await asyncio.to_thread(self._tokenized, body, messages))

    def _tokenized(self, body: TokenizeRequest, messages: list | None) -> dict:
        """/tokenize's answer, on a thread: rendering, tokenizing and the token strings of a
        long prompt never hold the event loop (the tokenizer releases the GIL)."""
        tokenizer, template = self._tokenizer()
        if messages is not None:
            text = template.prompt([m.as_dict() for m in messages], body.add_generation_prompt,
                                   body.continue_final_message, body.chat_template_kwargs,
                                   body.tools)
            special = bool(body.add_special_tokens)
        else:
            text = body.prompt
            special = body.add_special_tokens is not False
        tokenizer.check_fits(text, self.max_model_len, "messages" if messages else "prompt")
        ids = tokenizer.encode_unlocked(text, special)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = tokenizer.hf.decode_batch([[i] for i in ids],
                                                          skip_special_tokens=False)
        return out

    async def detokenize(self, request: Request) -> Response:
        self.access.identity(request)
        body = await read_json(request, DetokenizeRequest, self.args.max_body_bytes)
        for token in body.tokens:
            if token >= self.vocab_size:
                raise InvalidRequestError(
                    f"token id {token} is outside the vocabulary (size {self.vocab_size})",
                    param="tokens")
        return json_response({"prompt": await asyncio.to_thread(self._detokenized, body.tokens)})

    def _detokenized(self, ids: list[int]) -> str:
        tokenizer, _ = self._tokenizer()
        return tokenizer.decode(ids)

    async def version(self, request: Request) -> Response:
        return json_response({"version": __version__})
