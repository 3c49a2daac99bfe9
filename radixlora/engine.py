"""Offline Engine: one base model, many LoRA adapters, continuous batching in one process.

engine = Engine(model="path/to/hf-model", adapters={"sql": "path/to/peft-adapter"})
outs = engine.generate(["Hello"], SamplingParams(max_tokens=16), adapters=[("sql", 1.0)])
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from radixlora.config import EngineConfig, ModelConfig
from radixlora.errors import AdapterError, InvalidRequestError, RadixLoraError
from radixlora.lora.adapter import LoraAdapter
from radixlora.model.checkpoint_files import base_version
from radixlora.sampling_params import SamplingParams
from radixlora.sched.adapter_choice import parse_spec
from radixlora.sched.adapter_registry import AdapterRegistry
from radixlora.sched.grammar_compiler import GrammarCompiler
from radixlora.sched.intake import Intake
from radixlora.sched.prompt_limits import check_prompt_ids
from radixlora.sched.request import AdapterSet, Req, ReqStatus, uses_adapter
from radixlora.sched.scheduler import Scheduler
from radixlora.sched.step_loop import StepLoop
from radixlora.startup import phase_line
from radixlora.step_plan import AdapterLoad
from radixlora.text.detokenize import StopStream
from radixlora.text.tokenizer import Tokenizer
from radixlora.worker.executor import StepExecutor
from radixlora.worker.model_runner import ModelRunner
from radixlora.worker.sizing import with_start_adapters

log = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None
    # finish_reason "stop": the stop string matched, else the token that stopped it (EOS or
    # one of stop_token_ids), as the server's matched_stop
    stop_reason: str | int | None = None


@dataclass
class _StopState:
    """Stop strings of one sample, applied as the server's tokenizer process applies them
    (StopStream); a match aborts the request."""

    stream: StopStream
    seen: int = 0  # output tokens fed so far
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    adapters: str
    outputs: list[CompletionOutput] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)  # from logprob_start on
    # adapters trained on another base weight format than the served base's, served under
    # qlora_mismatch "serve": "name: trained on a nf4 base, served on a dense base"; else ""
    base_mismatch: str = ""


class Engine:
    def __init__(
        self,
        model: str | Path,
        adapters: dict[str, str | Path] | None = None,
        config: EngineConfig | None = None,
        **overrides,
    ):
        started = time.perf_counter()
        self.config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.model_path = Path(model)
        self.model_cfg = ModelConfig.from_dir(self.model_path).served(self.config)
        self.base_version = base_version(self.model_path, self.config.load_format)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        self.config = with_start_adapters(self.config, (adapters or {}).values(), self.model_cfg)
        self.runner = ModelRunner(self.model_path, self.model_cfg, self.config)
        self.runner.warm_up()
        self.config = self.runner.config  # pools and batch limits sized
        self.scheduler = Scheduler(self.config, self.config.max_context(self.model_cfg),
                                   self.model_cfg.lora_groups)
        self.registry = AdapterRegistry(
            self.model_cfg, self.config.max_rank, self.config.max_stacked, self.config.adapter_rows
        )
        self.intake = Intake(self.model_cfg, self.base_version, self.registry, self.scheduler,
                             self.config.seed, grammars=GrammarCompiler.for_model(
                                 self.model_path, self.model_cfg, self.config))
        self.loop = StepLoop(self.scheduler, self.config.overlap_schedule)
        # every adapter version a name or a live request still holds, for the executor's loads
        self._versions: weakref.WeakValueDictionary[str, LoraAdapter] = (
            weakref.WeakValueDictionary())
        self.executor = StepExecutor(self.runner, self._version)
        self._next_rid = 0
        self._stops: weakref.WeakKeyDictionary[Req, _StopState] = weakref.WeakKeyDictionary()
        with self.runner.phase("adapters"):
            for adapter in self.registry.load_all(adapters or {}):
                self._versions[adapter.adapter_id] = adapter
        log.info(phase_line(time.perf_counter() - started, self.runner.phases))

    # ---- adapters ----------------------------------------------------------------------------

    @property
    def adapters(self) -> dict[str, LoraAdapter]:
        return self.registry.by_name

    def load_adapter(self, name: str, path: str | Path) -> LoraAdapter:
        """Validate and register an adapter (re-using a name publishes a new version)."""
        adapter, replaced = self.registry.load(name, path)
        self._versions[adapter.adapter_id] = adapter
        if replaced is not None:
            self._forget(replaced)
        return adapter

    def add_adapter(self, adapter: LoraAdapter) -> LoraAdapter:
        """Register an already validated adapter under adapter.name."""
        adapter, replaced = self.registry.add(adapter)
        self._versions[adapter.adapter_id] = adapter
        if replaced is not None:
            self._forget(replaced)
        return adapter

    def unload_adapter(self, name: str) -> None:
        self._forget(self.registry.remove(name))

    def _forget(self, adapter: LoraAdapter) -> None:
        """Drop an adapter version no name points to: its cache namespaces and, once no running
        request holds it, its pool rows (in-flight requests finish on it first)."""
        if self.registry.is_named(adapter.adapter_id):
            return
        tree = self.scheduler.tree
        if tree is not None:
            tree.drop_namespaces(lambda ns: uses_adapter(ns, adapter.adapter_id),
                                 self.scheduler.kv.free)
        self.scheduler.residency.evict(adapter.adapter_id)

    def _version(self, load: AdapterLoad) -> LoraAdapter:
        return self._versions[load.adapter_id]

    def resolve_adapters(self, spec) -> AdapterSet:
        """None, a name, or a list of names / (name, weight) pairs -> canonical AdapterSet."""
        return self.registry.resolve(parse_spec(spec))

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
                self.scheduler.add(req)
        while self.scheduler.has_work():
            self.step()
        return [self.output_of(group) for group in groups]

    def submit(
        self, prompt, params: SamplingParams, adapters=None, cache_salt=None,
        logprob_start: int | None = None,
    ) -> list[Req]:
        """Validate and queue one prompt (n requests for n samples) without running; drive it
        with step() and read it with output_of(). With logprob_start, each request also gets
        the logprob of every prompt token from that position on (req.input_logprobs)."""
        reqs = self.make_requests(prompt, params, adapters, cache_salt, logprob_start)
        for req in reqs:
            self.scheduler.add(req)
        return reqs

    def score(self, prompts, logprob_start: int | list[int], adapters=None,
              cache_salt: str | None = None) -> list[list[float]]:
        """For each prompt (text or token ids), the logprob of each token from position
        logprob_start (>= 1) on, given all tokens before it: one prefill through the scheduler
        (chunked, batched with other work, reusing and filling the prefix cache), no output."""
        prompt_list = _as_prompt_list(prompts)
        starts = _per_prompt(logprob_start, len(prompt_list), int)
        specs = _adapter_specs(adapters, len(prompt_list))
        params = SamplingParams(max_tokens=1, seed=0)
        reqs = [
            self.submit(p, params, spec, cache_salt, start)[0]
            for p, start, spec in zip(prompt_list, starts, specs)
        ]
        while self.scheduler.has_work():
            self.step()
        return [list(req.input_logprobs) for req in reqs]

    def step(self) -> list[Req]:
        """Run one scheduler step; returns the requests that finished in it. With overlap
        scheduling the step planned now is launched before the previous one's results are
        folded in, so the host plans while the device computes."""
        plan = self.loop.next_plan()
        if plan is None and not self.executor.in_flight:
            raise RadixLoraError("scheduler made no progress with requests pending")
        if plan is not None:
            self.executor.submit(plan)
        keep = 1 if plan is not None and self.config.overlap_schedule else 0
        finished = []
        while results := self.executor.collect(keep):  # a fold may let a waiting step sample
            for result in results:
                finished += self._fold(result)
        return finished

    def _fold(self, result) -> list[Req]:
        folded = self.loop.fold(result)
        if folded.masks is not None:
            self.executor.give_masks(folded.masks)
        for adapter_id in folded.invalid_adapters:
            adapter = self._versions.get(adapter_id)
            raise AdapterError(adapter.name if adapter else adapter_id[:12],
                               folded.failed_adapters[adapter_id])
        if folded.error is not None or folded.failed_adapters:
            raise RadixLoraError(f"step {result.step} did not run: "
                                 f"{folded.error or folded.failed_adapters}")
        for req in folded.sampled:
            state = self._stops.get(req)
            if state is not None:
                self._apply_stops(req, state)
        return folded.finished

    def _apply_stops(self, req: Req, state: _StopState) -> None:
        """Feed the sample's new tokens to its stop strings; on a match, end it there."""
        new_ids = req.output_ids[state.seen :]
        state.seen = len(req.output_ids)
        _, finish_reason, state.stop_reason = state.stream.step(new_ids, req.finish_reason)
        if isinstance(state.stop_reason, str):  # a stop string matched
            if req.status is not ReqStatus.FINISHED:
                self.scheduler.abort(req)  # frees its KV at once, as the server does
            req.finish_reason = finish_reason

    def make_requests(
        self, prompt, params: SamplingParams, spec, cache_salt, logprob_start: int | None = None
    ) -> list[Req]:
        self._next_rid += 1
        for name, needed in (("stop", params.stop), ("bad_words", params.bad_words)):
            if needed and self.tokenizer is None:
                raise InvalidRequestError(f"{name} needs the model's tokenizer.json",
                                          param=name)
        if params.bad_words and not params.bad_words_ids:
            params = msgspec.structs.replace(
                params, bad_words_ids=self.tokenizer.bad_words_ids(params.bad_words))
        reqs, _ = self.intake.requests(f"req-{self._next_rid}", self._prompt_ids(prompt),
                                       params, parse_spec(spec), logprob_start, cache_salt)
        if params.stop:
            for req in reqs:
                self._stops[req] = _StopState(StopStream(self.tokenizer, list(params.stop),
                                                         min_tokens=params.min_tokens))
        return reqs

    def _prompt_ids(self, prompt) -> np.ndarray:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer.json; send token ids", param="prompt"
                )
            prompt = self.tokenizer.encode(prompt)
        return check_prompt_ids(prompt, self.model_cfg.vocab_size)

    def output_of(self, group: list[Req]) -> RequestOutput:
        first = group[0]
        out = RequestOutput(
            first.prompt_ids.tolist(),
            first.adapter_set.label,
            cached_tokens=first.cached_tokens,
            prompt_logprobs=list(first.input_logprobs),
            base_mismatch="; ".join(f"{a.name}: {a.base_mismatch}"
                                    for a in first.adapter_set.adapters if a.base_mismatch),
        )
        for i, req in enumerate(group):
            assert req.status is ReqStatus.FINISHED
            state = self._stops.get(req)
            if state is not None:
                text, stop_reason = state.stream.matcher.text, state.stop_reason
            else:
                text = self.tokenizer.decode(req.output_ids) if self.tokenizer else None
                stop_reason = req.output_ids[-1] if req.finish_reason == "stop" else None
            out.outputs.append(
                CompletionOutput(
                    i,
                    list(req.output_ids),
                    text,
                    list(req.output_logprobs),
                    list(req.top_logprobs),
                    req.finish_reason,
                    stop_reason,
                )
            )
        return out


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
