"""The host tier of adapters: each adapter packed once in the device pool's layout and dtype
(int8 pools: int8 rows and their scales; pinned on CUDA), so loading it into the pool is one
host-to-device copy. One LRU by adapter id within one byte budget, shared by the offline Engine
and the worker process.

Packed files: an adapter packed for one pool layout (PoolLayout.key), saved as a safetensors
file of one tensor beside the adapter's snapshot, so a worker's read is one file read into
pinned memory: no parsing, validation or packing in the worker. Invariant: a packed file is
written only by the server's own processes, from bytes that validated and hashed to the adapter
id it names, and only into snapshots of the server's private state directory (the worker reads
none elsewhere); it is written under a temporary name and renamed, so it is whole or absent."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

log = logging.getLogger(__name__)

PACKED_TENSOR = "rows"
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                      "I8": torch.int8}
MAX_PACKED_HEADER = 1 << 16


@dataclass(frozen=True)
class PackedAdapter:
    """One adapter version's pool rows for the module groups it adapts, flattened in
    AdapterPool.write() order: `group_ranks[g]` rows for each group g it has (the rows the
    kernels read), none for the others. For an int8 pool `data` is one int8 tensor: the
    groups' float32 dequantization scales as bytes, then the int8 rows (AdapterPool.pack), so
    a load stays one host-to-device copy and nbytes counts the scales. A DoRA adapter's data
    starts with its magnitude vectors, float32 [layers, out_total] for each of `dora_groups`
    (radixlora.worker.dora)."""

    adapter_id: str
    group_ranks: dict[str, int]
    data: torch.Tensor
    dora_groups: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class HostAdapterCache:
    """Packed adapters by id, least recently used first. The newest entry is always kept,
    whatever its size, so an adapter larger than the budget can still be loaded."""

    def __init__(self, budget_bytes: int, pin: bool):
        if budget_bytes < 0:
            raise ValueError(f"host adapter budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.pin = pin
        self._entries: OrderedDict[str, PackedAdapter] = OrderedDict()
        self._nbytes = 0
        self._added: set[str] = set()  # ids that entered / left since drain_changes()
        self._dropped: set[str] = set()

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def ids(self) -> list[str]:
        """Cached adapter ids, least recently used first."""
        return list(self._entries)

    def get(self, adapter_id: str) -> PackedAdapter | None:
        entry = self._entries.get(adapter_id)
        if entry is not None:
            self._entries.move_to_end(adapter_id)
        return entry

    def put(self, packed: PackedAdapter) -> PackedAdapter:
        """Cache `packed` (pinning it on CUDA) as the most recent entry; returns the cached one."""
        if self.pin and not packed.data.is_pinned():
            packed = dataclasses.replace(packed, data=packed.data.pin_memory())
        old = self._entries.pop(packed.adapter_id, None)
        if old is not None:
            self._nbytes -= old.nbytes
        self._entries[packed.adapter_id] = packed
        self._nbytes += packed.nbytes
        self._added.add(packed.adapter_id)
        self._dropped.discard(packed.adapter_id)
        self._trim()
        return packed

    def drain_changes(self) -> tuple[list[str], list[str]]:
        """(ids that entered, ids that left) since the last call: applied in call order to a
        set of the ids cached before, they give the ids cached now."""
        changes = sorted(self._added), sorted(self._dropped)
        self._added.clear()
        self._dropped.clear()
        return changes

    def _trim(self) -> None:
        while self._nbytes > self.budget_bytes and len(self._entries) > 1:
            adapter_id, dropped = self._entries.popitem(last=False)
            self._nbytes -= dropped.nbytes
            self._added.discard(adapter_id)
            self._dropped.add(adapter_id)


def packed_name(layout_key: str) -> str:
    return f"pool-{layout_key}.safetensors"


def write_packed(directory: str | Path, layout_key: str, packed: PackedAdapter) -> Path:
    """Save `packed` as `directory`/packed_name(layout_key), atomically."""
    path = Path(directory) / packed_name(layout_key)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    metadata = {"adapter_id": packed.adapter_id, "layout": layout_key,
                "group_ranks": json.dumps(packed.group_ranks),
                "dora_groups": json.dumps(packed.dora_groups)}
    try:
        save_file({PACKED_TENSOR: packed.data.contiguous()}, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_packed(directory: str | Path, layout_key: str, adapter_id: str,
                pin: bool) -> PackedAdapter | None:
    """The adapter packed for this layout from its packed file, read straight into (pinned)
    host memory; None if there is none, or if it is not exactly the file write_packed makes
    for this adapter and layout (the caller then packs from the adapter's files)."""
    path = Path(directory) / packed_name(layout_key)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            header_len = int.from_bytes(_read_exactly(f, 8), "little")
            if header_len > MAX_PACKED_HEADER:
                raise ValueError(f"header of {header_len} bytes")
            header = json.loads(_read_exactly(f, header_len))
            meta = header.pop("__metadata__")
            if meta["adapter_id"] != adapter_id or meta["layout"] != layout_key:
                raise ValueError("made for another adapter or layout")
            (name, info), = header.items()
            start, end = info["data_offsets"]
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            if (name != PACKED_TENSOR or start != 0 or 8 + header_len + end != size
                    or end % dtype.itemsize):
                raise ValueError("not one tensor filling the file")
            data = torch.empty(end, dtype=torch.uint8, pin_memory=pin)
            _read_into(f, memoryview(data.numpy()))
            group_ranks = {str(g): int(r) for g, r in json.loads(meta["group_ranks"]).items()}
            dora_groups = tuple(str(g) for g in json.loads(meta["dora_groups"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("packed file %s not used (%s): packing the adapter again", path, e)
        return None
    return PackedAdapter(adapter_id, group_ranks, data.view(dtype), dora_groups)


def _read_into(f, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise ValueError("truncated")
        got += n


def _read_exactly(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated")
    return data
