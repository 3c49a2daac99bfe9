"""The tokenizer process: prompts in (text, token ids or chat messages) -> token ids to the
scheduler; sampled tokens in -> text deltas to the api, with stop strings applied here. A stop
string match aborts the sample at the scheduler so its KV is freed at once. With data-parallel
replicas it also routes: the Router picks each tokenized request's replica, and every later
message about that request (aborts) goes to the same replica."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from radixlora.config import ModelConfig
from radixlora.errors import InvalidRequestError
from radixlora.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from radixlora.sched.prompt_limits import check_prompt_ids, fill_context, max_total_tokens
from radixlora.server.args import ServerArgs
from radixlora.server.ipc import (
    Heartbeats,
    Inbox,
    Outbox,
    child_main,
    failure_error,
    log_failure,
    send_ready,
    serve_forever,
)
from radixlora.server.messages import (
    AbortReq,
    ChatOptions,
    GenerateReq,
    OutputBatch,
    ReqError,
    RouterStats,
    SampleOutput,
    TokenBatch,
    TokenizedReq,
    TokenizerInbox,
    TokenOut,
    bytes_to_id_list,
    bytes_to_ids,
    ids_to_bytes,
)
from radixlora.server.procs.router import Router
from radixlora.text.chat import ChatTemplate
from radixlora.text.detokenize import StopStream
from radixlora.text.tokenizer import Tokenizer

log = logging.getLogger(__spec__.name)  # the module's name also when run with -m

INLINE_PROMPT_CHARS = 16 * 1024  # longer prompts tokenize on the pool's threads
TOKENIZE_THREADS = 2
BEAT_POLL_MS = 250  # the loop comes round at least this often to beat
ROUTER_STATS_S = 0.5  # how often the router's report goes to the api (replicas > 1)
RECENT_ROUTES = 4096  # ended requests whose replica is remembered (a late abort finds it)


def _id_texts(ids: list[int]) -> list[str]:
    """vLLM's return_tokens_as_token_ids: each token as "token_id:N" (whatever its text)."""
    return [f"token_id:{i}" for i in ids]


def _top(top: list[list[tuple[int, float]]], texts) -> list[list[tuple[int, float, str]]]:
    return [[(i, lp, text) for (i, lp), text in zip(row, texts([i for i, _ in row]))]
            for row in top]


@dataclass
class SampleState:
    stream: StopStream | None  # None: the model has no tokenizer (no text)
    token_texts: bool


@dataclass
class ReqState:
    n: int
    stop: list[str]
    token_texts: bool
    include_stop: bool = False
    skip_special_tokens: bool = True
    head: int | None = None  # logprob_start 0: the first prompt token, reported unscored
    prompt_text: str | None = None  # echo of a token-id prompt (GenerateReq.echo)
    min_tokens: int = 0
    ids_as_texts: bool = False  # GenerateReq.token_ids_as_texts
    samples: dict[int, SampleState] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)


class TokenizerService:
    """Pure logic of the process (no sockets): the handlers return (to_scheduler, to_api).
    After start_pool(), prompts longer than INLINE_PROMPT_CHARS are tokenized on the pool's
    threads, which send their results themselves."""

    def __init__(self, args: ServerArgs):
        self.model_cfg = ModelConfig.from_dir(args.model)
        self.max_total = max_total_tokens(self.model_cfg, args.engine_config())
        self.max_logprob_entries = args.max_logprob_entries or (
            self.max_total * (1 + MAX_TOP_LOGPROBS))
        self.tokenizer = Tokenizer.from_dir(args.tokenizer_dir)
        self.chat = ChatTemplate.from_dir(args.tokenizer_dir, args.chat_template)
        self.reqs: dict[str, ReqState] = {}
        # Guards reqs and pending. A pool thread sends its result while holding it, so an abort
        # either finds its request pending or follows its TokenizedReq to the scheduler.
        self.lock = threading.RLock()
        self.pending: dict[str, list[AbortReq]] = {}  # in the pool: the aborts held for it
        self.jobs: queue.SimpleQueue[GenerateReq] | None = None
        self.send: Callable[[list, list], None] | None = None
        self.router = make_router(args)
        self.routes: dict[str, int] = {}  # rid -> its replica, while the request lives
        self.ended: collections.OrderedDict[str, int] = collections.OrderedDict()

    def start_pool(self, send: Callable[[list, list], None],
                   threads: int = TOKENIZE_THREADS) -> None:
        """Tokenize long prompts on `threads` daemon threads; each sends its results through
        send(to_scheduler, to_api), which must be safe to call from any thread."""
        self.send = send
        self.jobs = queue.SimpleQueue()
        for i in range(threads):
            threading.Thread(target=self._work, name=f"tokenize-{i}", daemon=True).start()

    # ---- prompts -----------------------------------------------------------------------------

    def tokenize(self, req: GenerateReq) -> TokenizedReq:
        replicas = self.router.num_replicas
        if req.data_parallel_rank is not None and req.data_parallel_rank >= replicas:
            raise InvalidRequestError(f"data_parallel_rank must be below the {replicas} "
                                      "replicas", param="data_parallel_rank")
        ids = check_prompt_ids(self._prompt_ids(req), self.model_cfg.vocab_size)
        if len(ids) == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        params = req.params
        if req.fill_context:
            params = fill_context(params, len(ids), self.max_total,
                                  "messages" if req.messages is not None else "prompt")
        if params.bad_words:
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words needs the model's tokenizer.json",
                                          param="bad_words")
            params = msgspec.structs.replace(
                params, bad_words_ids=self.tokenizer.bad_words_ids(params.bad_words))
        # position 0 has no context: scoring starts at 1 and the api reports it unscored
        start = 1 if req.logprob_start == 0 else req.logprob_start
        self.check_logprobs(req, params, len(ids))
        return TokenizedReq(
            rid=req.rid, input_ids=ids_to_bytes(ids), params=params, adapters=req.adapters,
            logprob_start=start, adapter_param=req.adapter_param,
        )

    def check_logprobs(self, req: GenerateReq, params: SamplingParams, prompt_len: int) -> None:
        """The logprob entries the prompt's answer may hold (every sample repeats the prompt's)
        within its share of max_logprob_entries: the answer is built and held in memory whole."""
        scored = prompt_len - req.logprob_start if req.logprob_start is not None else 0
        outputs = params.max_tokens if params.logprobs is not None else 0
        entries = params.n * (scored + outputs) * (1 + (params.logprobs or 0))
        share = self.max_logprob_entries // req.request_prompts
        if entries > share:
            split = (f", {share} for each of its {req.request_prompts} prompts"
                     if req.request_prompts > 1 else "")
            raise InvalidRequestError(
                f"the logprobs asked would return {entries} entries (n {params.n} x "
                f"({scored} prompt + {outputs} output tokens) x (1 + {params.logprobs or 0} "
                f"top)); a request may return at most {self.max_logprob_entries}{split} "
                "(--max-logprob-entries): ask fewer samples, tokens or top logprobs",
                param="logprobs", code="too_many_logprobs")

    def _prompt_ids(self, req: GenerateReq) -> np.ndarray:
        if req.input_ids is not None:
            return bytes_to_ids(req.input_ids)
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer.json; send token ids", param="prompt"
            )
        if req.messages is not None:
            chat = req.chat or ChatOptions()
            text = self.chat.prompt([m.as_dict() for m in req.messages],
                                    chat.add_generation_prompt, chat.continue_final_message,
                                    chat.template_kwargs, chat.tools)
            self.check_bytes(text, "messages")
            ids = self.tokenizer.encode_unlocked(text, add_special_tokens=False)
        else:
            text = req.prompt or ""
            self.check_bytes(text, "prompt")
            ids = self.tokenizer.encode_unlocked(text)
        return np.asarray(ids, np.int32)

    def check_bytes(self, text: str, param: str) -> None:
        """Reject a text too long to fit in the context whatever its tokens, untokenized."""
        if self.tokenizer is not None:
            self.tokenizer.check_fits(text, self.max_total, param)

    def on_generate(self, req: GenerateReq):
        try:
            if req.prompt is not None:
                self.check_bytes(req.prompt, "prompt")
        except InvalidRequestError as e:
            return [], [_req_error(req.rid, e)]
        if self.jobs is None or _prompt_chars(req) <= INLINE_PROMPT_CHARS:
            return self._answer(req, self._outcome(req))
        with self.lock:
            self.pending[req.rid] = []
        self.jobs.put(req)
        return [], []

    def _outcome(self, req: GenerateReq) -> TokenizedReq | ReqError:
        try:
            return self.tokenize(req)
        except InvalidRequestError as e:
            return _req_error(req.rid, e)

    def _answer(self, req: GenerateReq, outcome: TokenizedReq | ReqError):
        if isinstance(outcome, ReqError):
            return [], [outcome]
        text = self._echo_text(req, outcome)
        if req.prompt_only:
            return [], [self._empty_outputs(req, len(outcome.input_ids) // 4, text)]
        head = int(bytes_to_ids(outcome.input_ids)[0]) if req.logprob_start == 0 else None
        with self.lock:
            self.reqs[req.rid] = ReqState(req.params.n, req.stop, req.token_texts,
                                          req.include_stop, req.skip_special_tokens, head, text,
                                          req.params.min_tokens, req.token_ids_as_texts)
            self.routes[req.rid] = self.router.route(req.adapters,
                                                     bytes_to_ids(outcome.input_ids),
                                                     req.params.n, req.data_parallel_rank)
        return [outcome], []

    def replicas_for(self, msg) -> list[int]:
        """The replicas a message to the schedulers goes to: its request's, else (a request
        the tokenizer does not know) every one."""
        with self.lock:
            replica = self.routes.get(msg.rid, self.ended.get(msg.rid))
        return list(range(self.router.num_replicas)) if replica is None else [replica]

    def _end(self, rid: str, samples: int) -> None:
        """`samples` samples of rid left the replica (finished, aborted, failed)."""
        replica = self.routes.get(rid)
        if replica is None:
            return
        self.router.release(replica, samples)
        if rid not in self.reqs:
            del self.routes[rid]
            self.ended[rid] = replica
            if len(self.ended) > RECENT_ROUTES:
                self.ended.popitem(last=False)

    def _work(self) -> None:
        while True:
            req = self.jobs.get()
            try:
                outcome = self._outcome(req)
            except Exception:  # noqa: BLE001 - one prompt never stops the pool
                log.exception("tokenizing request %s failed", req.rid)
                outcome = ReqError(rid=req.rid, message="internal error while tokenizing",
                                   code="internal_error", status=500)
            try:
                self._deliver(req, outcome)
            except Exception:  # noqa: BLE001 - sockets closed at exit
                log.exception("sending the tokens of request %s failed", req.rid)

    def _deliver(self, req: GenerateReq, outcome: TokenizedReq | ReqError) -> None:
        """Send a pool result, or nothing if the request was aborted meanwhile (the scheduler
        never heard of it); aborts of single samples follow their TokenizedReq."""
        with self.lock:
            held = self.pending.pop(req.rid)
            if any(abort.index is None for abort in held):
                return
            to_sched, to_api = self._answer(req, outcome)
            if to_sched:
                for abort in held:
                    self._abort(abort)
                to_sched += held
            self.send(to_sched, to_api)

    def _echo_text(self, req: GenerateReq, outcome: TokenizedReq) -> str | None:
        """An echoed token-id prompt's text (a text prompt is echoed by the api as given)."""
        if not req.echo or req.input_ids is None or self.tokenizer is None:
            return None
        return self.tokenizer.decode(bytes_to_id_list(outcome.input_ids),
                                     req.skip_special_tokens)

    @staticmethod
    def _empty_outputs(req: GenerateReq, prompt_tokens: int,
                       prompt_text: str | None = None) -> OutputBatch:
        return OutputBatch(outputs=[
            SampleOutput(rid=req.rid, index=i, text="", token_ids=b"", logprobs=[],
                         token_texts=[] if req.token_texts else None, top=None,
                         finish_reason="length", matched_stop=None,
                         prompt_tokens=prompt_tokens, cached_tokens=0, prompt_text=prompt_text)
            for i in range(req.params.n)
        ])

    # ---- outputs -----------------------------------------------------------------------------

    def on_tokens(self, batch: TokenBatch):
        with self.lock:
            return self._on_tokens(batch)

    def _on_tokens(self, batch: TokenBatch):
        aborts, outputs, errors = [], [], []
        for out in batch.outputs:
            state = self.reqs.get(out.rid)
            if state is None or out.index in state.done:
                continue  # aborted or stopped by a stop string: late tokens are dropped
            try:
                sample = self._output(state, out)
            except Exception:  # noqa: BLE001 - one request's text never stops the others
                log.exception("detokenizing request %s failed; it ends with an error", out.rid)
                del self.reqs[out.rid]
                self._end(out.rid, state.n - len(state.done))
                aborts.append(AbortReq(rid=out.rid))
                errors.append(ReqError(rid=out.rid, message="internal error while detokenizing "
                                       "the output", code="internal_error", status=500))
                continue
            if sample.finish_reason is not None:
                self._finish_sample(out.rid, state, out.index)
                if out.finish_reason is None:
                    aborts.append(AbortReq(rid=out.rid, index=out.index))
            outputs.append(sample)
        return aborts, ([OutputBatch(outputs=outputs)] if outputs else []) + errors

    def _output(self, state: ReqState, out: TokenOut) -> SampleOutput:
        sample = state.samples.get(out.index)
        input_ids, prompt_text = out.input_ids, None
        if sample is None:
            prompt_text = state.prompt_text
            stream = None if self.tokenizer is None else StopStream(
                self.tokenizer, state.stop, state.include_stop, state.min_tokens,
                state.skip_special_tokens)
            sample = SampleState(stream, state.token_texts)
            state.samples[out.index] = sample
            if state.head is not None:
                input_ids = ids_to_bytes([state.head, *bytes_to_id_list(input_ids)])
        ids = bytes_to_id_list(out.token_ids)
        texts = _id_texts if state.ids_as_texts else self._texts
        finish = out.finish_reason
        if sample.stream is not None:
            text, finish, matched = sample.stream.step(ids, finish)
        else:
            text, matched = "", ids[-1] if finish == "stop" and ids else None
        return SampleOutput(
            rid=out.rid,
            index=out.index,
            text=text,
            token_ids=out.token_ids,
            logprobs=out.logprobs,
            token_texts=texts(ids) if sample.token_texts else None,
            top=_top(out.top, texts) if sample.token_texts and out.top else None,
            finish_reason=finish,
            matched_stop=matched,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            fallback=out.fallback,
            base_mismatch=out.base_mismatch,
            input_logprobs=out.input_logprobs,
            input_ids=input_ids,
            input_top=_top(out.input_top, texts) if sample.token_texts and out.input_top else None,
            prompt_text=prompt_text,
            input_texts=texts(bytes_to_id_list(input_ids))
            if sample.token_texts and input_ids else None,
            scheduled_at=out.scheduled_at,
        )

    def _texts(self, ids: list[int]) -> list[str]:
        if self.tokenizer is None:
            return [str(i) for i in ids]
        return [self.tokenizer.decode([i], skip_special_tokens=False) for i in ids]

    def _finish_sample(self, rid: str, state: ReqState, index: int) -> None:
        state.done.add(index)
        state.samples.pop(index, None)
        if len(state.done) >= state.n:
            del self.reqs[rid]
        self._end(rid, 1)

    def on_abort(self, abort: AbortReq) -> list[AbortReq]:
        """The aborts to forward to the scheduler: none for a request still being tokenized
        (the abort is held and applied when tokenization ends)."""
        with self.lock:
            held = self.pending.get(abort.rid)
            if held is not None:
                held.append(abort)
                return []
            self._abort(abort)
            return [abort]

    def _abort(self, abort: AbortReq) -> None:
        state = self.reqs.get(abort.rid)
        if state is None:
            return
        if abort.index is None:
            del self.reqs[abort.rid]
            self._end(abort.rid, state.n - len(state.done))
        else:
            self._finish_sample(abort.rid, state, abort.index)

    def on_error(self, err: ReqError) -> None:
        with self.lock:
            state = self.reqs.pop(err.rid, None)
            if state is not None:
                self._end(err.rid, state.n - len(state.done))

    def router_stats(self) -> RouterStats:
        with self.lock:
            return RouterStats(**self.router.snapshot())


def make_router(args: ServerArgs) -> Router:
    """The router over args' replicas: each replica's tree bounded by its KV capacity, the load
    bound a quarter of its running batch (SGLang's default is 64 for a batch of 256). args:
    sized by the worker (the tokenizer starts once it is)."""
    config = args.engine_config()
    if not config.sized:
        raise ValueError("the tokenizer's router needs the worker's pool sizes")
    return Router(args.data_parallel_size, args.router_policy,
                  max_tree_tokens=config.kv_pages * config.page_size,
                  balance_abs=max(2, config.max_running // 4))


def _req_error(rid: str, e: InvalidRequestError) -> ReqError:
    return ReqError(rid=rid, message=e.message, code=e.code, param=e.param)


def _prompt_chars(req: GenerateReq) -> int:
    if req.prompt is not None:
        return len(req.prompt)
    if req.messages is not None:
        return sum(len(m.role) + len(m.content) for m in req.messages)
    return 0


class LockedOutbox(Outbox):
    """An Outbox shared by the loop and the tokenizing threads: one send at a time."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        super().__init__(ctx, endpoint)
        self.lock = threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            super().send(msg)


def sender(service: TokenizerService, to_schedulers: list[Outbox],
           to_api: Outbox) -> Callable[[list, list], None]:
    """send(to_sched, to_api): each message to the schedulers goes to its request's replica."""

    def send(to_sched: list, to_client: list) -> None:
        for m in to_sched:
            for replica in service.replicas_for(m):
                to_schedulers[replica].send(m)
        for m in to_client:
            to_api.send(m)

    return send


def run(args: ServerArgs, ctx: zmq.Context) -> None:
    service = TokenizerService(args)
    to_schedulers = [LockedOutbox(ctx, e) for e in args.endpoints.scheduler_list]
    to_api = LockedOutbox(ctx, args.endpoints.api)
    send = sender(service, to_schedulers, to_api)
    service.start_pool(send)
    inbox = Inbox(ctx, args.endpoints.tokenizer, TokenizerInbox, reject=to_api.send)
    heart = Heartbeats(ctx, args, "tokenizer")
    send_ready(ctx, args, "tokenizer")
    loop = TokenizerLoop(service, inbox, send, to_api, routes=len(to_schedulers) > 1)
    serve_forever(heart, loop.turn)


@dataclass
class TokenizerLoop:
    """Each turn handles the messages that came within BEAT_POLL_MS; with several replicas it
    reports the router's load to the api every ROUTER_STATS_S."""

    service: TokenizerService
    inbox: Inbox
    send: Callable
    to_api: LockedOutbox
    routes: bool
    handled: int = 0
    next_report: float = 0.0

    def turn(self) -> int:
        for msg in self.inbox.recv_within(BEAT_POLL_MS):
            self.handled += 1
            self.send(*handle(self.service, msg))
        if self.routes and time.monotonic() >= self.next_report:
            self.next_report = time.monotonic() + ROUTER_STATS_S
            self.to_api.send(self.service.router_stats())
        return self.handled


def handle(service: TokenizerService, msg) -> tuple[list, list]:
    """dispatch(), with a failure answered (a request) or logged, never raised."""
    try:
        return dispatch(service, msg)
    except Exception:  # noqa: BLE001 - one message never stops the process
        log_failure("tokenizer", msg)
        error = failure_error(msg) if isinstance(msg, GenerateReq) else None
        return [], [error] if error is not None else []


def dispatch(service: TokenizerService, msg) -> tuple[list, list]:
    if isinstance(msg, GenerateReq):
        try:
            msg.params.validate(service.model_cfg.vocab_size)
        except InvalidRequestError as e:
            return [], [ReqError(rid=msg.rid, message=e.message, code=e.code, param=e.param)]
        return service.on_generate(msg)
    if isinstance(msg, TokenBatch):
        return service.on_tokens(msg)
    if isinstance(msg, AbortReq):
        return service.on_abort(msg), []
    if isinstance(msg, ReqError):
        service.on_error(msg)
        return [], [msg]
    return [], []


if __name__ == "__main__":
    child_main("tokenizer", run, torch_threads=None)

