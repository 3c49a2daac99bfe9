"""Slot expand: the LoRA expand of a projection whose shrink rode in its GEMM.

With adapter slots (radixlora.lora.slots) a projection's weight carries the A rows of the
batch's adapter sets below its own rows, so one GEMM yields y_aug = [y | v]: the base output
and every token's shrink against every slot row. This op finishes the LoRA work in place: each
token picks its own set's v columns and adds v @ B from the slots' B rows."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
import triton
import triton.language as tl

from .lora_ops import GROUP_TOKENS
from .sgmv_expand import MAX_SLICES
from .sgmv_shrink import fp32_dot

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_BLOCK = 128
_ROWS_PER_STEP = 16


def slot_expand_ref(
    y_aug: torch.Tensor,
    out_offsets: Sequence[int],
    b_slots: torch.Tensor,
    slot_scales: torch.Tensor,
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    group_tokens: torch.Tensor,
    group_start: torch.Tensor,
    group_count: torch.Tensor,
) -> None:
    """Pure-torch reference of `slot_expand_` (a loop over groups; slow, exact)."""
    off = list(out_offsets)
    n_out, n_slices = off[-1], len(off) - 1
    indptr = group_indptr.tolist()
    for g in range(int(num_groups.item())):
        tokens = group_tokens[indptr[g] : indptr[g + 1]].long()
        start, count = int(group_start[g]), int(group_count[g])
        if count <= 0 or len(tokens) == 0:
            continue
        j = torch.arange(start, start + count, device=y_aug.device)
        for i in range(n_slices):
            v = y_aug[tokens[:, None], n_out + j * n_slices + i].float() * slot_scales[j]
            cols = slice(off[i], off[i + 1])
            delta = v @ b_slots[j, cols].float()
            y_aug[tokens, cols] = (y_aug[tokens, cols].float() + delta).to(y_aug.dtype)


@triton.jit
def _slot_expand_kernel(y_ptr, b_ptr, scale_ptr, num_groups_ptr, group_indptr_ptr,
                        group_tokens_ptr, start_ptr, count_ptr, n_out, n_slices, off1, off2,
                        stride_y, stride_b, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr,
                        STEP: tl.constexpr, FP32_DOT: tl.constexpr):  # fmt: skip
    c0 = tl.program_id(0) * BLOCK
    g = tl.program_id(1)
    if g >= tl.load(num_groups_ptr):
        return
    count = tl.load(count_ptr + g)
    t0 = tl.load(group_indptr_ptr + g)
    n_tok = tl.load(group_indptr_ptr + g + 1) - t0
    if (count <= 0) | (n_tok <= 0):
        return
    start = tl.load(start_ptr + g)
    slice_id = (c0 >= off1).to(tl.int32) + (c0 >= off2).to(tl.int32)  # blocks never straddle
    t_mask = tl.arange(0, BLOCK_T) < n_tok
    tokens = tl.load(group_tokens_ptr + t0 + tl.arange(0, BLOCK_T), mask=t_mask, other=0)
    rows = y_ptr + tokens.to(tl.int64)[:, None] * stride_y
    cols = c0 + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK_T, BLOCK], tl.float32)
    for j0 in range(0, count, STEP):
        offs = j0 + tl.arange(0, STEP)
        j_mask = offs < count
        slots = (start + offs).to(tl.int64)
        v = tl.load(rows + n_out + slots[None, :] * n_slices + slice_id,
                    mask=t_mask[:, None] & j_mask[None, :], other=0.0)  # fmt: skip
        v = v.to(tl.float32) * tl.load(scale_ptr + slots, mask=j_mask, other=0.0)[None, :]
        b = tl.load(b_ptr + slots[:, None] * stride_b + cols[None, :], mask=j_mask[:, None],
                    other=0.0)  # fmt: skip
        if FP32_DOT:
            acc += tl.dot(v, b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(v.to(b.dtype), b)
    y = tl.load(rows + cols[None, :], mask=t_mask[:, None], other=0.0).to(tl.float32)
    tl.store(rows + cols[None, :], (y + acc).to(y_ptr.dtype.element_ty), mask=t_mask[:, None])


def block_for(out_offsets: Sequence[int]) -> int | None:
    """Columns per program: the largest power of two (<= 128) dividing every slice boundary, so
    a program's columns lie in one slice; at least 16 (tl.dot), else None (not supported)."""
    block = _MAX_BLOCK
    while block >= 16 and any(o % block for o in out_offsets):
        block //= 2
    return block if block >= 16 else None


def _check_args(y_aug, off, b_slots, slot_scales, groups) -> None:
    n_slices = len(off) - 1
    if not 1 <= n_slices <= MAX_SLICES or off[0] != 0 or any(b <= a for a, b in pairwise(off)):
        raise ValueError(
            f"out_offsets must rise strictly from 0 in 1..{MAX_SLICES} slices, got {off}"
        )
    if y_aug.dim() != 2 or b_slots.dim() != 2 or slot_scales.dim() != 1:
        raise ValueError(
            f"expected y_aug [T, C], b_slots [S, out], slot_scales [S], got {tuple(y_aug.shape)}, "
            f"{tuple(b_slots.shape)}, {tuple(slot_scales.shape)}"
        )
    n_out, num_slots = off[-1], b_slots.shape[0]
    if b_slots.shape[1] != n_out or slot_scales.shape[0] != num_slots:
        raise ValueError(
            f"b_slots {tuple(b_slots.shape)} and slot_scales {tuple(slot_scales.shape)} must be "
            f"[S, {n_out}] and [S]"
        )
    if y_aug.shape[1] < n_out + n_slices * num_slots:
        raise ValueError(
            f"y_aug has {y_aug.shape[1]} columns, fewer than {n_out} + {n_slices} x {num_slots} "
            "slot rows"
        )
    if block_for(off) is None:
        raise ValueError(f"every slice boundary must be a multiple of 16, got {off}")
    if y_aug.dtype not in _FLOAT_DTYPES or b_slots.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"y_aug and b_slots must be float, got {y_aug.dtype}, {b_slots.dtype}")
    if slot_scales.dtype != torch.float32:
        raise ValueError(f"slot_scales must be float32, got {slot_scales.dtype}")
    if y_aug.shape[1] > 1 and y_aug.stride(1) != 1 or b_slots.stride(1) != 1:
        raise ValueError("y_aug and b_slots rows must be contiguous (stride 1 along columns)")
    names = ("num_groups", "group_indptr", "group_tokens", "group_start", "group_count")
    for name, t in zip(names, groups, strict=True):
        if t.dim() != 1 or t.dtype != torch.int32:
            raise ValueError(f"{name} must be a 1-d int32 tensor, got {t.dtype} {tuple(t.shape)}")
    if groups[0].numel() != 1 or groups[3].shape != groups[4].shape:
        raise ValueError("num_groups must hold one value; group_start and group_count match")
    if groups[1].numel() != groups[3].numel() + 1:
        raise ValueError("group_indptr must have one entry more than group_start")
    if any(t.device != y_aug.device for t in (b_slots, slot_scales, *groups)):
        raise ValueError(f"every tensor must be on {y_aug.device}")


def slot_expand_(
    y_aug: torch.Tensor,
    out_offsets: Sequence[int],
    b_slots: torch.Tensor,
    slot_scales: torch.Tensor,
    num_groups: torch.Tensor,
    group_indptr: torch.Tensor,
    group_tokens: torch.Tensor,
    group_start: torch.Tensor,
    group_count: torch.Tensor,
) -> torch.Tensor:
    """Semantics:
        n_out, n = out_offsets[-1], len(out_offsets) - 1        # n slices (q/k/v: 3)
        for g in range(num_groups[0]):                          # tokens of one adapter set
            tokens = group_tokens[group_indptr[g] : group_indptr[g + 1]]
            j = group_start[g] + arange(group_count[g])         # the set's slot rows
            for i in range(n):
                v = y_aug[tokens][:, n_out + j * n + i].float() * slot_scales[j]
                cols = slice(out_offsets[i], out_offsets[i + 1])
                y_aug[tokens, cols] = (y_aug[tokens, cols].float() + v @ b_slots[j, cols].float())
                                      .to(y_aug.dtype)

    y_aug is a GEMM output against a weight whose rows are [W; A slot rows], slot row j's slice
    i at row n_out + j * n + i, so its column n_out + j * n + i holds x @ A_i[j]. Each program
    reads one group's B rows for one column block once and applies them to all the group's
    tokens (a tensor-core product); tokens in no group are left as they are. fp32
    accumulation, one rounding to y_aug's dtype (as deferred deltas are added); with a 16-bit
    b_slots, v * scale is rounded to its dtype before the product (as in grouped_expand).
    Columns from n_out on are read, never written. Groups hold at most GROUP_TOKENS tokens
    (lora_ops.HostGroups) and num_groups <= len(group_start).

    Args:
        y_aug: [T, C] float16/bfloat16/float32, rows of stride 1, updated in place;
            C >= n_out + n * S.
        out_offsets: n + 1 python ints, 0 = out_offsets[0] < ... < out_offsets[n] = n_out,
            1 <= n <= 3.
        b_slots: [S, n_out] float, rows of stride 1: each slot row's B row.
        slot_scales: [S] float32, each slot row's scale (stacking weight).
        num_groups: [1] int32; group_indptr [G + 1], group_tokens [M], group_start [G],
            group_count [G]: int32, each group's tokens, first slot row and slot row count.

    Returns:
        y_aug.
    """
    off = [int(o) for o in out_offsets]
    groups = (num_groups, group_indptr, group_tokens, group_start, group_count)
    _check_args(y_aug, off, b_slots, slot_scales, groups)
    max_groups, n_out = group_start.numel(), off[-1]
    if max_groups == 0 or y_aug.shape[0] == 0:
        return y_aug
    block = block_for(off)
    bounds = off[1:-1] + [n_out] * (MAX_SLICES - len(off) + 1)
    _slot_expand_kernel[(n_out // block, max_groups)](
        y_aug, b_slots, slot_scales, *groups, n_out, len(off) - 1, bounds[0], bounds[1],
        y_aug.stride(0), b_slots.stride(0), BLOCK_T=GROUP_TOKENS, BLOCK=block,
        STEP=_ROWS_PER_STEP, FP32_DOT=fp32_dot(b_slots.dtype, b_slots.device),
        num_warps=4 if block >= 64 else 2,
    )  # fmt: skip
    return y_aug
