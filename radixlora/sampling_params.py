"""Sampling parameters, validated at the door; the worker's batched sampler that applies them is
radixlora.worker.sampler."""

from __future__ import annotations

import math

import msgspec

from radixlora.errors import InvalidRequestError
from radixlora.structured import Structure

MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_STOP_STRINGS = 16  # the server's limits on `stop` (radixlora.protocol.common)
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this, as OpenAI allows
MAX_REPETITION_PENALTY = 10.0
MAX_BAD_WORDS = 64


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
    # vLLM's: words never generated; their token sequences (bad_words_ids) are filled in by
    # whoever holds the tokenizer (radixlora.text.tokenizer.bad_words_ids)
    bad_words: tuple[str, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, tuple):
            msgspec.structs.force_setattr(self, "stop", tuple(stop or ()))
        elif stop is not self.stop:
            msgspec.structs.force_setattr(self, "stop", stop)
        if not isinstance(self.stop_token_ids, tuple):
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.bad_words, str) or not isinstance(self.bad_words, tuple):
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            msgspec.structs.force_setattr(self, "bad_words", tuple(words or ()))
        if not isinstance(self.bad_words_ids, tuple) or any(
                not isinstance(ids, tuple) for ids in self.bad_words_ids):
            msgspec.structs.force_setattr(self, "bad_words_ids",
                                          tuple(tuple(ids) for ids in self.bad_words_ids))
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
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequestError(f"bad_words may hold at most {MAX_BAD_WORDS} words",
                                      param="bad_words")
        for word in self.bad_words:
            if not isinstance(word, str) or not 1 <= len(word.strip()) <= MAX_STOP_CHARS:
                raise InvalidRequestError(f"bad_words must be 1-{MAX_STOP_CHARS} characters, "
                                          f"got {word!r}", param="bad_words")
        for ids in self.bad_words_ids:
            for t in ids:
                _check_int("bad_words", t, 0, vocab_size - 1)
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


def penalized(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


def banned_tokens(params: SamplingParams, output_ids) -> list[int]:
    """vLLM's bad_words: the last token of each bad word's sequence whose other tokens end the
    output so far (a one-token word: always)."""
    banned = []
    for ids in params.bad_words_ids:
        head = len(ids) - 1
        if head == 0 or (len(output_ids) >= head
                         and tuple(output_ids[len(output_ids) - head:]) == ids[:-1]):
            banned.append(ids[-1])
    return banned


def bans_after_newest(params: SamplingParams) -> bool:
    """Whether a bad word's ban depends on the output's newest token (a word of 2+ tokens)."""
    return any(len(ids) > 1 for ids in params.bad_words_ids)


def needs_adjustments(params: SamplingParams, step: int) -> bool:
    """Whether a row sampling with params at output index `step` is changed before sampling
    (LogitAdjustments, Penalties; bad words are banned through LogitAdjustments)."""
    return (bool(params.logit_bias) or step < params.min_tokens or penalized(params)
            or bool(params.bad_words_ids))
