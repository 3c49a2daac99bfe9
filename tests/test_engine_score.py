"""Engine.score: prompt-token logprobs through the normal scheduler equal transformers + PEFT,
with chunked prefill, a cached prefix, an adapter, and batched with generating requests."""

from __future__ import annotations

import pytest

from radixlora import Engine, SamplingParams
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.oracle import logprobs, peft_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    model = build_tiny_model(root / "tiny")
    adapter = build_tiny_adapter(model, root / "a1", rank=8, seed=1)
    engine = Engine(model, adapters={"a1": adapter}, max_batch_tokens=7)  # chunked prefills
    return engine, peft_model(model, {"a1": adapter})


def reference(oracle, ids: list[int], start: int, adapter) -> list[float]:
    table = logprobs(oracle, ids, None if adapter is None else [adapter])
    return [table[i - 1, ids[i]].item() for i in range(start, len(ids))]


@pytest.mark.parametrize("adapter", [None, "a1"])
def test_score_equals_reference(setup, adapter):
    engine, oracle = setup
    ids = engine.tokenizer.encode("A radix cache shares prefix KV between requests of the same")
    for start in (1, 5, len(ids) - 1, len(ids)):
        got = engine.score(ids, start, adapters=adapter)[0]
        assert got == pytest.approx(reference(oracle, ids, start, adapter), abs=1e-4)
    again = engine.score([ids, ids[:9]], [3, 4], adapters=adapter)  # prefix now cached
    assert again[0] == pytest.approx(reference(oracle, ids, 3, adapter), abs=1e-4)
    assert again[1] == pytest.approx(reference(oracle, ids[:9], 4, adapter), abs=1e-4)


def test_scoring_next_to_generation(setup):
    engine, oracle = setup
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    params = SamplingParams(max_tokens=6, temperature=0.0)
    alone = engine.generate("Multi-LoRA serving", params, adapters="a1")[0].outputs[0].token_ids
    scored = engine.submit(ids, SamplingParams(max_tokens=1, seed=0), logprob_start=2)
    generated = engine.submit("Multi-LoRA serving", params, adapters="a1")
    while engine.scheduler.has_work():
        engine.step()
    assert scored[0].input_logprobs == pytest.approx(reference(oracle, ids, 2, None), abs=1e-4)
    assert generated[0].output_ids == alone
    with pytest.raises(Exception, match="logprob_start"):
        engine.submit(ids, params, logprob_start=0)


def test_long_prompts_are_scored_a_few_rows_of_logits_at_a_time(tmp_path, monkeypatch):
    """Prompt logprobs and their top tokens when the scored rows' logits are made 3 rows at a
    time (SCORE_ROWS; no step holds a prompt's full-vocabulary logits): as transformers."""
    from radixlora.worker import model_runner

    monkeypatch.setattr(model_runner, "SCORE_ROWS", 3)
    model = build_tiny_model(tmp_path / "tiny")
    engine = Engine(model)
    oracle = peft_model(model, {"a1": build_tiny_adapter(model, tmp_path / "a1", rank=4,
                                                         seed=2)})
    ids = engine.tokenizer.encode("Long prompts are scored in slices of a few rows each")
    reqs = engine.submit(ids, SamplingParams(max_tokens=1, seed=0, logprobs=2), logprob_start=1)
    while engine.scheduler.has_work():
        engine.step()
    table = logprobs(oracle, ids, None)
    assert reqs[0].input_logprobs == pytest.approx(reference(oracle, ids, 1, None), abs=1e-4)
    for i, top in enumerate(reqs[0].input_top, start=1):
        values, tokens = table[i - 1].topk(2)
        assert [t for t, _ in top] == tokens.tolist()
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)
