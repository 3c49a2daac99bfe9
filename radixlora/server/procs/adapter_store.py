"""Immutable snapshots of validated adapters, named by content hash
(STATE_DIR/adapters/<hash>-<random>).
The scheduler and the worker read an adapter version from its snapshot, never from the
watched or user-supplied directory, so a version stays loadable (for requests still queued on
it) after its source files were rewritten or deleted. The scheduler deletes a version's
snapshots once no name and no request refers to it (AdapterLifecycle.sweep)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from radixlora.config import ModelConfig
from radixlora.lora.adapter import LoraAdapter, adapter_from_bytes, check_header, read_adapter_files
from radixlora.lora.host_cache import packed_name
from radixlora.lora.layout import PoolLayout
from radixlora.lora.registration import PackTarget

CONFIG_FILE = "adapter_config.json"
TENSOR_FILE = "adapter_model.safetensors"
SNAPSHOTS = "adapters"  # the store's directory in a state directory
PACKED_AHEAD = "packed"  # adapters packed by validation, until their snapshot takes them


def pack_target(state_dir: Path, layouts: tuple[PoolLayout, ...]) -> PackTarget | None:
    return PackTarget(state_dir / PACKED_AHEAD, layouts) if layouts else None


def snapshot_roots(state_dir: str, data_parallel: bool) -> tuple[Path, ...]:
    """The stores whose snapshots a worker may read packed files from: its server's (admin
    loads) and, for a data-parallel replica, the registry's one level up."""
    if not state_dir:
        return ()
    own = Path(state_dir) / SNAPSHOTS
    return (own, Path(state_dir).parent / SNAPSHOTS) if data_parallel else (own,)


def file_signature(path: Path, name: str = "") -> tuple:
    """(name, size, mtime_ns) of every file of an adapter directory: changes while it is written.
    FilesChanged (for adapter `name`) if a file or the directory vanishes while it is listed."""
    if not path.is_dir():
        return ()
    out = []
    try:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if entry.is_file():
                st = entry.stat()
                out.append((entry.name, st.st_size, st.st_mtime_ns))
    except FileNotFoundError:
        raise FilesChanged(name) from None
    return tuple(out)


@dataclass(frozen=True)
class Validated:
    """An adapter validated from exactly these bytes, not yet snapshotted."""

    adapter: LoraAdapter
    config_bytes: bytes
    tensor_bytes: bytes


class AdapterStore:
    """Every saved snapshot is a new directory `<hash>-<random>`: one per publication, so
    deleting a forgotten version's snapshot never removes one a later publication of the same
    content (possibly not yet seen by the scheduler) points to."""

    def __init__(self, root: str | Path, pack: PackTarget | None = None):
        """pack: the workers' pool layouts; each snapshot then holds the adapter packed for
        each of them (radixlora.lora.host_cache), taken from `pack.root` where validation
        packed it ahead, else packed at save from the validated weights."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.pack = pack

    def read(self, name: str, src: str | Path, model: ModelConfig, max_rank: int,
             stable: bool = True, roots: Sequence[str | Path] = ()) -> Validated:
        """Read and validate `src` (each file resolving inside `roots`, if any); AdapterError if
        invalid, FilesChanged if (with stable) its files changed while they were read."""
        src = Path(src)
        check_header(name, src, model, max_rank, roots)
        before = file_signature(src, name)
        config_bytes, tensor_bytes = read_adapter_files(name, src, roots)
        if stable and file_signature(src, name) != before:
            raise FilesChanged(name)
        adapter = adapter_from_bytes(name, src, config_bytes, tensor_bytes, model, max_rank)
        return Validated(adapter, config_bytes, tensor_bytes)

    def save(self, validated: Validated) -> LoraAdapter:
        """Write the validated bytes into a new snapshot; the adapter pointing to it."""
        digest = validated.adapter.content_hash
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.root))
        (staging / CONFIG_FILE).write_bytes(validated.config_bytes)
        (staging / TENSOR_FILE).write_bytes(validated.tensor_bytes)
        if self.pack is not None:
            self._take_packed(validated.adapter, staging)
        final = self.root / f"{digest}-{secrets.token_hex(4)}"
        os.rename(staging, final)
        return dataclasses.replace(validated.adapter, path=str(final))

    def _take_packed(self, adapter: LoraAdapter, staging: Path) -> None:
        """Move the adapter's packed files from where validation wrote them; pack the layouts
        still missing from its weights, if it has them (else the workers pack it)."""
        ahead = self.pack.directory(adapter.adapter_id)
        for layout in self.pack.layouts:
            name = packed_name(layout.key)
            with contextlib.suppress(FileNotFoundError):
                os.replace(ahead / name, staging / name)
        with contextlib.suppress(OSError):
            ahead.rmdir()
        if adapter.weights:
            self.pack.write(adapter, staging)

    def snapshot(self, name: str, src: str | Path, model: ModelConfig, max_rank: int,
                 stable: bool = True, roots: Sequence[str | Path] = ()) -> LoraAdapter:
        """Read, validate and snapshot `src`."""
        return self.save(self.read(name, src, model, max_rank, stable, roots))

    def owns(self, path: str | Path) -> bool:
        return Path(path).parent == self.root

    def delete(self, path: str | Path) -> None:
        """Remove a snapshot of this store (never anything else)."""
        if not self.owns(path):
            raise ValueError(f"{path} is not a snapshot in {self.root}")
        shutil.rmtree(path, ignore_errors=True)


class FilesChanged(Exception):
    def __init__(self, name: str):
        super().__init__(f"adapter {name!r}: its files changed while they were read")
        self.name = name
