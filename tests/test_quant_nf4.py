"""NF4 bases against bitsandbytes itself (the oracle, on the CPU): dequantization bit-identical
for blocksizes 64/128/256 with and without double quantization, quantization at load identical,
the Triton kernel (interpreted) equal to both, and a tiny NF4 model saved by transformers +
bitsandbytes giving transformers' greedy tokens and logprobs."""

from __future__ import annotations

import dataclasses

import bitsandbytes.functional as bnb_functional
import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.model.quant import NF4Linear, dequantize_nf4, nf4_from_bnb, quantize_nf4
from radixlora_kernels.nf4_dequant import nf4_dequant
from scripts.checkpoints import build_nf4_model

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = 1e-4  # fp32 logprobs: measured 1.2e-6 against transformers + bitsandbytes


def bnb_quantized(weight: torch.Tensor, blocksize: int, double_quant: bool):
    """(packed, QuantState) of bitsandbytes, and the same as the parts a checkpoint stores."""
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4",
                                                 compress_statistics=double_quant)
    return packed, state, {**state.as_dict(packed=True), "weight": packed}


def random_weight(seed: int, dtype: torch.dtype, shape=(96, 512)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * 0.05
    w[3] *= 40  # an outlier row: its blocks' absmaxes span a wider range
    return w.to(dtype)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("blocksize", [64, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantization_is_bit_identical_to_bitsandbytes(blocksize, double_quant, dtype):
    packed, state, parts = bnb_quantized(random_weight(blocksize, dtype), blocksize, double_quant)
    expected = bnb_functional.dequantize_4bit(packed, state)
    ours = dequantize_nf4(nf4_from_bnb(parts), dtype)
    assert ours.dtype == expected.dtype == dtype
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("blocksize", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_at_load_is_bitsandbytes(blocksize, dtype):
    weight = random_weight(7 + blocksize, dtype)
    packed, state, _ = bnb_quantized(weight, blocksize, double_quant=False)
    ours = quantize_nf4(weight, blocksize)
    assert torch.equal(ours.packed, packed.reshape(-1))
    assert torch.equal(ours.absmax, state.absmax)


@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("blocksize", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_dequantization_equals_bitsandbytes(blocksize, double_quant, dtype):
    shape = (24, 256)  # 6,144 weights: three programs, the last one partly masked
    packed, state, parts = bnb_quantized(random_weight(3, dtype, shape), blocksize, double_quant)
    w = nf4_from_bnb(parts)
    out = torch.empty(shape, dtype=dtype)
    nf4_dequant(w.packed, w.absmax, w.code, blocksize, out)
    assert torch.equal(out, dequantize_nf4(w, dtype))
    assert torch.equal(out, bnb_functional.dequantize_4bit(packed, state))


def transformers_bnb(path):
    """transformers + bitsandbytes on the CPU, each Linear4bit dequantizing to fp32 before its
    GEMM (bitsandbytes' own semantics): its AVX512-BF16 repacked kernel, which it picks on CPUs
    that have the instructions, computes in bf16 and would make the oracle machine-dependent."""
    import bitsandbytes
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, device_map="cpu").eval()
    for module in model.modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


def greedy_against(engine: Engine, model, prompt: list[int], max_tokens: int = 16) -> float:
    """Generate greedily; assert the oracle's argmax at every step; the largest |logprob| gap."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    out = engine.generate(prompt, params)[0].outputs[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    assert out.token_ids == ref.argmax(dim=-1).tolist()
    return max(abs(lp - float(ref[i, t])) for i, (t, lp) in
               enumerate(zip(out.token_ids, out.logprobs)))


@pytest.mark.parametrize("arch,double_quant", [("llama", True), ("llama", False),
                                               ("mistral", True)])
def test_nf4_checkpoint_matches_transformers_bitsandbytes(tmp_path, arch, double_quant):
    # blocksize 64 (what transformers quantizes with): bitsandbytes' CPU kernel indexes the
    # blocks of a row shorter than a block per row, unlike its CUDA kernel and its quantizer;
    # the tiny model's 64-wide rows keep the oracle out of that case. Mistral's checkpoint is
    # sharded: a weight's quant-state tensors may sit in other files than the weight
    path = build_nf4_model(tmp_path / "nf4", arch, double_quant=double_quant,
                           sharded=arch == "mistral")
    engine = Engine(path, kv_pages=128)
    assert engine.model_cfg.quantization == "nf4"
    assert greedy_against(engine, transformers_bnb(path), [5, 9, 17, 33, 65, 129]) <= TOL


def transformers_nf4(path):
    """transformers quantizing the dense checkpoint at `path` with bitsandbytes NF4 at load
    (fp32 compute, the repacked bf16 kernel off as in transformers_bnb)."""
    import bitsandbytes
    import transformers

    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=config, dtype=torch.float32, device_map="cpu")
    for module in model.modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model.eval()


def test_quantization_nf4_at_load_matches_bitsandbytes_quantizing_the_dense_base(checkpoints):
    engine = Engine(checkpoints["qwen2"], kv_pages=128, quantization="nf4")
    assert greedy_against(engine, transformers_nf4(checkpoints["qwen2"]),
                          [7, 3, 250, 11, 42]) <= TOL


def test_quantization_flag_on_an_already_quantized_checkpoint_is_refused(tmp_path):
    from radixlora.config import EngineConfig, ModelConfig
    from radixlora.errors import ModelLoadError

    path = build_nf4_model(tmp_path / "nf4", "llama")
    cfg = ModelConfig.from_dir(path)
    assert cfg.served(EngineConfig(quantization="nf4")).quantization == "nf4"
    assert cfg.served(EngineConfig()).quantization == "nf4"  # the checkpoint's own
    fp8_like = dataclasses.replace(cfg, quantization="fp8")
    with pytest.raises(ModelLoadError, match="already fp8"):
        fp8_like.served(EngineConfig(quantization="nf4"))


def test_nf4_linear_buffers_follow_the_device_it_is_built_on():
    """Built under a device context (the loader builds on the target device), the NF4 code
    lands there with the packed weights: the CUDA kernel reads all three."""
    with torch.device("meta"):
        linear = NF4Linear(128, 64, False, 64, torch.float32)
    assert {b.device.type for b in (linear.packed, linear.absmax, linear.code)} == {"meta"}
