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
