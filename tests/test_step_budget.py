"""The step budget (--itl-target-ms): the cost model's fit and its prefill budget, and the
scheduler under it: a step beside decoding streams never plans more prompt tokens than the budget
allows, a step with no stream decoding takes --max-batch-tokens, and the outputs are those of an
engine without a target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.sched.step_budget import MIN_PREFILL, MIN_STEPS, StepCosts
from tests.conftest import assert_all_free

TRUTH = (0.004, 2e-8, 1e-5, 1e-4)  # base, per context token, per decode, per prefill token


def synthetic(costs: StepCosts, n: int, truth=TRUTH, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(n):
        context, decodes = int(rng.integers(0, 200_000)), int(rng.integers(0, 512))
        prefill = int(rng.choice([0, int(rng.integers(1, 8192))]))
        costs.observe(context, decodes, prefill, float(np.dot(truth, (1, context, decodes,
                                                                      prefill))))


def test_the_fit_recovers_a_linear_step_cost_and_budgets_within_bounds():
    costs = StepCosts()
    synthetic(costs, MIN_STEPS - 1)
    assert costs.coefficients() is None
    assert costs.prefill_budget(1000, 10, 0.05, 8192) == 8192  # nothing measured: no cap
    synthetic(costs, 100, seed=1)
    np.testing.assert_allclose(costs.coefficients(), TRUTH, rtol=1e-6, atol=1e-12)
    base, per_context, per_decode, per_prefill = TRUTH
    context, decodes, target = 50_000, 200, 0.05
    room = target - base - per_context * context - per_decode * decodes
    assert abs(costs.prefill_budget(context, decodes, target, 8192) - room / per_prefill) <= 1
    assert costs.prefill_budget(context, decodes, 0.001, 8192) == MIN_PREFILL
    assert costs.prefill_budget(context, decodes, 10.0, 8192) == 8192


def test_no_cap_while_prefill_never_varied():
    costs = StepCosts()
    for i in range(64):
        costs.observe(1000 + i, 8 + i % 5, 0, 0.01 + 1e-4 * i)
    assert costs.coefficients() is None
    assert costs.prefill_budget(1000, 8, 0.001, 4096) == 4096


PER_PREFILL = 1e-3  # the primed model: a prompt token costs 1 ms, nothing else costs
TARGET_MS = 300.0  # so 300 prompt tokens a step while streams decode


def primed_engine(checkpoints, **kw) -> tuple[Engine, list]:
    """An engine whose step-cost model is primed so that a prompt token costs 1 ms and nothing
    else does; the steps it measures are recorded instead of fitted (the CPU's own timings
    would move the fit)."""
    engine = Engine(checkpoints["llama"], kv_pages=8192, max_batch_tokens=1024, **kw)
    costs, seen = engine.scheduler.step_costs, []
    if costs is not None:  # without a target the scheduler keeps no costs
        synthetic(costs, 64, truth=(0.0, 0.0, 0.0, PER_PREFILL))
        costs.observe = lambda *sample: seen.append(sample)
    return engine, seen


def long_prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 256, (length,), generator=g).tolist() for _ in range(n)]


def test_steps_beside_decoding_streams_keep_to_the_prefill_budget(checkpoints):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = long_prompts(8, 400)
    engine, seen = primed_engine(checkpoints, itl_target_ms=TARGET_MS)
    capped = engine.generate(prompts, params)
    assert seen and all(prefill <= TARGET_MS / 1000 / PER_PREFILL
                        for _, decodes, prefill, _ in seen if decodes)
    assert any(decodes and prefill for _, decodes, prefill, _ in seen)  # prompts still moved
    assert max(prefill for _, decodes, prefill, _ in seen if not decodes) == 1024
    plain, unseen = primed_engine(checkpoints)
    assert [o.outputs[0].token_ids for o in capped] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert plain.scheduler.step_costs is None and not unseen
    assert_all_free(engine)


def test_itl_target_must_be_positive():
    from radixlora.config import EngineConfig

    with pytest.raises(ValueError, match="itl_target_ms"):
        EngineConfig(itl_target_ms=0)
