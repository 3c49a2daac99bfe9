"""Grammars never crash or stall the process that compiles them for the scheduler: their limits
are checked before compiling (400 naming the field and the limit), each new grammar is
compiled first in a sandbox process under a time and memory budget (a crash or an overrun
fails that request only, and the next grammar gets a new sandbox), compiles run on threads of
their own, and requests of one grammar share one compile."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import llguidance
import pytest

from radixlora.demo import DEMO_MODEL_DIR
from radixlora.errors import InvalidRequestError
from radixlora.sched.grammar_compiler import GrammarCompiler
from radixlora.sched.grammar_sandbox import BudgetExceeded, GrammarSandbox
from radixlora.structured import (
    MAX_GRAMMAR_RULES,
    MAX_REGEX_REPEAT,
    MAX_SCHEMA_DEPTH,
    GrammarBudget,
    Structure,
    allowed_tokens,
)

TOKENIZER = DEMO_MODEL_DIR / "tokenizer.json"
VOCAB, EOS = 896, (2,)


def ref_chain(n: int) -> str:
    """A JSON schema whose $defs refer to one another n deep (91 KB at n = 1000)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})


def alias_chain(n: int) -> str:
    """An EBNF grammar of n rules, each an alias of the next."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "a"'])


def properties(n: int) -> str:
    return json.dumps({"type": "object",
                       "properties": {f"p{i}": {"type": "string"} for i in range(n)}})


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOKENIZER, VOCAB, EOS)


@pytest.mark.parametrize("structure, message", [
    (Structure("json_schema", ref_chain(1000)),
     f"nests deeper than {MAX_SCHEMA_DEPTH} levels (counted through its $refs)"),
    (Structure("json_schema", '{"type": "object", "properties": {"x": ' * 2000
               + '{"type": "string"}' + "}}" * 2000, param="guided_json"),
     f"nests deeper than {MAX_SCHEMA_DEPTH} levels"),
    (Structure("regex", "(a{1000}){1000}", param="guided_regex"),
     f"repeats more than {MAX_REGEX_REPEAT} times"),
    (Structure("json_schema", json.dumps({"type": "string", "pattern": "^(ab{40}){40}$"}),
               param="guided_json"), f"repeats more than {MAX_REGEX_REPEAT} times"),
    (Structure("grammar", alias_chain(3000), param="guided_grammar"),
     f"has 3002 rules; at most {MAX_GRAMMAR_RULES}"),
    (Structure("grammar", 'start: /(x{100}){100}/', param="ebnf"),
     f"repeats more than {MAX_REGEX_REPEAT} times"),
    (Structure("json_schema", json.dumps({"$ref": "#/$defs/missing"})), "points nowhere"),
])
def test_grammars_past_their_limits_are_refused_before_compiling(compiler, structure, message):
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(structure)
    assert e.value.param == structure.param and message in e.value.message
    assert time.monotonic() - started < 5  # refused by the checks, not by the budget


def test_recursive_and_deep_but_allowed_schemas_compile(compiler):
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array",
                                                 "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"}
    compiler.compile(Structure("json_schema", json.dumps(tree)))
    compiler.compile(Structure("json_schema", ref_chain(8)))
    compiler.compile(Structure("grammar", alias_chain(900), param="ebnf"))
    compiler.compile(Structure("regex", "[a-c]{10}-(x{3}){3}", param="regex"))


def test_requests_of_one_grammar_share_one_compile_and_get_their_own_matchers():
    compiler = GrammarCompiler(TOKENIZER, VOCAB, EOS)
    structure = Structure("json_schema", properties(300))
    futures = [compiler.submit(structure) for _ in range(64)]
    assert all(f is futures[0] for f in futures)
    first, second = (compiler.compile(structure) for _ in range(2))
    assert compiler.compiles == 1
    allowed = allowed_tokens(first.mask(), VOCAB)
    assert first.advance(int(allowed[0]))
    assert list(allowed_tokens(second.mask(), VOCAB)) == list(allowed)  # untouched by first
    assert list(allowed_tokens(futures[0].result().mask(), VOCAB)) == list(allowed)


def test_a_compile_past_its_time_budget_fails_its_request_and_the_next_compiles():
    compiler = GrammarCompiler(TOKENIZER, VOCAB, EOS, GrammarBudget(seconds=0.5))
    slow = Structure("json_schema", properties(10_000))
    started = time.monotonic()
    refused = compiler.submit(slow)
    with pytest.raises(InvalidRequestError) as e:
        refused.result()
    assert e.value.code == "grammar_too_costly" and "longer than 0.5 s" in e.value.message
    assert time.monotonic() - started < 30
    compiler.compile(Structure("regex", "[a-c]{2,4}", param="regex"))
    assert compiler.submit(slow) is not refused  # a busy machine may fit it another time


def test_a_compile_past_its_memory_budget_ends_the_sandbox_only():
    sandbox = GrammarSandbox(TOKENIZER, VOCAB, EOS, GrammarBudget(memory_bytes=32 << 20))
    big = llguidance.LLMatcher.grammar_from_json_schema(json.loads(properties(10_000)))
    with pytest.raises(BudgetExceeded, match="more than 32 MiB"):
        sandbox.check(big)
    assert sandbox.check(llguidance.grammar_from("regex", "ab")) == ""
    assert sandbox.starts == 2


def test_a_crash_of_the_grammar_library_fails_one_request_and_the_sandbox_restarts():
    """The library's crashes (stack overflows, aborts) happen in the sandbox: here a signal
    sent to it while it compiles stands in for one."""
    sandbox = GrammarSandbox(TOKENIZER, VOCAB, EOS, GrammarBudget(seconds=60))
    assert sandbox.check(llguidance.grammar_from("regex", "a")) == ""
    pid = sandbox.proc.pid
    threading.Timer(0.3, os.kill, (pid, signal.SIGSEGV)).start()
    slow = llguidance.LLMatcher.grammar_from_json_schema(json.loads(properties(10_000)))
    assert sandbox.check(slow) == "the grammar library crashed on it (SIGSEGV)"
    assert sandbox.check(llguidance.grammar_from("regex", "ab")) == ""
    assert sandbox.starts == 2 and sandbox.proc.pid != pid


def test_compiles_run_off_the_caller_thread(compiler):
    """submit returns at once, whatever the grammar costs; the result comes later."""
    structure = Structure("json_schema", properties(2000))
    started = time.monotonic()
    future = compiler.submit(structure)
    assert time.monotonic() - started < 0.05
    future.result(timeout=60)
