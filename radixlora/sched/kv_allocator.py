"""Paged KV cache, the scheduler's side: page bookkeeping (KVAllocator); the worker holds the
tensors (radixlora.worker.kv_pool). A token's KV lives in one slot; slot = page * page_size +
offset. Page 0 is reserved as the padding target: slots 0..page_size-1 are never handed out."""

from __future__ import annotations

import numpy as np


class KVAllocator:
    """Free list of KV pages. Callers speak in slots; whole pages are allocated and freed."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (page 0 is reserved)")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self._is_free = np.ones(num_pages, dtype=bool)
        self._is_free[0] = False

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def capacity_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size

    def free_tokens(self) -> int:
        return len(self._free) * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_alloc(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def alloc(self, num_pages: int) -> np.ndarray:
        """Slots of `num_pages` fresh pages, page by page, in order. Raises if not enough."""
        if num_pages > len(self._free):
            raise MemoryError(f"KV pool exhausted: need {num_pages} pages, {len(self._free)} free")
        pages = np.array(self._free[len(self._free) - num_pages :][::-1], dtype=np.int32)
        del self._free[len(self._free) - num_pages :]
        self._is_free[pages] = False
        if self.page_size == 1:
            return pages
        offsets = np.arange(self.page_size, dtype=np.int32)
        return (pages[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def free(self, slots: np.ndarray) -> None:
        """Free the pages that `slots` cover; `slots` must be whole pages (page-aligned runs)."""
        if len(slots) == 0:
            return
        pages = np.unique(np.asarray(slots) // self.page_size)
        if pages.min() <= 0 or self._is_free[pages].any():
            raise ValueError("double free of a KV page, or a free of the reserved page 0")
        self._is_free[pages] = True
        self._free.extend(pages.tolist())
