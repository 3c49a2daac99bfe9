"""Checkpoint bytes straight into the model's tensors at disk speed.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the bytes. `stored_tensors` reads that header;
`WeightReader` copies byte ranges into device tensors: several threads read (`os.preadv`
releases the GIL), on CUDA into pinned staging buffers whose host-to-device copies run on the
reading thread's own stream while it reads the next chunk; on the CPU straight into the
destination."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from radixlora.errors import ModelLoadError

CHUNK_BYTES = 16 << 20  # one staging buffer; two per reader thread
MAX_READERS = 8
_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: dtype (None where torch has no such dtype), shape,
    and where its bytes lie in the file."""

    dtype: torch.dtype | None
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def stored_tensors(file: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, by name, in file order."""
    with open(file, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        if size <= 0 or size > os.fstat(f.fileno()).st_size:
            raise ModelLoadError(f"{file}: not a safetensors file")
        try:
            header = json.loads(f.read(size))
        except ValueError as e:
            raise ModelLoadError(f"{file}: unreadable safetensors header: {e}") from e
    header.pop("__metadata__", None)
    base = 8 + size
    tensors = {
        name: StoredTensor(_DTYPES.get(info["dtype"]), tuple(info["shape"]),
                           base + info["data_offsets"][0],
                           info["data_offsets"][1] - info["data_offsets"][0])
        for name, info in header.items()
    }
    return dict(sorted(tensors.items(), key=lambda item: item[1].offset))


@dataclass(frozen=True)
class _Chunk:
    path: Path
    offset: int
    dst: torch.Tensor  # uint8 view of the destination's bytes


class WeightReader:
    """Collects (file range -> tensor) copies, then runs them all with `run()`: the bytes of
    each range land in its tensor, which must be contiguous and of the stored dtype."""

    def __init__(self, device: torch.device | str):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the readers' threads use it too
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.chunks: list[_Chunk] = []
        self.nbytes = 0

    def add(self, path: Path, stored: StoredTensor, dst: torch.Tensor) -> None:
        flat = dst.view(-1).view(torch.uint8)
        for start in range(0, stored.nbytes, CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, stored.nbytes)
            self.chunks.append(_Chunk(path, stored.offset + start, flat[start:end]))
        self.nbytes += stored.nbytes

    def run(self) -> None:
        readers = max(1, min(MAX_READERS, os.cpu_count() or 1, len(self.chunks)))
        shares = [self.chunks[i::readers] for i in range(readers)]
        fds = {path: os.open(path, os.O_RDONLY) for path in {c.path for c in self.chunks}}
        try:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the empty weights exist
            with ThreadPoolExecutor(readers, thread_name_prefix="weights") as pool:
                for done in [pool.submit(self._read, share, fds) for share in shares]:
                    done.result()
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read(self, chunks: list[_Chunk], fds: dict[Path, int]) -> None:
        if self.device.type != "cuda":
            for c in chunks:
                _pread(fds[c.path], c.dst.numpy(), c.offset)
            return
        with torch.cuda.device(self.device):
            stream = torch.cuda.Stream()
            slots = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
                     for _ in range(2)]
            copied = [torch.cuda.Event(), torch.cuda.Event()]
            with torch.cuda.stream(stream):
                for i, c in enumerate(chunks):
                    slot, n = slots[i % 2], c.dst.numel()
                    copied[i % 2].synchronize()  # the slot's previous copy has left it
                    _pread(fds[c.path], slot[:n].numpy(), c.offset)
                    c.dst.copy_(slot[:n], non_blocking=True)
                    copied[i % 2].record(stream)
            stream.synchronize()


def _pread(fd: int, buf, offset: int) -> None:
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ModelLoadError(f"checkpoint file ends {len(view) - done} bytes early")
        done += n
