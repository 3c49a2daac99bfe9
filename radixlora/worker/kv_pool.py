"""Paged KV cache, the worker's side: one K and one V tensor per layer, indexed by slot (the
scheduler's KVAllocator in radixlora.sched.kv_allocator hands the slots out). The storage dtype
may be narrower than the model's (FP8 e4m3, scale 1): K and V are rounded to it as they are
stored, and read back exactly into `compute_dtype`."""

from __future__ import annotations

import torch

from radixlora_kernels.rotary_kv import to_cache_dtype


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
        compute_dtype: torch.dtype | None = None,
    ):
        """dtype: the storage dtype; compute_dtype: the dtype K and V arrive and are read in
        (default: dtype)."""
        shape = (num_slots, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.compute_dtype = compute_dtype or dtype

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_cache[layer_id][loc] = to_cache_dtype(k, self.k_cache[layer_id].dtype)
        self.v_cache[layer_id][loc] = to_cache_dtype(v, self.v_cache[layer_id].dtype)

    @staticmethod
    def bytes_per_slot(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
