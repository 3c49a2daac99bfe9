"""The worker's batched sampler: per-row sampling inputs (SamplingBatch), the logit processors
(logit bias and min_tokens, penalties, structured-output masks) and the draw.

Randomness is counter-based: the noise for (seed, output index, vocab id) is a hash, so a seeded
request draws the same tokens alone or in any batch, after retraction and recomputation, and on
any backend. No per-request generator objects, no Python loop over requests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from radixlora.sampling_params import SamplingParams
from radixlora_kernels.device import to_device
from radixlora_kernels.sampling import sample_tokens, sample_tokens_ref


@dataclass
class SamplingBatch:
    """Per-row sampling inputs of one batch, as host arrays (the CUDA graphs copy them into
    static buffers with the rest of a step's inputs)."""

    temperature: np.ndarray  # [B] float32; 0 = greedy
    top_p: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int64; <= 0 = off
    min_p: np.ndarray  # [B] float32
    seeds: np.ndarray  # [B] int64
    steps: np.ndarray  # [B] int64 index of the token being sampled
    num_top_logprobs: int = 0

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], steps: list[int]):
        return cls(
            temperature=np.array([p.temperature for p in params], np.float32),
            top_p=np.array([p.top_p for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int64),
            min_p=np.array([p.min_p for p in params], np.float32),
            seeds=np.array(seeds, np.int64),
            steps=np.array(steps, np.int64),
            num_top_logprobs=max((p.logprobs or 0) for p in params) if params else 0,
        )

    @property
    def needs_filter(self) -> bool:
        hot = self.temperature > 0
        return bool((hot & ((self.top_p < 1) | (self.top_k > 0) | (self.min_p > 0))).any())

    def rows(self) -> dict[str, np.ndarray]:
        """The per-row arrays by name (ROW_FIELDS), as `draw` and the static buffers take them."""
        return {name: getattr(self, name) for name in ROW_FIELDS}

    def to(self, device) -> dict[str, torch.Tensor]:
        dev = torch.device(device)
        return {name: to_device(values, ROW_DTYPES[name], dev)
                for name, values in self.rows().items()}


@dataclass
class LogitAdjustments:
    """Values added to single logits before sampling: a request's logit_bias, -inf on its
    stop tokens (EOS unless ignore_eos, and stop_token_ids) while fewer than min_tokens
    tokens are out, and -inf on the tokens that would complete one of its bad words. One entry
    per (row, token, value); a token may repeat (they add up)."""

    rows: np.ndarray  # [n] int64
    tokens: np.ndarray  # [n] int64
    values: np.ndarray  # [n] float32

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int], eos_ids: tuple[int, ...],
              banned: list[bytes | None] | None = None) -> LogitAdjustments | None:
        """None when no row is adjusted (`steps`: each row's output index; `banned`: each
        row's bad-word tokens, int32, as the scheduler found them)."""
        entries = []
        for row, (p, step) in enumerate(zip(params, steps)):
            entries += [(row, token, bias) for token, bias in p.logit_bias]
            if banned is not None and banned[row]:
                tokens = dict.fromkeys(np.frombuffer(banned[row], "<i4").tolist())
                entries += [(row, token, -math.inf) for token in tokens]
            if step < p.min_tokens:
                held = dict.fromkeys(p.stop_token_ids + (() if p.ignore_eos else eos_ids))
                entries += [(row, token, -math.inf) for token in held]
        if not entries:
            return None
        rows, tokens, values = zip(*entries)
        return cls(np.array(rows, np.int64), np.array(tokens, np.int64),
                   np.array(values, np.float32))

    def apply(self, logits: torch.Tensor) -> None:
        """Add the values to float32 logits [B, V], in place."""
        dev = logits.device
        logits.index_put_((to_device(self.rows, torch.int64, dev),
                           to_device(self.tokens, torch.int64, dev)),
                          to_device(self.values, torch.float32, dev), accumulate=True)


@dataclass
class Penalties:
    """The presence, frequency and repetition penalties of the rows that have them. Each
    row's output tokens so far (`output`: placeholders resolved on the device already) and,
    with a repetition penalty, its prompt tokens (`prompt`), as (row, token) pairs."""

    rows: np.ndarray  # [P] int64: the penalized rows
    presence: np.ndarray  # [P] float32
    frequency: np.ndarray  # [P] float32
    repetition: np.ndarray  # [P] float32
    output: tuple[torch.Tensor, torch.Tensor]  # (index into rows, token), int64 on the device
    prompt: tuple[torch.Tensor, torch.Tensor]

    def apply(self, logits: torch.Tensor) -> None:
        """Penalize float32 logits [B, V] in place: count each row's output tokens, subtract
        presence and frequency, then apply the repetition penalty to every token seen."""
        dev, vocab = logits.device, logits.shape[1]
        rows = to_device(self.rows, torch.int64, dev)
        counts = torch.zeros(len(self.rows), vocab, dtype=torch.float32, device=dev)
        counts.index_put_(self.output, torch.ones_like(self.output[1], dtype=torch.float32),
                          accumulate=True)
        x = logits[rows]
        x -= to_device(self.frequency, torch.float32, dev)[:, None] * counts
        x -= to_device(self.presence, torch.float32, dev)[:, None] * (counts > 0)
        seen = counts > 0
        seen[self.prompt] = True
        r = to_device(self.repetition, torch.float32, dev)[:, None].expand_as(x)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
        logits[rows] = x


@dataclass
class TokenMask:
    """Structured output: each masked row may sample only the tokens its bitmask allows
    (radixlora.structured; int32 words, bit t % 32 of word t // 32 is token t). Applied after
    the other processors; a row they left with no allowed finite logit samples uniformly
    among its allowed tokens."""

    rows: np.ndarray  # [M] int64
    words: np.ndarray  # [M, ceil(V / 32)] int32

    @classmethod
    def build(cls, masks: list[bytes | None]) -> TokenMask | None:
        rows = [row for row, mask in enumerate(masks) if mask is not None]
        if not rows:
            return None
        words = np.stack([np.frombuffer(masks[r], np.int32) for r in rows])
        return cls(np.array(rows, np.int64), words)

    def apply(self, logits: torch.Tensor) -> None:
        dev, vocab = logits.device, logits.shape[1]
        rows = to_device(self.rows, torch.int64, dev)
        # little-endian int32 words read as bytes: bit t % 8 of byte t // 8 is token t
        octets = to_device(self.words.view(np.uint8), torch.uint8, dev)
        shifts = torch.arange(8, dtype=torch.uint8, device=dev)
        allowed = ((octets[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
        x = logits[rows].masked_fill_(~allowed, -math.inf)
        stuck = ~torch.isfinite(x).any(dim=1, keepdim=True)
        logits[rows] = torch.where(stuck & allowed, 0.0, x)


ROW_FIELDS = ("temperature", "seeds", "steps", "top_k", "top_p", "min_p")
ROW_DTYPES = {"temperature": torch.float32, "seeds": torch.int64, "steps": torch.int64,
              "top_k": torch.int64, "top_p": torch.float32, "min_p": torch.float32}


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B]
    logprobs: torch.Tensor  # [B] logprob of the chosen token under the model's distribution
    top_ids: torch.Tensor | None = None  # [B, k]
    top_logprobs: torch.Tensor | None = None  # [B, k]


def draw(logits: torch.Tensor, rows: dict[str, torch.Tensor], filtered: bool = True):
    """(tokens, their logprobs, log-sum-exp) of logits [B, V] (any float dtype) with per-row
    tensors named as in ROW_FIELDS: the one-pass sampling kernel on CUDA (also inside CUDA
    graphs), its torch reference elsewhere. filtered=False ignores top-k/top-p/min-p (the caller
    knows no row has one)."""
    filters = (rows["top_k"], rows["top_p"], rows["min_p"]) if filtered else None
    sampler = sample_tokens if logits.is_cuda else sample_tokens_ref
    return sampler(logits, rows["temperature"], rows["seeds"], rows["steps"], filters)


def with_top_logprobs(out: SampleOutput, logits: torch.Tensor, lse: torch.Tensor,
                      k: int) -> SampleOutput:
    """out with the k most likely tokens of each row and their logprobs, when k > 0."""
    if k:
        top_logits, out.top_ids = logits.topk(k, dim=-1)
        out.top_logprobs = top_logits.float() - lse[:, None]
    return out


def sample(logits: torch.Tensor, batch: SamplingBatch,
           processors: tuple = ()) -> SampleOutput:
    """logits: [B, V] (any float dtype). Tokens are drawn from the logits as `processors`
    (LogitAdjustments, then Penalties, as vLLM orders them) leave them; logprobs are of the
    raw model distribution (before processors, temperature and filters)."""
    if not processors:
        tokens, chosen, lse = draw(logits, batch.to(logits.device), batch.needs_filter)
    else:
        processed = logits.float().clone()
        for processor in processors:
            processor.apply(processed)
        tokens, _, _ = draw(processed, batch.to(logits.device), batch.needs_filter)
        raw = logits.float()
        lse = torch.logsumexp(raw, dim=-1)
        chosen = raw.gather(1, tokens[:, None])[:, 0] - lse
    return with_top_logprobs(SampleOutput(tokens, chosen), logits, lse, batch.num_top_logprobs)
