"""Overlap scheduling: step N+1 is planned (with placeholders for step N's tokens) before step
N's results are folded in. Oracle: the same engine with overlap off, over workloads that end
requests early (stop tokens), retract them (tight KV), chunk prefills, score prompts, and
abort; every KV page and adapter row is free afterwards."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.step_plan import bytes_to_ids
from radixlora_kernels.device import StagingRing
from tests.conftest import assert_all_free

SPECS = ["a", None, "b", [("a", 1.0), ("c", -0.5)], "c", None, "a", "b"]


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make(checkpoints, adapters, overlap: bool, **kw) -> Engine:
    dirs = {k: adapters["llama"][k] for k in "abc"}
    engine = Engine(checkpoints["llama"], adapters=dirs, max_rank=64, overlap_schedule=overlap,
                    **kw)
    engine.placeholders = 0
    launch = engine.runner.launch

    def counting_launch(plan, loads=()):
        engine.placeholders += int((bytes_to_ids(plan.input_ids) < 0).sum())
        return launch(plan, loads)

    engine.runner.launch = counting_launch
    return engine


def workload(seed: int = 0):
    prompts = [tokens(seed + i, 5 + 3 * i) for i in range(len(SPECS))]
    params = [
        SamplingParams(max_tokens=4 + 3 * i, temperature=0.0 if i % 3 == 0 else 0.9, seed=i,
                       n=1 + (i == 4), logprobs=2 if i == 2 else None,
                       # a frequent id ends some requests early, in the middle of a pipeline
                       stop_token_ids=tuple(range(2, 60)) if i in (1, 6) else (),
                       ignore_eos=True)
        for i in range(len(SPECS))
    ]
    return prompts, params


def outputs(results) -> list:
    """Tokens, finish reasons and top-logprob ids (values differ by float noise only)."""
    return [[(o.token_ids, o.finish_reason, [[i for i, _ in row] for row in o.top_logprobs])
             for o in r.outputs] for r in results]


def assert_close_logprobs(want, got) -> None:
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=2e-5, rtol=0)
            np.testing.assert_allclose([[lp for _, lp in row] for row in x.top_logprobs],
                                       [[lp for _, lp in row] for row in y.top_logprobs],
                                       atol=2e-5, rtol=0)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(max_batch_tokens=16),  # chunked prefills
    dict(kv_pages=28, page_size=2),  # retractions
    dict(enable_radix_cache=False),
])
def test_overlap_equals_no_overlap(checkpoints, adapters, kw):
    prompts, params = workload()
    want = make(checkpoints, adapters, overlap=False, **kw).generate(prompts, params, SPECS)
    engine = make(checkpoints, adapters, overlap=True, **kw)
    got = engine.generate(prompts, params, SPECS)
    assert outputs(got) == outputs(want)
    assert_close_logprobs(want, got)
    assert engine.placeholders > 0
    if "kv_pages" in kw:
        assert engine.scheduler.num_retractions > 0
    stopped = [o.finish_reason for r in got for o in r.outputs]
    assert "stop" in stopped and "length" in stopped
    assert_all_free(engine)


def test_outputs_staged_in_a_ring(checkpoints, adapters):
    """The outputs' host copies in a staging ring (as on CUDA) small enough to wrap many times
    and to refuse the larger outputs (those with top logprobs): the same results, and every
    region read."""
    prompts, params = workload(seed=30)
    want = make(checkpoints, adapters, overlap=True).generate(prompts, params, SPECS)
    engine = make(checkpoints, adapters, overlap=True)
    engine.runner.host_outputs = StagingRing(1024, pin=False)
    taken = []
    take = engine.runner.host_outputs.take

    def counting_take(nbytes):
        view = take(nbytes)
        taken.append(view is not None)
        return view

    engine.runner.host_outputs.take = counting_take
    got = engine.generate(prompts, params, SPECS)
    ids = tokens(9, 14)
    scores = engine.score([ids, ids[:9]], [2, 4], adapters="b")
    assert outputs(got) == outputs(want)
    assert_close_logprobs(want, got)
    assert scores == make(checkpoints, adapters, overlap=True).score([ids, ids[:9]], [2, 4],
                                                                     adapters="b")
    assert sum(taken) > 16 and not all(taken)  # regions of 128 bytes or more: twice round
    assert_all_free(engine)


def test_scoring_with_overlap(checkpoints, adapters):
    ids = tokens(7, 20)
    want = make(checkpoints, adapters, overlap=False, max_batch_tokens=8)
    engine = make(checkpoints, adapters, overlap=True, max_batch_tokens=8)
    for eng in (want, engine):
        eng.submit(tokens(8, 6), SamplingParams(max_tokens=12, temperature=0.0), adapters="a")
    expected = want.score([ids, ids[:11]], [2, 5], adapters="b")
    got = engine.score([ids, ids[:11]], [2, 5], adapters="b")
    for a, b in zip(got, expected, strict=True):
        assert a == pytest.approx(b, abs=2e-5)
    while engine.scheduler.has_work():
        engine.step()
    assert_all_free(engine)


def test_abort_with_a_step_in_flight(checkpoints, adapters):
    engine = make(checkpoints, adapters, overlap=True)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    keep = engine.submit(tokens(20, 9), params, adapters="a")[0]
    drop = engine.submit(tokens(21, 9), params, adapters="b")[0]
    for _ in range(4):
        engine.step()
    assert engine.scheduler.num_in_flight == 1 and drop.pending == 1
    engine.scheduler.abort(drop)
    while engine.scheduler.has_work():
        engine.step()
    alone = make(checkpoints, adapters, overlap=False).generate(tokens(20, 9), params, "a")[0]
    assert keep.output_ids == alone.outputs[0].token_ids
    assert drop.finish_reason == "abort" and len(drop.output_ids) < 20
    assert_all_free(engine)


def test_overlap_switched_off_between_steps(checkpoints, adapters):
    engine = make(checkpoints, adapters, overlap=True)
    prompts, params = workload(seed=60)
    groups = [engine.submit(p, sp, spec) for p, sp, spec in zip(prompts, params, SPECS)]
    for _ in range(3):
        engine.step()
    engine.config = dataclasses.replace(engine.config, overlap_schedule=False)
    while engine.scheduler.has_work():
        engine.step()
    want = make(checkpoints, adapters, overlap=False).generate(prompts, params, SPECS)
    assert outputs([engine.output_of(g) for g in groups]) == outputs(want)
    assert_all_free(engine)


def test_discarded_plan_recomputes(checkpoints, adapters):
    """A step the worker could not run: its requests recompute, their outputs unchanged, and
    the step launched after it (which read placeholders of the lost step) is dropped."""
    prompts, params = workload(seed=40)
    want = make(checkpoints, adapters, overlap=False).generate(prompts, params, SPECS)
    engine = make(checkpoints, adapters, overlap=True)
    groups = [engine.submit(p, sp, spec) for p, sp, spec in zip(prompts, params, SPECS)]
    sched = engine.scheduler
    for _ in range(3):
        engine.step()
    engine.executor.in_flight.popleft()
    _, lost, _ = engine.loop.in_flight.popleft()
    engine.runner.failed()
    successor = engine.loop.next_plan()
    assert (bytes_to_ids(successor.input_ids) < 0).any()
    engine.executor.submit(successor)
    sched.discard(lost)
    while sched.has_work():
        engine.step()
    assert sched.num_retractions > 0
    got = [engine.output_of(g) for g in groups]
    assert outputs(got) == outputs(want)
    assert_all_free(engine)


@pytest.mark.parametrize("overlap", [True, False])
def test_step_totals_count_every_step_by_kind(checkpoints, overlap):
    """The loop's cumulative totals: every step once, as decode (one token per request) or
    mixed, with all the tokens and requests the plans held."""
    engine = Engine(checkpoints["llama"], kv_pages=256, max_batch_tokens=16,
                    overlap_schedule=overlap)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plans = []
    submit = engine.executor.submit
    engine.executor.submit = lambda plan: plans.append(plan) or submit(plan)
    engine.generate([[3] * 20, [4] * 5, [5] * 9], params)
    totals = engine.loop.totals
    lens = [[i.extend_len for i in p.items] for p in plans]
    decode = [n for n in lens if max(n) == 1]
    assert totals["decode"].steps == len(decode) and totals["mixed"].steps == len(lens) - len(
        decode)
    assert totals["decode"].tokens == totals["decode"].requests == sum(map(len, decode))
    assert totals["decode"].tokens + totals["mixed"].tokens == 20 + 5 + 9 + 3 * 5
    assert totals["mixed"].requests == sum(len(n) for n in lens if max(n) > 1)
    assert all(t.seconds > 0 and 0 < t.plan_seconds < t.seconds * 10 for t in totals.values())
