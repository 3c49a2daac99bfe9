"""Program state and its executor.

`s += expr` does not block: the program thread turns the expression into ops and queues them on
the state's StreamExecutor, a thread that runs them in order against the backend. Reading a
result (`s[name]`, `s.text()`) waits for the queue to drain. Forked states have executors of their
own, so `for f in s.fork(4): f += gen(...)` puts four requests in flight at once and the runtime
batches them into shared scheduler steps."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from radixlora.errors import InvalidRequestError

from .backend import Backend
from .chat import role_affixes
from .ir import (
    UNSET,
    AdapterSpec,
    Concat,
    Gen,
    Role,
    Select,
    normalize_adapters,
)


@dataclass(frozen=True)
class _RoleBegin:
    role: str


@dataclass(frozen=True)
class _RoleEnd:
    role: str


@dataclass(frozen=True)
class _Join:
    states: tuple[ProgramState, ...]
    base_text: str
    mode: str


@dataclass(frozen=True)
class _Barrier:
    done: threading.Event


_END = object()
JOIN_MODES = ("gather_variable", "concate_and_append")


class StreamExecutor:
    """Runs one state's ops in order on its own thread; owns text, messages and variables.
    After a failed op, later ops are skipped and the error is raised by sync()."""

    def __init__(
        self, backend: Backend, stream: bool = False, parent: StreamExecutor | None = None
    ):
        self.backend = backend
        self.text = parent.text if parent else ""
        self.messages: list[dict] = list(parent.messages) if parent else []
        self.variables: dict = dict(parent.variables) if parent else {}
        self.meta: dict[str, dict] = dict(parent.meta) if parent else {}
        self.error: BaseException | None = None
        self.assigned: list[str] = []  # variables set by this executor's own ops
        self.children: list[StreamExecutor] = []
        self._roles: list[tuple[str, int, str]] = []  # open roles: (role, text start, suffix)
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submissions against _END
        self._ended = False
        self._events: queue.SimpleQueue | None = queue.SimpleQueue() if stream else None
        self._thread = threading.Thread(target=self._run, name="radixlora-program", daemon=True)
        self._thread.start()

    # ---- called from program threads -----------------------------------------------------------

    def submit(self, op) -> None:
        with self._lock:
            if self._ended:
                raise RuntimeError("this program state has finished; it takes no more text")
            self._ops.put(op)

    def sync(self) -> None:
        """Wait until every op submitted so far ran; raise the first failure."""
        done = threading.Event()
        with self._lock:  # a barrier is either queued before _END or not queued at all
            ended = self._ended
            if not ended:
                self._ops.put(_Barrier(done))
        if ended:
            self._thread.join()
        else:
            done.wait()
        if self.error is not None:
            raise self.error

    def end(self) -> None:
        """No more ops: the thread exits once the queue is drained (children too)."""
        for child in self.children:
            child.end()
        with self._lock:
            if not self._ended:
                self._ended = True
                self._ops.put(_END)

    def events(self) -> Iterator[tuple[str | None, str]]:
        """(variable name or None, text) as the state's text grows, until end()."""
        if self._events is None:
            raise RuntimeError("streaming needs program.run(..., stream=True)")
        while (event := self._events.get()) is not _END:
            yield event

    # ---- the executor thread -------------------------------------------------------------------

    def _run(self) -> None:
        while (op := self._ops.get()) is not _END:
            if isinstance(op, _Barrier):
                op.done.set()
            elif self.error is None:
                try:
                    self._execute(op)
                except Exception as e:  # raised in the program thread by sync()
                    self.error = e
        if self._events is not None:
            self._events.put(_END)

    def _execute(self, op) -> None:
        if isinstance(op, str):
            self._append(op, None)
        elif isinstance(op, Gen):
            self._gen(op)
        elif isinstance(op, Select):
            self._select(op)
        elif isinstance(op, _RoleBegin):
            self._role_begin(op.role)
        elif isinstance(op, _RoleEnd):
            self._role_end(op.role)
        elif isinstance(op, _Join):
            self._join(op)
        else:
            raise TypeError(f"unknown op {op!r}")

    def _append(self, text: str, name: str | None) -> None:
        self.text += text
        self._emit(name, text)

    def _emit(self, name: str | None, text: str) -> None:
        if self._events is not None and text:
            self._events.put((name, text))

    def _gen(self, op: Gen) -> None:
        on_text = None
        if self._events is not None:

            def on_text(chunk: str) -> None:
                self._emit(op.name, chunk)

        result = self.backend.generate(self.text, op.params, op.adapter, on_text)
        self.text += result.text
        if on_text is None:
            self._emit(op.name, result.text)
        self._store(op.name, result.text, {**result.meta(), "adapter": op.adapter})

    def _select(self, op: Select) -> None:
        scores = self.backend.score(self.text, list(op.choices), op.adapter)
        for choice, logprobs in zip(op.choices, scores):
            if not logprobs:
                raise InvalidRequestError(
                    f"choice {choice!r} adds no tokens after the prompt", param="choices"
                )
        ranks = [_rank(lps, op.method) for lps in scores]
        best = max(range(len(ranks)), key=ranks.__getitem__)
        self._append(op.choices[best], op.name)
        self._store(
            op.name,
            op.choices[best],
            {
                "choices": list(op.choices),
                "token_logprobs": scores,
                "scores": ranks,
                "method": op.method,
                "adapter": op.adapter,
            },
        )

    def _store(self, name: str | None, value, meta: dict) -> None:
        if name is not None:
            self.variables[name] = value
            self.meta[name] = meta
            if name not in self.assigned:
                self.assigned.append(name)

    def _role_begin(self, role: str) -> None:
        prefix, suffix = role_affixes(self.backend.chat_template, self.messages, role)
        self._append(prefix, None)
        self._roles.append((role, len(self.text), suffix))

    def _role_end(self, role: str) -> None:
        if not self._roles:
            raise InvalidRequestError(f"role {role!r} closed but none is open")
        opened, start, suffix = self._roles.pop()
        if opened != role:
            raise InvalidRequestError(f"role {role!r} closed while {opened!r} is open")
        self.messages.append({"role": role, "content": self.text[start:]})
        self._append(suffix, None)

    def _join(self, op: _Join) -> None:
        for state in op.states:
            state.executor.sync()
        if op.mode == "gather_variable":
            for name in _assigned_in_forks(op.states):
                values = [s.executor.variables.get(name) for s in op.states]
                self._store(name, values, {"forks": [s.executor.meta.get(name) for s in op.states]})
        else:
            self._append("".join(s.executor.text[len(op.base_text) :] for s in op.states), None)
        for state in op.states:
            state.executor.end()


def _assigned_in_forks(states: tuple[ProgramState, ...]) -> list[str]:
    names: list[str] = []
    for state in states:
        names += [n for n in state.executor.assigned if n not in names]
    return names


def _rank(logprobs: list[float], method: str) -> float:
    if not logprobs:
        return -math.inf
    total = math.fsum(logprobs)
    return total / len(logprobs) if method == "normalized" else total


class ProgramState:
    """The `s` of a program. `s += expr` queues work; `s[name]`, `s.text()` and friends wait
    for it. `with s.adapter(spec):` makes `spec` the adapter of every gen/select added inside
    that names none."""

    def __init__(self, executor: StreamExecutor, adapter: AdapterSpec = None):
        self.executor = executor
        self._adapters: list[AdapterSpec] = [adapter]

    # ---- building ------------------------------------------------------------------------------

    def __iadd__(self, expr) -> ProgramState:
        for op in self._ops(expr):
            self.executor.submit(op)
        return self

    def _ops(self, expr) -> Iterator:
        if isinstance(expr, str):
            yield expr
        elif isinstance(expr, (Gen, Select)):
            yield (
                expr
                if expr.adapter is not UNSET
                else dataclasses.replace(expr, adapter=self.default_adapter)
            )
        elif isinstance(expr, Concat):
            for part in expr.parts:
                yield from self._ops(part)
        elif isinstance(expr, Role):
            yield _RoleBegin(expr.role)
            for part in expr.content:
                yield from self._ops(part)
            yield _RoleEnd(expr.role)
        else:
            raise TypeError(f"cannot add {type(expr).__name__} to a program state")

    @property
    def default_adapter(self) -> AdapterSpec:
        return self._adapters[-1]

    @contextlib.contextmanager
    def adapter(self, spec) -> Iterator[None]:
        self._adapters.append(normalize_adapters(spec))
        try:
            yield
        finally:
            self._adapters.pop()

    @contextlib.contextmanager
    def role(self, role: str) -> Iterator[None]:
        self.executor.submit(_RoleBegin(role))
        try:
            yield
        finally:
            self.executor.submit(_RoleEnd(role))

    def system(self):
        return self.role("system")

    def user(self):
        return self.role("user")

    def assistant(self):
        return self.role("assistant")

    def fork(self, n: int) -> ForkGroup:
        """n copies of this state (text, messages, variables, default adapter) that run on
        their own; `group.join()` brings their results back."""
        self.sync()
        children = [StreamExecutor(self.executor.backend, parent=self.executor) for _ in range(n)]
        self.executor.children += children
        states = tuple(ProgramState(c, self.default_adapter) for c in children)
        return ForkGroup(self, states, self.executor.text)

    # ---- reading -------------------------------------------------------------------------------

    def sync(self) -> None:
        self.executor.sync()

    def __getitem__(self, name: str):
        self.sync()
        return self.executor.variables[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.executor.variables

    def get_meta_info(self, name: str) -> dict:
        self.sync()
        return self.executor.meta[name]

    def text(self) -> str:
        self.sync()
        return self.executor.text

    def messages(self) -> list[dict]:
        self.sync()
        return list(self.executor.messages)

    def variables(self) -> dict:
        self.sync()
        return dict(self.executor.variables)

    @property
    def error(self) -> BaseException | None:
        """The error that stopped this program, if any (after it finished)."""
        return self.executor.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is produced (program.run(..., stream=True)): everything appended, or only
        the output of `gen`/`select` calls named var_name. Raises the program's error at the end,
        if any."""
        for name, text in self.executor.events():
            if var_name is None or name == var_name:
                yield text
        if self.executor.error is not None:
            raise self.executor.error


@dataclass(frozen=True)
class ForkGroup:
    parent: ProgramState
    states: tuple[ProgramState, ...]
    base_text: str

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:
        """Lets `forks[i] += expr` work (the state is updated in place)."""
        if state is not self.states[i]:
            raise TypeError("a fork group's states cannot be replaced")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def join(self, mode: str = "gather_variable") -> None:
        """Queue, on the parent, a wait for every fork, then either `gather_variable`: each
        variable a fork set becomes, on the parent, the list of the forks' values; or
        `concate_and_append`: the parent's text gets each fork's new text, in fork order."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {JOIN_MODES}")
        self.parent.executor.submit(_Join(self.states, self.base_text, mode))
