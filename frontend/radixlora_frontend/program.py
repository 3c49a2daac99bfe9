"""`@function` programs: run one, stream one, or run many concurrently."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from tqdm.auto import tqdm

from .backend import Backend, get_default_backend
from .interpreter import ProgramState, StreamExecutor
from .ir import normalize_adapters

DEFAULT_THREADS = 64


class Program:
    """A function `fn(s, *args, **kwargs)` over a ProgramState."""

    def __init__(self, fn: Callable[..., None]):
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(
        self,
        *args,
        backend: Backend | None = None,
        stream: bool = False,
        default_adapter=None,
        **kwargs,
    ) -> ProgramState:
        """Run the program and return its finished state (raising the program's error), or with
        `stream=True` return at once and let `state.text_iter()` follow it. `default_adapter`
        is the adapter set of calls that name none (None: the base model)."""
        state = _new_state(backend, stream, default_adapter)
        if stream:
            threading.Thread(
                target=self._execute,
                args=(state, args, kwargs),
                daemon=True,
                name="radixlora-program-fn",
            ).start()
            return state
        self._execute(state, args, kwargs)
        if state.error is not None:
            raise state.error
        return state

    def run_batch(
        self,
        batch_kwargs: Sequence[dict],
        *,
        backend: Backend | None = None,
        num_threads: int = DEFAULT_THREADS,
        progress: bool = False,
        default_adapter=None,
    ) -> list[ProgramState]:
        """Run the program once per kwargs dict, up to num_threads at a time (their requests
        share the backend's batches); states come back in input order, a failed one with
        `state.error` set (reading its results raises it)."""
        backend = _backend(backend)
        states = [_new_state(backend, False, default_adapter) for _ in batch_kwargs]
        with (
            ThreadPoolExecutor(max(1, min(num_threads, len(states)))) as pool,
            tqdm(total=len(states), disable=not progress, desc=self.__name__) as bar,
        ):
            futures = [
                pool.submit(self._execute, state, (), kwargs)
                for state, kwargs in zip(states, batch_kwargs)
            ]
            for _ in as_completed(futures):
                bar.update(1)
        return states

    def _execute(self, state: ProgramState, args: tuple, kwargs: dict) -> None:
        """Run fn, wait for its ops, stop the executor; errors end up in state.error."""
        executor = state.executor
        fn_error: Exception | None = None
        try:
            self.fn(state, *args, **kwargs)
        except Exception as e:  # the state reports it; run() re-raises it
            fn_error = e
        _drain(executor)
        if fn_error is not None and executor.error is None:
            executor.error = fn_error
        executor.end()


def _drain(executor: StreamExecutor) -> None:
    """Wait for every queued op (a failure stays recorded in executor.error)."""
    with contextlib.suppress(Exception):
        executor.sync()


def _backend(backend: Backend | None) -> Backend:
    backend = backend or get_default_backend()
    if backend is None:
        raise RuntimeError("no backend: pass backend= or call set_default_backend(...)")
    return backend


def _new_state(backend: Backend | None, stream: bool, adapter) -> ProgramState:
    return ProgramState(
        StreamExecutor(_backend(backend), stream=stream), normalize_adapters(adapter)
    )


def function(fn: Callable[..., None]) -> Program:
    """Decorator: `@function def prog(s, question): s += question + gen("answer")`."""
    return Program(fn)
