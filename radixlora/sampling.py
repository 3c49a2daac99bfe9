"""Sampling parameters (validated at the door) and the batched sampler.

Randomness is counter-based: the noise for (seed, output index, vocab id) is a hash, so a seeded
request draws the same tokens alone or in any batch, after retraction and recomputation, and on
any backend. No per-request generator objects, no Python loop over requests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from radixlora.device import to_device
from radixlora.errors import InvalidRequestError
from radixlora.kernels.sampling import sample_tokens, sample_tokens_ref
from radixlora.structured import Structure

MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16  # the server's limits on `stop` (radixlora.protocol.schemas)
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this, as OpenAI allows
MAX_REPETITION_PENALTY = 10.0


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True):
    """OpenAI's sampling fields that radixlora supports. `stop`: a string or strings; the
    output ends just before the first one to complete (finish_reason "stop"), as on the
    server. A list given for `stop` or `stop_token_ids` is kept as a tuple."""

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
    stop: tuple[str, ...] = ()
    # the first min_tokens tokens are never EOS, a stop token or the end of a stop string
    min_tokens: int = 0
    # (token id, bias) pairs added to the logits before sampling (a dict is accepted too);
    # logprobs stay those of the model's distribution
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's: subtracted from the logit of each token once it is in the output (presence),
    # times its count there (frequency); vLLM's: divides positive logits of tokens in the
    # prompt or the output and multiplies negative ones (1: none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # the output must match it (radixlora.structured): a JSON schema, any JSON object, a
    # regular expression, a choice of strings or a grammar
    structure: Structure | None = None

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(stop or ()))
        elif stop is not self.stop:
            msgspec.structs.force_setattr(self, "stop", stop)
        if not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        if not isinstance(bias, tuple) or any(not isinstance(b, tuple) for b in bias):
            try:
                bias = tuple(tuple(b) for b in bias)
            except TypeError:
                raise InvalidRequestError("logit_bias maps token ids to biases",
                                          param="logit_bias") from None
            msgspec.structs.force_setattr(self, "logit_bias", bias)

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
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
                     low_open=True)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, "
                                      f"got {len(self.logit_bias)}", param="logit_bias")
        for pair in self.logit_bias:
            if len(pair) != 2:
                raise InvalidRequestError("logit_bias maps token ids to biases",
                                          param="logit_bias")
            _check_int("logit_bias", pair[0], 0, vocab_size - 1)
            _check_float("logit_bias", pair[1], -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, "
                                      f"got {len(self.stop)}", param="stop")
        for s in self.stop:
            if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
                raise InvalidRequestError(f"stop strings must be 1-{MAX_STOP_CHARS} characters, "
                                          f"got {s!r}", param="stop")


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


GREEDY = SamplingParams(temperature=0.0)  # rows that sample nothing: cheapest to compute


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
    """Values added to single logits before sampling: a request's logit_bias, and -inf on its
    stop tokens (EOS unless ignore_eos, and stop_token_ids) while fewer than min_tokens
    tokens are out. One entry per (row, token, value); a token may repeat (they add up)."""

    rows: np.ndarray  # [n] int64
    tokens: np.ndarray  # [n] int64
    values: np.ndarray  # [n] float32

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int],
              eos_ids: tuple[int, ...]) -> LogitAdjustments | None:
        """None when no row is adjusted (`steps`: each row's output index)."""
        entries = []
        for row, (p, step) in enumerate(zip(params, steps)):
            entries += [(row, token, bias) for token, bias in p.logit_bias]
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
        words = to_device(self.words, torch.int32, dev)
        shifts = torch.arange(32, dtype=torch.int32, device=dev)
        allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab]
        x = logits[rows].masked_fill(~allowed, -math.inf)
        stuck = ~torch.isfinite(x).any(dim=1, keepdim=True)
        zeros = torch.zeros_like(x)
        logits[rows] = torch.where(stuck, zeros.masked_fill(~allowed, -math.inf), x)


def penalized(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


def needs_adjustments(params: SamplingParams, step: int) -> bool:
    """Whether a row sampling with params at output index `step` is changed before sampling
    (LogitAdjustments, Penalties)."""
    return bool(params.logit_bias) or step < params.min_tokens or penalized(params)


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
