"""An FP8 KV cache (--kv-cache-dtype fp8): K and V rounded to e4m3 (scale 1) as they are stored
and read back exactly. The kernels under the interpreter against their torch references on the
same FP8 pool; the engine's prompt logprobs against the full-precision cache within a stated
tolerance, the Triton path against the torch path, the radix cache on against off; and the
bundled demo's four tasks."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.cli.flags import add_engine_flags, engine_overrides
from radixlora.config import EngineConfig
from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR, TASKS, format_prompt
from radixlora.demo.tasks import sample_inputs
from radixlora.worker.kv_pool import KVPool
from radixlora_kernels.rotary_kv import rotary_store_kv_, rotary_store_kv_ref
from scripts.checkpoints import build_tiny_model
from tests.test_kernels_attention import (
    assert_close,
    decode_ref,
    extend_ref,
    make_case,
    run_decode,
    run_extend,
)

FP8 = torch.float8_e4m3fn
# the tiny random model's teacher-forced prompt logprobs, FP8 KV against fp32 KV
MEAN_TOL, MAX_TOL = 0.02, 0.15


def fp8_case(case):
    """The case with its pool rounded to FP8 (the q and its dtype unchanged)."""
    return dataclasses.replace(case, k_cache=case.k_cache.to(FP8), v_cache=case.v_cache.to(FP8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_kernels_read_an_fp8_pool_as_their_references_do(dtype):
    extend = fp8_case(make_case([5, 3], [7, 0], page_size=2, dtype=dtype))
    assert_close(run_extend(extend), extend_ref(extend), dtype)
    decode = fp8_case(make_case([1, 1, 1], [9, 2, 30], dtype=dtype))
    for splits in (1, 2):
        assert_close(run_decode(decode, splits), decode_ref(decode), dtype)


def test_rotary_store_rounds_into_an_fp8_pool_as_torch_does():
    """Rounding to nearest even, subnormals and carries into the next binade included, and
    clamping at +-448 instead of torch's NaN: the kernel's pool equals the reference's."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, h, 16, generator=gen) * s for h, s in ((4, 1), (2, 3), (2, 0.05)))
    v[0, 0, :4] = torch.tensor([1000.0, -600.0, 447.0, 7.9])
    positions, inv_freq = torch.arange(6), 1e-2 ** (torch.arange(8) / 8)
    loc = torch.tensor([3, 9, 1, 4, 7, 0])
    pools = [[torch.zeros(12, 2, 16, dtype=FP8) for _ in range(2)] for _ in range(2)]
    q1, q2 = q.clone(), q.clone()
    rotary_store_kv_(q1, k, v, positions, inv_freq, *pools[0], loc)
    rotary_store_kv_ref(q2, k, v, positions, inv_freq, *pools[1], loc)
    torch.testing.assert_close(q1, q2)
    for got, want in zip(pools[0], pools[1]):
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0)
        assert got.float()[loc].abs().sum() > 0 and not got.float().isnan().any()
    assert pools[0][1].float()[3, 0, :4].tolist() == [448.0, -448.0, 448.0, 8.0]


def test_an_fp8_pool_holds_twice_the_tokens_per_byte():
    bf16 = KVPool.bytes_per_slot(32, 8, 128, torch.bfloat16)
    assert KVPool.bytes_per_slot(32, 8, 128, FP8) * 2 == bf16
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_storage_dtype(None) == FP8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    p = argparse.ArgumentParser()
    add_engine_flags(p)
    assert engine_overrides(p.parse_args(["--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("fp8kv") / "tiny")


def scores(engine: Engine, prompts: list[list[int]]) -> list[list[float]]:
    return engine.score(prompts, [1] * len(prompts))


def test_prompt_logprobs_stay_within_tolerance_of_full_precision_kv(model):
    """Teacher-forced prompt logprobs (chunked prefills read the earlier chunks' KV from the
    pool): FP8 KV against fp32 KV within MEAN_TOL on average and MAX_TOL at worst, on the torch
    and the Triton path; the two FP8 paths agree more closely still."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 200, (n,), generator=gen).tolist() for n in (40, 23, 61)]
    kw = dict(kv_pages=512, max_batch_tokens=16)
    full = scores(Engine(model, **kw), prompts)
    fp8 = {backend: scores(Engine(model, kv_cache_dtype="fp8", attention_backend=backend, **kw),
                           prompts)
           for backend in ("torch", "triton")}
    for got in fp8.values():
        diffs = torch.tensor([abs(a - b) for x, y in zip(full, got) for a, b in zip(x, y)])
        assert diffs.mean() < MEAN_TOL and diffs.max() < MAX_TOL
        assert diffs.max() > 0  # the pool really is FP8
    paths = torch.tensor([abs(a - b) for x, y in zip(fp8["torch"], fp8["triton"])
                          for a, b in zip(x, y)])
    assert paths.max() < MAX_TOL / 3


def test_cached_fp8_prefixes_give_what_recomputing_gives(model):
    """The radix cache is unchanged: a prefix's FP8 KV read from the cache is the KV a
    recomputation would store, so cache on and off generate the same tokens and logprobs."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    prefix = list(range(10, 50))
    prompts = [prefix + [60 + i] for i in range(3)]
    outs = {}
    for cache in (True, False):
        engine = Engine(model, kv_pages=512, kv_cache_dtype="fp8", enable_radix_cache=cache)
        engine.generate(prefix + [99], params)
        outs[cache] = engine.generate(prompts, params)
    assert sum(o.cached_tokens for o in outs[True]) >= 3 * len(prefix)
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-5)


def test_the_demo_does_its_four_tasks_on_an_fp8_cache():
    """The bundled demo (fp32 on the CPU) over 30 held-out inputs, the base and the four
    adapters in one batch: with FP8 KV at least 98% of the greedy outputs are those of the fp32
    cache (149 of 150 when this was written) and every task still passes its check."""
    inputs = sample_inputs(30, 2024, heldout=True)
    specs = [None, *DEMO_ADAPTERS]
    prompts = [format_prompt(text) for text in inputs for _ in specs]
    routing = [spec for _ in inputs for spec in specs]
    greedy = SamplingParams(max_tokens=64, temperature=0.0)
    texts = {}
    for kv in ("auto", "fp8"):
        engine = Engine(DEMO_MODEL_DIR, adapters=DEMO_ADAPTERS, max_running=192, kv_pages=12288,
                        kv_cache_dtype=kv)
        texts[kv] = [o.outputs[0].text for o in engine.generate(prompts, greedy,
                                                                adapters=routing)]
    same = sum(a == b for a, b in zip(texts["auto"], texts["fp8"]))
    assert same >= 0.98 * len(prompts)
    for k, spec in enumerate(specs[1:], start=1):
        outputs = texts["fp8"][k::len(specs)]
        assert sum(TASKS[spec].check(x, y) for x, y in zip(inputs, outputs)) >= 0.9 * len(inputs)
