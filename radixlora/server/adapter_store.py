"""Immutable, content-addressed snapshots of validated adapters (STATE_DIR/adapters/<hash>).
The scheduler and the worker read an adapter version from its snapshot, never from the
watched or user-supplied directory, so a version stays loadable (for requests still queued on
it) after its source files were rewritten or deleted."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

from radixlora.config import ModelConfig
from radixlora.lora.adapter import (
    LoraAdapter,
    adapter_from_bytes,
    read_adapter_files,
)

CONFIG_FILE = "adapter_config.json"
TENSOR_FILE = "adapter_model.safetensors"


def file_signature(path: Path) -> tuple:
    """(name, size, mtime_ns) of every file of an adapter directory: changes while it is written."""
    if not path.is_dir():
        return ()
    out = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_file():
            st = entry.stat()
            out.append((entry.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


class AdapterStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def snapshot(self, name: str, src: str | Path, model: ModelConfig, max_rank: int,
                 stable: bool = True) -> LoraAdapter:
        """Read, validate and snapshot `src`; AdapterError if invalid, or (with stable) if its
        files changed while they were read."""
        src = Path(src)
        before = file_signature(src)
        config_bytes, tensor_bytes = read_adapter_files(name, src)
        if stable and file_signature(src) != before:
            raise FilesChanged(name)
        adapter = adapter_from_bytes(name, src, config_bytes, tensor_bytes, model, max_rank)
        path = self._write(adapter.content_hash, config_bytes, tensor_bytes)
        return dataclasses.replace(adapter, path=str(path))

    def _write(self, digest: str, config_bytes: bytes, tensor_bytes: bytes) -> Path:
        final = self.root / digest
        if final.is_dir():
            return final
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))
        (staging / CONFIG_FILE).write_bytes(config_bytes)
        (staging / TENSOR_FILE).write_bytes(tensor_bytes)
        try:
            os.rename(staging, final)
        except OSError:  # another writer won the race with the same content
            for f in staging.iterdir():
                f.unlink()
            staging.rmdir()
        return final


class FilesChanged(Exception):
    def __init__(self, name: str):
        super().__init__(f"adapter {name!r}: its files changed while they were read")
        self.name = name
