"""In-process backend: the offline Engine driven by one thread, shared by many programs.

Only the runtime's loop thread touches the Engine. Program threads post work (a generation, a
scoring, any `call(fn)`) and wait on a Future; between two scheduler steps the loop submits what
was posted, so requests of concurrent programs join the running batch and share its steps.
Stop strings and streaming are handled here, after every step, with the server's incremental
detokenizer and stop matcher: a request that hits a stop string is aborted at once."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from radixlora.engine import Engine
from radixlora.errors import InvalidRequestError, RadixLoraError
from radixlora.sampling_params import SamplingParams
from radixlora.sched.request import Req, ReqStatus
from radixlora.text.chat import ChatTemplate
from radixlora.text.detokenize import StopStream

from .backend import Backend, GenResult, TextCallback
from .ir import AdapterSpec, GenParams

T = TypeVar("T")


@dataclass
class _Sample:
    req: Req
    stream: StopStream | None  # with stop strings or a text callback
    seen: int = 0
    emitted: str = ""
    matched: str | None = None  # the stop string that ended it
    done: bool = False


@dataclass
class _GenTask:
    samples: list[_Sample]
    stops: tuple[str, ...]
    on_text: TextCallback | None
    future: Future


class Runtime(Backend):
    """`Runtime(engine)` or `Runtime(model_path, adapters={name: path}, **engine_overrides)`.
    While it runs, use the Engine only through `runtime.call(fn)`; `shutdown()` stops the loop
    (the Engine is usable directly again)."""

    def __init__(self, engine: Engine | str | Path, adapters: dict | None = None, **overrides):
        if not isinstance(engine, Engine):
            engine = Engine(engine, adapters, **overrides)
        self.engine = engine
        self._chat_template = ChatTemplate.from_dir(self.engine.model_path)
        self._inbox: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._tasks: list[_GenTask] = []
        self._closed = False
        self.num_steps = 0
        self.peak_batch = 0  # most requests in one scheduler step
        self._thread = threading.Thread(target=self._loop, name="radixlora-runtime", daemon=True)
        self._thread.start()

    @property
    def chat_template(self) -> ChatTemplate:
        return self._chat_template

    # ---- called from any thread ----------------------------------------------------------------

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        adapters: AdapterSpec = None,
        stop: Sequence[str] = (),
        on_text: TextCallback | None = None,
        logprob_start: int | None = None,
    ) -> Future[list[GenResult]]:
        """Queue one prompt (params.n samples); the Future gives one GenResult per sample.
        With logprob_start, each result carries the prompt's logprobs from that position."""
        if on_text is not None and params.n != 1:
            raise InvalidRequestError("streaming needs n == 1", param="n")
        future: Future[list[GenResult]] = Future()
        self._post(
            lambda: self._start_gen(
                prompt, params, adapters, tuple(stop), on_text, logprob_start, future
            )
        )
        return future

    def generate(
        self,
        prompt: str,
        params: GenParams,
        adapters: AdapterSpec,
        on_text: TextCallback | None = None,
    ) -> GenResult:
        future = self.submit(prompt, params.sampling_params(), adapters, params.stop, on_text)
        return future.result()[0]

    def score(self, prompt: str, choices: list[str], adapters: AdapterSpec) -> list[list[float]]:
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError("select needs a model with a tokenizer.json")
        start = len(tok.encode(prompt))
        if start == 0:
            raise InvalidRequestError("select needs a non-empty prompt before the choices")
        futures = []
        for choice in choices:
            ids = tok.encode(prompt + choice)
            futures.append(self.score_tokens(ids, start, adapters) if len(ids) > start else None)
        return [f.result() if f is not None else [] for f in futures]

    def score_tokens(
        self, token_ids: Sequence[int], start: int, adapters: AdapterSpec = None
    ) -> Future[list[float]]:
        """logprob of token_ids[i] given token_ids[:i] for i >= start (Engine prompt logprobs)."""
        scored: Future[list[float]] = Future()
        params = SamplingParams(max_tokens=1, seed=0)
        future = self.submit(list(token_ids), params, adapters, logprob_start=start)
        future.add_done_callback(lambda f: _chain(f, scored))
        return scored

    def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the loop thread between two steps and return its result."""
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn(self.engine))
            except Exception as e:
                future.set_exception(e)

        self._post(run)
        return future.result()

    def shutdown(self) -> None:
        """Stop the loop; work still in flight fails with RadixLoraError."""
        if not self._closed:
            self._closed = True
            self._inbox.put(None)
        self._thread.join()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _post(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise RadixLoraError("the runtime is shut down")
        self._inbox.put(fn)

    # ---- the loop thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._serve_inbox():
                if self.engine.scheduler.has_work():
                    self._step()
        finally:
            self._fail_all(RadixLoraError("the runtime is shut down"))

    def _serve_inbox(self) -> bool:
        """Run everything posted so far, waiting for work when idle; False after shutdown."""
        block = not self.engine.scheduler.has_work()
        while True:
            try:
                fn = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if fn is None:
                return False
            fn()
            block = False

    def _start_gen(
        self, prompt, params, adapters, stops, on_text, logprob_start, future: Future
    ) -> None:
        try:
            reqs = self.engine.submit(prompt, params, adapters, logprob_start=logprob_start)
        except Exception as e:
            future.set_exception(e)
            return
        watch = bool(stops) or on_text is not None
        tok = self.engine.tokenizer
        samples = [_Sample(r, StopStream(tok, list(stops)) if watch else None) for r in reqs]
        self._tasks.append(_GenTask(samples, stops, on_text, future))

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as e:
            self._fail_all(e)
            return
        self.num_steps += 1
        self.peak_batch = max(self.peak_batch, len(self.engine.scheduler.running) + len(finished))
        self._tasks = [t for t in self._tasks if not self._advance(t)]

    def _advance(self, task: _GenTask) -> bool:
        """Fold the step's tokens into the task; True (and the Future set) once it is done."""
        for sample in task.samples:
            if not sample.done:
                self._advance_sample(task, sample)
        if not all(s.done for s in task.samples):
            return False
        task.future.set_result([self._result(task, s) for s in task.samples])
        return True

    def _advance_sample(self, task: _GenTask, sample: _Sample) -> None:
        req = sample.req
        finished = req.status is ReqStatus.FINISHED
        if sample.stream is not None:
            new_ids = req.output_ids[sample.seen :]
            sample.seen = len(req.output_ids)
            text, _, stopped = sample.stream.step(new_ids, req.finish_reason if finished
                                                  else None)
            self._emit(task, sample, text)
            if isinstance(stopped, str):  # a stop string matched
                sample.matched = stopped
                if not finished:
                    self.engine.scheduler.abort(req)
                finished = True
        sample.done = finished

    def _emit(self, task: _GenTask, sample: _Sample, text: str) -> None:
        if task.on_text is not None and text:
            sample.emitted += text
            task.on_text(text)

    def _result(self, task: _GenTask, sample: _Sample) -> GenResult:
        req = sample.req
        text = self.engine.tokenizer.decode(req.output_ids) if self.engine.tokenizer else ""
        text = cut_at_stop(text, task.stops)
        if text.startswith(sample.emitted):  # streamed chunks add up to the final text
            self._emit(task, sample, text[len(sample.emitted) :])
        finish, matched = req.finish_reason, None
        if sample.matched is not None:
            finish, matched = "stop", sample.matched
        elif finish == "stop" and req.output_ids:
            matched = req.output_ids[-1]
        return GenResult(
            text,
            finish,
            matched,
            len(req.prompt_ids),
            req.cached_tokens,
            list(req.output_ids),
            list(req.output_logprobs),
            list(req.top_logprobs),
            list(req.input_logprobs),
        )

    def _fail_all(self, error: Exception) -> None:
        for task in self._tasks:
            for sample in task.samples:
                if sample.req.status is not ReqStatus.FINISHED:
                    self.engine.scheduler.abort(sample.req)
            task.future.set_exception(error)
        self._tasks = []


def _chain(done: Future[list[GenResult]], scored: Future[list[float]]) -> None:
    if done.exception() is not None:
        scored.set_exception(done.exception())
    else:
        scored.set_result(done.result()[0].prompt_logprobs)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """text up to the earliest occurrence of any stop string."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]
