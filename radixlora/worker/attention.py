"""Attention over the paged KV pool. The metadata is FlashInfer-style CSR (qo_indptr, kv_indptr,
kv_indices): request b's new tokens are the last qo_len_b entries of its kv list. The torch
backend is the CPU path and the reference; the Triton backend uses the same metadata."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from radixlora.config import ModelConfig
from radixlora.model.ops import add_delta_ref, full_rotary, rotary
from radixlora.worker.kv_pool import KVPool
from radixlora_kernels.device import int32_parts_to_device, to_device


@dataclass
class AttentionInputs:
    """Host-side description of one batch's attention, from which backends build metadata."""

    qo_lens: list[int]
    kv_lens: list[int]
    kv_indices: torch.Tensor  # [sum(kv_lens)] int64 slots, on the device


class AttentionBackend(ABC):
    def __init__(self, kv_pool: KVPool, num_heads: int, head_dim: int,
                 sliding_window: int | None = None, *, sm_scale: float | None = None,
                 softcap: float | None = None, layer_windows: tuple[int | None, ...] = ()):
        """softmax(scale * q k^T) v over the paged pool; sm_scale: the scale (head_dim^-0.5);
        softcap: scores become tanh(scores / softcap) * softcap before the softmax; each layer
        slides its window (layer_windows), or every layer `sliding_window`."""
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self.softcap = softcap
        self.layer_windows = layer_windows
        self.sliding_window = sliding_window

    def window(self, layer_id: int) -> int | None:
        return self.layer_windows[layer_id] if self.layer_windows else self.sliding_window

    def windows(self) -> set[int | None]:
        """The distinct windows of the model's layers."""
        return set(self.layer_windows) if self.layer_windows else {self.sliding_window}

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs):
        """Per-batch metadata, built once and shared by every layer."""

    @abstractmethod
    def forward(self, q, k, v, layer_id: int, out_cache_loc: torch.Tensor, meta) -> torch.Tensor:
        """Store k/v at out_cache_loc, then attend. q: [T, Hq, D] -> [T, Hq, D]."""

    def forward_with_rope(
        self, q, k, v, positions, inv_freq, layer_id: int, out_cache_loc: torch.Tensor, meta,
        deltas=None, rope_scale: float = 1.0,
    ) -> torch.Tensor:
        """Rotary embedding of q and k (neox; cos and sin times rope_scale), then `forward`.
        deltas: (dq, dk, dv), deferred LoRA deltas (float32) added to q, k, v first, or None."""
        if deltas is not None:
            q, k, v = map(add_delta_ref, (q, k, v), deltas)
        q, k = rotary(q, k, positions, inv_freq, rope_scale)
        return self.forward(q, k, v, layer_id, out_cache_loc, meta)


@dataclass
class TorchAttentionMeta:
    q_index: torch.Tensor  # [B, Lq] token row of each padded query
    q_valid: torch.Tensor  # [B, Lq] bool
    kv_slots: torch.Tensor  # [B, Lk] slot of each padded key (0 = padding)
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, Lq, Lk] bool, True = attend


class TorchAttentionBackend(AttentionBackend):
    """Padded batched SDPA: one gather of every request's keys, one masked attention call."""

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMeta:
        device = inputs.kv_indices.device
        qo = torch.tensor(inputs.qo_lens, device=device)
        kv = torch.tensor(inputs.kv_lens, device=device)
        lq, lk = int(qo.max()), int(kv.max())
        i = torch.arange(lq, device=device)[None, :]
        j = torch.arange(lk, device=device)[None, :]
        q_valid = i < qo[:, None]
        k_valid = j < kv[:, None]
        qo_start = torch.cumsum(qo, 0) - qo
        kv_start = torch.cumsum(kv, 0) - kv
        q_index = torch.where(q_valid, qo_start[:, None] + i, 0)
        kv_pos = torch.where(k_valid, kv_start[:, None] + j, 0)
        kv_slots = torch.where(k_valid, inputs.kv_indices[kv_pos], 0)
        q_pos = (kv - qo)[:, None] + i
        causal = k_valid[:, None, :] & (j[:, None, :] <= q_pos[:, :, None])
        masks = {}
        for window in self.windows():
            mask = causal if window is None else causal & (
                q_pos[:, :, None] - j[:, None, :] < window)
            masks[window] = (mask | ~q_valid[:, :, None])[:, None]
        return TorchAttentionMeta(q_index, q_valid, kv_slots, masks)

    def forward(self, q, k, v, layer_id, out_cache_loc, meta: TorchAttentionMeta):
        self.kv_pool.store(layer_id, out_cache_loc, k, v)
        qp = q[meta.q_index].transpose(1, 2)
        kp = self.kv_pool.k_cache[layer_id][meta.kv_slots].to(q.dtype).transpose(1, 2)
        vp = self.kv_pool.v_cache[layer_id][meta.kv_slots].to(q.dtype).transpose(1, 2)
        group = qp.shape[1] // kp.shape[1]
        if group > 1:
            kp = kp.repeat_interleave(group, dim=1)
            vp = vp.repeat_interleave(group, dim=1)
        mask = meta.masks[self.window(layer_id)]
        if self.softcap is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.sm_scale)
        else:
            o = softcapped_attention(qp, kp, vp, mask, self.sm_scale, self.softcap)
        return o.transpose(1, 2)[meta.q_valid]


def softcapped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """softmax(tanh(scale q k^T / cap) * cap, masked) v, in float32 (Gemma 2's scores)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)


@dataclass
class MixedSplit:
    """A batch of decodes and extends split between the two kernels: the decode kernel for
    the requests of one new token, the extend kernel over the tiles of the others."""

    decodes: torch.Tensor  # [D] int32, the requests with one new token
    tile_req: torch.Tensor  # [N] int32, request of each extend tile (extend_tiles)
    tile_m: torch.Tensor  # [N] int32, its query block


@dataclass
class TritonAttentionMeta:
    qo_indptr: torch.Tensor  # [B + 1] int32
    kv_indptr: torch.Tensor  # [B + 1] int32
    kv_indices: torch.Tensor  # [N] int32
    max_qo_len: int
    decode_only: bool
    split: MixedSplit | None = None  # eager batches with extends: each kind to its kernel


class TritonAttentionBackend(AttentionBackend):
    """Paged attention kernels: flash-decoding when every request adds one token; otherwise the
    extend kernel (cached prefix + new tokens, causal) over the tiles of the requests that
    extend, and flash-decoding for those that add one token. An extend program computes
    BLOCK_M query rows against every key block it visits, so a one-token request in it would
    waste all but one row of that work."""

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMeta:
        device = inputs.kv_indices.device
        qo = torch.tensor([0, *inputs.qo_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        kv = torch.tensor([0, *inputs.kv_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        max_qo = max(inputs.qo_lens)
        split = None if max_qo == 1 else self._split(inputs.qo_lens, device)
        return TritonAttentionMeta(to_device(qo, torch.int32, device),
                                   to_device(kv, torch.int32, device),
                                   inputs.kv_indices.to(torch.int32), max_qo, max_qo == 1,
                                   split)

    def _split(self, qo_lens: list[int], device) -> MixedSplit:
        from radixlora_kernels.attention_extend import extend_block_m, extend_tiles

        lens = np.asarray(qo_lens, np.int64)
        block_m = extend_block_m(self.head_dim, self.kv_pool.compute_dtype)
        tile_req, tile_m = extend_tiles(np.where(lens > 1, lens, 0), block_m)
        decodes = np.flatnonzero(lens == 1).astype(np.int32)
        return MixedSplit(*int32_parts_to_device([decodes, tile_req, tile_m], device))

    def forward(self, q, k, v, layer_id, out_cache_loc, meta: TritonAttentionMeta):
        self.kv_pool.store(layer_id, out_cache_loc, k, v)
        return self._attend(q, layer_id, meta)

    def forward_with_rope(self, q, k, v, positions, inv_freq, layer_id, out_cache_loc, meta,
                          deltas=None, rope_scale: float = 1.0):
        """One kernel adds the deltas, rotates q and stores rotary(k) and v in the pool, then
        attention (a head rotated in part, or a rope scale: the torch rotary, then the
        store)."""
        from radixlora_kernels.rotary_kv import rotary_store_kv_

        if not full_rotary(q, inv_freq, rope_scale):
            return super().forward_with_rope(q, k, v, positions, inv_freq, layer_id,
                                             out_cache_loc, meta, deltas, rope_scale)

        k_cache, v_cache = self.kv_pool.k_cache[layer_id], self.kv_pool.v_cache[layer_id]
        rotary_store_kv_(q, k, v, positions, inv_freq, k_cache, v_cache, out_cache_loc, deltas)
        return self._attend(q, layer_id, meta)

    def _attend(self, q, layer_id: int, meta: TritonAttentionMeta) -> torch.Tensor:
        from radixlora_kernels.attention_decode import decode_attention
        from radixlora_kernels.attention_extend import extend_attention

        k_cache, v_cache = self.kv_pool.k_cache[layer_id], self.kv_pool.v_cache[layer_id]
        o = torch.empty_like(q)
        window = self.window(layer_id)
        cap = self.softcap
        if meta.decode_only:
            return decode_attention(q, k_cache, v_cache, o, meta.kv_indptr, meta.kv_indices,
                                    self.sm_scale, sliding_window=window, softcap=cap)
        split = meta.split
        if split is None:  # a graph's static batch
            return extend_attention(q, k_cache, v_cache, o, meta.qo_indptr, meta.kv_indptr,
                                    meta.kv_indices, self.sm_scale, sliding_window=window,
                                    max_qo_len=meta.max_qo_len, softcap=cap)
        if split.decodes.numel():
            # one split: a count that follows the decodes would compile a variant per count
            decode_attention(q, k_cache, v_cache, o, meta.kv_indptr, meta.kv_indices,
                             self.sm_scale, sliding_window=window, num_splits=1,
                             rows=(split.decodes, meta.qo_indptr), softcap=cap)
        return extend_attention(q, k_cache, v_cache, o, meta.qo_indptr, meta.kv_indptr,
                                meta.kv_indices, self.sm_scale, sliding_window=window,
                                tiles=(split.tile_req, split.tile_m), softcap=cap)


ATTENTION_BACKENDS = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend}


def make_attention_backend(name: str, kv_pool: KVPool, cfg: ModelConfig,
                           device) -> AttentionBackend:
    """The attention of a model of shape `cfg` (this rank's heads); "auto" is triton on CUDA,
    torch elsewhere."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose auto or "
                         f"{sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name](kv_pool, cfg.num_heads, cfg.head_dim, sm_scale=cfg.sm_scale,
                                    softcap=cfg.attn_softcap, layer_windows=cfg.layer_windows)
