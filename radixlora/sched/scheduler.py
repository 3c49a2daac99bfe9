"""The scheduler: decides every step's batch and owns all bookkeeping (waiting queue, KV pages,
radix tree, adapter residency); it never touches device tensors. The offline Engine and the
scheduler process drive the same class through the StepLoop: schedule() -> BatchPlan, whose
StepPlan an executor runs, then process_results() folds the sampled tokens back in.

Overlap: step N+1 may be planned before step N's results are in. Planning commits optimistically
(KV positions are reserved and kv_len advanced when planned); a token step N samples is "pending"
and step N+1 feeds it as a placeholder, -1 - i for the i-th sampled token of step N, which the
model runner replaces on the device. A grammar's mask for step N+1 needs that token too: the
item is planned with its mask to come (late_mask), which the StepLoop computes once step N is
folded, while step N+1's forward runs, and the worker samples step N+1 only then. Results of
requests finished, aborted or retracted after a plan was made are dropped (the plan item's
epoch no longer matches). This is safe because the worker runs plans in order: KV slots or
adapter rows freed while a step is in flight are written again only by later steps."""

from __future__ import annotations

import enum
import functools
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from radixlora.config import DENSE_GROUPS, EngineConfig
from radixlora.errors import InvalidRequestError
from radixlora.lora.adapter import LoraAdapter
from radixlora.sampling_params import banned_tokens, bans_after_newest, penalized
from radixlora.sched.kv_allocator import KVAllocator
from radixlora.sched.radix_cache import RadixCache
from radixlora.sched.request import Req, ReqStatus
from radixlora.sched.residency import AdapterResidency, ReaderView
from radixlora.sched.step_budget import StepCosts
from radixlora.sched.token_bucket import SwapCap
from radixlora.step_plan import AdapterLoad, GroupRows, PlanItem, StepPlan, ids_to_bytes
from radixlora.structured import next_token_masks

AGING_STEPS = 64
# finish_reason of a request whose sampled token's logprob was NaN or infinite: its logits were
# not finite (an adapter whose weights blow up the activations), so it ends without the token
NON_FINITE_LOGITS = "non_finite_logits"
# Share of a running request's remaining max_tokens kept free when admitting new work, so that
# admissions do not immediately force retractions (retraction stays the fallback).
DECODE_RESERVE_RATIO = 0.3
# Rank rows of prefetch loads one step may start (at least one adapter, whatever its rank): 64
# rows are eight rank-8 adapters, about 0.3 GB and 7-13 ms of host-to-device copy for an
# 8B-shaped model, well inside a step of a busy batch, so the copies overlap the forwards.
PREFETCH_ROWS_PER_STEP = 64


@dataclass
class ScheduledReq:
    req: Req
    extend_ids: np.ndarray  # tokens whose KV this step computes
    start: int  # position of extend_ids[0]
    sample: bool  # True when this step completes the fill, so a token is sampled
    epoch: int = 0  # req.num_retractions when planned; a mismatch marks a stale result
    out_index: int = 0  # index in req.output_ids of the token it samples
    # prompt logprobs: positions score_from, score_from + 1, ... of this chunk predict these ids
    score_from: int = 0
    score_ids: np.ndarray | None = None
    late_mask: bool = False  # its grammar's mask is sent once its newest token is folded


@dataclass
class BatchPlan:
    """One step as the scheduler keeps it (live Reqs); the worker gets its StepPlan."""

    items: list[ScheduledReq]
    adapter_loads: list[tuple[LoraAdapter, np.ndarray]] = field(default_factory=list)
    # loads for waiting requests, ahead of their turn; no item of this plan reads their rows
    prefetch_loads: list[tuple[LoraAdapter, np.ndarray]] = field(default_factory=list)
    lora_rows: dict[tuple, dict[str, GroupRows]] = field(default_factory=dict)  # by set key
    made_at: int = 0  # the scheduler's step count when it made this plan
    # what the step costs (radixlora.sched.step_budget): the KV its attention reads, its
    # decoding requests, its prefill tokens
    context_tokens: int = 0
    decodes: int = 0
    prefill_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(item.extend_ids) for item in self.items)

    def to_step_plan(self, step: int) -> StepPlan:
        index = {key: i for i, key in enumerate(self.lora_rows)}
        structured = [k for k, item in enumerate(self.items)
                      if item.sample and item.req.grammar is not None and not item.late_mask]
        masks = dict(zip(structured, next_token_masks([self.items[k].req.grammar
                                                       for k in structured])))
        items = [
            PlanItem(
                extend_len=len(item.extend_ids),
                start=item.start,
                sample=item.sample,
                params=item.req.params,
                seed=item.req.seed,
                out_index=item.out_index,
                adapter_set=index[item.req.adapter_set.key],
                score_from=item.score_from,
                score_ids=None if item.score_ids is None else ids_to_bytes(item.score_ids),
                allowed=masks.get(k),
                late_mask=item.late_mask,
                banned=_banned(item),
                **_penalty_history(item),
            )
            for k, item in enumerate(self.items)
        ]
        input_ids = np.concatenate([item.extend_ids for item in self.items])
        kv_slots = np.concatenate(
            [item.req.kv_slots[: item.start + len(item.extend_ids)] for item in self.items])
        return StepPlan(step=step, items=items, input_ids=ids_to_bytes(input_ids),
                        kv_slots=ids_to_bytes(kv_slots),
                        adapter_loads=_adapter_loads(self.adapter_loads),
                        prefetch_loads=_adapter_loads(self.prefetch_loads),
                        adapter_sets=list(self.lora_rows.values()))




def _banned(item: ScheduledReq) -> bytes | None:
    """PlanItem.banned of a sampling item with bad words: what they ban after its output so
    far (a request whose bans depend on its newest token is planned only once it is folded)."""
    params = item.req.params
    if not item.sample or not params.bad_words_ids:
        return None
    return ids_to_bytes(banned_tokens(params, item.req.output_ids))


def _penalty_history(item: ScheduledReq) -> dict[str, bytes]:
    """PlanItem.output_ids and prompt_ids of a sampling item with penalties."""
    params = item.req.params
    if not (item.sample and penalized(params)):
        return {}
    out = {"output_ids": ids_to_bytes(np.asarray(item.req.output_ids, np.int32))}
    if params.repetition_penalty != 1.0:
        out["prompt_ids"] = ids_to_bytes(item.req.prompt_ids)
    return out


def _adapter_loads(loads: list[tuple[LoraAdapter, np.ndarray]]) -> list[AdapterLoad]:
    return [AdapterLoad(adapter_id=a.adapter_id, name=a.name, path=a.path,
                        rows=ids_to_bytes(rows)) for a, rows in loads]


def _note_costs(plan: BatchPlan) -> None:
    """The plan's KV read, decoding requests and prompt tokens (before its items' kv_len
    advance), for the step budget's cost model."""
    for item in plan.items:
        req = item.req
        plan.context_tokens += req.kv_len + len(item.extend_ids)
        if req.decoding:
            plan.decodes += 1
        else:
            plan.prefill_tokens += len(item.extend_ids)


class Scheduler:
    def __init__(self, config: EngineConfig, max_context: int,
                 groups: Sequence[str] = DENSE_GROUPS):
        """groups: the module groups of the base's adapter pool (ModelConfig.lora_groups)."""
        if not config.sized:
            raise ValueError("the Scheduler needs a sized config (radixlora.worker.sizing; the "
                             "ModelRunner's config)")
        self.config = config
        self.max_context = max_context
        self.kv = KVAllocator(config.kv_pages, config.page_size)
        self.residency = AdapterResidency(config.group_rows(groups))
        self.tree = RadixCache(config.page_size) if config.enable_radix_cache else None
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.step_count = 0
        self.num_retractions = 0
        self.swap_cap: SwapCap | None = None  # hard cap on adapter loads per second
        self.num_swap_deferred = 0  # requests the cap held back in the last schedule()
        self.num_in_flight = 0  # plans made whose results are not folded in yet
        self.num_prefetches = 0  # adapters loaded ahead of the requests that need them
        self.reads = ReaderView()  # the worker's adapter reads and host tier, as reported
        # the steps' measured costs, with --itl-target-ms (the step budget); else None
        self.step_costs = StepCosts() if config.itl_target_ms is not None else None

    # ---- intake ----------------------------------------------------------------------------

    def check_admissible(self, req: Req) -> None:
        """Reject at once what can never be served (instead of letting it wait forever)."""
        prompt_len = len(req.prompt_ids)
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if prompt_len >= self.max_context:
            raise InvalidRequestError(
                f"the prompt ({prompt_len} tokens) leaves no room in the context length "
                f"{self.max_context}: shorten it to at most {self.max_context - 1} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if req.max_total_tokens > self.max_context:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({req.params.max_tokens}) exceeds the "
                f"context length {self.max_context}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if self.kv.pages_for(req.max_total_tokens) > self.kv.num_pages - 1:
            raise InvalidRequestError(
                f"prompt + max_tokens = {req.max_total_tokens} tokens exceeds the whole KV pool "
                f"({self.kv.capacity_tokens} tokens)",
                param="max_tokens",
                code="kv_pool_exceeded",
            )
        oversized = self.residency.oversized(req.adapter_set.adapters)
        if oversized is not None:
            raise InvalidRequestError(oversized, param="adapters")

    def add(self, req: Req) -> None:
        self.check_admissible(req)
        req.arrival_step = self.step_count
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.num_in_flight)

    # ---- batch formation -------------------------------------------------------------------

    def schedule(self) -> BatchPlan | None:
        self.step_count += 1
        self.num_swap_deferred = 0
        budget = self.config.max_batch_tokens
        prefill = self.prefill_budget()
        items = self._schedule_running(budget, prefill)
        budget -= sum(len(i.extend_ids) for i in items)
        if prefill < self.config.max_batch_tokens:
            budget = min(budget, prefill - sum(len(i.extend_ids) for i in items
                                               if not i.req.decoding))
        plan = BatchPlan(items, made_at=self.step_count)
        queue = _WaitingQueue(self)
        reserved = self._admission_room(budget)
        if reserved is not None:
            self._admit_waiting(plan, budget, queue, reserved, hold_unread=True)
            if not plan.items:  # nothing else to run: no request waits for a read
                self._admit_waiting(plan, budget, queue, reserved, hold_unread=False)
        if not plan.items:
            return None
        if self._may_prefetch():
            self._prefetch(plan, queue.order, queue.needs)
        if self.step_costs is not None:
            _note_costs(plan)
        sampled = 0
        for item in plan.items:
            req = item.req
            if req.adapter_set.key not in plan.lora_rows:
                plan.lora_rows[req.adapter_set.key] = self._lora_rows(req)
            req.kv_len += len(item.extend_ids)
            if item.sample:
                item.out_index = len(req.output_ids) + req.pending
                item.late_mask = req.grammar is not None and req.pending > 0
                req.pending += 1
                req.pending_index = sampled
                sampled += 1
        self.num_in_flight += 1
        return plan

    def prefill_budget(self) -> int:
        """Prefill tokens this step may plan: with --itl-target-ms and streams decoding, what
        keeps the step within the target by the measured step costs; else max_batch_tokens."""
        ceiling = self.config.max_batch_tokens
        target = self.config.itl_target_ms
        if self.step_costs is None:
            return ceiling
        decoding = [r for r in self.running if r.decoding]
        if not decoding:
            return ceiling
        context = sum(r.kv_len + 1 for r in decoding)
        return self.step_costs.prefill_budget(context, len(decoding), target / 1000, ceiling)

    def _schedule_running(self, budget: int, prefill: int) -> list[ScheduledReq]:
        wanted: list[tuple[Req, int]] = []
        used = prefilled = 0
        for req in self.running:
            if len(req.output_ids) + req.pending >= req.params.max_tokens:
                continue  # its last token is being sampled
            if req.pending and bans_after_newest(req.params):
                continue  # its next bans need the token being sampled
            n = min(req.remaining_prefill, budget - used)
            if prefill < budget and not req.decoding:  # capped: its prompt tokens count
                n = min(n, prefill - prefilled)
                prefilled += max(n, 0)
            if n > 0:
                wanted.append((req, n))
                used += n
        if self._reserve_all(wanted):
            return [self._item(req, n) for req, n in wanted]
        return self._schedule_running_retracting(budget, prefill)

    def _reserve_all(self, wanted: list[tuple[Req, int]]) -> bool:
        """Reserve the KV of every (request, tokens) at once, evicting cached prefixes if need
        be; False (nothing reserved) if they do not all fit. One allocation for the batch: the
        per-request cost of a decode step is a few list operations."""
        kv = self.kv
        pages = [kv.pages_for(req.kv_len + n) - req.num_slots // kv.page_size
                 for req, n in wanted]
        total = sum(p for p in pages if p > 0)
        if not total:
            return True
        if not kv.can_alloc(total) and self.tree is not None:
            self.tree.evict(total * kv.page_size - kv.free_tokens(), kv.free)
        if not kv.can_alloc(total):
            return False
        slots = kv.alloc(total)
        at = 0
        for (req, _), p in zip(wanted, pages, strict=True):
            if p > 0:
                end = at + p * kv.page_size
                req.append_slots(slots[at:end])
                at = end
        return True

    def _schedule_running_retracting(self, budget: int, prefill: int) -> list[ScheduledReq]:
        """Request by request in admission order, retracting the newest requests while the KV
        for an older one does not fit."""
        items: list[ScheduledReq] = []
        used = prefilled = 0
        for req in list(self.running):
            if req.status is not ReqStatus.RUNNING:
                continue  # retracted while an older request made room
            if len(req.output_ids) + req.pending >= req.params.max_tokens:
                continue  # its last token is being sampled
            if req.pending and bans_after_newest(req.params):
                continue  # its next bans need the token being sampled
            n = min(req.remaining_prefill, budget - used)
            if prefill < budget and not req.decoding:
                n = min(n, prefill - prefilled)
            if n <= 0:
                continue
            while not self._reserve_kv(req, n):
                victim = self._pick_victim()
                self._retract(victim)
                if victim is req:
                    break
            if req.status is ReqStatus.RUNNING:
                items.append(self._item(req, n))
                used += n
                prefilled += 0 if prefill >= budget or req.decoding else n
        return [i for i in items if i.req.status is ReqStatus.RUNNING]

    def _admission_room(self, budget: int) -> int | None:
        """The KV the running requests keep for their decodes, or None when no waiting request
        could be admitted (the gates of _admit_waiting that do not depend on the request),
        checked before the queue is sorted: a saturated batch costs no pass over it."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_running:
            return None
        reserved = sum(self._decode_reserve(r) for r in self.running)
        if self.running and self.free_kv_tokens() <= reserved:
            return None
        return reserved

    def _may_prefetch(self) -> bool:
        """Whether a waiting request's adapter is not resident (else _prefetch has no work)."""
        resident = self.residency.is_resident
        return any(not resident(a.adapter_id) for req in self.waiting
                   for a in req.adapter_set.adapters)

    def _admit_waiting(self, plan: BatchPlan, budget: int, queue: _WaitingQueue,
                       reserved: int, hold_unread: bool) -> None:
        """Admit waiting requests in priority order, each through the admission gates in turn
        (ADMISSION_GATES; reserved: the running requests' decode reserve, _admission_room).
        A gate that holds a request lets later ones go, unless it has waited AGING_STEPS:
        then it stops admissions behind it, so that it is not starved. With hold_unread, a
        request that _needs_read waits while _prefetch loads its adapter, so no step stops for
        a disk read while others can run."""
        room = _Admission(budget, reserved, {r.adapter_set.key for r in self.running},
                          queue.needs, hold_unread)
        for req in queue.order:
            verdict = self._admission_verdict(req, room)
            aged = self.step_count - req.arrival_step >= AGING_STEPS
            if verdict is Gate.STOP or (verdict is Gate.HOLD and aged):
                return
            if verdict is not Gate.PASS:
                continue
            if not self._start(req, plan, room.budget, room.needs):
                return
            room.budget -= len(plan.items[-1].extend_ids)
            room.adapter_sets.add(req.adapter_set.key)
            room.reserved += self._decode_reserve(req)

    def _admission_verdict(self, req: Req, room: _Admission) -> Gate:
        """The first gate's verdict that is not PASS (PASS: admit it)."""
        for gate in ADMISSION_GATES:
            verdict = gate(self, req, room)
            if verdict is not Gate.PASS:
                return verdict
        return Gate.PASS

    def _gate_room(self, req: Req, room: _Admission) -> Gate:
        """The step's token budget, the running limit, and KV for its prompt and decode
        reserve beside the running requests' reserves."""
        if room.budget <= 0 or len(self.running) >= self.config.max_running:
            return Gate.STOP
        need = req.remaining_prefill + self._decode_reserve(req)
        if self.running and self.free_kv_tokens() - room.reserved < need:
            return Gate.STOP
        return Gate.PASS

    def _gate_parent(self, req: Req, room: _Admission) -> Gate:
        """A sample of n waits for its first sibling's prompt to be cached (or finished)."""
        if req.parent is not None and not self._parent_ready(req.parent):
            return Gate.SKIP
        return Gate.PASS

    def _gate_adapter_sets(self, req: Req, room: _Admission) -> Gate:
        """At most max_adapter_sets_per_batch distinct adapter sets, when it is set."""
        limit = self.config.max_adapter_sets_per_batch
        if (limit is not None and req.adapter_set.key not in room.adapter_sets
                and len(room.adapter_sets) >= limit):
            return Gate.HOLD
        return Gate.PASS

    def _gate_rows(self, req: Req, room: _Admission) -> Gate:
        """Pool rows for its adapters (AdapterResidency.can_acquire)."""
        return Gate.PASS if self.residency.can_acquire(req.adapter_set.adapters) else Gate.HOLD

    def _gate_swap_cap(self, req: Req, room: _Admission) -> Gate:
        """The swap cap has tokens for its loads (_swap_allowed)."""
        if self._swap_allowed(req):
            return Gate.PASS
        self.num_swap_deferred += 1
        return Gate.HOLD

    def _gate_unread(self, req: Req, room: _Admission) -> Gate:
        """With hold_unread, its adapter is in the host tier or on the device (_needs_read)."""
        return Gate.HOLD if room.hold_unread and self._needs_read(req) else Gate.PASS

    def _prefetch(self, plan: BatchPlan, order: list[Req], needs: dict[str, int]) -> None:
        """Start loads for the adapters of waiting requests in queue order, ahead of their
        turn, into free rows or rows of adapters no request up to theirs needs (see
        AdapterResidency.prefetch), at most PREFETCH_ROWS_PER_STEP rows a step. Loads take
        swap-cap tokens after this step's admissions; none while the cap holds one back."""
        if self.num_swap_deferred:
            return
        rows = 0
        for position, req in enumerate(order):
            if req.status is not ReqStatus.WAITING:
                continue
            for adapter in req.adapter_set.adapters:
                if self.residency.is_resident(adapter.adapter_id):
                    continue
                if rows and rows + adapter.pool_rows > PREFETCH_ROWS_PER_STEP:
                    return
                cost = self._swap_cost([adapter])
                if self.swap_cap is not None and not self.swap_cap.allows(cost):
                    return
                got = self.residency.prefetch(adapter, needs, position)
                if got is None:
                    return
                if self.swap_cap is not None:
                    self.swap_cap.take(cost)
                plan.prefetch_loads.append((adapter, got))
                self.reads.asked(adapter.adapter_id, plan.made_at)
                rows += adapter.pool_rows
                self.num_prefetches += 1

    def _swap_cost(self, adapters) -> float:
        """Swaps the loads of the non-resident ones among `adapters` cost."""
        if self.swap_cap is None:
            return 0.0
        return sum(self.swap_cap.cost(a) for a in adapters
                   if not self.residency.is_resident(a.adapter_id))

    def _swap_allowed(self, req: Req) -> bool:
        """The swap cap: loads wait for tokens (see SwapCap.allows)."""
        if self.swap_cap is None:
            return True
        cost = self._swap_cost(req.adapter_set.adapters)
        return not cost or self.swap_cap.allows(cost)

    @staticmethod
    def _decode_reserve(req: Req) -> int:
        return int(DECODE_RESERVE_RATIO * (req.params.max_tokens - len(req.output_ids)))

    def _waiting_by_priority(self) -> list[Req]:
        young_after, is_resident = self.step_count - AGING_STEPS, self.residency.is_resident

        def key(req: Req):
            adapters = req.adapter_set.adapters
            resident = not adapters or all(is_resident(a.adapter_id) for a in adapters)
            return (req.arrival_step > young_after, not resident, req.arrival_step)

        return sorted(self.waiting, key=key)

    @staticmethod
    def _parent_ready(parent: Req) -> bool:
        return parent.prompt_cached or parent.status is ReqStatus.FINISHED

    def _start(self, req: Req, plan: BatchPlan, budget: int, needs: dict[str, int]) -> bool:
        """Match the prefix, reserve KV and adapters, move req to running. False if no KV."""
        self._match_prefix(req)
        n = min(req.remaining_prefill, budget)
        if not self._reserve_kv(req, n):
            self._release_kv(req)
            return False
        cost = self._swap_cost(req.adapter_set.adapters)
        loads = self.residency.acquire(req.adapter_set.adapters, needs)
        if loads and self.swap_cap is not None:
            self.swap_cap.take(cost)
        plan.adapter_loads += loads
        self.waiting.remove(req)
        req.status = ReqStatus.RUNNING
        if req.scheduled_at is None:
            req.scheduled_at = time.monotonic()
        self.running.append(req)
        plan.items.append(self._item(req, n))
        return True

    def _item(self, req: Req, n: int) -> ScheduledReq:
        start = req.kv_len
        if start >= len(req.prompt_ids):  # decode / recomputed output: no prompt copy needed
            ids = req.output_ids[start - len(req.prompt_ids) :][:n]
            if len(ids) < n:  # only the newest token can be pending when a step is planned
                ids.append(-1 - req.pending_index)
            extend = np.array(ids, np.int32)
        else:
            extend = req.known_ids[start : start + n]
            if len(extend) < n:
                extend = np.append(extend, np.int32(-1 - req.pending_index))
        item = ScheduledReq(req, extend, start, sample=start + n == req.fill_len,
                            epoch=req.num_retractions)
        if req.logprob_start is not None:
            first = max(start, req.logprob_start - 1)
            end = min(start + n, len(req.prompt_ids) - 1)  # position end predicts token end + 1
            if first < end:
                item.score_from, item.score_ids = first, req.prompt_ids[first + 1 : end + 1]
        return item

    def _lora_rows(self, req: Req) -> dict[str, GroupRows]:
        rows: dict[str, GroupRows] = {}
        for adapter, weight in req.adapter_set.entries:
            group_rows = self.residency.group_rows(adapter.adapter_id)
            for group, rank in adapter.group_ranks.items():
                entry = rows.setdefault(group, GroupRows([], []))
                entry.rows += group_rows[group]
                entry.scales += [weight] * rank
                if group in adapter.dora_groups:  # a DoRA adapter is alone in its set
                    entry.magnitude = self.residency.magnitude_row(adapter.adapter_id)
        return rows

    # ---- KV ----------------------------------------------------------------------------------

    def _match_prefix(self, req: Req) -> None:
        if self.tree is None:
            return
        upto = req.fill_len - 1
        if req.logprob_start is not None:  # scored positions need their logits computed
            upto = min(upto, req.logprob_start - 1)
        match = self.tree.match_prefix(req.namespace, req.known_ids[:upto])
        cached = len(match.kv_slots)
        req.set_slots(match.kv_slots)
        req.kv_len = req.cached_len = cached
        if req.num_retractions == 0:
            req.cached_tokens = cached
        if cached:
            req.last_node = match.last_node
            self.tree.inc_lock_ref(match.last_node)

    def _reserve_kv(self, req: Req, n: int) -> bool:
        need = self.kv.pages_for(req.kv_len + n) - req.num_slots // self.kv.page_size
        if need <= 0:
            return True
        if not self.kv.can_alloc(need) and self.tree is not None:
            self.tree.evict(need * self.kv.page_size - self.kv.free_tokens(), self.kv.free)
        if not self.kv.can_alloc(need):
            return False
        req.append_slots(self.kv.alloc(need))
        return True

    def _release_kv(self, req: Req) -> None:
        """Give back the request's own pages and its lock on the tree."""
        self.kv.free(req.kv_slots[req.cached_len :])
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.set_slots(np.zeros(0, np.int32))
        req.kv_len = req.cached_len = 0
        req.last_node = None

    def _cache_prefix(self, req: Req, num_tokens: int) -> None:
        """Hand the request's first num_tokens (page-aligned) of KV to the radix tree and lock
        the new path instead of the old one; duplicates of already-cached KV are freed."""
        ps = self.kv.page_size
        aligned = num_tokens // ps * ps
        if self.tree is None or aligned <= req.cached_len:
            return
        tokens = req.known_ids[:aligned]
        existing = self.tree.insert(req.namespace, tokens, req.kv_slots[:aligned])
        if existing > req.cached_len:
            self.kv.free(req.kv_slots[req.cached_len : existing])
        match = self.tree.match_prefix(req.namespace, tokens, record_stats=False)
        req.kv_slots[:aligned] = match.kv_slots
        self.tree.inc_lock_ref(match.last_node)
        if req.last_node is not None:
            self.tree.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.cached_len = aligned

    def _pick_victim(self) -> Req:
        return max(self.running, key=lambda r: (r.arrival_step, len(r.output_ids) == 0))

    def _retract(self, req: Req) -> None:
        """Free a running request's KV; it resumes later by recomputing prompt + output so far
        (sampling noise depends only on (seed, step), so its output is unchanged)."""
        self._release_kv(req)
        self.residency.release(a.adapter_id for a in req.adapter_set.adapters)
        self.running.remove(req)
        req.pending = 0
        req.status = ReqStatus.WAITING
        req.input_logprobs.clear()  # recomputed with the prompt
        req.input_top.clear()
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    # ---- results -----------------------------------------------------------------------------

    def process_results(
        self,
        plan: BatchPlan,
        tokens: list[int],
        logprobs: list[float],
        top: list[list[tuple[int, float]]] | None,
        input_logprobs: list[list[float]] | None = None,
        input_top: list[list[list[tuple[int, float]]]] | None = None,
    ) -> list[Req]:
        """Fold one step's sampled tokens (and, for items with scored positions, their prompt
        logprobs, one list per plan item) in; returns the requests that finished. Plans are
        folded in the order they were made."""
        self.num_in_flight -= 1
        finished = []
        sampled = iter(range(len(tokens)))
        for k, item in enumerate(plan.items):
            req = item.req
            i = next(sampled) if item.sample else -1
            if not self.is_live(item):
                continue  # finished, aborted or retracted after the plan was made
            if input_logprobs is not None:
                req.input_logprobs += input_logprobs[k]
            if input_top is not None:
                req.input_top += input_top[k]
            if not item.sample:
                continue
            req.pending -= 1
            if not math.isfinite(logprobs[i]):  # the logits were not: nothing to sample from
                self.abort(req)
                req.finish_reason = NON_FINITE_LOGITS
                finished.append(req)
                continue
            req.output_ids.append(tokens[i])
            req.output_logprobs.append(logprobs[i])
            if req.grammar is not None:
                req.grammar.advance(tokens[i])
            if top is not None and req.params.logprobs:
                req.top_logprobs.append(top[i][: req.params.logprobs])
            if not req.prompt_cached:
                self._cache_prefix(req, len(req.prompt_ids))
                req.prompt_cached = True
            req.check_finished()
            if req.finish_reason is not None:
                self._finish(req)
                finished.append(req)
        return finished

    def _needs_read(self, req: Req) -> bool:
        """Whether admitting req now would make its step wait for a read: an adapter of it is
        being read for a prefetch load, or is neither resident nor in the host tier."""
        return any(self.reads.waits_for_read(a.adapter_id,
                                             self.residency.is_resident(a.adapter_id))
                   for a in req.adapter_set.adapters)

    def discard(self, plan: BatchPlan) -> None:
        """A plan the worker did not run: its live requests go back to waiting and recompute
        (the plan made after it, if any, then holds only stale items for them)."""
        self.num_in_flight -= 1
        for item in plan.items:
            if self.is_live(item):
                self._retract(item.req)

    @staticmethod
    def is_live(item: ScheduledReq) -> bool:
        req = item.req
        return req.status is ReqStatus.RUNNING and item.epoch == req.num_retractions

    def _finish(self, req: Req) -> None:
        self._cache_prefix(req, req.kv_len)
        self._release_kv(req)
        self.residency.release(a.adapter_id for a in req.adapter_set.adapters)
        self.running.remove(req)
        req.status = ReqStatus.FINISHED

    def abort(self, req: Req) -> None:
        if req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        elif req.status is ReqStatus.RUNNING:
            self._release_kv(req)
            self.residency.release(a.adapter_id for a in req.adapter_set.adapters)
            self.running.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = "abort"

    # ---- accounting ----------------------------------------------------------------------------

    def free_kv_tokens(self) -> int:
        """Free KV tokens, counting what the tree could evict."""
        evictable = self.tree.evictable_size() if self.tree is not None else 0
        return self.kv.free_tokens() + evictable

    def flush_cache(self) -> None:
        if self.tree is not None:
            self.tree.evict(self.tree.total_size(), self.kv.free)


class Gate(enum.Enum):
    """An admission gate's verdict on a waiting request."""

    PASS = "pass"  # the next gate decides; past the last one, it is admitted
    SKIP = "skip"  # not now; requests behind it may go
    HOLD = "hold"  # not now; requests behind it may go unless it has aged (then none)
    STOP = "stop"  # no more admissions this step


@dataclass
class _Admission:
    """What one pass of admissions has left and knows (Scheduler._admit_waiting)."""

    budget: int
    reserved: int
    adapter_sets: set
    needs: dict[str, int]
    hold_unread: bool


# in order: a request is admitted when every one passes it
ADMISSION_GATES = (Scheduler._gate_room, Scheduler._gate_parent, Scheduler._gate_adapter_sets,
                   Scheduler._gate_rows, Scheduler._gate_swap_cap, Scheduler._gate_unread)


class _WaitingQueue:
    """The waiting requests in admission order and their adapters' first positions, computed
    on first use within one schedule()."""

    def __init__(self, scheduler: Scheduler):
        self._scheduler = scheduler

    @functools.cached_property
    def order(self) -> list[Req]:
        return self._scheduler._waiting_by_priority()

    @functools.cached_property
    def needs(self) -> dict[str, int]:
        return _queue_needs(self.order)


def _queue_needs(order: list[Req]) -> dict[str, int]:
    """Adapter id -> position in `order` of the first waiting request that needs it."""
    needs: dict[str, int] = {}
    for position, req in enumerate(order):
        for adapter in req.adapter_set.adapters:
            needs.setdefault(adapter.adapter_id, position)
    return needs
