"""FP8 bases (compressed-tensors, FP8_DYNAMIC; quant_method fp8 with block scales, as Qwen's and
DeepSeek's FP8 checkpoints): a tiny checkpoint with e4m3 projections and a weight scale per
channel, per tensor or per block gives, on the CPU (the reference path: weights
dequantized to the compute dtype), exactly the outputs of the same model saved dense with
those weights dequantized, LoRA beside it included; the GPU path's W8A8 product (dynamic
per-token activation scales, torch._scaled_mm) stays within FP8's error of that reference."""

from __future__ import annotations

import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.errors import ModelLoadError
from radixlora.model.quant_fp8 import (
    Fp8Linear,
    fp8_linear_w8a8,
    quantize_per_token,
    quantize_per_token_ref,
    scaled_mm_supported,
)
from scripts.checkpoints import build_fp8_model, build_peft_adapter

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
PROMPT = [4, 8, 15, 16, 23, 42]


BLOCK = (24, 16)  # rows, columns: partial row blocks in every projection of the tiny model


@pytest.fixture(scope="module", params=["channel", "tensor", "block"])
def fp8(request, tmp_path_factory, checkpoints):
    """(FP8 checkpoint, its dequantized dense twin, an adapter of the dense base)."""
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    path, ref = build_fp8_model(root / "fp8", checkpoints["llama"], request.param, BLOCK)
    adapter = build_peft_adapter(checkpoints["llama"], root / "adapter", seed=3, r=8,
                                 lora_alpha=16)
    return path, ref, adapter


def test_fp8_checkpoint_equals_its_dequantized_reference(fp8):
    path, ref, adapter = fp8
    engine = Engine(path, adapters={"a": adapter}, kv_pages=128)
    reference = Engine(ref, adapters={"a": adapter}, kv_pages=128)
    assert engine.model_cfg.quantization == "fp8"
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear)
    assert qkv.block == (BLOCK if "block" in str(path) else None)
    for spec in (None, "a"):  # LoRA stays in the model's dtype beside the FP8 projections
        ours = engine.generate(PROMPT, GREEDY, adapters=spec)[0].outputs[0]
        theirs = reference.generate(PROMPT, GREEDY, adapters=spec)[0].outputs[0]
        assert ours.token_ids == theirs.token_ids
        assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs)) <= 1e-6


def test_quantization_fp8_at_load_equals_the_per_channel_checkpoint(tmp_path, checkpoints):
    _, ref = build_fp8_model(tmp_path / "fp8", checkpoints["llama"], "channel")
    engine = Engine(checkpoints["llama"], kv_pages=128, quantization="fp8")
    assert engine.model_cfg.quantization == "fp8"
    ours = engine.generate(PROMPT, GREEDY)[0].outputs[0]
    theirs = Engine(ref, kv_pages=128).generate(PROMPT, GREEDY)[0].outputs[0]
    assert ours.token_ids == theirs.token_ids
    assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs)) <= 1e-6


def test_w8a8_product_is_within_fp8_error_of_the_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 256, generator=g, dtype=torch.float32)
    w = torch.randn(96, 256, generator=g) * 0.05
    scale = w.abs().amax(dim=1) / 448.0
    w8 = (w / scale[:, None]).to(torch.float8_e4m3fn)
    reference = x @ (w8.float() * scale[:, None]).T
    y = fp8_linear_w8a8(x, w8, scale, None)
    # e4m3 keeps 3 mantissa bits (relative error <= 1/16 per activation); over 256 terms the
    # errors average out to about 1% of the output's scale
    assert (y - reference).norm() / reference.norm() < 0.03
    x8, x_scale = quantize_per_token_ref(x)
    assert torch.equal(x8.float().abs().amax(dim=1), torch.full((6,), 448.0))
    assert torch.allclose(x8.float() * x_scale, x, rtol=1 / 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("in_dim", [40, 4096 + 48])  # one loop step; two, the last masked
def test_triton_activation_quantization_equals_the_torch_one(dtype, in_dim):
    """The one-launch Triton quantizer of the GPU path (interpreted here) gives the torch
    spelling's e4m3 values and scales bit for bit: tokens spanning e4m3's subnormal range
    (values below 2**-6 of the scale), exact ties between two e4m3 values, an all-zero token
    and negative zeros."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, in_dim, generator=g) * torch.logspace(-6, 2, in_dim).flip(0)
    x[1] = torch.linspace(-448, 448, in_dim).round()  # absmax 448: scale 1, e4m3 ties
    x[2] = 0.0
    x[3, : in_dim // 2] = -0.0
    x[4, 0] = 3e4  # everything else falls below e4m3's smallest normal
    x = x.to(dtype)
    x8, scale = quantize_per_token(x)
    ref8, ref_scale = quantize_per_token_ref(x)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
    assert (x8.view(torch.uint8) & 0x7F).ne(0).sum() > in_dim  # not all rounded to zero


def test_the_fp8_gemm_path_is_chosen_only_on_cuda_89():
    assert not scaled_mm_supported(torch.device("cpu"))


@pytest.mark.parametrize("block", [[128], [0, 128], "128x128", [128, 128.0]])
def test_a_block_size_that_is_not_two_positive_integers_is_refused(checkpoints, tmp_path,
                                                                   block):
    import json

    path, _ = build_fp8_model(tmp_path / "fp8", checkpoints["llama"], "block", BLOCK)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = block
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="expected \\[rows, columns\\]"):
        Engine(path, kv_pages=128)


def test_compressed_tensors_block_strategy_names_its_block_structure():
    from radixlora.model.quant_fp8 import fp8_block

    group = {"weights": {"num_bits": 8, "type": "float", "strategy": "block",
                         "block_structure": [128, 128]}}
    assert fp8_block({"quant_method": "compressed-tensors",
                      "config_groups": {"group_0": group}}) == (128, 128)
    assert fp8_block({"quant_method": "fp8", "weight_block_size": [64, 32]}) == (64, 32)
    assert fp8_block({"quant_method": "fp8"}) is None
    del group["weights"]["block_structure"]
    with pytest.raises(ValueError, match="without a block_structure"):
        fp8_block({"quant_method": "compressed-tensors", "config_groups": {"group_0": group}})
