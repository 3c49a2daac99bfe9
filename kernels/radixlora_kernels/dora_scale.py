"""DoRA's per-output-channel scale of a complete projection output (radixlora.worker.dora): for
each token t with a magnitude row r_t >= 0, with g - 1 = b_pool[r_t] (times its slice's qscale
in an int8 pool) and z = y[t] - bias + delta[t]:
    without delta: y[t] += (g - 1) * z                 (y already holds the LoRA delta)
    with delta:    delta[t] += (g - 1) * z             (a deferred delta, y + delta is the output)
so the output is g * (x W^T + s B A x) + bias, as PEFT computes it. Tokens with r_t < 0 are not
touched. One launch per projection; rows are read only for the tokens that have one."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .triton_compat import cdiv, tl, triton

BLOCK = 1024


def dora_scale_ref(y: torch.Tensor, b_pool: torch.Tensor, out_offsets: Sequence[int],
                   rows: torch.Tensor, bias: torch.Tensor | None = None,
                   delta: torch.Tensor | None = None,
                   qscales: torch.Tensor | None = None) -> None:
    """Pure-torch reference of dora_scale (in place)."""
    tokens = torch.nonzero(rows >= 0).flatten()
    if tokens.numel() == 0:
        return
    r = rows[tokens].long()
    gm1 = b_pool[r].float()
    if qscales is not None:
        widths = torch.tensor([b - a for a, b in zip(out_offsets, out_offsets[1:])],
                              device=y.device)
        gm1 = gm1 * qscales[:, r].t().repeat_interleave(widths, dim=1)
    z = y[tokens].float()
    if bias is not None:
        z = z - bias.float()
    target = y if delta is None else delta
    if delta is not None:
        z = z + delta[tokens]
    target[tokens] = (target[tokens].float() + gm1 * z).to(target.dtype)


@triton.jit
def _dora_scale_kernel(y_ptr, delta_ptr, bias_ptr, b_ptr, qs_ptr, rows_ptr, n_cols, off1, off2,
                       stride_y, stride_delta, stride_b, stride_qs, BLOCK: tl.constexpr,
                       HAS_DELTA: tl.constexpr, HAS_BIAS: tl.constexpr,
                       QUANTIZED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + t)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < tl.where(row >= 0, n_cols, 0)  # a token with no magnitude row reads nothing
    safe_row = tl.maximum(row, 0).to(tl.int64)
    gm1 = tl.load(b_ptr + safe_row * stride_b + cols, mask=mask, other=0).to(tl.float32)
    if QUANTIZED:
        slice_idx = (cols >= off1).to(tl.int32) + (cols >= off2).to(tl.int32)
        gm1 *= tl.load(qs_ptr + slice_idx * stride_qs + safe_row, mask=mask, other=0)
    y = tl.load(y_ptr + t * stride_y + cols, mask=mask, other=0)
    z = y.to(tl.float32)
    if HAS_BIAS:
        z -= tl.load(bias_ptr + cols, mask=mask, other=0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta_ptr + t * stride_delta + cols, mask=mask, other=0)
        z += d
        tl.store(delta_ptr + t * stride_delta + cols, d + gm1 * z, mask=mask)
    else:
        out = y.to(tl.float32) + gm1 * z
        tl.store(y_ptr + t * stride_y + cols, out.to(y_ptr.dtype.element_ty), mask=mask)


def dora_scale(y: torch.Tensor, b_pool: torch.Tensor, out_offsets: Sequence[int],
               rows: torch.Tensor, bias: torch.Tensor | None = None,
               delta: torch.Tensor | None = None, qscales: torch.Tensor | None = None) -> None:
    """See the module docstring. y [T, out_total] (rows contiguous); b_pool [num_rows,
    out_total]; rows [T] int32; bias [out_total]; delta [T, out_total] float32; qscales
    [n_slices, num_rows] float32 for an int8 b_pool (at most 3 slices)."""
    n_tokens, n_cols = y.shape
    if n_tokens == 0:
        return
    if len(out_offsets) > 4 or (qscales is not None) != (b_pool.dtype == torch.int8):
        raise ValueError("dora_scale takes at most 3 slices, and qscales exactly for int8")
    off = [*out_offsets[1:-1], n_cols, n_cols][:2]
    _dora_scale_kernel[(n_tokens, cdiv(n_cols, BLOCK))](
        y, y if delta is None else delta, y if bias is None else bias, b_pool,
        b_pool if qscales is None else qscales, rows, n_cols, off[0], off[1],
        y.stride(0), 0 if delta is None else delta.stride(0), b_pool.stride(0),
        0 if qscales is None else qscales.stride(0),
        BLOCK=BLOCK, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None,
        QUANTIZED=qscales is not None,
    )
