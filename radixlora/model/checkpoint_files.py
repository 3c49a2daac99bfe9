"""A checkpoint's weight files and its identity, without torch (the scheduler process keys its
prefix cache on the identity and needs nothing else of the model)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from radixlora.errors import ModelLoadError


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise ModelLoadError(f"{path} holds only pickle weights; radixlora loads safetensors only")
    raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")


def base_version(path: Path, load_format: str = "safetensors") -> str:
    """Identity of the base checkpoint for cache keys: its config and its weight files' names
    and sizes (hashing every weight byte would cost a full read of a multi-GB model)."""
    h = hashlib.sha256((path / "config.json").read_bytes())
    if load_format == "dummy":
        return h.hexdigest() + "-dummy"
    for f in weight_files(path):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()
