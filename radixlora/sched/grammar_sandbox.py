"""The grammar sandbox: a child process that compiles each new grammar (and its first mask)
before the process that serves it does, under a wall-clock and a memory budget. An input that
crashes llguidance (a stack overflow, an abort) or runs past its budget ends this child only:
the caller fails that one request and starts a new child for the next grammar. The compile it
then repeats in its own process is the same computation, which the child finished within the
budget.

Frames on the child's stdin and stdout: a 4-byte little-endian length, then msgpack (Setup,
then Check after Check; each answered by a Checked, and the Setup by an empty one once the
child is ready)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec

from radixlora.structured import COMPILE_STACK_BYTES, GrammarBudget, build_matcher

log = logging.getLogger(__spec__.name)  # the module's name also when run with -m

START_TIMEOUT_S = 120.0  # building the tokenizer of a large vocabulary takes seconds
OUT_OF_MEMORY = 3  # the child's exit status when Python's allocator hit the budget
PR_SET_PDEATHSIG = 1


class Setup(msgspec.Struct, frozen=True):
    tokenizer_file: str
    vocab_size: int
    eos_ids: list[int]
    memory_bytes: int


class Check(msgspec.Struct, frozen=True):
    grammar: str


class Checked(msgspec.Struct, frozen=True):
    error: str = ""  # llguidance's error for the grammar; "" when it compiled


class BudgetExceeded(Exception):
    """The grammar took more time or memory than its budget allows."""


class SandboxUnavailable(Exception):
    """The sandbox process could not be started."""


class GrammarSandbox:
    """The caller's side: one child at a time, started on first use and again after one
    ended. Not thread-safe: each compile thread has its own."""

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_ids: tuple[int, ...],
                 budget: GrammarBudget):
        self.setup = Setup(str(tokenizer_file), vocab_size, list(eos_ids), budget.memory_bytes)
        self.budget = budget
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def check(self, grammar: str) -> str:
        """llguidance's error for `grammar` ("" if it compiles); BudgetExceeded past the budget.
        A crash of the library is that error, named by its signal."""
        if self.proc is None:
            self._start()
        try:
            _write(self.proc.stdin, msgspec.msgpack.encode(Check(grammar)))
            raw = _read(self.proc.stdout, time.monotonic() + self.budget.seconds)
        except TimeoutError:
            self._stop()
            raise BudgetExceeded(f"compiling took longer than {self.budget.seconds:g} s "
                                 "(--grammar-compile-timeout)") from None
        except (EOFError, BrokenPipeError):
            return self._ended()
        return msgspec.msgpack.decode(raw, type=Checked).error

    def _ended(self) -> str:
        status = self._stop()
        if status in (OUT_OF_MEMORY, -signal.SIGABRT):
            raise BudgetExceeded(f"compiling needed more than {self.budget.memory_bytes >> 20}"
                                 " MiB (--grammar-compile-memory)")
        name = signal.Signals(-status).name if status < 0 else f"exit status {status}"
        log.warning("the grammar compiler crashed on a request's grammar (%s)", name)
        return f"the grammar library crashed on it ({name})"

    def _start(self) -> None:
        self.starts += 1
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixlora.sched.grammar_sandbox"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0, close_fds=True)
        try:
            _write(self.proc.stdin, msgspec.msgpack.encode(self.setup))
            _read(self.proc.stdout, time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, EOFError, BrokenPipeError) as e:
            status = self._stop()
            raise SandboxUnavailable(f"the grammar sandbox did not start ({type(e).__name__}, "
                                     f"status {status})") from None

    def _stop(self) -> int:
        """Kill the child (if it still runs) and reap it; its exit status."""
        proc, self.proc = self.proc, None
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        status = proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            pipe.close()
        return status


def _write(pipe, payload: bytes) -> None:
    pipe.write(len(payload).to_bytes(4, "little") + payload)


def _read(pipe, deadline: float) -> bytes:
    """One frame from a raw pipe: TimeoutError past `deadline`, EOFError at its end."""
    size = int.from_bytes(_read_exactly(pipe, 4, deadline), "little")
    return _read_exactly(pipe, size, deadline)


def _read_exactly(pipe, size: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < size:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([pipe], [], [], wait)[0]:
                raise TimeoutError
        chunk = pipe.read(size - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


# ---- the child ---------------------------------------------------------------------------------


def main() -> None:
    _die_with_parent()
    stdin, stdout = os.fdopen(0, "rb", buffering=0), os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # what the libraries print goes to stderr, never into a frame
    setup = msgspec.msgpack.decode(_read(stdin, None), type=Setup)
    threading.stack_size(COMPILE_STACK_BYTES)  # as deep as the caller's compile threads
    thread = threading.Thread(target=_serve, args=(setup, stdin, stdout), name="grammar-check")
    thread.start()
    thread.join()


def _serve(setup: Setup, stdin, stdout) -> None:
    import llguidance

    budget = GrammarBudget(memory_bytes=setup.memory_bytes)
    tokenizer = llguidance.LLTokenizer(Path(setup.tokenizer_file).read_text(),
                                       n_vocab=setup.vocab_size, eos_token=setup.eos_ids or None)
    # a first matcher starts llguidance's mask threads before the memory limit is set
    build_matcher(tokenizer, llguidance.grammar_from("regex", "a"), budget, setup.vocab_size)
    _limit_memory(setup.memory_bytes)
    _write(stdout, msgspec.msgpack.encode(Checked()))
    while True:
        try:
            check = msgspec.msgpack.decode(_read(stdin, None), type=Check)
        except EOFError:
            return
        try:
            _, error = build_matcher(tokenizer, check.grammar, budget, setup.vocab_size)
        except MemoryError:
            os._exit(OUT_OF_MEMORY)
        _write(stdout, msgspec.msgpack.encode(Checked(error=error)))


def _limit_memory(budget: int) -> None:
    """The address space the child has now, plus `budget`, is all it may map."""
    import resource

    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return
    size_kib = next(int(line.split()[1]) for line in status.splitlines()
                    if line.startswith("VmSize:"))
    limit = (size_kib << 10) + budget
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _die_with_parent() -> None:
    """SIGKILL when the thread that started this child ends (a compile thread, which lives
    as long as its process); a closed stdin ends it too."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


if __name__ == "__main__":
    main()
