"""Checkpoint loading through WeightReader: every parameter equals the tensors transformers
saved (sharded files, fused q/k/v and gate/up rows, tensors split over many chunks and reader
threads), a dtype to convert still loads through safetensors, and a damaged file is refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from radixlora.config import ModelConfig
from radixlora.errors import ModelLoadError
from radixlora.model import weight_reader
from radixlora.model.checkpoint_files import weight_files
from radixlora.model.loader import load_model
from radixlora.model.weight_reader import stored_tensors


def saved_tensors(path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        out |= load_file(file)
    return out


def expected(saved: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """Our fused parameters of one layer, built from the checkpoint's tensors."""
    p = f"model.layers.{layer}."
    qkv = [saved[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]
    gate_up = [saved[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")]
    return {
        f"layers.{layer}.self_attn.qkv_proj.weight": torch.cat(qkv),
        f"layers.{layer}.self_attn.o_proj.weight": saved[f"{p}self_attn.o_proj.weight"],
        f"layers.{layer}.mlp.gate_up_proj.weight": torch.cat(gate_up),
        f"layers.{layer}.mlp.down_proj.weight": saved[f"{p}mlp.down_proj.weight"],
        f"layers.{layer}.input_layernorm.weight": saved[f"{p}input_layernorm.weight"],
    }


@pytest.mark.parametrize("chunk", [weight_reader.CHUNK_BYTES, 1000])
def test_every_parameter_equals_the_saved_tensors(checkpoints, monkeypatch, chunk):
    path = checkpoints["mistral"]  # sharded into many files
    assert len(weight_files(path)) > 1
    monkeypatch.setattr(weight_reader, "CHUNK_BYTES", chunk)
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.float32, "cpu")
    params = dict(model.named_parameters())
    saved = saved_tensors(path)
    assert torch.equal(params["embed_tokens.weight"], saved["model.embed_tokens.weight"])
    assert torch.equal(params["norm.weight"], saved["model.norm.weight"])
    for layer in range(cfg.num_layers):
        for name, tensor in expected(saved, layer).items():
            assert torch.equal(params[name], tensor), name


def test_a_dtype_to_convert_loads_through_safetensors(checkpoints):
    path = checkpoints["qwen2"]  # stored in fp32, with q/k/v biases
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, torch.bfloat16, "cpu")
    params = dict(model.named_parameters())
    saved = saved_tensors(path)
    for name, tensor in expected(saved, 0).items():
        assert torch.equal(params[name], tensor.to(torch.bfloat16)), name
    bias = torch.cat([saved[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv"])
    assert torch.equal(params["layers.0.self_attn.qkv_proj.bias"], bias.to(torch.bfloat16))


def test_the_header_names_each_tensor_and_its_bytes(checkpoints):
    file = weight_files(checkpoints["llama"])[0]
    stored = stored_tensors(file)
    saved = load_file(file)
    assert set(stored) == set(saved)
    for name, s in stored.items():
        assert s.dtype == saved[name].dtype and s.shape == tuple(saved[name].shape)
        assert s.nbytes == saved[name].numel() * saved[name].element_size()


def test_a_damaged_checkpoint_is_refused(checkpoints, tmp_path):
    src = checkpoints["llama"]
    cfg = ModelConfig.from_dir(src)
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match="ends 100 bytes early"):
        load_model(tmp_path, cfg, torch.float32, "cpu")
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a safetensors file"):
        load_model(tmp_path, cfg, torch.float32, "cpu")
