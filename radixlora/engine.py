"""Offline Engine: one base model, many LoRA adapters, continuous batching in one process.

engine = Engine(model="path/to/hf-model", adapters={"sql": "path/to/peft-adapter"})
outs = engine.generate(["Hello"], SamplingParams(max_tokens=16), adapters=[("sql", 1.0)])
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from radixlora.config import EngineConfig, ModelConfig
from radixlora.errors import AdapterNotFoundError, InvalidRequestError, RadixLoraError
from radixlora.lora.adapter import LoraAdapter, load_adapter
from radixlora.model.loader import base_version
from radixlora.model_runner import ModelRunner
from radixlora.request import AdapterSet, Req, ReqStatus, cache_namespace
from radixlora.sampling import SamplingParams
from radixlora.scheduler import Scheduler
from radixlora.tokenizer import Tokenizer

MAX_ADAPTER_NAME = 128


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    adapters: str
    outputs: list[CompletionOutput] = field(default_factory=list)
    cached_tokens: int = 0


class Engine:
    def __init__(
        self,
        model: str | Path,
        adapters: dict[str, str | Path] | None = None,
        config: EngineConfig | None = None,
        **overrides,
    ):
        self.config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.model_path = Path(model)
        self.model_cfg = ModelConfig.from_dir(self.model_path)
        self.base_version = base_version(self.model_path, self.config.load_format)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        self.runner = ModelRunner(self.model_path, self.model_cfg, self.config)
        self.scheduler = Scheduler(self.config, max_context=self.model_cfg.max_position)
        self.adapters: dict[str, LoraAdapter] = {}
        self._rng = random.Random(self.config.seed)
        self._next_rid = 0
        for name, path in (adapters or {}).items():
            self.load_adapter(name, path)

    # ---- adapters ----------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path) -> LoraAdapter:
        """Validate and register an adapter (re-using a name publishes a new version)."""
        _check_adapter_name(name)
        return self.add_adapter(load_adapter(name, path, self.model_cfg, self.config.max_rank))

    def add_adapter(self, adapter: LoraAdapter) -> LoraAdapter:
        """Register an already validated adapter under adapter.name."""
        name = adapter.name
        if adapter.rank > self.config.adapter_rows:
            raise InvalidRequestError(f"adapter {name!r} of rank {adapter.rank} exceeds the pool")
        previous = self.adapters.get(name)
        self.adapters[name] = adapter
        if previous is not None and previous.adapter_id != adapter.adapter_id:
            self._forget(previous)
        return adapter

    def unload_adapter(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise AdapterNotFoundError(name)
        self._forget(adapter)

    def _forget(self, adapter: LoraAdapter) -> None:
        """Drop an adapter version no name points to: its cache namespaces and, once no running
        request holds it, its pool rows (in-flight requests finish on it first)."""
        if any(a.adapter_id == adapter.adapter_id for a in self.adapters.values()):
            return
        tree = self.scheduler.tree
        if tree is not None:
            tree.drop_namespaces(lambda ns: _uses(ns, adapter.adapter_id), self.scheduler.kv.free)
        self.scheduler.residency.evict(adapter.adapter_id)

    def resolve_adapters(self, spec) -> AdapterSet:
        """None, a name, or a list of names / (name, weight) pairs -> canonical AdapterSet."""
        if spec is None:
            return AdapterSet()
        pairs = [spec] if isinstance(spec, str) else list(spec)
        if len(pairs) > self.config.max_stacked:
            raise InvalidRequestError(
                f"{len(pairs)} adapters requested; at most {self.config.max_stacked} can be "
                "stacked in one request",
                param="adapters",
                code="too_many_adapters",
            )
        resolved, seen = [], set()
        for pair in pairs:
            name, weight = (pair, 1.0) if isinstance(pair, str) else _pair(pair)
            if name not in self.adapters:
                raise AdapterNotFoundError(name)
            if name in seen:
                raise InvalidRequestError(f"adapter {name!r} is named twice", param="adapters")
            seen.add(name)
            resolved.append((self.adapters[name], weight))
        return AdapterSet.of(resolved)

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        adapters=None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt (text or token ids) or a list of them. `adapters` is one spec
        for every prompt, or a list with one spec per prompt (a list of (name, weight) tuples
        is one stacked spec)."""
        prompt_list = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompt_list), SamplingParams)
        specs = _adapter_specs(adapters, len(prompt_list))
        groups = [
            self.make_requests(p, sp, spec, cache_salt)
            for p, sp, spec in zip(prompt_list, params, specs)
        ]
        for group in groups:
            for req in group:
                self.scheduler.check_admissible(req)
        for group in groups:
            for req in group:
                self.scheduler.add(req)
        while self.scheduler.has_work():
            self.step()
        return [self.output_of(group) for group in groups]

    def submit(self, prompt, params: SamplingParams, adapters=None, cache_salt=None) -> list[Req]:
        """Validate and queue one prompt (n requests for n samples) without running; drive it
        with step() and read it with output_of()."""
        reqs = self.make_requests(prompt, params, adapters, cache_salt)
        for req in reqs:
            self.scheduler.check_admissible(req)
        for req in reqs:
            self.scheduler.add(req)
        return reqs

    def step(self) -> list[Req]:
        """Run one scheduler step; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        if plan is None:
            raise RadixLoraError("scheduler made no progress with requests pending")
        out = self.runner.execute(plan)
        return self.scheduler.process_results(plan, out.token_ids, out.logprobs, out.top_logprobs)

    def make_requests(self, prompt, params: SamplingParams, spec, cache_salt) -> list[Req]:
        params.validate(self.model_cfg.vocab_size)
        ids = self._prompt_ids(prompt)
        adapter_set = self.resolve_adapters(spec)
        namespace = cache_namespace(self.base_version, adapter_set, cache_salt)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        reqs: list[Req] = []
        for i in range(params.n):
            reqs.append(
                Req(
                    rid=f"req-{self._next_rid}-{i}",
                    prompt_ids=ids,
                    params=params,
                    adapter_set=adapter_set,
                    namespace=namespace,
                    seed=_sample_seed(base_seed, i),
                    eos_ids=frozenset(self.model_cfg.eos_token_ids),
                    parent=reqs[0] if i and self.scheduler.tree is not None else None,
                )
            )
        self._next_rid += 1
        return reqs

    def _prompt_ids(self, prompt) -> np.ndarray:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer.json; send token ids", param="prompt"
                )
            prompt = self.tokenizer.encode(prompt)
        ids = np.asarray(prompt, dtype=np.int64)
        if ids.ndim != 1:
            raise InvalidRequestError(
                "a prompt must be a string or a flat list of token ids", param="prompt"
            )
        if len(ids) and (ids.min() < 0 or ids.max() >= self.model_cfg.vocab_size):
            raise InvalidRequestError(
                f"token ids must be in [0, {self.model_cfg.vocab_size})", param="prompt"
            )
        return ids.astype(np.int32)

    def output_of(self, group: list[Req]) -> RequestOutput:
        first = group[0]
        out = RequestOutput(
            first.prompt_ids.tolist(), first.adapter_set.label, cached_tokens=first.cached_tokens
        )
        for i, req in enumerate(group):
            assert req.status is ReqStatus.FINISHED
            text = self.tokenizer.decode(req.output_ids) if self.tokenizer else None
            out.outputs.append(
                CompletionOutput(
                    i,
                    list(req.output_ids),
                    text,
                    list(req.output_logprobs),
                    list(req.top_logprobs),
                    req.finish_reason,
                )
            )
        return out


def _check_adapter_name(name) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_ADAPTER_NAME:
        raise InvalidRequestError(
            f"adapter names must be 1-{MAX_ADAPTER_NAME} characters", param="name"
        )
    if any(c in name for c in "/\\:\0") or name in (".", ".."):
        raise InvalidRequestError(
            f"adapter name {name!r} may not contain / \\ : or NUL", param="name"
        )


def _pair(pair) -> tuple[str, float]:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
        raise InvalidRequestError(
            f"an adapter entry must be a name or (name, weight), got {pair!r}", param="adapters"
        )
    weight = pair[1]
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise InvalidRequestError(
            f"adapter weight must be a finite number, got {weight!r}", param="adapters"
        )
    return pair[0], float(weight)


def _uses(namespace: tuple, adapter_id: str) -> bool:
    adapters = dict(namespace).get("adapters", ())
    return any(aid == adapter_id for aid, _ in adapters)


def _sample_seed(seed: int, index: int) -> int:
    return seed if index == 0 else (seed ^ (index * 0x9E3779B97F4A7C15)) & (2**63 - 1)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        return [prompts]
    return prompts


def _per_prompt(value, count: int, kind):
    if isinstance(value, kind):
        return [value] * count
    value = list(value)
    if len(value) != count:
        raise InvalidRequestError(f"expected {count} sampling params, got {len(value)}")
    return value


def _is_stack(spec) -> bool:
    return (
        isinstance(spec, (list, tuple))
        and len(spec) > 0
        and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in spec)
    )


def _adapter_specs(adapters, count: int) -> list:
    if adapters is None or isinstance(adapters, str) or _is_stack(adapters):
        return [adapters] * count
    adapters = list(adapters)
    if len(adapters) != count:
        raise InvalidRequestError(
            f"adapters: got {len(adapters)} specs for {count} prompts", param="adapters"
        )
    return adapters
