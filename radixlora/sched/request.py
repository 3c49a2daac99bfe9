"""A generation request as the scheduler sees it: token ids, adapter set, KV ownership."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

import numpy as np

from radixlora.errors import InvalidRequestError
from radixlora.lora.adapter import LoraAdapter
from radixlora.sampling_params import SamplingParams


@dataclass(frozen=True)
class AdapterSet:
    """Canonical adapter set: (adapter, weight) sorted by adapter id (content hash), so the merge
    order and the cache namespace never depend on the order a request or file events give."""

    entries: tuple[tuple[LoraAdapter, float], ...] = ()

    @classmethod
    def of(cls, pairs: list[tuple[LoraAdapter, float]]) -> AdapterSet:
        return cls(tuple(sorted(pairs, key=lambda p: p[0].adapter_id)))

    @functools.cached_property
    def adapters(self) -> tuple[LoraAdapter, ...]:
        return tuple(a for a, _ in self.entries)

    @functools.cached_property
    def key(self) -> tuple[tuple[str, float], ...]:
        return tuple((a.adapter_id, w) for a, w in self.entries)

    @property
    def label(self) -> str:
        if not self.entries:
            return "base"
        return "+".join(a.name if w == 1.0 else f"{a.name}*{w:g}" for a, w in self.entries)


def cache_namespace(base_version: str, adapter_set: AdapterSet, cache_salt: str | None,
                    lora_dtype: str = "auto") -> tuple:
    """Radix-tree namespace: every component tagged by its kind, so no salt or name can
    impersonate another component; compared in full by the tree, never only by hash. An
    adapter set served from an int8 pool (lora_dtype) computes other KV than from the
    model-dtype pool, so its namespace says so; the base model's does not depend on it."""
    namespace = (("base", base_version), ("adapters", adapter_set.key), ("salt", cache_salt or ""))
    if adapter_set.entries and lora_dtype != "auto":
        namespace += (("adapter_pool", lora_dtype),)
    return namespace


def uses_adapter(namespace: tuple, adapter_id: str) -> bool:
    """Whether a cache namespace belongs to an adapter set holding this adapter version."""
    return any(aid == adapter_id for aid, _ in dict(namespace).get("adapters", ()))


def build_requests(
    rid: str,
    prompt_ids: np.ndarray,
    params: SamplingParams,
    adapter_set: AdapterSet,
    namespace: tuple,
    base_seed: int,
    eos_ids: frozenset[int],
    share_prompt: bool,
) -> list[Req]:
    """The params.n requests of one prompt; with share_prompt, siblings wait for the first
    one's prompt KV to enter the radix cache and reuse it."""
    reqs: list[Req] = []
    for i in range(params.n):
        reqs.append(
            Req(
                rid=f"{rid}#{i}",
                prompt_ids=prompt_ids,
                params=params,
                adapter_set=adapter_set,
                namespace=namespace,
                seed=sample_seed(base_seed, i),
                eos_ids=eos_ids,
                parent=reqs[0] if i and share_prompt else None,
            )
        )
    return reqs


def check_logprob_start(start: int | None, prompt_len: int) -> None:
    """Prompt logprobs start at a position >= 1 (position 0 has no context) inside the prompt."""
    if start is not None and not 1 <= start <= prompt_len:
        raise InvalidRequestError(f"logprob_start must be in [1, {prompt_len}], got {start}",
                                  param="logprob_start")


def sample_seed(seed: int, index: int) -> int:
    """Seed of the index-th sample of a request seeded with `seed`."""
    return seed if index == 0 else (seed ^ (index * 0x9E3779B97F4A7C15)) & (2**63 - 1)


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: np.ndarray  # int32
    params: SamplingParams
    adapter_set: AdapterSet
    namespace: tuple
    seed: int
    eos_ids: frozenset[int]
    arrival_step: int = 0
    parent: Req | None = None  # an n > 1 sibling waits until the parent's prompt is cached
    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    slot_buf: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    num_slots: int = 0  # slots held (whole pages); slot_buf grows geometrically
    kv_len: int = 0  # tokens whose KV is computed or being computed by a planned step
    # Tokens sampled by planned steps whose results are not folded in yet (overlap scheduling);
    # the newest one is the pending_index-th sampled token of the plan in flight.
    pending: int = 0
    pending_index: int = 0
    cached_len: int = 0  # leading kv_slots owned by the radix tree (locked through last_node)
    last_node: object = None
    prompt_cached: bool = False
    cached_tokens: int = 0  # prefix tokens served from the cache at first admission
    scheduled_at: float | None = None  # time.monotonic() of its first admission
    finish_reason: str | None = None
    num_retractions: int = 0
    # Prompt logprobs: logprob of prompt_ids[i] given prompt_ids[:i] for i >= logprob_start,
    # filled in during prefill (prefix-cache matches stop before position logprob_start - 1).
    logprob_start: int | None = None
    input_logprobs: list[float] = field(default_factory=list)
    input_top: list[list[tuple[int, float]]] = field(default_factory=list)  # with k > 0
    # structured output (radixlora.structured.Matcher): advanced with each folded token; the
    # request is planned to sample only once its newest token is folded
    grammar: object = None

    @property
    def kv_slots(self) -> np.ndarray:
        """KV slot of every position this request holds (a view: writes go through)."""
        return self.slot_buf[: self.num_slots]

    def set_slots(self, slots: np.ndarray) -> None:
        self.slot_buf = np.array(slots, dtype=np.int32)
        self.num_slots = len(slots)

    def append_slots(self, slots: np.ndarray) -> None:
        end = self.num_slots + len(slots)
        if end > len(self.slot_buf):
            grown = np.zeros(max(end, 2 * len(self.slot_buf)), np.int32)
            grown[: self.num_slots] = self.kv_slots
            self.slot_buf = grown
        self.slot_buf[self.num_slots : end] = slots
        self.num_slots = end

    @property
    def known_ids(self) -> np.ndarray:
        """Prompt and output tokens known so far (pending ones are not)."""
        if not self.output_ids:
            return self.prompt_ids
        return np.concatenate([self.prompt_ids, np.asarray(self.output_ids, np.int32)])

    @property
    def fill_len(self) -> int:
        """Tokens whose KV must exist before the next token is sampled, pending ones included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def remaining_prefill(self) -> int:
        return self.fill_len - self.kv_len

    @property
    def decoding(self) -> bool:
        """Its prompt's KV is complete and a step computes only its newest token."""
        return self.kv_len >= len(self.prompt_ids) and self.remaining_prefill <= 1

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def check_finished(self) -> None:
        token = self.output_ids[-1]
        if (
            not self.params.ignore_eos
            and token in self.eos_ids
            or token in self.params.stop_token_ids
        ):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish_reason = "length"
