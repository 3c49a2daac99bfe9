"""The staging ring that host-device transfers use in place of per-transfer pinned allocations:
a region is never handed out while its fence, or an earlier region's, has not passed."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from radixlora_kernels.device import (
    REGION_ALIGN,
    HostRead,
    StagingRing,
    staged,
    to_device,
    to_host,
)


class Copy:
    """A stand-in for a CUDA event after a copy: passes when the test says so."""

    def __init__(self) -> None:
        self.recorded = False
        self.passed = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.passed


def offset(ring: StagingRing, view: torch.Tensor) -> int:
    return view.data_ptr() - ring.buffer.data_ptr()


def test_regions_follow_one_another_aligned():
    ring = StagingRing(4096, pin=False)
    a = ring.take(10)
    ring.fence(Copy())
    b = ring.take(REGION_ALIGN + 1)
    ring.fence(Copy())
    assert (offset(ring, a), a.numel()) == (0, REGION_ALIGN)
    assert (offset(ring, b), b.numel()) == (REGION_ALIGN, 2 * REGION_ALIGN)


def test_a_region_waits_for_its_fence_and_the_earlier_ones():
    ring = StagingRing(1024, pin=False)  # regions of up to 256 bytes
    fences = []
    for _ in range(4):
        assert ring.take(256) is not None
        fences.append(Copy())
        ring.fence(fences[-1])
    assert ring.take(64) is None  # full: the caller allocates
    fences[1].passed = True
    assert ring.take(64) is None  # the oldest has not passed, so neither is free yet
    fences[0].passed = True
    view = ring.take(256)  # both free now: the ring wraps to the start
    assert offset(ring, view) == 0
    ring.fence(Copy())
    assert offset(ring, ring.take(256)) == 256


def test_a_region_too_large_for_the_ring_is_refused():
    ring = StagingRing(1024, pin=False)
    assert ring.take(257) is None
    assert ring.take(256) is not None


def test_wrapping_skips_the_tail_that_does_not_fit():
    ring = StagingRing(1024, pin=False)
    fences = [Copy() for _ in range(3)]
    for fence in fences:  # [0, 192), [192, 384), [384, 576)
        ring.take(192)
        ring.fence(fence)
    fences[0].passed = True
    ring.take(256)  # [576, 832)
    ring.fence(Copy())
    assert ring.take(256) is None  # [832, 1088) does not fit, nor does [0, 256) beside [192, ...)
    view = ring.take(192)  # [832, 1024)
    assert offset(ring, view) == 832
    ring.fence(Copy())
    assert offset(ring, ring.take(128)) == 0  # wraps into what the first region left


def test_random_use_never_hands_out_a_region_in_use():
    rng = random.Random(0)
    ring = StagingRing(4096, pin=False)
    live: list[tuple[int, int, Copy]] = []  # regions handed out whose fences have not passed
    given = 0
    for _ in range(3000):
        if rng.random() < 0.4 and live:
            rng.choice(live)[2].passed = True
        view = ring.take(rng.randint(0, 1024))
        # what the ring may hand out again: a prefix of the regions whose fences all passed
        while live and live[0][2].passed:
            live.pop(0)
        if view is None:
            continue
        start, end = offset(ring, view), offset(ring, view) + view.numel()
        assert start >= 0 and end <= ring.capacity and start % REGION_ALIGN == 0
        for s, e, _ in live:
            assert end <= s or e <= start, (start, end, s, e)
        fence = Copy()
        ring.fence(fence)
        live.append((start, end, fence))
        given += 1
    assert given > 300  # some 40 times round the ring


def test_staged_fills_a_region_and_fences_it_with_a_recorded_event():
    ring = StagingRing(1024, pin=False)
    events = []

    def new_event() -> Copy:
        events.append(Copy())
        return events[-1]

    with staged(3, torch.int64, ring, None, new_event) as host:
        host.copy_(torch.tensor([7, 8, 9]))
        copied = host.clone()  # what a device copy would read
    assert copied.tolist() == [7, 8, 9]
    assert len(events) == 1 and events[0].recorded
    assert ring.regions[-1][2] is events[0]


def test_staged_fences_the_region_when_the_block_raises():
    ring = StagingRing(1024, pin=False)
    with pytest.raises(RuntimeError), staged(4, torch.int32, ring, None, Copy):
        raise RuntimeError("after the copy was queued")
    assert len(ring.regions) == 1


def test_staged_without_room_or_ring_gives_a_tensor_of_its_own():
    with staged(5, torch.float32, None) as host:
        assert host.shape == (5,) and host.dtype == torch.float32
    ring = StagingRing(1024, pin=False)
    with staged(1000, torch.int64, ring, None, Copy) as host:  # 8,000 bytes: over a quarter
        assert host.numel() == 1000
    assert not ring.regions


def test_to_host_packs_the_outputs_in_one_region_until_read():
    ring = StagingRing(4096, pin=False)
    tokens = torch.tensor([3, 1, 2], dtype=torch.int64)
    logprobs = torch.tensor([-0.5, -1.5, -0.25], dtype=torch.float32)
    top = torch.arange(6, dtype=torch.int64).view(3, 2)
    copies, read = to_host([tokens, logprobs, top], ring)
    assert isinstance(read, HostRead) and len(ring.regions) == 1
    assert [c.tolist() for c in copies] == [tokens.tolist(), logprobs.tolist(), top.tolist()]
    assert all(offset(ring, c) % REGION_ALIGN == 0 for c in copies)
    again, _ = to_host([tokens], ring)
    assert offset(ring, again[0]) >= offset(ring, copies[2]) + copies[2].numel() * 8
    read.read = True
    ring.take(8)
    assert ring.regions[0][2] is not read  # retired once read


def test_to_host_fences_its_region_when_a_copy_fails():
    ring = StagingRing(4096, pin=False)
    with pytest.raises(NotImplementedError):  # torch cannot copy out of a meta tensor
        to_host([torch.ones(4), torch.empty(4, device="meta")], ring)  # the first one copied
    assert len(ring.regions) == 1 and ring.regions[0][2].query()
    assert ring.take(1024) is not None


def test_to_host_without_room_copies_as_before():
    ring = StagingRing(256, pin=False)
    big = torch.zeros(100, dtype=torch.int64)
    copies, read = to_host([big], ring)
    assert read is None and copies[0].tolist() == big.tolist()
    assert to_host([], ring) == ([], None)


@pytest.mark.parametrize("values, dtype", [
    ([1, 2, 3], torch.int64),
    (np.array([[1.5, 2.5]], np.float64), torch.float32),
    (np.array([True, False]), torch.int32),
    (np.zeros((0, 4), np.int32), torch.int32),
])
def test_to_device_on_the_cpu_converts_as_torch_does(values, dtype):
    out = to_device(values, dtype, torch.device("cpu"))
    expected = torch.as_tensor(np.asarray(values), dtype=dtype)
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.equal(out, expected)
