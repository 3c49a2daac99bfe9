"""The tokenizer process: prompts in (text, token ids or chat messages) -> token ids to the
scheduler; sampled tokens in -> text deltas to the api, with stop strings applied here. A stop
string match aborts the sample at the scheduler so its KV is freed at once."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from radixlora.config import ModelConfig
from radixlora.errors import InvalidRequestError
from radixlora.intake import check_prompt_ids, fill_context, max_total_tokens
from radixlora.server.args import ServerArgs
from radixlora.server.chat import ChatTemplate
from radixlora.server.detokenize import IncrementalDecoder, StopMatcher
from radixlora.server.ipc import Inbox, Outbox, child_main, send_ready
from radixlora.server.messages import (
    AbortReq,
    GenerateReq,
    OutputBatch,
    ReqError,
    SampleOutput,
    TokenBatch,
    TokenizedReq,
    TokenizerInbox,
    TokenOut,
    bytes_to_ids,
    ids_to_bytes,
)
from radixlora.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class SampleState:
    decoder: IncrementalDecoder
    stops: StopMatcher
    token_texts: bool


@dataclass
class ReqState:
    n: int
    stop: list[str]
    token_texts: bool
    samples: dict[int, SampleState] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)


class TokenizerService:
    """Pure logic of the process (no sockets): handle() returns (to_scheduler, to_api)."""

    def __init__(self, args: ServerArgs):
        self.model_cfg = ModelConfig.from_dir(args.model)
        self.max_total = max_total_tokens(self.model_cfg, args.engine_config())
        self.tokenizer = Tokenizer.from_dir(args.model)
        self.chat = ChatTemplate.from_dir(args.model)
        self.reqs: dict[str, ReqState] = {}

    # ---- prompts -----------------------------------------------------------------------------

    def tokenize(self, req: GenerateReq) -> TokenizedReq:
        ids = check_prompt_ids(self._prompt_ids(req), self.model_cfg.vocab_size)
        if len(ids) == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        params = req.params
        if req.fill_context:
            params = fill_context(params, len(ids), self.max_total,
                                  "messages" if req.messages is not None else "prompt")
        return TokenizedReq(
            rid=req.rid, input_ids=ids_to_bytes(ids), params=params, adapters=req.adapters,
            logprob_start=req.logprob_start,
        )

    def _prompt_ids(self, req: GenerateReq) -> np.ndarray:
        if req.input_ids is not None:
            return bytes_to_ids(req.input_ids)
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer.json; send token ids", param="prompt"
            )
        if req.messages is not None:
            messages = [msgspec.structs.asdict(m) for m in req.messages]
            text = self.chat.render(messages)
            return np.asarray(self.tokenizer.encode(text, add_special_tokens=False), np.int32)
        return np.asarray(self.tokenizer.encode(req.prompt or ""), np.int32)

    def on_generate(self, req: GenerateReq):
        try:
            tokenized = self.tokenize(req)
        except InvalidRequestError as e:
            return [], [ReqError(rid=req.rid, message=e.message, code=e.code, param=e.param)]
        if req.prompt_only:
            return [], [self._empty_outputs(req, len(tokenized.input_ids) // 4)]
        self.reqs[req.rid] = ReqState(req.params.n, req.stop, req.token_texts)
        return [tokenized], []

    @staticmethod
    def _empty_outputs(req: GenerateReq, prompt_tokens: int) -> OutputBatch:
        return OutputBatch(outputs=[
            SampleOutput(rid=req.rid, index=i, text="", token_ids=b"", logprobs=[],
                         token_texts=[] if req.token_texts else None, top=None,
                         finish_reason="length", matched_stop=None,
                         prompt_tokens=prompt_tokens, cached_tokens=0)
            for i in range(req.params.n)
        ])

    # ---- outputs -----------------------------------------------------------------------------

    def on_tokens(self, batch: TokenBatch):
        aborts, outputs = [], []
        for out in batch.outputs:
            state = self.reqs.get(out.rid)
            if state is None or out.index in state.done:
                continue  # aborted or stopped by a stop string: late tokens are dropped
            sample = self._output(state, out)
            if sample.finish_reason is not None:
                self._finish_sample(out.rid, state, out.index)
                if out.finish_reason is None:
                    aborts.append(AbortReq(rid=out.rid, index=out.index))
            outputs.append(sample)
        return aborts, ([OutputBatch(outputs=outputs)] if outputs else [])

    def _output(self, state: ReqState, out: TokenOut) -> SampleOutput:
        sample = state.samples.get(out.index)
        if sample is None:
            sample = SampleState(
                IncrementalDecoder(self.tokenizer), StopMatcher(state.stop), state.token_texts
            )
            state.samples[out.index] = sample
        ids = bytes_to_ids(out.token_ids).tolist()
        text = sample.stops.feed(sample.decoder.push(ids)) if self.tokenizer else ""
        finish, matched = out.finish_reason, None
        if sample.stops.matched is not None:
            finish, matched = "stop", sample.stops.matched
        elif finish is not None:
            text += sample.stops.feed(sample.decoder.flush()) if self.tokenizer else ""
            if sample.stops.matched is not None:
                matched = sample.stops.matched
            else:
                text += sample.stops.flush()
                matched = ids[-1] if finish == "stop" and ids else None
        return SampleOutput(
            rid=out.rid,
            index=out.index,
            text=text,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            token_texts=self._texts(ids) if sample.token_texts else None,
            top=self._top(out.top) if sample.token_texts and out.top else None,
            finish_reason=finish,
            matched_stop=matched,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            fallback=out.fallback,
            input_logprobs=out.input_logprobs,
            input_ids=out.input_ids,
        )

    def _texts(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [str(i) for i in ids]
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def _top(self, top: list[list[tuple[int, float]]]) -> list[list[tuple[int, float, str]]]:
        return [[(i, lp, self._texts([i])[0]) for i, lp in row] for row in top]

    def _finish_sample(self, rid: str, state: ReqState, index: int) -> None:
        state.done.add(index)
        state.samples.pop(index, None)
        if len(state.done) >= state.n:
            del self.reqs[rid]

    def on_abort(self, abort: AbortReq) -> None:
        state = self.reqs.get(abort.rid)
        if state is None:
            return
        if abort.index is None:
            del self.reqs[abort.rid]
        else:
            self._finish_sample(abort.rid, state, abort.index)

    def on_error(self, err: ReqError) -> None:
        self.reqs.pop(err.rid, None)


def run(args: ServerArgs, ctx: zmq.Context) -> None:
    service = TokenizerService(args)
    inbox = Inbox(ctx, args.endpoints.tokenizer, TokenizerInbox)
    to_scheduler = Outbox(ctx, args.endpoints.scheduler)
    to_api = Outbox(ctx, args.endpoints.api)
    send_ready(ctx, args, "tokenizer")
    while True:
        msg = inbox.recv()
        to_sched, to_client = dispatch(service, msg)
        for m in to_sched:
            to_scheduler.send(m)
        for m in to_client:
            to_api.send(m)


def dispatch(service: TokenizerService, msg) -> tuple[list, list]:
    if isinstance(msg, GenerateReq):
        return service.on_generate(msg)
    if isinstance(msg, TokenBatch):
        return service.on_tokens(msg)
    if isinstance(msg, AbortReq):
        service.on_abort(msg)
        return [msg], []
    if isinstance(msg, ReqError):
        service.on_error(msg)
        return [], [msg]
    return [], []


if __name__ == "__main__":
    child_main("tokenizer", run)
