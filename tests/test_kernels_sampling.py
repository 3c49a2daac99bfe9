"""The one-pass sampling kernel vs its torch reference (under TRITON_INTERPRET=1), and the
reference vs torch's own softmax: greedy is argmax with the first maximum, logprobs are
log_softmax of the raw logits, and Gumbel-max at temperature T draws from softmax(x / T)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from radixlora.kernels.sampling import (  # noqa: E402
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


def assert_matches_ref(logits, temps, seeds, steps, all_greedy=False, **kw) -> None:
    tokens, logprobs, lse = sample_tokens(logits, temps, seeds, steps, all_greedy=all_greedy,
                                          block=BLOCK, **kw)  # fmt: skip
    ref = sample_tokens_ref(logits, temps, seeds, steps, all_greedy=all_greedy)
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
    assert_matches_ref(*batch(rows, vocab, seed=rows, hot=False), all_greedy=True)


def test_kernel_on_a_row_slice_of_wider_logits():
    logits, *rest = batch(4, 200)
    assert_matches_ref(logits[:, :130], *rest, num_splits=2)


def test_first_maximum_wins_across_splits():
    logits = torch.zeros(2, 300)
    logits[0, [250, 20, 140]] = 5.0  # three splits of 128 columns: each holds one maximum
    tokens, logprobs, _ = sample_tokens(logits, torch.zeros(2), torch.zeros(2, dtype=torch.long),
                                        torch.zeros(2, dtype=torch.long), block=BLOCK,
                                        num_splits=3)  # fmt: skip
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
                                     torch.full((draws,), 3, dtype=torch.int64))  # fmt: skip
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
