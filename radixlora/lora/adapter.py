"""PEFT LoRA adapters: read, validate and hash an `adapter_config.json` +
`adapter_model.safetensors` directory into host tensors ready for the paged adapter pool (the
checks that need no tensor data live in radixlora.lora.header). Every failure is an AdapterError
naming the adapter and the reason; nothing is ever unpickled."""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from radixlora.config import ModelConfig
from radixlora.errors import AdapterError
from radixlora.lora.header import (
    CHANGING,
    MAX_ADAPTER_BYTES,
    MAX_CONFIG_BYTES,
    MAX_MAGNITUDE,
    LoraAdapter,
    adapter_files,
    check_base_format,
    check_header,
    checked_pairs,
    dora_groups,
    group_ranks_of,
    parse_config,
    read_file,
    read_regular,
    tensor_header,
)

# RMSNorm squares the hidden state in float32: a delta whose output can pass
# sqrt(float32 max / hidden_size) for an input of RMS 1 overflows the next norm (inf, NaN).
FP32_MAX = torch.finfo(torch.float32).max


def load_adapter(name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoraAdapter:
    path = Path(path)
    check_header(name, path, model, max_rank)
    config_bytes, tensor_bytes = read_adapter_files(name, path)
    return adapter_from_bytes(name, path, config_bytes, tensor_bytes, model, max_rank)


def adapter_from_bytes(
    name: str, path: str | Path, config_bytes: bytes, tensor_bytes: bytes, model: ModelConfig,
    max_rank: int, digest: str | None = None,
) -> LoraAdapter:
    """Validate the two files' bytes; the content hash covers exactly these bytes (`digest`, if
    given, must be content_hash of these very bytes, computed by the caller)."""
    config = parse_config(name, config_bytes)
    tensors = _parse_tensors(name, tensor_bytes)
    weights, magnitudes = _build_weights(name, config, tensors, model, max_rank)
    group_ranks = group_ranks_of((module, a.shape[0]) for (_, module), (a, _) in weights.items())
    digest = digest or content_hash(config_bytes, tensor_bytes)
    trained_on, mismatch = check_base_format(name, config, model)
    return LoraAdapter(name, str(path), digest, max(group_ranks.values()), group_ranks, weights,
                       trained_on, mismatch, dora_groups(magnitudes), magnitudes)


def content_hash(config_bytes: bytes, tensor_bytes: bytes) -> str:
    """The adapter id: sha256 of the config bytes, a NUL and the tensor bytes."""
    digest = hashlib.sha256(config_bytes)
    digest.update(b"\0")
    digest.update(tensor_bytes)
    return digest.hexdigest()


def read_adapter_files(name: str, path: Path,
                       roots: Sequence[str | Path] = ()) -> tuple[bytes, bytes]:
    """(adapter_config.json, adapter_model.safetensors) bytes, or an AdapterError. Each file
    must be a regular file within its size cap and, with `roots`, resolve inside one of them."""
    config_path, tensor_path = adapter_files(name, path)
    return (read_file(name, config_path, MAX_CONFIG_BYTES, roots),
            read_regular(name, tensor_path, MAX_ADAPTER_BYTES, roots,
                          functools.partial(_read_tensors, name)))


def _read_tensors(name: str, f: BinaryIO, size: int) -> bytes:
    """The whole safetensors file, once its header was checked against its size
    (tensor_header): never more than the header accounts for."""
    tensor_header(name, f, size)
    f.seek(0)
    data = f.read(size)
    if len(data) != size:
        raise AdapterError(name, "adapter_model.safetensors changed while it was read",
                           code=CHANGING)
    return data


def _parse_tensors(name: str, raw: bytes) -> dict[str, torch.Tensor]:
    if not raw:
        raise AdapterError(name, "adapter_model.safetensors is empty")
    try:
        return load_safetensors(raw)
    except (SafetensorError, ValueError, RuntimeError, OverflowError) as e:
        raise AdapterError(name, f"adapter_model.safetensors is corrupted: {e}") from e


def _build_weights(name, config, tensors, model: ModelConfig, max_rank):
    """(weights, magnitudes) of LoraAdapter."""
    weights, magnitudes = {}, {}
    for (layer, module, key), (a, b), scale, m in checked_pairs(name, config, tensors, model,
                                                                 max_rank):
        a, b = a.float(), b.float() * scale
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(name, f"{key} holds NaN or infinite values")
        _check_delta_bound(name, key, a, b, model.hidden_size)
        weights[(layer, module)] = (a.contiguous(), b.contiguous())
        if m is not None:
            m = m.float()
            if not torch.isfinite(m).all() or m.abs().max() > MAX_MAGNITUDE:
                raise AdapterError(name, f"{key}'s lora_magnitude_vector holds NaN, infinite "
                                         f"or values past {MAX_MAGNITUDE:g}")
            magnitudes[(layer, module)] = m.contiguous()
    return weights, magnitudes


def _check_delta_bound(name: str, key: str, a: torch.Tensor, b: torch.Tensor,
                       hidden_size: int) -> None:
    """Refuse a delta (b already scaled) whose output can overflow the next layer's norm.
    For x of RMS 1 (|x| = sqrt(in)): |(B A x)_i| <= |B_i| |A|_2 |x| <= |B_i| |A|_F sqrt(in)."""
    bound = (b.norm(dim=1).max() * a.norm() * math.sqrt(a.shape[1])).item()
    limit = math.sqrt(FP32_MAX / hidden_size)
    if not bound <= limit:
        raise AdapterError(name, f"{key}'s scaled delta can reach {bound:.3g} for an input of "
                                 f"RMS 1, past the {limit:.3g} at which the next layer's "
                                 "float32 norm overflows: the weights are not a usable adapter")
