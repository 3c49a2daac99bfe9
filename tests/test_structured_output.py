"""Structured output against an oracle: transformers + PEFT decoding greedily step by step with
the allowed tokens of an independent llguidance matcher must give the Engine's tokens, for a
JSON schema, a regular expression and a choice, on the base and on adapters in one mixed batch
(beside unconstrained requests, which are unchanged); the outputs match their structure; bad
structures are refused with the field they came from; nothing leaks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import llguidance
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from radixlora import Engine, SamplingParams
from radixlora.errors import InvalidRequestError
from radixlora.step_plan import StepMasks
from radixlora.structured import Structure, allowed_tokens, mask_words
from radixlora.worker.cuda_graph import StaticInputs
from radixlora.worker.sampler import TokenMask
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.conftest import assert_all_free
from tests.oracle import logprobs, peft_model

ENGINE = dict(kv_pages=256, max_running=8, adapter_rows=32)
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}
REGEX = r"[a-c]{2,4}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]
STRUCTURES = {
    "json": Structure("json_schema", json.dumps(SCHEMA)),
    "regex": Structure("regex", REGEX, param="regex"),
    "choice": Structure("choice", json.dumps(CHOICES), param="guided_choice"),
}
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured")
    model = build_tiny_model(root / "model")
    adapters = {f"a{i}": build_tiny_adapter(model, root / f"a{i}", rank=4, seed=i)
                for i in (1, 2)}
    return model, adapters


@pytest.fixture(scope="module")
def engine(tiny):
    model, adapters = tiny
    return Engine(model, adapters=adapters, **ENGINE)


def _oracle(model: Path, hf, structure: Structure, prompt: list[int], adapter: str | None,
            vocab: int, eos: int) -> list[int]:
    """Greedy decoding by transformers + PEFT where only the llguidance-allowed tokens may be
    picked; stops after EOS or MAX_TOKENS."""
    tokenizer = llguidance.LLTokenizer((model / "tokenizer.json").read_text(), n_vocab=vocab,
                                       eos_token=eos)
    matcher = llguidance.LLMatcher(tokenizer, structure.grammar())
    out: list[int] = []
    while len(out) < MAX_TOKENS:
        scores = logprobs(hf, prompt + out, active=[adapter] if adapter else None)[-1]
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[allowed_tokens(matcher.compute_bitmask(), vocab)] = True
        token = int(scores.masked_fill(~allowed, -torch.inf).argmax())
        out.append(token)
        if token == eos:
            break
        assert matcher.consume_token(token)
    return out


def _text(model: Path, ids: list[int], eos: int) -> str:
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return tok.decode([t for t in ids if t != eos])


def _check(kind: str, text: str) -> None:
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"ok", "tag", "n"} and isinstance(value["ok"], bool)
        assert value["tag"] in SCHEMA["properties"]["tag"]["enum"] and 0 <= value["n"] <= 99
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def test_structured_outputs_equal_masked_greedy_transformers_in_a_mixed_batch(tiny, engine):
    model, adapters = tiny
    cfg = engine.model_cfg
    eos = cfg.eos_token_ids[0]
    prompt = engine.tokenizer.encode("The answer is")
    cases = [(kind, adapter) for kind in STRUCTURES for adapter in (None, "a1", "a2")]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [engine.generate(prompt, plain, adapters=a)[0].outputs[0].token_ids
             for a in (None, "a1")]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                             structure=STRUCTURES[kind]) for kind, _ in cases]
    outs = engine.generate([prompt] * (len(cases) + 2), params + [plain, plain],
                           adapters=[a for _, a in cases] + [None, "a1"])
    hf = peft_model(model, adapters)
    for (kind, adapter), out in zip(cases, outs):
        got = out.outputs[0].token_ids
        assert got == _oracle(model, hf, STRUCTURES[kind], prompt, adapter, cfg.vocab_size,
                              eos), (kind, adapter)
        assert got[-1] == eos and out.outputs[0].finish_reason == "stop", (kind, adapter)
        _check(kind, _text(model, got, eos))
    assert [o.outputs[0].token_ids for o in outs[-2:]] == alone
    assert_all_free(engine)


def test_a_constrained_request_is_planned_while_its_previous_token_is_sampled(engine,
                                                                              monkeypatch):
    """With overlap scheduling each step is planned while the one before runs; a constrained
    request's mask needs the token that step samples, so it comes after the plan (late_mask)
    and the executor samples the step only then: the request is in every step, overlapped
    (the oracle test above checks the tokens such steps give)."""
    late = []
    sample_late = engine.runner.sample_late

    def spy(step, words):
        late.append(len(words) // (4 * mask_words(engine.model_cfg.vocab_size)))
        sample_late(step, words)

    monkeypatch.setattr(engine.runner, "sample_late", spy)
    prompt = engine.tokenizer.encode("The answer is")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                            structure=STRUCTURES["json"])
    steps, overlapped = engine.loop.num_steps, engine.loop.num_overlapped
    out = engine.generate(prompt, params, adapters="a1")[0].outputs[0].token_ids
    steps, overlapped = engine.loop.num_steps - steps, engine.loop.num_overlapped - overlapped
    # the prefill samples the first token, each step one more, and the step planned while the
    # last one (the end of the JSON) was sampled is dropped
    assert steps == len(out) + 1
    assert overlapped == steps - 1 and late == [1] * (steps - 1)
    assert_all_free(engine)


def test_late_masks_that_do_not_fit_their_step_fail_that_step_alone(engine):
    """Masks for a step that waits for none are dropped; masks that do not fit the step fail
    it (its request recomputes, as after any failed step) and serving goes on."""
    prompt = engine.tokenizer.encode("The answer is")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                            structure=STRUCTURES["regex"])
    engine.submit(prompt, params)
    executor, loop = engine.executor, engine.loop
    first = loop.next_plan()
    executor.submit(first)
    late = loop.next_plan()  # planned while the first token is being sampled
    assert [item.late_mask for item in late.items] == [True]
    executor.submit(late)
    (result,) = executor.collect(keep=1)
    folded = loop.fold(result)
    vocab = engine.model_cfg.vocab_size
    assert folded.masks.step == late.step and len(folded.masks.words) == 4 * mask_words(vocab)
    executor.give_masks(StepMasks(step=late.step + 1, words=folded.masks.words))  # dropped
    assert executor.collect(keep=0) == []  # the late step still waits
    executor.give_masks(StepMasks(step=late.step, words=b""))
    (failed,) = executor.collect(keep=0)
    assert failed.error.startswith("ValueError: 0 late masks for 1 late items")
    assert loop.fold(failed).error is not None
    while engine.scheduler.has_work():
        engine.step()
    assert_all_free(engine)


class EagerStaticInputs(StaticInputs):
    forward = StaticInputs.static_forward


def test_masked_and_penalised_steps_run_the_graph_forward(tiny, engine):
    """Steps whose rows have token masks (late ones too), penalties or biases run the
    static-buffer forward (what a CUDA graph replays, here eagerly) and sample from its logits
    afterwards: the same tokens as the eager path."""
    model, adapters = tiny
    prompts = [engine.tokenizer.encode(t) for t in ("The answer is", "Pick one", "Say", "Go")]
    params = [SamplingParams(max_tokens=10, temperature=0.0, structure=STRUCTURES["regex"]),
              SamplingParams(max_tokens=10, temperature=0.9, seed=5, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.2, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.0, logit_bias={7: 5.0}, min_tokens=4),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    specs = ["a1", None, "a2", "a1"]
    ref = engine.generate(prompts, params, adapters=specs)
    eng = Engine(model, adapters=adapters, attention_backend="triton", lora_backend="triton",
                 **ENGINE)
    eng.runner.graphs = EagerStaticInputs(eng.runner, max_batch=8, max_context=256, max_rows=64)
    replays = []
    forward = eng.runner.graphs.forward
    eng.runner.graphs.forward = lambda *a, **k: replays.append(a[0]) or forward(*a, **k)
    got = eng.generate(prompts, params, adapters=specs)
    for a, b in zip(ref, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(replays) >= 9  # every decode step
    assert_all_free(eng)


def test_sampled_structured_outputs_match_for_every_sample_and_seed(tiny, engine):
    model, _ = tiny
    eos = engine.model_cfg.eos_token_ids[0]
    prompt = engine.tokenizer.encode("Pick one")
    for kind, structure in STRUCTURES.items():
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.3, seed=7, n=3,
                                structure=structure)
        first = engine.generate(prompt, params, adapters="a2")[0]
        again = engine.generate(prompt, params, adapters="a2")[0]
        for sample, repeat in zip(first.outputs, again.outputs):
            assert sample.token_ids == repeat.token_ids  # seeded: reproducible
            _check(kind, _text(model, sample.token_ids, eos))
    assert_all_free(engine)


@pytest.mark.parametrize("structure, message", [
    (Structure("json_schema", "{not json"), "JSON schema"),
    (Structure("regex", "a(b", param="regex"), "does not compile"),
    (Structure("choice", "[]", param="guided_choice"), "non-empty list"),
    (Structure("grammar", "start: ( ", param="ebnf"), "ebnf"),
])
def test_bad_structures_are_refused_with_their_field(engine, structure, message):
    with pytest.raises(InvalidRequestError) as e:
        engine.generate([5, 6, 7], SamplingParams(max_tokens=4, structure=structure))
    assert e.value.param == structure.param and message in e.value.message
    assert_all_free(engine)


def test_token_mask_keeps_only_allowed_tokens_and_never_leaves_a_row_empty():
    vocab = 70
    logits = torch.randn(3, vocab)
    logits[2, :] = -torch.inf  # a row another processor left empty
    allowed = {0: [1, 33, 69], 2: [5, 64]}
    masks = []
    for row in range(3):
        if row not in allowed:
            masks.append(None)
            continue
        words = np.zeros(mask_words(vocab), np.uint32)
        for t in allowed[row]:
            words[t // 32] |= np.uint32(1 << (t % 32))
        masks.append(words.view(np.int32).tobytes())
    before = logits.clone()
    TokenMask.build(masks).apply(logits)
    for row, tokens in allowed.items():
        finite = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert finite == tokens
        assert list(allowed_tokens(masks[row], vocab)) == tokens
    assert torch.equal(logits[1], before[1])
    assert torch.equal(logits[0, [1, 33, 69]], before[0, [1, 33, 69]])


def test_object_schemas_are_closed_unless_they_say_otherwise():
    """As xgrammar's strict mode reads schemas (vLLM's default): an object schema that lists
    properties and says nothing of others admits no others; one that allows them keeps that."""
    from radixlora.structured import closed

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "c": {"type": "array", "items": {"properties": {"d": {}}}},
        "e": {"type": "object", "properties": {}, "additionalProperties": True}},
        "$defs": {"X": {"anyOf": [{"properties": {"y": {}}}]}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["e"]["additionalProperties"] is True
    assert out["$defs"]["X"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own schema is left alone


def test_a_compiler_without_its_tokenizer_refuses_structured_requests(tmp_path):
    """Where llguidance's tokenizer cannot be built (here: no file; on a machine without
    llguidance: its import), structured requests get a 400 saying so; nothing else breaks."""
    from radixlora.sched.grammar_compiler import GrammarCompiler

    compiler = GrammarCompiler(tmp_path / "missing.json", 64, (2,))
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(STRUCTURES["regex"])
    assert e.value.code == "structured_output_unavailable" and e.value.param == "regex"
