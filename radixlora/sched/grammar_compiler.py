"""The GrammarCompiler: structured-output grammars compiled off every loop that must keep
beating. Each grammar's limits are checked first (Structure.grammar), then it is compiled in a
sandbox process under a time and memory budget (radixlora.sched.grammar_sandbox: an input that
crashes the library or runs past the budget fails its own request only), then here, on a
thread of its own with a deep stack; the result is kept for every request of that grammar."""

from __future__ import annotations

import collections
import logging
import queue
import threading
from concurrent.futures import Future
from pathlib import Path

from radixlora.errors import InvalidRequestError
from radixlora.sched.grammar_sandbox import BudgetExceeded, GrammarSandbox
from radixlora.structured import (
    COMPILE_STACK_BYTES,
    GrammarBudget,
    Matcher,
    Structure,
    build_matcher,
)

log = logging.getLogger(__name__)

COMPILE_THREADS = 2
CACHED_GRAMMARS = 128


class GrammarCompiler:
    """Compiles Structures for one model's tokenizer, off the caller's thread: `submit` gives a
    future of the compiled grammar's pristine Matcher (requests take `.copy()`s of it), the
    same future for every request of a grammar kept in the cache. Each grammar is compiled in
    a sandbox process first (GrammarBudget), then here on a thread with a COMPILE_STACK_BYTES
    stack. The llguidance tokenizer is built on a thread from construction (about a second for
    a 128k vocabulary); the first compile waits for it."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_ids: tuple[int, ...],
                 budget: GrammarBudget | None = None):
        self.vocab_size = vocab_size
        self.budget = budget or GrammarBudget()
        self.tokenizer_file = Path(tokenizer_file)
        self.eos_ids = eos_ids
        self._tokenizer = None
        self._error: Exception | None = None
        self._ready = threading.Event()
        self._cache: collections.OrderedDict[Structure, Future] = collections.OrderedDict()
        self._jobs: queue.SimpleQueue[tuple[Structure, Future]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (each once, whatever requests share it)
        threading.Thread(target=self._build, name="grammar-tokenizer", daemon=True).start()

    @classmethod
    def for_model(cls, tokenizer_dir: str | Path, model_cfg, config) -> GrammarCompiler | None:
        """The compiler of the tokenizer.json in tokenizer_dir for a ModelConfig, with an
        EngineConfig's budget; None without one."""
        path = Path(tokenizer_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        budget = GrammarBudget(config.grammar_compile_timeout,
                               config.grammar_compile_memory_mb << 20)
        return cls(path, model_cfg.vocab_size, tuple(model_cfg.eos_token_ids), budget)

    def _build(self) -> None:
        try:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(
                self.tokenizer_file.read_text(), n_vocab=self.vocab_size,
                eos_token=list(self.eos_ids) or None)
        except Exception as e:  # noqa: BLE001 - reported to each structured request
            self._error = e
        finally:
            self._ready.set()

    def compile(self, structure: Structure) -> Matcher:
        """A fresh matcher for `structure`, waiting for it; InvalidRequestError if it does not
        compile within its limits and budget."""
        return self.submit(structure).result().copy()

    def submit(self, structure: Structure) -> Future:
        """The future of `structure`'s compiled Matcher (a pristine one: take copies)."""
        with self._lock:
            future = self._cache.get(structure)
            if future is not None:
                self._cache.move_to_end(structure)
                return future
            future = self._cache[structure] = Future()
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            if len(self._threads) < COMPILE_THREADS:
                self._start_thread()
        self._jobs.put((structure, future))
        return future

    def _start_thread(self) -> None:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=self._serve, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
        self._threads.append(thread)

    def _serve(self) -> None:
        sandbox = GrammarSandbox(self.tokenizer_file, self.vocab_size, self.eos_ids, self.budget)
        while True:
            structure, future = self._jobs.get()
            try:
                future.set_result(self._compile(structure, sandbox))
            except BudgetExceeded as e:
                self._forget(structure, future)  # a busy machine may fit it another time
                future.set_exception(InvalidRequestError(
                    f"{structure.param}: {e}", param=structure.param, code="grammar_too_costly"))
            except InvalidRequestError as e:
                future.set_exception(e)
            except BaseException as e:  # noqa: BLE001 - llguidance's panics included
                log.exception("compiling a %s grammar failed", structure.kind)
                future.set_exception(InvalidRequestError(
                    f"{structure.param} could not be compiled: {type(e).__name__}",
                    param=structure.param))

    def _forget(self, structure: Structure, future: Future) -> None:
        with self._lock:
            if self._cache.get(structure) is future:
                del self._cache[structure]

    def _compile(self, structure: Structure, sandbox) -> Matcher:
        self._ready.wait()
        if self._tokenizer is None:
            raise InvalidRequestError(f"structured output is unavailable: "
                                      f"{type(self._error).__name__}: {self._error}",
                                      param=structure.param,
                                      code="structured_output_unavailable")
        grammar = structure.grammar()
        error = sandbox.check(grammar)
        if not error:
            matcher, error = build_matcher(self._tokenizer, grammar, self.budget, self.vocab_size)
        if error:
            raise InvalidRequestError(f"{structure.param} does not compile: {error.strip()}",
                                      param=structure.param)
        self.compiles += 1
        return matcher
