"""The adapter-aware radix cache and the scheduler, end to end on the offline Engine:
cache-on equals cache-off, retraction keeps outputs, no starvation, admission control."""

from __future__ import annotations

import shutil

import pytest
import torch

from radixlora import Engine, InvalidRequestError, SamplingParams
from radixlora.sched.scheduler import AGING_STEPS
from scripts.checkpoints import build_peft_adapter
from tests.conftest import assert_all_free

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def workload():
    """(prompt, adapters) pairs: shared system prompts across adapters, stacks in both orders."""
    system_a, system_b = tokens(1, 40), tokens(2, 23)
    specs = [None, "a", "b", "c", [("a", 1.0), ("b", 0.5)], [("b", 0.5), ("a", 1.0)], "a", None]
    out = []
    for i, spec in enumerate(specs):
        system = system_a if i % 2 == 0 else system_b
        out.append((system + tokens(100 + i, 3 + i), spec))
        out.append((system + tokens(200 + i, 5), spec))
    return out


def run_workload(engine: Engine, rounds: int = 2) -> list:
    results = []
    for _ in range(rounds):
        for prompt, spec in workload():
            results.append(engine.generate(prompt, GREEDY, adapters=spec)[0])
        prompts, specs = zip(*workload())
        results += engine.generate(list(prompts), GREEDY, adapters=list(specs))
    return results


def assert_same_outputs(on, off) -> None:
    for a, b in zip(on, off, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs),
                                   torch.tensor(b.outputs[0].logprobs), atol=2e-5, rtol=0)


def make(checkpoints, adapter_dirs, **kw) -> Engine:
    kw.setdefault("max_rank", 64)
    return Engine(checkpoints["llama"], adapters=adapter_dirs, **kw)


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_on_equals_cache_off(checkpoints, adapters, page_size):
    dirs = {k: adapters["llama"][k] for k in "abc"}
    on = make(checkpoints, dirs, page_size=page_size, kv_pages=1024 // page_size)
    off = make(checkpoints, dirs, page_size=page_size, kv_pages=1024 // page_size,
               enable_radix_cache=False)
    res_on, res_off = run_workload(on), run_workload(off)
    assert_same_outputs(res_on, res_off)
    assert sum(r.cached_tokens for r in res_on) > 0
    assert all(r.cached_tokens == 0 for r in res_off)
    stats = on.scheduler.tree.namespace_stats()
    assert len(stats) >= 5  # base, a, b, c, the stack (one namespace for both orders)
    assert_all_free(on)
    assert_all_free(off)


def test_stacks_in_any_order_share_one_namespace(checkpoints, adapters):
    eng = make(checkpoints, {k: adapters["llama"][k] for k in "ab"})
    prompt = tokens(5, 30)
    eng.generate(prompt, GREEDY, adapters=[("a", 1.0), ("b", 0.5)])
    hit = eng.generate(prompt, GREEDY, adapters=[("b", 0.5), ("a", 1.0)])[0]
    assert hit.cached_tokens == 29
    other_weight = eng.generate(prompt, GREEDY, adapters=[("b", 0.25), ("a", 1.0)])[0]
    assert other_weight.cached_tokens == 0
    salted = eng.generate(prompt, GREEDY, adapters=[("a", 1.0), ("b", 0.5)], cache_salt="t2")[0]
    assert salted.cached_tokens == 0
    assert_all_free(eng)


def test_republished_adapter_misses_and_matches_fresh_engine(checkpoints, adapters, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(adapters["llama"]["a"], live)
    eng = make(checkpoints, {"x": live})
    prompt = tokens(7, 25)
    old = eng.generate(prompt, GREEDY, adapters="x")[0]
    assert eng.generate(prompt, GREEDY, adapters="x")[0].cached_tokens == 24
    shutil.rmtree(live)
    build_peft_adapter(checkpoints["llama"], live, seed=99, r=8, lora_alpha=16)
    eng.load_adapter("x", live)
    new = eng.generate(prompt, GREEDY, adapters="x")[0]
    assert new.cached_tokens == 0
    fresh = make(checkpoints, {"x": live}, enable_radix_cache=False)
    assert_same_outputs([new], fresh.generate(prompt, GREEDY, adapters="x"))
    assert new.outputs[0].token_ids != old.outputs[0].token_ids
    assert_all_free(eng)


class CollidingNamespace(tuple):
    """A namespace whose hash collides with every other one."""

    def __hash__(self) -> int:
        return 7


def test_hash_colliding_namespaces_never_share(checkpoints, adapters, monkeypatch):
    import radixlora.sched.intake as engine_module

    real = engine_module.cache_namespace
    monkeypatch.setattr(engine_module, "cache_namespace",
                        lambda *args: CollidingNamespace(real(*args)))
    dirs = {k: adapters["llama"][k] for k in "abc"}
    on, off = make(checkpoints, dirs), make(checkpoints, dirs, enable_radix_cache=False)
    assert_same_outputs(run_workload(on, rounds=1), run_workload(off, rounds=1))
    assert_all_free(on)


def test_retraction_keeps_outputs(checkpoints, adapters):
    dirs = {k: adapters["llama"][k] for k in "abcd"}
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=3, ignore_eos=True)
    prompts = [tokens(300 + i, 12 + i) for i in range(8)]
    specs = ["a", "b", None, "c", "d", [("a", 1.0), ("c", 1.0)], "a", "b"]
    roomy = make(checkpoints, dirs, kv_pages=2048)
    tight = make(checkpoints, dirs, kv_pages=90)
    want = roomy.generate(prompts, params, adapters=specs)
    got = tight.generate(prompts, params, adapters=specs)
    assert tight.scheduler.num_retractions > 0
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_all_free(tight)


def test_rare_adapter_is_not_starved(checkpoints, adapters):
    dirs = {k: adapters["llama"][k] for k in "abcd"}
    # rows for a (8) + b (4) + c (16) = 28; d (rank 64) fits only once the others are released
    eng = make(checkpoints, dirs, adapter_rows=72, max_running=8)
    flood = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(12):
        eng.submit(tokens(i, 6), flood, adapters="abc"[i % 3])
    rare = eng.submit(tokens(50, 6), flood, adapters="d")[0]
    steps = 0
    while rare.finish_reason is None:
        eng.submit(tokens(1000 + steps, 6), flood, adapters="abc"[steps % 3])
        eng.step()
        steps += 1
        assert steps < AGING_STEPS + 40, "rare adapter starved"
    while eng.scheduler.has_work():
        eng.step()
    assert_all_free(eng)


def test_impossible_request_is_rejected_at_once(checkpoints, adapters):
    eng = make(checkpoints, {"a": adapters["llama"]["a"]}, kv_pages=33)
    with pytest.raises(InvalidRequestError) as info:
        eng.generate(tokens(1, 20), SamplingParams(max_tokens=20), adapters="a")
    assert info.value.code == "kv_pool_exceeded"
    ok = eng.generate(tokens(1, 20), SamplingParams(max_tokens=5, temperature=0.0), adapters="a")
    assert len(ok[0].outputs[0].token_ids) <= 5
    context = eng.scheduler.max_context
    with pytest.raises(InvalidRequestError) as info:
        eng.generate(tokens(1, context), SamplingParams(max_tokens=20))
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    assert f"the prompt ({context} tokens)" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:  # the prompt fits; the answer does not
        eng.generate(tokens(1, context - 4), SamplingParams(max_tokens=20))
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    assert_all_free(eng)


def test_n_samples_share_the_prompt_prefix(checkpoints, adapters):
    eng = make(checkpoints, {"a": adapters["llama"]["a"]})
    prompt = tokens(9, 40)
    out = eng.generate(prompt, SamplingParams(max_tokens=5, n=4, seed=1, ignore_eos=True),
                       adapters="a")[0]
    assert len(out.outputs) == 4
    (hits, lookups), = [v for k, v in eng.scheduler.tree.namespace_stats().items()]
    assert hits >= 3 * 39  # every sibling reused the parent's prompt KV
    assert_all_free(eng)


def test_chunked_prefill_matches_unchunked(checkpoints, adapters):
    dirs = {k: adapters["llama"][k] for k in "ab"}
    prompts = [tokens(400 + i, 60 + 7 * i) for i in range(3)]
    whole = make(checkpoints, dirs, max_batch_tokens=4096, enable_radix_cache=False)
    chunked = make(checkpoints, dirs, max_batch_tokens=16, enable_radix_cache=False)
    want = whole.generate(prompts, GREEDY, adapters=["a", "b", None])
    got = chunked.generate(prompts, GREEDY, adapters=["a", "b", None])
    assert_same_outputs(got, want)
    assert_all_free(chunked)


def test_unload_drops_the_adapters_namespaces(checkpoints, adapters):
    eng = make(checkpoints, {k: adapters["llama"][k] for k in "ab"})
    prompt = tokens(11, 20)
    eng.generate(prompt, GREEDY, adapters="a")
    eng.generate(prompt, GREEDY, adapters=[("a", 1.0), ("b", 1.0)])
    eng.generate(prompt, GREEDY, adapters="b")
    a_id = eng.adapters["a"].adapter_id
    eng.unload_adapter("a")
    remaining = [dict(ns)["adapters"] for ns in eng.scheduler.tree.namespaces()]
    assert remaining and all(a_id not in [aid for aid, _ in key] for key in remaining)
    assert not eng.scheduler.residency.is_resident(a_id)
    assert eng.generate(prompt, GREEDY, adapters="b")[0].cached_tokens == 19
    assert_all_free(eng)
