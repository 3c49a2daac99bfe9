"""Request intake, one path for the offline Engine, the scheduler and tokenizer processes and
the batch-file runner: prompt ids checked, the adapter choice resolved once into an AdapterSet,
the context rule applied, and the Reqs built (n per prompt) with their cache namespace and
sampling seeds."""

from __future__ import annotations

import random
from concurrent.futures import Future

import msgspec
import numpy as np

from radixlora.config import EngineConfig, ModelConfig
from radixlora.errors import AdapterNotFoundError, InvalidRequestError
from radixlora.sampling_params import SamplingParams
from radixlora.sched.adapter_choice import AdapterChoice
from radixlora.sched.adapter_registry import AdapterRegistry
from radixlora.sched.grammar_compiler import GrammarCompiler
from radixlora.sched.request import (
    AdapterSet,
    Req,
    build_requests,
    cache_namespace,
    check_logprob_start,
)
from radixlora.sched.scheduler import Scheduler
from radixlora.structured import Matcher, Structure


def max_total_tokens(model_cfg: ModelConfig, config: EngineConfig) -> int:
    """Prompt + output tokens one request may hold: the context length, capped by the KV pool
    (one page stays free so a full-length request can always be admitted)."""
    return min(config.max_context(model_cfg), (config.kv_pages - 1) * config.page_size)


def fill_context(params: SamplingParams, prompt_len: int, max_total: int,
                 param: str = "prompt") -> SamplingParams:
    """params with max_tokens set to the room the context leaves after the prompt."""
    room = max_total - prompt_len
    if room < 1:
        raise InvalidRequestError(
            f"the prompt ({prompt_len} tokens) leaves no room to generate "
            f"(at most {max_total} tokens in total)",
            param=param,
            code="context_length_exceeded",
        )
    return msgspec.structs.replace(params, max_tokens=room)


def check_prompt_ids(ids, vocab_size: int) -> np.ndarray:
    """A flat prompt of token ids in [0, vocab_size), as int32."""
    try:
        ids = np.asarray(ids)
    except (ValueError, TypeError):
        ids = np.zeros((0, 0))
    if ids.ndim != 1 or (len(ids) and not np.issubdtype(ids.dtype, np.integer)):
        raise InvalidRequestError(
            "a prompt must be a string or a flat list of token ids", param="prompt"
        )
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidRequestError(f"token ids must be in [0, {vocab_size})", param="prompt")
    return ids.astype(np.int32)


class Intake:
    """Turns a validated prompt and a request's choices into the Reqs the scheduler queues.

    With fallback_to_base, a choice naming an adapter that is not served is served by the base
    model (the server's --adapter-failure-policy base) and `fallback` says why."""

    def __init__(self, model_cfg: ModelConfig, base_version: str, adapters: AdapterRegistry,
                 scheduler: Scheduler, seed: int, fallback_to_base: bool = False,
                 grammars: GrammarCompiler | None = None):
        self.model_cfg = model_cfg
        self.grammars = grammars  # structured output; None: the model has no tokenizer.json
        self.base_version = base_version
        self.adapters = adapters
        self.scheduler = scheduler
        self.rng = random.Random(seed)
        self.fallback_to_base = fallback_to_base
        self.eos_ids = frozenset(model_cfg.eos_token_ids)

    def requests(self, rid: str, ids: np.ndarray, params: SamplingParams,
                 choices: list[AdapterChoice] | None, logprob_start: int | None = None,
                 cache_salt: str | None = None,
                 grammar: Matcher | None = None) -> tuple[list[Req], str]:
        """The params.n requests of one prompt, checked admissible, and why the request is
        served base-only ("" when it is not). `grammar`: params.structure compiled (submit's
        result), else it is compiled here, waiting for it."""
        params.validate(self.model_cfg.vocab_size)
        check_logprob_start(logprob_start, len(ids))
        adapter_set, fallback = self.resolve(choices)
        if params.structure is not None:
            grammar = grammar or self.submit(params.structure).result()
            params = msgspec.structs.replace(params, structure=None)  # plans carry the mask
        base_seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        reqs = build_requests(
            rid, ids, params, adapter_set,
            cache_namespace(self.base_version, adapter_set, cache_salt,
                            self.scheduler.config.lora_dtype), base_seed,
            self.eos_ids, share_prompt=self.scheduler.tree is not None,
        )
        for req in reqs:
            req.logprob_start = logprob_start
            if grammar is not None:
                req.grammar = grammar.copy()  # the compiled one stays pristine in the cache
            self.scheduler.check_admissible(req)
        return reqs, fallback

    def submit(self, structure: Structure) -> Future:
        """The future of `structure`'s compiled Matcher (GrammarCompiler.submit)."""
        if self.grammars is None:
            raise InvalidRequestError("structured output needs the model's tokenizer.json",
                                      param=structure.param)
        return self.grammars.submit(structure)

    def resolve(self, choices: list[AdapterChoice] | None) -> tuple[AdapterSet, str]:
        try:
            return self.adapters.resolve(choices), ""
        except AdapterNotFoundError as e:
            if not self.fallback_to_base:
                raise
            return AdapterSet(), f"adapter {e.name!r} is not available; served by the base model"
