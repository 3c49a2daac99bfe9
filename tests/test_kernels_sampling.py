"""The one-pass sampling kernel vs its torch reference (under TRITON_INTERPRET=1), and the
reference vs torch's own softmax: greedy is argmax with the first maximum, logprobs are
log_softmax of the raw logits, and Gumbel-max at temperature T draws from softmax(x / T)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from radixlora_kernels.sampling import (  # noqa: E402
    filter_scores_ref,
    gumbel_noise,
    sample_tokens,
    sample_tokens_ref,
)

BLOCK = 64  # small vocabulary steps, so that a few hundred columns span several splits


def batch(rows: int, vocab: int, dtype=torch.float32, seed: int = 0, hot: bool = True):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    temps = torch.tensor([0.0, 0.7, 1.0, 1e-9, 2.5, 0.0, 1.3][:rows] * (rows // 7 + 1))[:rows]
    seeds = torch.randint(-(2**62), 2**62, (rows,), generator=g)
    steps = torch.randint(0, 10**6, (rows,), generator=g)
    return logits, temps if hot else torch.zeros(rows), seeds, steps


def filters(rows: int):
    """Per row: (top_k, top_p, min_p), with rows of each filter alone, all three, and none."""
    table = [(0, 1.0, 0.0), (5, 1.0, 0.0), (-1, 0.6, 0.0), (-1, 1.0, 0.05), (20, 0.9, 0.01),
             (1, 1.0, 0.0), (-1, 1e-6, 0.0), (-1, 1.0, 1.0), (3, 0.95, 0.0)]
    rows_of = [table[i % len(table)] for i in range(rows)]
    top_k, top_p, min_p = zip(*rows_of) if rows else ((), (), ())
    return (torch.tensor(top_k, dtype=torch.int64), torch.tensor(top_p, dtype=torch.float32),
            torch.tensor(min_p, dtype=torch.float32))


def assert_matches_ref(logits, temps, seeds, steps, filters=None, **kw):
    tokens, logprobs, lse = sample_tokens(logits, temps, seeds, steps, filters,
                                          block=BLOCK, filter_block=BLOCK, **kw)
    ref = sample_tokens_ref(logits, temps, seeds, steps, filters)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, ref[0])
    torch.testing.assert_close(logprobs, ref[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref[2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_kernel_matches_reference(dtype, splits):
    assert_matches_ref(*batch(7, 451, dtype), num_splits=splits)


@pytest.mark.parametrize("rows,vocab", [(0, 5), (1, 1), (1, 63), (2, 64), (3, 65), (9, 300)])
def test_kernel_shapes_and_default_splits(rows, vocab):
    assert_matches_ref(*batch(rows, vocab, seed=rows))
    assert_matches_ref(*batch(rows, vocab, seed=rows, hot=False))


def test_kernel_on_a_row_slice_of_wider_logits():
    logits, *rest = batch(4, 200)
    assert_matches_ref(logits[:, :130], *rest, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_filtered_kernel_matches_reference(dtype, splits):
    logits, temps, seeds, steps = batch(18, 300, dtype, seed=3)
    assert_matches_ref(logits, temps, seeds, steps, filters(18), num_splits=splits)
    for step in (1, 2):  # other noise: other candidates, other loop lengths
        assert_matches_ref(logits, temps, seeds, steps + step, filters(18), num_splits=splits)


def test_filter_reference_against_its_definition():
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(9, 40, generator=g).repeat_interleave(2, dim=1)  # ties in every row
    kept = filter_scores_ref(scores, *filters(9)).isfinite()
    probs = torch.softmax(scores, -1)
    for row, (top_k, top_p, min_p) in enumerate(zip(*filters(9))):
        for col in range(scores.shape[1]):
            higher = scores[row] > scores[row, col]
            want = ((top_k <= 0 or higher.sum() < top_k)
                    and (top_p >= 1 or probs[row][higher].sum() < top_p)
                    and probs[row, col] >= min_p * probs[row].max())
            assert kept[row, col] == want, (row, col)
    assert kept[torch.arange(9), scores.argmax(-1)].all()  # the top column always stays


def test_filtered_gumbel_max_draws_from_the_kept_softmax():
    draws = 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).expand(draws, -1)
    seeds = torch.arange(draws, dtype=torch.int64) * 7919 + 17
    steps = torch.zeros(draws, dtype=torch.int64)
    probs = torch.softmax(logits[0], -1)  # 0.55, 0.20, 0.12, 0.07, 0.03: top_p 0.8 keeps 3
    one = (torch.full((draws,), -1), torch.full((draws,), 0.8), torch.zeros(draws))
    tokens, _, _ = sample_tokens_ref(logits, torch.ones(draws), seeds, steps, one)
    freq = torch.bincount(tokens, minlength=5).float() / draws
    want = torch.cat((probs[:3] / probs[:3].sum(), torch.zeros(2)))
    torch.testing.assert_close(freq, want, atol=0.012, rtol=0)
    kernel_tokens, _, _ = sample_tokens(logits[:64], torch.ones(64), seeds[:64], steps[:64],
                                        tuple(t[:64] for t in one), block=BLOCK,
                                        filter_block=BLOCK)
    assert torch.equal(kernel_tokens, tokens[:64])


def test_first_maximum_wins_across_splits():
    logits = torch.zeros(2, 300)
    logits[0, [250, 20, 140]] = 5.0  # three splits of 128 columns: each holds one maximum
    tokens, logprobs, _ = sample_tokens(logits, torch.zeros(2), torch.zeros(2, dtype=torch.long),
                                        torch.zeros(2, dtype=torch.long), block=BLOCK,
                                        num_splits=3)
    assert tokens.tolist() == [20, 0]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[[0, 1], tokens])


def test_reference_is_softmax_argmax_and_log_softmax():
    logits, temps, seeds, steps = batch(7, 97)
    lp = torch.log_softmax(logits, -1)
    tokens, logprobs, lse = sample_tokens_ref(logits, temps * 0, seeds, steps)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, lp.gather(1, tokens[:, None])[:, 0])
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
    hot_tokens, hot_logprobs, _ = sample_tokens_ref(logits, temps, seeds, steps)
    torch.testing.assert_close(hot_logprobs, lp.gather(1, hot_tokens[:, None])[:, 0])


def test_gumbel_max_draws_from_the_tempered_softmax():
    draws, temperature = 20000, 0.8
    logits = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]]).expand(draws, -1)
    seeds = torch.arange(draws, dtype=torch.int64) * 7919 - 12345
    tokens, _, _ = sample_tokens_ref(logits, torch.full((draws,), temperature), seeds,
                                     torch.full((draws,), 3, dtype=torch.int64))
    freq = torch.bincount(tokens, minlength=5).float() / draws
    torch.testing.assert_close(freq, torch.softmax(logits[0] / temperature, -1), atol=0.012, rtol=0)


def test_noise_depends_on_every_counter_word():
    base = gumbel_noise(torch.tensor([5]), torch.tensor([9]), 64)
    for seeds, steps in (([5 + 2**32], [9]), ([6], [9]), ([5], [10])):
        other = gumbel_noise(torch.tensor(seeds), torch.tensor(steps), 64)
        assert not torch.equal(base, other)
    assert base.isfinite().all() and base.dtype == torch.float32


def test_bad_arguments_raise():
    logits, temps, seeds, steps = batch(3, 50)
    with pytest.raises(ValueError, match="logits"):
        sample_tokens(logits.t(), temps, seeds, steps)
    with pytest.raises(ValueError, match="logits"):
        sample_tokens(logits.long(), temps, seeds, steps)
    with pytest.raises(ValueError, match="temperature"):
        sample_tokens(logits, temps.double(), seeds, steps)
    with pytest.raises(ValueError, match="steps"):
        sample_tokens(logits, temps, seeds, steps[:2])
    with pytest.raises(ValueError, match="vocab"):
        sample_tokens(logits[:, :0], temps, seeds, steps)
    top_k, top_p, min_p = filters(3)
    with pytest.raises(ValueError, match="top_p"):
        sample_tokens(logits, temps, seeds, steps, (top_k, top_p.double(), min_p))


@pytest.mark.parametrize("filtered", [False, True])
def test_rows_of_nan_end_in_a_column_and_leave_other_rows_alone(filtered):
    """A row of NaN logits (a broken adapter, an overflow) still gets a column of its row, never
    the one past it, and a filtered row's candidate loop ends; the other rows are unchanged."""
    logits, temps, seeds, steps = batch(9, 200)
    logits[2] = float("nan")
    logits[4, 17] = float("nan")
    row_filters = filters(9) if filtered else None
    tokens, _, _ = sample_tokens(logits, temps, seeds, steps, row_filters,
                                 block=BLOCK, filter_block=BLOCK)
    assert bool(((tokens >= 0) & (tokens < 200)).all()), tokens
    ref = sample_tokens_ref(logits, temps, seeds, steps, row_filters)[0]
    finite = [r for r in range(9) if r not in (2, 4)]
    assert torch.equal(tokens[finite], ref[finite])
