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
