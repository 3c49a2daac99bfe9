"""The Triton attention and LoRA backends (under TRITON_INTERPRET on the CPU) give the same
tokens and logprobs as the torch path inside the real engine: GQA, sliding window, paged KV,
mixed prefill/decode batches, stacks and no-adapter rows."""

from __future__ import annotations

import pytest
import torch

from radixlora import Engine, SamplingParams
from tests.conftest import assert_all_free

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)


@pytest.mark.parametrize("arch,page_size", [("mistral", 4), ("qwen2", 1)])
def test_triton_backends_match_torch(checkpoints, adapters, arch, page_size):
    dirs = {k: adapters[arch][k] for k in "abd"}
    prompts = [[3 + i] * (4 + 9 * i) for i in range(4)]
    specs = [None, "a", [("b", 0.5), ("d", 1.0)], "d"]
    kw = dict(adapters=dirs, max_rank=64, page_size=page_size, kv_pages=256 // page_size)
    ref = Engine(checkpoints[arch], **kw).generate(prompts, PARAMS, adapters=specs)
    eng = Engine(checkpoints[arch], attention_backend="triton", lora_backend="triton", **kw)
    got = eng.generate(prompts, PARAMS, adapters=specs)
    for a, b in zip(ref, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(a.outputs[0].logprobs),
                                   torch.tensor(b.outputs[0].logprobs), atol=1e-4, rtol=0)
    assert_all_free(eng)


def staggered(engine: Engine, prompts, specs) -> list:
    """Requests joining one by one while the earlier ones decode, prompts chunked: steps that
    mix decodes with prefill chunks (the attention split between the two kernels)."""
    reqs = []
    for prompt, spec in zip(prompts, specs, strict=True):
        reqs += engine.submit(prompt, PARAMS, adapters=spec)
        engine.step()
    while engine.scheduler.has_work():
        engine.step()
    return [(r.output_ids, r.output_logprobs) for r in reqs]


def test_mixed_steps_match_torch(checkpoints, adapters):
    dirs = {k: adapters["mistral"][k] for k in "ab"}
    prompts = [[5 + i] * (3 + 11 * i) for i in range(5)]
    specs = [None, "a", "b", None, "a"]
    kw = dict(adapters=dirs, max_rank=64, kv_pages=512, max_batch_tokens=16)
    ref = staggered(Engine(checkpoints["mistral"], **kw), prompts, specs)
    eng = Engine(checkpoints["mistral"], attention_backend="triton", lora_backend="triton", **kw)
    backend, splits = eng.runner.attn_backend, []
    split = backend._split
    backend._split = lambda lens, device: splits.append(split(lens, device)) or splits[-1]
    got = staggered(eng, prompts, specs)
    assert any(s.decodes.numel() and s.tile_req.numel() for s in splits)
    for (ids_a, lp_a), (ids_b, lp_b) in zip(ref, got, strict=True):
        assert ids_a == ids_b
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4, rtol=0)
    assert_all_free(eng)


def test_adapter_grouped_mixed_steps_match_peft(checkpoints, adapters, monkeypatch):
    """Steps mixing decodes and prefill chunks over several adapters and the base run the
    grouped LoRA kernels (tokens gathered by adapter set, chunks and decodes alike) and give
    the tokens and logprobs transformers + PEFT computes for each request alone."""
    from radixlora_kernels.lora_ops import LoraBatchMeta
    from tests.oracle import logprobs, peft_model

    built = []
    from_segments = LoraBatchMeta.from_segments.__func__

    def spy(cls, seg_lens, *args, **kw):
        meta = from_segments(cls, seg_lens, *args, **kw)
        built.append((list(seg_lens), meta.groups is not None))
        return meta

    monkeypatch.setattr(LoraBatchMeta, "from_segments", classmethod(spy))
    dirs = {k: adapters["llama"][k] for k in "ab"}
    prompts = [[7 + i] * (5 + 10 * i) for i in range(5)]
    specs = ["a", "b", None, "a", "b"]
    eng = Engine(checkpoints["llama"], adapters=dirs, max_rank=64, kv_pages=512,
                 max_batch_tokens=16, attention_backend="triton", lora_backend="triton")
    got = staggered(eng, prompts, specs)
    mixed = [grouped for lens, grouped in built if max(lens) > 1 and lens.count(1) >= 2]
    assert mixed and all(mixed)
    ref_model = peft_model(checkpoints["llama"], dirs)
    for prompt, spec, (ids, lps) in zip(prompts, specs, got, strict=True):
        ref = logprobs(ref_model, prompt + ids, None if spec is None else [spec])
        rows = ref[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
        assert ids == rows.argmax(-1).tolist()
        torch.testing.assert_close(torch.tensor(lps), rows.gather(1, torch.tensor(ids)[:, None])
                                   .squeeze(1), atol=1e-4, rtol=0)
    assert_all_free(eng)
