"""Sampling parameters (validated at the door) and the batched sampler.

Randomness is counter-based: the noise for (seed, output index, vocab id) is a hash, so a seeded
request draws the same tokens alone or in any batch, after retraction and recomputation, and on
any backend. No per-request generator objects, no Python loop over requests."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec
import torch

from radixlora.errors import InvalidRequestError
from radixlora.forward_batch import to_device
from radixlora.kernels.sampling import sample_tokens, sample_tokens_ref

MAX_TOP_LOGPROBS = 20
MAX_N = 128


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def validate(self, vocab_size: int) -> None:
        _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("n", self.n, 1, MAX_N)
        _check_int("top_k", self.top_k, -1, None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.seed is not None:
            _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        _check_float("temperature", self.temperature, 0.0, None)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, vocab_size - 1)


def _check_int(name: str, value, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise InvalidRequestError(f"{name} must be {bound}, got {value}", param=name)


def _check_float(name, value, low, high, low_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
    if value < low or (low_open and value == low) or (high is not None and value > high):
        interval = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}]"
        raise InvalidRequestError(f"{name} must be in {interval}, got {value}", param=name)


@dataclass
class SamplingBatch:
    """Per-row sampling inputs of one batch, on the device."""

    temperature: torch.Tensor  # [B] fp32; 0 = greedy
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] int64; <= 0 = off
    min_p: torch.Tensor  # [B]
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64 index of the token being sampled
    num_top_logprobs: int = 0
    needs_filter: bool = field(default=False)
    all_greedy: bool = field(default=False)

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], steps: list[int], device):
        def t(values, dtype):
            return to_device(values, dtype, torch.device(device))

        return cls(
            temperature=t([p.temperature for p in params], torch.float32),
            top_p=t([p.top_p for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.int64),
            min_p=t([p.min_p for p in params], torch.float32),
            seeds=t(seeds, torch.int64),
            steps=t(steps, torch.int64),
            num_top_logprobs=max((p.logprobs or 0) for p in params),
            needs_filter=any(p.top_p < 1 or p.top_k > 0 or p.min_p > 0 for p in params),
            all_greedy=all(p.temperature == 0 for p in params),
        )


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor  # [B] logprob of the chosen token under the model's distribution
    top_ids: torch.Tensor | None  # [B, k]
    top_logprobs: torch.Tensor | None  # [B, k]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """logits: [B, V] (any float dtype). Logprobs are of the raw model distribution (before
    temperature and filters). The one-pass sampling kernel on CUDA, its torch reference
    elsewhere."""
    filters = (batch.top_k, batch.top_p, batch.min_p) if batch.needs_filter else None
    sampler = sample_tokens if logits.is_cuda else sample_tokens_ref
    tokens, chosen, lse = sampler(logits, batch.temperature, batch.seeds, batch.steps, filters,
                                  all_greedy=batch.all_greedy)  # fmt: skip
    top_ids = top_lp = None
    if batch.num_top_logprobs:
        top_logits, top_ids = logits.topk(batch.num_top_logprobs, dim=-1)
        top_lp = top_logits.float() - lse[:, None]
    return SampleOutput(tokens, chosen, top_ids, top_lp)
