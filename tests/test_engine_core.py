"""Sampling, stop conditions, n > 1, dtypes and slot/row accounting of the offline Engine."""

from __future__ import annotations

import msgspec
import pytest
import torch

from radixlora import Engine, SamplingParams
from tests.conftest import assert_all_free
from tests.oracle import logprobs, peft_model


@pytest.fixture(scope="module")
def engine(checkpoints, adapters):
    return Engine(checkpoints["llama"], adapters=adapters["llama"], max_rank=64, kv_pages=256)


def test_seeded_sampling_is_batch_invariant(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01,
                            seed=1234, ignore_eos=True)
    alone = engine.generate([3, 4, 5, 6], params, adapters="a")[0].outputs[0].token_ids
    others = [[7, 8, 9], [10, 11], [3, 4, 5, 6]]
    mixed = engine.generate(others, params, adapters=["b", None, "a"])
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = msgspec.structs.replace(params, seed=99)
    assert engine.generate([3, 4, 5, 6], other_seed, adapters="a")[0].outputs[0].token_ids != alone
    assert_all_free(engine)


def test_sampled_logprobs_match_peft(engine, checkpoints, adapters):
    ref = peft_model(checkpoints["llama"], {"c": adapters["llama"]["c"]})
    ids = [9, 8, 7, 6, 5]
    params = SamplingParams(max_tokens=10, temperature=1.3, seed=5, ignore_eos=True)
    out = engine.generate(ids, params, adapters="c")[0].outputs[0]
    lp = logprobs(ref, ids + out.token_ids, ["c"])
    for step, token in enumerate(out.token_ids):
        assert abs(out.logprobs[step] - float(lp[len(ids) - 1 + step, token])) < 1e-4


def test_degenerate_filters_equal_greedy(engine):
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = engine.generate([4, 4, 2], greedy, adapters="d")[0].outputs[0].token_ids
    for params in (SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True, seed=1),
                   SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, ignore_eos=True),
                   SamplingParams(max_tokens=8, temperature=1.0, min_p=1.0, ignore_eos=True)):
        assert engine.generate([4, 4, 2], params, adapters="d")[0].outputs[0].token_ids == want


def test_n_samples_and_stop_tokens(engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=77, n=3, ignore_eos=True)
    out = engine.generate([1, 2, 3, 4, 5, 6], params, adapters="b")[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    single = SamplingParams(max_tokens=10, temperature=1.0, seed=77, ignore_eos=True)
    assert engine.generate([1, 2, 3, 4, 5, 6], single, adapters="b")[0].outputs[0].token_ids == (
        out.outputs[0].token_ids)
    greedy = engine.generate([5, 5], SamplingParams(max_tokens=10, temperature=0.0,
                                                    ignore_eos=True))[0].outputs[0]
    stop = greedy.token_ids[4]
    first = greedy.token_ids.index(stop)
    cut = engine.generate([5, 5], SamplingParams(max_tokens=10, temperature=0.0,
                                                 stop_token_ids=(stop,)))[0].outputs[0]
    assert cut.token_ids == greedy.token_ids[: first + 1] and cut.finish_reason == "stop"
    assert greedy.finish_reason == "length"
    assert_all_free(engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(checkpoints, adapters, dtype):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    eng32 = Engine(checkpoints["qwen2"], adapters={"a": adapters["qwen2"]["a"]}, kv_pages=64)
    eng16 = Engine(checkpoints["qwen2"], adapters={"a": adapters["qwen2"]["a"]}, kv_pages=64,
                   dtype=dtype)
    assert eng16.runner.kv_pool.k_cache[0].dtype == getattr(torch, dtype)
    ref = dict(eng32.generate(ids, params, adapters="a")[0].outputs[0].top_logprobs[0])
    got = dict(eng16.generate(ids, params, adapters="a")[0].outputs[0].top_logprobs[0])
    shared = set(ref) & set(got)
    assert len(shared) >= 3
    assert max(abs(ref[t] - got[t]) for t in shared) < 0.15


def test_text_prompts_with_tokenizer(tmp_path):
    from scripts.checkpoints import build_tiny_adapter, build_tiny_model

    model = build_tiny_model(tmp_path / "m")
    eng = Engine(model, adapters={"x": build_tiny_adapter(model, tmp_path / "x", 8, seed=3)})
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    base, lora = eng.generate(["The quick brown fox"] * 2, params, adapters=[None, "x"])
    assert base.outputs[0].text is not None and base.prompt_token_ids[0] != 0
    assert base.outputs[0].token_ids != lora.outputs[0].token_ids
    assert_all_free(eng)
