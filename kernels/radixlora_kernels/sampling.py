"""Next-token choice from logits in one read of the vocabulary: greedy, or Gumbel-max at a
temperature with counter-based noise, plus the log-sum-exp of the raw logits for logprobs.

Stage 1 runs one program per (row, vocabulary split) and keeps, in one pass over its columns,
the running max and sum of exponentials of the logits and the best score with its first
column. Stage 2 merges the splits of each row. The noise of (seed, step, column) is murmur3's
finalizer over those 32-bit words, the same bits in `gumbel_noise` (torch) and in the kernel.

Top-k, top-p and min-p keep the columns whose tempered score is at least a row's threshold, so
the kept set only grows as a column's score does. Stage 2 finds the Gumbel-max over it without
a sort: it starts from stage 1's winner over all columns; while the candidate is not kept, every
kept column scores strictly higher than it, so the next candidate is the Gumbel-max over the
columns scoring higher, found with the candidate's membership in one more pass over the row.
The top column is always kept, so the loop ends (a candidate with no column above it is kept
outright, so a row with NaN logits ends it too); a sample of the unfiltered distribution lands
in the kept set with probability about top_p, so most rows take one pass.
"""

from __future__ import annotations

import torch

from .sgmv_shrink import sm_count
from .triton_compat import cdiv, next_power_of_2, tl, triton

_M32 = 0xFFFFFFFF
MIN_TEMPERATURE = 1e-6  # temperatures are clamped up to this before their reciprocal
BLOCK = 2048  # vocabulary columns per step of a program's loop
PROGRAMS_PER_SM = 8  # stage 1 splits rows until the grid has this many programs per SM
WARPS = 4  # per stage-1 program
FILTER_WARPS = 32  # per stage-2 program when filters are given (a row's candidate passes)
FILTER_BLOCK = 16384  # columns per step of a candidate pass
_CPU_SMS = 1
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, vocab] float32 that depends only on (seed, step, vocab id)."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    h = _fmix32((seeds[:, None] & _M32) ^ _fmix32(steps[:, None] * 0x9E3779B1 + 0x7F4A7C15))
    h = _fmix32(h ^ ((seeds[:, None] >> 32) & _M32) * 0x85EBCA77)
    h = _fmix32(h ^ _fmix32(ids * 0xC2B2AE3D + 0x165667B1))
    # (2k + 1) / 2^24 for a 23-bit k: exact in float32, strictly inside (0, 1)
    u = ((h >> 9).float() + 0.5) * 2.0**-23
    return -torch.log(-torch.log(u))


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding 32-bit values (products wrap; only
    the low 32 bits are kept, which wrapping preserves)."""
    h = h & _M32
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _M32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def filter_scores_ref(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """scores [B, V] with -inf in the columns top-k/top-p/min-p drop. A column stays when fewer
    than top_k columns score strictly higher (top_k <= 0: off), the softmax mass of the columns
    scoring strictly higher is below top_p (or top_p >= 1), and its probability is at least
    min_p times the top one's. Ties at the boundary all stay."""
    vocab = scores.shape[-1]
    desc = scores.sort(dim=-1, descending=True).values
    mass_before = torch.softmax(desc, dim=-1).cumsum(dim=-1)
    above = vocab - torch.searchsorted(desc.flip(-1).contiguous(), scores, right=True)
    mass_above = mass_before.gather(1, (above - 1).clamp_min(0)).masked_fill(above == 0, 0.0)
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    keep = (above < k) & ((top_p[:, None] >= 1) | (mass_above < top_p[:, None]))
    keep &= torch.exp(scores - desc[:, :1]) >= min_p[:, None]
    return scores.masked_fill(~keep, float("-inf"))


def sample_tokens_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch reference of `sample_tokens`."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    tokens = x.argmax(dim=-1)
    if bool((temperature > 0).any()):
        scores = x * (1.0 / temperature.clamp_min(MIN_TEMPERATURE))[:, None]
        if filters is not None:
            scores = filter_scores_ref(scores, *filters)
        sampled = (scores + gumbel_noise(seeds, steps, x.shape[-1])).argmax(dim=-1)
        tokens = torch.where(temperature > 0, sampled, tokens)
    chosen = x.gather(1, tokens[:, None])[:, 0] - lse
    return tokens, chosen, lse


@triton.jit
def _fmix(h):
    """murmur3's 32-bit finalizer on uint32 values (products wrap mod 2^32)."""
    h = (h ^ (h >> 16)) * 0x85EBCA6B
    h = (h ^ (h >> 13)) * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_hash(seed, step):
    """The per-row words of `gumbel_noise`: seed and step mixed, as uint32."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = (seed >> 32).to(tl.uint32)
    h = _fmix(seed_lo ^ _fmix(step.to(tl.uint32) * 0x9E3779B1 + 0x7F4A7C15))
    return _fmix(h ^ seed_hi * 0x85EBCA77)


@triton.jit
def _gumbel(row_hash, cols):
    h = _fmix(row_hash ^ _fmix(cols.to(tl.uint32) * 0xC2B2AE3D + 0x165667B1))
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
    return -tl.log(-tl.log(u))


@triton.jit
def _rescaled_sum(run_sum, run_max, new_max, values):
    """An online sum of exp(values - max): run_sum (taken at run_max) moved to new_max, plus one
    tile's terms."""
    return run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(values - new_max), axis=0)


@triton.jit
def _first_max(score, cols, vocab, best, best_idx):
    """The running (max score, its first column) after one more tile: on a tie the earlier
    column stays."""
    tile_best = tl.max(score, axis=0)
    tile_idx = tl.min(tl.where(score == tile_best, cols, vocab), axis=0)
    better = tile_best > best
    return tl.where(better, tile_best, best), tl.where(better, tile_idx, best_idx)


@triton.jit
def _row_filtered(row, hot, top_k_ptr, top_p_ptr, min_p_ptr, FILTER: tl.constexpr):
    """Whether a row samples from a filtered set: it is hot and has top-k, top-p or min-p."""
    filtered = hot & False
    if FILTER:
        filtered = hot & ((tl.load(top_k_ptr + row) > 0) | (tl.load(top_p_ptr + row) < 1)
                          | (tl.load(min_p_ptr + row) > 0))
    return filtered


@triton.jit
def _partials(row_ptr, lo, hi, vocab, inv_temp, row_hash,
              BLOCK: tl.constexpr, HOT: tl.constexpr, TEMPERED_SUM: tl.constexpr):
    """One pass over columns [lo, hi): the max and sum of exp of the logits, the sum of exp of
    the tempered scores (taken at max * inv_temp; when TEMPERED_SUM), and the best score with
    its first column (the logit, or when HOT the tempered score plus noise)."""
    run_max = tl.full((), float("-inf"), tl.float32)
    run_sum = tl.zeros((), tl.float32)
    run_sum_t = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int32)
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        run_sum = _rescaled_sum(run_sum, run_max, new_max, x)
        if TEMPERED_SUM:
            run_sum_t = _rescaled_sum(run_sum_t, run_max * inv_temp, new_max * inv_temp,
                                      x * inv_temp)
        run_max = new_max
        score = x
        if HOT:
            score = x * inv_temp + _gumbel(row_hash, cols)  # masked columns stay -inf
        best, best_idx = _first_max(score, cols, vocab, best, best_idx)
    return run_max, run_sum, run_sum_t, best, best_idx


# the split and row counts (and the partials' stride) change with the batch: not specialized
# on, so an unseen batch size never compiles a new variant while serving
@triton.jit(do_not_specialize=["num_splits", "stride_part"])
def _sample_partials_kernel(
    logits_ptr, temp_ptr, seed_ptr, step_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    parts_ptr, part_idx_ptr,
    vocab, chunk, num_splits, stride_row, stride_part, min_temp,
    BLOCK: tl.constexpr, FILTER: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    hot = temp > 0
    inv_temp = tl.div_rn(1.0, tl.maximum(temp, min_temp))
    row_hash = _row_hash(tl.load(seed_ptr + row), tl.load(step_ptr + row))
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    # one branch per kind of row, so a greedy row computes no noise and an unfiltered row no
    # tempered sum, whatever the other rows of the batch are
    if _row_filtered(row, hot, top_k_ptr, top_p_ptr, min_p_ptr, FILTER):
        run_max, run_sum, run_sum_t, best, best_idx = _partials(
            row_ptr, lo, hi, vocab, inv_temp, row_hash, BLOCK, True, True)
    elif hot:
        run_max, run_sum, run_sum_t, best, best_idx = _partials(
            row_ptr, lo, hi, vocab, inv_temp, row_hash, BLOCK, True, False)
    else:
        run_max, run_sum, run_sum_t, best, best_idx = _partials(
            row_ptr, lo, hi, vocab, inv_temp, row_hash, BLOCK, False, False)
    out = row * num_splits + split  # parts: [4, B, splits] max, sum of exp, best, tempered sum
    tl.store(parts_ptr + out, run_max)
    tl.store(parts_ptr + stride_part + out, run_sum)
    tl.store(parts_ptr + 2 * stride_part + out, best)
    tl.store(parts_ptr + 3 * stride_part + out, run_sum_t)
    tl.store(part_idx_ptr + out, best_idx)


@triton.jit
def _scan_above(row_ptr, vocab, floor, inv_temp, lse_t, row_hash, BLOCK: tl.constexpr):
    """Over one row's tempered scores s: the softmax mass and the number of columns with
    s > floor, and the first column maximising s + noise among them (vocab if none)."""
    mass = tl.zeros((), tl.float32)
    count = tl.zeros((), tl.int32)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int32) + vocab
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        s = s * inv_temp
        if tl.max(s, axis=0) > floor:  # most tiles hold no column above a candidate
            above = s > floor
            mass += tl.sum(tl.where(above, tl.exp(s - lse_t), 0.0), axis=0)
            count += tl.sum(above.to(tl.int32), axis=0)
            score = tl.where(above, s + _gumbel(row_hash, cols), float("-inf"))
            best, best_idx = _first_max(score, cols, vocab, best, best_idx)
    return mass, count, best_idx


@triton.jit(do_not_specialize=["num_splits", "stride_part", "rows"])
def _sample_merge_kernel(
    logits_ptr, parts_ptr, part_idx_ptr, token_ptr, out_ptr,
    temp_ptr, seed_ptr, step_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    vocab, num_splits, stride_row, stride_part, rows, min_temp,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr, FILTER: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    splits = tl.arange(0, SPLITS)
    mask = splits < num_splits
    at = row * num_splits + splits
    part_max = tl.load(parts_ptr + at, mask=mask, other=float("-inf"))
    part_sum = tl.load(parts_ptr + stride_part + at, mask=mask, other=0.0)
    row_max = tl.max(part_max, axis=0)
    lse = row_max + tl.log(tl.sum(part_sum * tl.exp(part_max - row_max), axis=0))
    part_best = tl.load(parts_ptr + 2 * stride_part + at, mask=mask, other=float("-inf"))
    part_idx = tl.load(part_idx_ptr + at, mask=mask, other=vocab)
    best = tl.max(part_best, axis=0)
    # a row of NaN has no best column: any column in range, never one past the row
    token = tl.minimum(tl.min(tl.where(part_best == best, part_idx, vocab), axis=0), vocab - 1)
    if FILTER:
        temp = tl.load(temp_ptr + row)
        if _row_filtered(row, temp > 0, top_k_ptr, top_p_ptr, min_p_ptr, FILTER):
            top_k = tl.load(top_k_ptr + row)
            top_p = tl.load(top_p_ptr + row)
            min_p = tl.load(min_p_ptr + row)
            k = tl.where(top_k > 0, tl.minimum(top_k, vocab), vocab).to(tl.int32)
            inv_temp = tl.div_rn(1.0, tl.maximum(temp, min_temp))
            row_hash = _row_hash(tl.load(seed_ptr + row), tl.load(step_ptr + row))
            max_t = row_max * inv_temp
            part_sum_t = tl.load(parts_ptr + 3 * stride_part + at, mask=mask, other=0.0)
            sum_t = tl.sum(part_sum_t * tl.exp(part_max * inv_temp - max_t), axis=0)
            lse_t = max_t + tl.log(sum_t)
            kept = tl.zeros((), tl.int32)
            while kept == 0:
                score = tl.load(row_ptr + token).to(tl.float32) * inv_temp
                mass, count, above_best = _scan_above(row_ptr, vocab, score, inv_temp, lse_t,
                                                      row_hash, BLOCK)
                # no column above the candidate: it is a top column, which every filter keeps
                # (and a NaN candidate or row ends the loop here instead of spinning)
                kept = (((count < k) & ((top_p >= 1) | (mass < top_p))
                         & (tl.exp(score - max_t) >= min_p)) | (above_best == vocab)).to(tl.int32)
                token = tl.where(kept != 0, token, above_best)
    chosen = tl.load(row_ptr + token).to(tl.float32)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(out_ptr + row, chosen - lse)  # out: [2, B] logprobs, lse
    tl.store(out_ptr + rows + row, lse)


def default_num_splits(rows: int, vocab: int, device: torch.device, block: int = BLOCK) -> int:
    """Splits per row so that the grid has PROGRAMS_PER_SM programs per SM, each at least one
    block of the vocabulary."""
    sms = sm_count(device.index) if device.type == "cuda" else _CPU_SMS
    return max(1, min(cdiv(PROGRAMS_PER_SM * sms, max(rows, 1)), cdiv(vocab, block)))


def _check(logits, temperature, seeds, steps, filters) -> None:
    if logits.dim() != 2 or logits.dtype not in _FLOAT_DTYPES or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be [B, V] fp16/bf16/fp32 with unit column stride, got "
            f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}"
        )
    rows = logits.shape[0]
    named = {"temperature": (temperature, torch.float32), "seeds": (seeds, torch.int64),
             "steps": (steps, torch.int64)}
    if filters is not None:
        named.update(zip(("top_k", "top_p", "min_p"),
                         zip(filters, (torch.int64, torch.float32, torch.float32))))
    for name, (t, dtype) in named.items():
        if t.shape != (rows,) or t.dtype != dtype or t.device != logits.device:
            raise ValueError(
                f"{name} must be [{rows}] {dtype} on {logits.device}, got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
            )
    if logits.shape[1] == 0 or logits.shape[1] >= 2**31:
        raise ValueError(f"vocab size must be in [1, 2^31), got {logits.shape[1]}")


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    filters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    *,
    num_splits: int | None = None,
    block: int = BLOCK,
    filter_block: int = FILTER_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Semantics:
        x = logits.float()
        lse = logsumexp(x, -1)
        scores = x * (1 / temperature.clamp_min(1e-6))[:, None]
        if filters is not None:
            scores = filter_scores_ref(scores, *filters)
        scores = scores + gumbel_noise(seeds, steps, V)
        tokens = where(temperature > 0, scores.argmax(-1), x.argmax(-1))
        return tokens, x[arange(B), tokens] - lse, lse

    argmax takes the first column among equal maxima. Logits must be finite.

    Args:
        logits: [B, V] float16/bfloat16/float32, unit column stride.
        temperature: [B] float32 (0: greedy). seeds, steps: [B] int64, the noise's counters.
        filters: (top_k [B] int64, top_p [B] float32, min_p [B] float32), or None.
        num_splits: vocabulary splits per row (default: `default_num_splits`).
        block: vocabulary columns per step of a program's loop (a power of 2).
        filter_block: the same for a filtered row's candidate passes.

    Returns:
        tokens [B] int64, their logprobs under softmax(x) [B] float32, lse [B] float32.
    """
    _check(logits, temperature, seeds, steps, filters)
    rows, vocab = logits.shape
    splits = num_splits or default_num_splits(rows, vocab, logits.device, block)
    chunk = cdiv(cdiv(vocab, splits), block) * block
    splits = cdiv(vocab, chunk)
    filtered = filters is not None
    parts = torch.empty(4, rows, splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    out = torch.empty(2, rows, dtype=torch.float32, device=logits.device)
    if rows > 0:
        filter_ptrs = filters if filtered else (temperature,) * 3
        _sample_partials_kernel[(rows, splits)](
            logits, temperature, seeds, steps, *filter_ptrs, parts, part_idx,
            vocab, chunk, splits, logits.stride(0), parts.stride(0), MIN_TEMPERATURE,
            BLOCK=block, FILTER=filtered, num_warps=WARPS,
        )
        _sample_merge_kernel[(rows,)](
            logits, parts, part_idx, tokens, out,
            temperature, seeds, steps, *filter_ptrs,
            vocab, splits, logits.stride(0), parts.stride(0), rows, MIN_TEMPERATURE,
            SPLITS=next_power_of_2(cdiv(vocab, block)),  # >= splits, any batch
            BLOCK=filter_block, FILTER=filtered,
            num_warps=FILTER_WARPS if filtered else 1,
        )
    return tokens, out[0], out[1]
