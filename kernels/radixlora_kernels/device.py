"""Host-to-device transfers that never synchronise the stream."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a device tensor without synchronising the stream (a pinned staging copy
    that the caching host allocator keeps alive until the transfer is done), so a step can be
    prepared while the previous one still runs on the GPU."""
    src = torch.as_tensor(np.asarray(values), dtype=dtype)
    if device.type != "cuda":
        return src.to(device)
    return src.pin_memory().to(device, non_blocking=True)


ALIGN_WORDS = 4  # int32 words in 16 bytes


def int32_parts_to_device(parts, device: torch.device) -> list[torch.Tensor]:
    """Int32 arrays as device tensors from one transfer (to_device), each a view that starts
    16-byte aligned: Triton specializes a pointer argument on 16-byte alignment, so a view at
    an offset that follows the lengths before it would make kernel variants of its own."""
    sizes = [len(part) for part in parts]
    starts = np.cumsum([0, *(-(-n // ALIGN_WORDS) * ALIGN_WORDS for n in sizes)])
    words = np.zeros(int(starts[-1]), np.int32)
    for start, part in zip(starts, parts):
        words[start : start + len(part)] = part
    packed = to_device(words, torch.int32, device)
    return [packed[start : start + n] for start, n in zip(starts, sizes)]
