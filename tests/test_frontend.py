"""The frontend DSL on the in-process Runtime, on the tiny model: every construct gives the text
of the equivalent direct Engine request, adapters reach the Engine as asked, select picks the
choice the model (transformers + PEFT) ranks highest, forks run concurrently, and a program's
calls share their prefix through the radix cache."""

from __future__ import annotations

import json

import pytest

from radixlora import Engine, SamplingParams
from radixlora.errors import AdapterNotFoundError
from radixlora.sched.request import cache_namespace
from radixlora.text.chat import ChatTemplate
from radixlora_frontend import (
    Runtime,
    assistant,
    function,
    gen,
    select,
    system,
    user,
)
from radixlora_frontend.chat import role_affixes
from radixlora_frontend.runtime import cut_at_stop
from scripts.checkpoints import build_tiny_adapter, build_tiny_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ADAPTERS = ("a0", "a1", "a2", "a3", "a4")
STACK = (("a1", 0.5), ("a2", 1.0))
SPECS = {"base": None, "single": "a1", "stacked": STACK}
PROMPT = "A radix cache shares prefix KV between"
GREEDY = dict(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend")
    model = build_tiny_model(root / "tiny")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    adapters = {
        name: build_tiny_adapter(model, root / name, rank=4 + 4 * i, seed=10 + i)
        for i, name in enumerate(ADAPTERS)
    }
    return model, adapters


@pytest.fixture(scope="module")
def runtime(checkpoints):
    model, adapters = checkpoints
    with Runtime(Engine(model, adapters=adapters, kv_pages=4096)) as rt:
        yield rt


@pytest.fixture
def submitted(runtime, monkeypatch):
    """Adapter set keys of every request the Engine receives during the test."""
    keys: list[tuple] = []
    engine = runtime.engine
    original = engine.submit

    def spy(prompt, params, adapters=None, *args, **kwargs):
        keys.append(engine.resolve_adapters(adapters).key)
        return original(prompt, params, adapters, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", spy)
    return keys


def direct(runtime, prompt, adapters=None, stop=(), **params) -> str:
    """The text of the equivalent direct Engine request (stop strings cut as documented)."""
    sp = SamplingParams(**{**GREEDY, **params})
    out = runtime.call(lambda e: e.generate(prompt, sp, adapters=adapters))
    return cut_at_stop(out[0].outputs[0].text, stop)


def key(runtime, spec) -> tuple:
    return runtime.engine.resolve_adapters(spec).key


# ---- gen and text --------------------------------------------------------------------------


@function
def one_gen(s, prompt, adapter, **params):
    s += prompt
    s += gen("out", adapter=adapter, **params)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_gen_matches_direct_request_and_reaches_engine_as_asked(runtime, submitted, spec):
    state = one_gen.run(PROMPT, spec, backend=runtime, **GREEDY)
    assert state["out"] == direct(runtime, PROMPT, spec)
    assert state.text() == PROMPT + state["out"]
    assert submitted[0] == key(runtime, spec)
    assert state.get_meta_info("out")["finish_reason"] == "length"


def test_seeded_sampling_matches_direct_request(runtime):
    params = dict(max_tokens=10, temperature=0.9, top_p=0.9, seed=1234)
    state = one_gen.run(PROMPT, "a2", backend=runtime, **params)
    assert state["out"] == direct(runtime, PROMPT, "a2", **params)


def test_stop_string_cuts_like_direct_request(runtime):
    full = direct(runtime, PROMPT, "a1", max_tokens=12)
    stop = full[3:5]
    state = one_gen.run(PROMPT, "a1", backend=runtime, max_tokens=12, temperature=0.0, stop=stop)
    assert state["out"] == full[: full.find(stop)]
    meta = state.get_meta_info("out")
    assert (meta["finish_reason"], meta["matched_stop"]) == ("stop", stop)


def test_concatenated_expression(runtime):
    @function
    def qa(s):
        s += "Q: " + PROMPT + gen("a", max_tokens=5, temperature=0.0) + "\nDone."

    state = qa.run(backend=runtime)
    expected = direct(runtime, "Q: " + PROMPT, max_tokens=5)
    assert state["a"] == expected
    assert state.text() == "Q: " + PROMPT + expected + "\nDone."


# ---- adapters --------------------------------------------------------------------------------


def test_adapter_scope_sets_the_default_of_calls_inside(runtime, submitted):
    @function
    def scoped(s):
        s += PROMPT
        s += gen("outer", max_tokens=2, temperature=0.0)
        with s.adapter("a1"):
            s += gen("single", max_tokens=2, temperature=0.0)
            with s.adapter([("a1", 0.5), ("a2", 1.0)]):
                s += gen("stacked", max_tokens=2, temperature=0.0)
                s += gen("explicit_base", max_tokens=2, temperature=0.0, adapter=None)
            s += gen("single_again", max_tokens=2, temperature=0.0)
        s += gen("base_again", max_tokens=2, temperature=0.0)

    state = scoped.run(backend=runtime)
    expected = [None, "a1", STACK, None, "a1", None]
    assert submitted == [key(runtime, spec) for spec in expected]
    assert state.get_meta_info("stacked")["adapter"] == STACK


def test_program_default_adapter(runtime, submitted):
    one_gen.run(PROMPT, None, backend=runtime, default_adapter="a3", max_tokens=2)
    assert submitted == [key(runtime, None)]  # explicit adapter=None wins over the default

    @function
    def plain(s):
        s += PROMPT + gen("x", max_tokens=2)

    plain.run(backend=runtime, default_adapter="a3")
    assert submitted[-1] == key(runtime, "a3")


def test_unknown_adapter_fails_the_program(runtime):
    with pytest.raises(AdapterNotFoundError):
        one_gen.run(PROMPT, "missing", backend=runtime, max_tokens=2)
    states = one_gen.run_batch(
        [{"prompt": PROMPT, "adapter": a, "max_tokens": 2} for a in ("a1", "missing")],
        backend=runtime,
    )
    assert states[0].error is None and states[0]["out"]
    assert isinstance(states[1].error, AdapterNotFoundError)
    with pytest.raises(AdapterNotFoundError):
        states[1]["out"]


# ---- select ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle(checkpoints):
    from tests.oracle import peft_model

    model, adapters = checkpoints
    return peft_model(model, {"a1": adapters["a1"]})


def oracle_logprobs(runtime, oracle, prompt, choice, adapter) -> list[float]:
    from tests.oracle import logprobs

    tok = runtime.engine.tokenizer
    start, ids = len(tok.encode(prompt)), tok.encode(prompt + choice)
    table = logprobs(oracle, ids, None if adapter is None else [adapter])
    return [table[i - 1, ids[i]].item() for i in range(start, len(ids))]


@pytest.mark.parametrize("adapter", [None, "a1"])
@pytest.mark.parametrize("method", ["normalized", "sum"])
def test_select_picks_highest_logprob(runtime, oracle, adapter, method):
    choices = [" fox", " dog jumps over", " cache", "x"]

    @function
    def pick(s):
        s += PROMPT
        s += select("pick", choices=choices, adapter=adapter, method=method)

    state = pick.run(backend=runtime)
    meta = state.get_meta_info("pick")
    ref = [oracle_logprobs(runtime, oracle, PROMPT, c, adapter) for c in choices]
    for got, want in zip(meta["token_logprobs"], ref):
        assert got == pytest.approx(want, abs=1e-4)
    ranks = [sum(r) / len(r) if method == "normalized" else sum(r) for r in ref]
    best = choices[max(range(len(choices)), key=ranks.__getitem__)]
    assert state["pick"] == best
    assert state.text() == PROMPT + best


def test_select_then_gen_continues_from_the_choice(runtime):
    @function
    def pick_then_gen(s):
        s += PROMPT
        s += select("pick", choices=[" yes", " no"], adapter="a2")
        s += gen("more", max_tokens=4, temperature=0.0, adapter="a2")

    state = pick_then_gen.run(backend=runtime)
    assert state["more"] == direct(runtime, PROMPT + state["pick"], "a2", max_tokens=4)


# ---- chat roles ------------------------------------------------------------------------------


def test_roles_render_the_model_chat_template(runtime):
    @function
    def chat(s, question):
        s += system("You answer briefly.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=6, temperature=0.0, adapter="a1"))

    state = chat.run("What is a radix cache?", backend=runtime)
    template = runtime.chat_template
    assert template.source == CHATML
    asked = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "What is a radix cache?"},
    ]
    prompt = template.render(asked, add_generation_prompt=True)
    assert state["answer"] == direct(runtime, prompt, "a1", max_tokens=6)
    messages = [*asked, {"role": "assistant", "content": state["answer"]}]
    assert state.messages() == messages
    assert state.text() == template.render(messages, add_generation_prompt=False)


def test_role_context_managers_equal_role_expressions(runtime):
    @function
    def with_blocks(s):
        with s.system():
            s += "Be terse."
        with s.user():
            s += "Hi " + "there"
        with s.assistant():
            s += gen("a", max_tokens=4, temperature=0.0)

    @function
    def with_exprs(s):
        s += system("Be terse.") + user("Hi there")
        s += assistant(gen("a", max_tokens=4, temperature=0.0))

    a, b = with_blocks.run(backend=runtime), with_exprs.run(backend=runtime)
    assert a.text() == b.text() and a.messages() == b.messages()


def test_fallback_template_when_the_checkpoint_has_none(tmp_path):
    template = ChatTemplate.from_dir(tmp_path)
    assert role_affixes(template, [], "user") == ("<|user|>\n", "\n")
    history = [{"role": "user", "content": "hi"}]
    assert role_affixes(template, history, "assistant") == ("<|assistant|>\n", "\n")


# ---- fork / join, streaming, concurrency ------------------------------------------------------


def test_fork_join_gathers_each_fork_result(runtime):
    @function
    def branches(s):
        s += PROMPT
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += gen("x", max_tokens=5, temperature=0.0, adapter=f"a{i}")
        forks.join()
        s += " and more"

    runtime.call(lambda e: setattr(runtime, "peak_batch", 0))
    state = branches.run(backend=runtime)
    assert state["x"] == [direct(runtime, PROMPT, f"a{i}", max_tokens=5) for i in range(3)]
    assert state.text() == PROMPT + " and more"
    assert runtime.peak_batch >= 3  # the three forks shared scheduler steps


def test_reading_forks_right_after_join(runtime):
    @function
    def branches(s, seen):
        s += PROMPT
        forks = s.fork(2)
        for f in forks:
            f += gen("x", max_tokens=1, temperature=0.0)
        forks.join()  # queued on the parent; the forks end when it runs
        seen.append((forks[0]["x"], forks[1].text(), s["x"]))

    for _ in range(10):
        seen: list = []
        branches.run(seen, backend=runtime)
        first, text, gathered = seen[0]
        assert gathered == [first, first] and text == PROMPT + first


def test_fork_join_concatenate(runtime):
    @function
    def branches(s):
        s += PROMPT
        forks = s.fork(2)
        forks[0] += " one" + gen("x", max_tokens=3, temperature=0.0)
        forks[1] += " two"
        forks.join("concate_and_append")

    state = branches.run(backend=runtime)
    first = direct(runtime, PROMPT + " one", max_tokens=3)
    assert state.text() == PROMPT + " one" + first + " two"


def test_streaming_text_adds_up_to_the_result(runtime):
    @function
    def story(s):
        s += PROMPT
        s += gen("out", max_tokens=12, temperature=0.0, adapter="a4")
        s += " END"

    state = story.run(backend=runtime, stream=True)
    chunks = list(state.text_iter())
    assert len(chunks) > 2
    assert "".join(chunks) == state.text() == PROMPT + state["out"] + " END"
    assert state["out"] == direct(runtime, PROMPT, "a4", max_tokens=12)
    again = story.run(backend=runtime, stream=True)
    assert "".join(again.text_iter("out")) == state["out"]


def test_run_batch_50_programs_over_5_adapters(runtime):
    @function
    def ask(s, i, adapter):
        s += f"Request {i}: {PROMPT}"
        s += gen("a", max_tokens=6, temperature=0.0, adapter=adapter)

    specs = [ADAPTERS[i % 5] if i % 7 else STACK for i in range(50)]
    runtime.call(lambda e: setattr(runtime, "peak_batch", 0))
    states = ask.run_batch(
        [{"i": i, "adapter": spec} for i, spec in enumerate(specs)], backend=runtime, progress=True
    )
    prompts = [f"Request {i}: {PROMPT}" for i in range(50)]
    outs = runtime.call(
        lambda e: e.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), specs)
    )
    assert [s["a"] for s in states] == [o.outputs[0].text for o in outs]
    assert runtime.peak_batch > 10


# ---- prefix sharing --------------------------------------------------------------------------


def test_second_gen_on_the_same_state_hits_the_cache(runtime):
    prompt = "Legal, medical, code and support adapters answer in their own voice. " * 3

    @function
    def two_calls(s):
        s += prompt
        s += gen("first", max_tokens=4, temperature=0.0)
        s += " Then:"
        s += gen("second", max_tokens=4, temperature=0.0)

    engine = runtime.engine
    namespace = cache_namespace(engine.base_version, engine.resolve_adapters("a3"), None)
    before = runtime.call(lambda e: e.scheduler.tree.namespace_stats().get(namespace, (0, 0)))
    state = two_calls.run(backend=runtime, default_adapter="a3")
    after = runtime.call(lambda e: e.scheduler.tree.namespace_stats()[namespace])
    prompt_tokens = len(engine.tokenizer.encode(prompt))
    assert state.get_meta_info("first")["cached_tokens"] == 0
    assert state.get_meta_info("second")["cached_tokens"] >= prompt_tokens
    assert after[0] - before[0] >= prompt_tokens  # hit tokens, counted by the radix tree
