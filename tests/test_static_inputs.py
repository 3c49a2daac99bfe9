"""The inputs CUDA graphs replay: batches bucketed and padded into static buffers (padding
requests, padding tokens, LoRA row buckets) must give the same results as the eager path. The
graph capture itself needs a GPU (scripts/gpu_checks.py); this runs the same static-buffer
forward eagerly on the CPU with the Triton kernels under the interpreter."""

from __future__ import annotations

import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.worker import cuda_graph
from radixlora.worker.cuda_graph import StaticInputs
from tests.conftest import assert_all_free


class EagerStaticInputs(StaticInputs):
    forward = StaticInputs.static_forward


@pytest.mark.parametrize("mode", ["deferred", "added"])
def test_static_buffers_match_eager(checkpoints, adapters, monkeypatch, mode):
    """Two ways of adding the LoRA deltas in graph buckets: the deltas deferred to the consumer
    kernels (the default); the deltas added into the projection outputs (defer limit 0)."""
    if mode == "added":
        monkeypatch.setattr(cuda_graph, "LORA_DEFER_MAX_TOKENS", 0)
    dirs = {k: adapters["llama"][k] for k in "abd"}
    specs = [None, "a", [("b", 0.5), ("d", 1.0)], "d", None]
    prompts = [[7 + i] * (2 + 6 * i) for i in range(len(specs))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    kw = dict(adapters=dirs, max_rank=64, page_size=2, kv_pages=256)
    ref = Engine(checkpoints["llama"], **kw).generate(prompts, params, adapters=specs)
    eng = Engine(checkpoints["llama"], attention_backend="triton", lora_backend="triton",
                 max_batch_tokens=24, **kw)
    eng.runner.graphs = EagerStaticInputs(eng.runner, max_batch=8, max_context=512, max_rows=128)
    runs = [eng.generate(prompts, params, adapters=specs) for _ in range(2)]  # cold, cache hits
    for got in runs:
        for a, b in zip(ref, got, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs),
                                       torch.tensor(b.outputs[0].logprobs), atol=1e-4, rtol=0)
    assert_all_free(eng)


def test_sampling_rows_in_static_buffers_match_eager(checkpoints, adapters):
    """Seeded temperature, top-k/top-p/min-p and greedy rows side by side: the rows the graphs
    sample from (padded with greedy rows to the bucket) draw the eager path's tokens."""
    dirs = {k: adapters["llama"][k] for k in "ab"}
    specs = [None, "a", "b", None, "a"]
    prompts = [[9 + i] * (3 + 5 * i) for i in range(len(specs))]
    params = [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=5, temperature=0.8, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=1.0, top_p=0.9, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0.7, top_k=5, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=1.3, min_p=0.1, seed=4, ignore_eos=True,
                             logprobs=2)]
    kw = dict(adapters=dirs, max_rank=64, page_size=2, kv_pages=256)
    ref = Engine(checkpoints["llama"], **kw).generate(prompts, params, adapters=specs)
    eng = Engine(checkpoints["llama"], attention_backend="triton", lora_backend="triton",
                 max_batch_tokens=24, **kw)
    eng.runner.graphs = EagerStaticInputs(eng.runner, max_batch=8, max_context=512, max_rows=128)
    got = eng.generate(prompts, params, adapters=specs)
    for a, b in zip(ref, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs),
                                   torch.tensor(b.outputs[0].logprobs), atol=1e-4, rtol=0)
        top = [[[t for t, _ in row] for row in r.outputs[0].top_logprobs] for r in (a, b)]
        assert top[0] == top[1]
    assert len({tuple(r.outputs[0].token_ids) for r in ref}) > 1
    assert_all_free(eng)


@pytest.mark.parametrize("given,rows", [((), 16), ("ab", 16), ("ac", 16), ("ad", 128)])
def test_startup_graphs_stop_at_the_row_bucket_of_the_largest_start_rank(checkpoints,
                                                                        adapters, given, rows):
    """Graphs captured before ready: every decode bucket and the one-request extends, without
    adapters and up to the row bucket the adapters given at start need (the first LoRA bucket
    when none was given: b, a and c are rank 4, 8 and 16, d 64); the rest wait for idle turns."""
    eng = Engine(checkpoints["llama"], adapters={k: adapters["llama"][k] for k in given},
                 lora_backend="triton", max_rank=64, kv_pages=16)
    graphs = StaticInputs(eng.runner, max_batch=8, max_context=64, max_rows=512)
    startup = cuda_graph.CudaGraphRunner.startup_keys(graphs)
    assert {k.rows for k in startup} == {r for r in (0, 16, 32, 128) if r <= rows}
    assert {k for k in graphs.all_keys() if (k.decode or k.batch == 1) and k.rows <= rows} \
        == set(startup)
    assert {k.rows for k in graphs.all_keys()} == {0, 16, 32, 128, 512}


def test_static_buffers_need_the_triton_lora_backend(checkpoints):
    eng = Engine(checkpoints["llama"], lora_backend="torch", kv_pages=16)
    with pytest.raises(ValueError, match="lora_backend triton"):
        StaticInputs(eng.runner, max_batch=4, max_context=64, max_rows=16)


def test_blas_library_is_scoped_to_capture(monkeypatch):
    """The graphs' BLAS preference holds inside the block only and is restored even when the
    capture fails; a build that lacks the library keeps its default."""
    state = {"library": "default"}

    def preferred(library=None):
        if library == "missing":
            raise RuntimeError("not compiled with it")
        if library is not None:
            state["library"] = library
        return state["library"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred)
    with pytest.raises(KeyError), cuda_graph.blas_library("cublaslt"):
        assert state["library"] == "cublaslt"
        raise KeyError("capture failed")
    assert state["library"] == "default"
    with cuda_graph.blas_library("missing"):
        assert state["library"] == "default"
    with cuda_graph.blas_library(None):
        assert state["library"] == "default"
