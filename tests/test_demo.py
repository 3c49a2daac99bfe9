"""The bundled demo (radixlora/demo) through the Engine: in one mixed batch over the base and every
adapter, each adapter does its task on held-out inputs and nothing else does, and transformers +
PEFT load the shipped files and agree with the Engine token for token."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from radixlora import Engine, SamplingParams
from radixlora.demo import DEMO_ADAPTERS, DEMO_DIR, DEMO_MODEL_DIR, TASKS, format_prompt
from radixlora.demo.tasks import sample_inputs

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
EVAL_SEED = 2024  # not the training script's seed: a second held-out sample
MIN_ACCURACY = 0.9
MAX_WRONG_TASK_ACCURACY = 0.1
MAX_DEMO_BYTES = 8_000_000


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(DEMO_MODEL_DIR, adapters=DEMO_ADAPTERS, max_running=192, kv_pages=12288)


@pytest.fixture(scope="module")
def inputs() -> list[str]:
    return sample_inputs(30, EVAL_SEED, heldout=True)


@pytest.fixture(scope="module")
def served(engine, inputs) -> dict[str | None, list[str]]:
    """spec -> outputs for every input, from ONE batch with the base and all adapters
    interleaved request by request."""
    specs = [None, *DEMO_ADAPTERS]
    prompts = [format_prompt(text) for text in inputs for _ in specs]
    routing = [spec for _ in inputs for spec in specs]
    outs = engine.generate(prompts, GREEDY, adapters=routing)
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    texts = [o.outputs[0].text for o in outs]
    return {spec: texts[k :: len(specs)] for k, spec in enumerate(specs)}


def passes(spec: str | None, text: str, answer: str) -> bool:
    """The base passes by echoing; an adapter by its task's checker."""
    return answer.strip() == text if spec is None else TASKS[spec].check(text, answer)


def accuracy(task: str, inputs: list[str], outputs: list[str]) -> float:
    check = TASKS[task].check
    return sum(check(x, y) for x, y in zip(inputs, outputs)) / len(inputs)


@pytest.mark.parametrize("name", list(DEMO_ADAPTERS))
def test_adapter_does_its_task_and_no_other(served, inputs, name):
    assert accuracy(name, inputs, served[name]) >= MIN_ACCURACY
    for other in TASKS:
        if other != name:
            assert accuracy(other, inputs, served[name]) <= MAX_WRONG_TASK_ACCURACY


def test_base_echoes_and_does_no_task(served, inputs):
    echoed = sum(passes(None, x, y) for x, y in zip(inputs, served[None]))
    assert echoed >= MIN_ACCURACY * len(inputs)
    for task in TASKS:
        assert accuracy(task, inputs, served[None]) <= MAX_WRONG_TASK_ACCURACY


def test_cached_prompt_kv_stays_with_its_adapter_set(engine):
    """The same prompts, first under `upper` (their KV enters the radix cache), then under every
    other spec: nothing may reuse upper's KV, and each answer passes its own checker."""
    texts = sample_inputs(10, EVAL_SEED + 1, heldout=True)
    prompts = [format_prompt(text) for text in texts]
    salt = "isolation"  # a cache namespace of this test's own
    first = engine.generate(prompts, GREEDY, adapters="upper", cache_salt=salt)
    others = [None, "reverse", "digits", "json"]
    routing = [others[i % len(others)] for i in range(len(prompts))]
    mixed = engine.generate(prompts, GREEDY, adapters=routing, cache_salt=salt)
    assert all(out.cached_tokens == 0 for out in mixed)
    answers = [out.outputs[0].text for out in mixed]
    passed = sum(map(passes, routing, texts, answers))
    assert passed >= len(texts) - 1  # a stale-KV bug fails nearly all of them
    again = engine.generate(prompts, GREEDY, adapters="upper", cache_salt=salt)
    assert all(out.cached_tokens > 0 for out in again)
    assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in first]


def test_shipped_files_are_hf_and_peft_format():
    config = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "llama"
    for name in ("model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (DEMO_MODEL_DIR / name).is_file()
    for path in DEMO_ADAPTERS.values():
        assert json.loads((path / "adapter_config.json").read_text())["peft_type"] == "LORA"
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
            assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in f.keys()  # noqa: SIM118
    total = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert total <= MAX_DEMO_BYTES


def test_transformers_tokenizer_and_chat_template_agree(engine):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    prompt = format_prompt("the red fox ate 42 fish")
    assert hf(prompt)["input_ids"] == engine.tokenizer.encode(prompt)
    messages = [{"role": "user", "content": "the red fox ate 42 fish"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt


def test_peft_generates_what_the_engine_generates(engine, inputs):
    from tests.oracle import peft_model

    model = peft_model(DEMO_MODEL_DIR, DEMO_ADAPTERS)
    for spec in [None, *DEMO_ADAPTERS]:
        for text in inputs[:2]:
            ids = engine.tokenizer.encode(format_prompt(text))
            ours = engine.generate(ids, GREEDY, adapters=spec)[0].outputs[0].token_ids
            assert ours == peft_greedy(model, ids, spec), (spec, text)


def peft_greedy(model, ids: list[int], spec: str | None) -> list[int]:
    """transformers' own greedy generation with adapter `spec` (None: the base)."""
    import contextlib

    import torch

    if spec is not None:
        model.base_model.set_adapter(spec)
    adapters_off = model.disable_adapter() if spec is None else contextlib.nullcontext()
    with torch.no_grad(), adapters_off:
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()
