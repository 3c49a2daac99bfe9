"""Request intake, one path for the offline Engine and the scheduler process: the adapter
choice resolved once into an AdapterSet, and the Reqs built (n per prompt) with their cache
namespace and sampling seeds. The prompt and context checks that come before it are in
radixlora.sched.prompt_limits (the tokenizer process and the batch-file runner use them too)."""

from __future__ import annotations

import random
from concurrent.futures import Future

import msgspec
import numpy as np

from radixlora.config import ModelConfig
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
