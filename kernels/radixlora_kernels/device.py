"""Host-device transfers that never synchronise the stream and, once started, allocate no
pinned memory: their host side is a region of a StagingRing allocated once.

Pinning memory (cudaHostAlloc, which torch's caching host allocator calls whenever it has no
free block of the size asked for) is a host call that may wait for work queued on the device,
so one made while a step is launched holds the launching thread until the device catches up."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch

from radixlora_kernels.triton_compat import cdiv

REGION_ALIGN = 64  # bytes: every region starts here, so any dtype's view of it is aligned
STAGING_BYTES = 128 << 20  # the process's host-to-device ring (on CUDA, at its first transfer)


class Fence(Protocol):
    def query(self) -> bool:
        """Whether the region it guards may be written again."""
        ...


class StagingRing:
    """A host buffer handed out in regions, one after another around the ring. Each region is
    fenced when its transfer is queued (`fence`): a CUDA event after a copy from it, or a
    HostRead the reader marks once done with a copy into it. A region is handed out again
    only after its fence and those of every earlier region have passed; `take` never waits
    for one: with no room left it returns None, and the caller allocates as before."""

    def __init__(self, nbytes: int, pin: bool = True):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.pinned = pin
        self.capacity = nbytes
        self.regions: deque[tuple[int, int, Fence]] = deque()  # (start, end, fence), oldest first
        self._taken: tuple[int, int] | None = None

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 view of at least `nbytes` bytes starting REGION_ALIGN-aligned, to be fenced
        (`fence`) before the next take; None when it is over a quarter of the ring or the
        regions in use leave no room."""
        size = cdiv(max(nbytes, 1), REGION_ALIGN) * REGION_ALIGN
        if size > self.capacity // 4:
            return None
        self._retire()
        start = self._fit(size)
        if start is None:
            return None
        self._taken = (start, start + size)
        return self.buffer[start : start + size]

    def fence(self, fence: Fence) -> None:
        """Guard the region taken last with `fence`."""
        start, end = self._taken
        self._taken = None
        self.regions.append((start, end, fence))

    def _retire(self) -> None:
        while self.regions and self.regions[0][2].query():
            self.regions.popleft()

    def _fit(self, size: int) -> int | None:
        """Where a region of `size` bytes fits beside the regions in use, which lie in one run
        around the ring from the oldest's start to the newest's end."""
        if not self.regions:
            return 0
        first, last = self.regions[0][0], self.regions[-1][1]
        if last > first:  # in use: [first, last)
            if last + size <= self.capacity:
                return last
            return 0 if size <= first else None
        return last if last + size <= first else None  # in use: [first, end) and [0, last)


class HostRead:
    """The fence of a device-to-host region: passed once the reader has marked it read."""

    def __init__(self) -> None:
        self.read = False

    def query(self) -> bool:
        return self.read


_staging: StagingRing | None = None


def staging_ring() -> StagingRing:
    """The process's host-to-device staging ring, pinned at its first use."""
    global _staging
    if _staging is None:
        _staging = StagingRing(STAGING_BYTES)
    return _staging


@contextmanager
def staged(numel: int, dtype: torch.dtype, ring: StagingRing | None, stream=None,
           new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event) -> Iterator[torch.Tensor]:
    """A 1-D host tensor of `numel` values to fill and copy to the device (non_blocking, on
    `stream`) inside the block: a region of `ring`, whose event is recorded on `stream` (None:
    the current device's current stream) as the block ends (also when it raises: a copy may
    have been queued), or, with no ring or no room in it, a new tensor, pinned as the ring is
    (without a ring: pageable)."""
    nbytes = numel * dtype.itemsize
    region = ring.take(nbytes) if ring is not None else None
    if region is None:
        yield torch.empty(numel, dtype=dtype, pin_memory=ring is not None and ring.pinned)
        return
    try:
        yield region[:nbytes].view(dtype)
    finally:
        event = new_event()
        event.record(stream)
        ring.fence(event)


def to_device(values, dtype: torch.dtype, device: torch.device,
              ring: StagingRing | None = None) -> torch.Tensor:
    """Host values as a device tensor without synchronising the stream, staged in `ring`
    (default the process's), so a step can be prepared while the previous one still runs on
    the GPU."""
    array = np.asarray(values)
    if device.type != "cuda":
        return torch.as_tensor(array, dtype=dtype).to(device)
    # the copy runs on the device's current stream, which need not be the current device's
    with staged(array.size, dtype, ring or staging_ring(),
                torch.cuda.current_stream(device)) as host:
        host.copy_(torch.as_tensor(array).reshape(-1))
        return host.view(array.shape).to(device, non_blocking=True)


def to_host(tensors: Sequence[torch.Tensor],
            ring: StagingRing | None) -> tuple[list[torch.Tensor], HostRead | None]:
    """Device tensors copied (non_blocking) into one region of `ring`, and that region's fence,
    to be marked read once the caller has read them after the copies; with no room, new
    pinned tensors and no fence."""
    if not tensors:
        return [], None
    sizes = [t.numel() * t.element_size() for t in tensors]
    steps = [cdiv(n, REGION_ALIGN) * REGION_ALIGN for n in sizes]
    region = ring.take(sum(steps)) if ring is not None else None
    if region is None:
        return [t.to("cpu", non_blocking=True) for t in tensors], None
    out, at, read = [], 0, HostRead()
    try:
        for t, n, step in zip(tensors, sizes, steps):
            host = region[at : at + n].view(t.dtype).view(t.shape)
            host.copy_(t, non_blocking=True)
            out.append(host)
            at += step
    except BaseException:  # nothing is read: the region is free once the copies queued end
        if tensors[0].is_cuda:
            read = torch.cuda.Event()
            read.record(torch.cuda.current_stream(tensors[0].device))
        else:
            read.read = True
        raise
    finally:
        ring.fence(read)
    return out, read


ALIGN_WORDS = 4  # int32 words in 16 bytes


def int32_parts_to_device(parts, device: torch.device) -> list[torch.Tensor]:
    """Int32 arrays as device tensors from one transfer (to_device), each a view that starts
    16-byte aligned: Triton specializes a pointer argument on 16-byte alignment, so a view at
    an offset that follows the lengths before it would make kernel variants of its own."""
    sizes = [len(part) for part in parts]
    starts = np.cumsum([0, *(cdiv(n, ALIGN_WORDS) * ALIGN_WORDS for n in sizes)])
    words = np.zeros(int(starts[-1]), np.int32)
    for start, part in zip(starts, parts):
        words[start : start + len(part)] = part
    packed = to_device(words, torch.int32, device)
    return [packed[start : start + n] for start, n in zip(starts, sizes)]
