"""Scatter of packed 32-bit words into a word array: a CUDA graph's step inputs (token ids,
positions, KV slots, attention and LoRA metadata) arrive packed in one host-to-device copy, and
one launch puts each part into the static buffer it belongs to, instead of 7 copies per step
(22 with LoRA)."""

from __future__ import annotations

import torch

from .triton_compat import cdiv, tl, triton

_BLOCK = 1024
_MAX_PROGRAMS = 64  # per part; a program strides over the part's blocks


def scatter_words_ref(packed: torch.Tensor, words: torch.Tensor, num_parts: int) -> None:
    """Pure-torch reference of `scatter_words`."""
    table = packed[: 3 * num_parts].view(num_parts, 3).tolist()
    for src, dst, n in table:
        words[dst : dst + n] = packed[src : src + n]


@triton.jit
def _scatter_words_kernel(packed_ptr, words_ptr, BLOCK: tl.constexpr):
    part = tl.program_id(0)
    src = tl.load(packed_ptr + 3 * part).to(tl.int64)
    dst = tl.load(packed_ptr + 3 * part + 1).to(tl.int64)
    n = tl.load(packed_ptr + 3 * part + 2)
    for start in range(tl.program_id(1) * BLOCK, n, tl.num_programs(1) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(words_ptr + dst + offs, tl.load(packed_ptr + src + offs, mask=mask), mask=mask)


def scatter_words(packed: torch.Tensor, words: torch.Tensor, num_parts: int, max_part: int) -> None:
    """Semantics:
        table = packed[: 3 * num_parts].view(num_parts, 3)   # (src, dst, n) per part
        for src, dst, n in table:
            words[dst : dst + n] = packed[src : src + n]

    Args:
        packed: int32 [P], contiguous: the table, then the parts' words (src offsets count from
            packed[0]); parts must not overlap one another in words.
        words: int32 [W], contiguous, on packed's device; every dst + n <= W.
        num_parts: rows of the table (0 launches nothing).
        max_part: the largest part's n; it sizes the grid only (a smaller one gives fewer
            programs per part, which stride over its blocks).
    """
    for name, t in (("packed", packed), ("words", words)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous int32 vector, got {t.dtype} "
                             f"{tuple(t.shape)} strides {t.stride()}")
    if packed.device != words.device:
        raise ValueError(f"packed is on {packed.device}, words on {words.device}")
    if num_parts < 0 or 3 * num_parts > packed.numel():
        raise ValueError(f"num_parts {num_parts} does not fit packed [{packed.numel()}]")
    if num_parts == 0:
        return
    programs = min(_MAX_PROGRAMS, max(1, cdiv(max_part, _BLOCK)))
    _scatter_words_kernel[(num_parts, programs)](packed, words, BLOCK=_BLOCK)
