"""Batches limited by the adapter pool's rows, not by a count of adapters, and adapter loads
started ahead of need (prefetch): the scheduler driven directly with fake adapters (batch
width, prefetch order and bound, eviction order, the swap cap, and a state machine over
arrivals, steps, results, aborts and evictions checking rows, refs and the rows a step reads),
then the offline Engine with a small pool against one holding every adapter."""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixlora import Engine, SamplingParams
from radixlora.config import EngineConfig, ModelConfig
from radixlora.errors import AdapterError, RadixLoraError
from radixlora.lora.adapter import LoraAdapter
from radixlora.lora.host_cache import HostAdapterCache, PackedAdapter
from radixlora.sched.request import AdapterSet, Req, ReqStatus, cache_namespace
from radixlora.sched.residency import AdapterResidency
from radixlora.sched.scheduler import AGING_STEPS, BatchPlan, Scheduler
from radixlora.sched.token_bucket import SwapCap
from radixlora.step_plan import GroupRows, bytes_to_ids
from radixlora.worker.adapter_pool import AdapterPool
from scripts.checkpoints import TINY_CONFIG, build_tiny_adapter, build_tiny_model
from tests.conftest import assert_all_free


def fake_adapter(k: int, rank: int = 1) -> LoraAdapter:
    return LoraAdapter(name=f"a{k}", path=f"/nowhere/a{k}", content_hash=f"{k:064x}",
                       rank=rank, group_ranks={"qkv": rank, "down": rank}, weights={})


def make_scheduler(rows: int, max_running: int = 256, **kw) -> Scheduler:
    config = EngineConfig(kv_pages=8192, adapter_rows=rows, max_running=max_running,
                          max_batch_tokens=kw.pop("max_batch_tokens", 4096),
                          host_adapter_bytes=0, **kw)
    return Scheduler(config, max_context=1024)


def make_req(rid: str, adapters: list[LoraAdapter], prompt_len: int = 4,
             max_tokens: int = 3) -> Req:
    adapter_set = AdapterSet.of([(a, 1.0) for a in adapters])
    return Req(rid=rid, prompt_ids=np.arange(3, 3 + prompt_len, dtype=np.int32),
               params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
               adapter_set=adapter_set, namespace=cache_namespace("base", adapter_set, None),
               seed=0, eos_ids=frozenset())


def fold(sched: Scheduler, plan: BatchPlan, unread: list[str] = ()) -> list[Req]:
    """The step loop's fold of plan's result; `unread`: the prefetch reads it says have not
    ended (none: an executor whose reads end at once)."""
    sched.reads.note_reads(plan.made_at, list(unread))
    n = sum(item.sample for item in plan.items)
    return sched.process_results(plan, [7] * n, [0.0] * n, None)


def loaded_ids(loads) -> list[str]:
    return [a.adapter_id for a, _ in loads]


# ---- batch width ---------------------------------------------------------------------------


def test_batch_holds_more_distinct_adapters_than_32_when_rows_allow():
    adapters = [fake_adapter(k, rank=1 + k % 2) for k in range(48)]
    sched = make_scheduler(rows=sum(a.rank for a in adapters))
    for k, a in enumerate(adapters):
        sched.add(make_req(f"r{k}", [a]))
    plan = sched.schedule()
    assert len(plan.items) == 48 and len(plan.lora_rows) == 48
    assert len(plan.adapter_loads) == 48 and not plan.prefetch_loads


def test_admission_keeps_the_running_batch_full():
    """While requests wait and KV allows, every step runs max_running requests: each one that
    finishes is replaced in the next plan."""
    sched = make_scheduler(rows=8, max_running=8)
    for k in range(40):
        sched.add(make_req(f"r{k}", [], prompt_len=3 + k % 5, max_tokens=1 + k % 7))
    sizes = []
    while sched.has_work():
        plan = sched.schedule()
        if sched.waiting:
            sizes.append(len(plan.items))
        fold(sched, plan)
    assert sizes and set(sizes) == {8}


def test_a_full_batch_is_planned_without_a_pass_over_the_waiting_queue(monkeypatch):
    """With the running batch at max_running, planning neither sorts the waiting requests nor
    scans them for prefetches, and a decode step reserves its KV in one allocation: the
    per-step cost follows the running batch, not the queue."""
    sched = make_scheduler(rows=8, max_running=8)
    for k in range(200):
        sched.add(make_req(f"r{k}", [], max_tokens=50))
    fold(sched, sched.schedule())
    calls = {"sort": 0, "alloc": 0}

    def counted(name, fn):
        def wrapper(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return wrapper

    monkeypatch.setattr(sched, "_waiting_by_priority", counted("sort", sched._waiting_by_priority))
    monkeypatch.setattr(sched.kv, "alloc", counted("alloc", sched.kv.alloc))
    for _ in range(5):
        plan = sched.schedule()
        assert [len(i.extend_ids) for i in plan.items] == [1] * 8
        fold(sched, plan)
    assert calls == {"sort": 0, "alloc": 5}
    assert len(sched.waiting) == 192


def test_small_pool_limits_the_batch_by_rows():
    adapters = [fake_adapter(k, rank=2) for k in range(48)]
    sched = make_scheduler(rows=20)
    for k, a in enumerate(adapters):
        sched.add(make_req(f"r{k}", [a]))
    plan = sched.schedule()
    assert len(plan.lora_rows) == 10  # 20 rows of rank-2 adapters
    assert sched.residency.rows.num_free() == 0


def test_count_cap_is_optional_and_validated():
    adapters = [fake_adapter(k) for k in range(12)]
    sched = make_scheduler(rows=64, max_adapter_sets_per_batch=5)
    for k, a in enumerate(adapters):
        sched.add(make_req(f"r{k}", [a]))
    assert len(sched.schedule().lora_rows) == 5
    assert EngineConfig().max_adapter_sets_per_batch is None
    with pytest.raises(ValueError, match="max_adapter_sets_per_batch"):
        EngineConfig(max_adapter_sets_per_batch=0)


def test_resident_adapters_go_first_and_aging_bounds_the_wait():
    """A request whose adapter needs rows held by running requests waits while requests on
    resident adapters keep coming, but no longer than AGING_STEPS (then it blocks admissions
    until rows free up)."""
    hot, cold = fake_adapter(1, rank=4), fake_adapter(2, rank=4)
    sched = make_scheduler(rows=4, max_running=8)
    sched.add(make_req("first", [hot], max_tokens=2))
    fold(sched, sched.schedule())
    starved = make_req("cold", [cold], max_tokens=2)
    sched.add(starved)
    admitted_at = None
    for step in range(4 * AGING_STEPS):
        sched.add(make_req(f"hot{step}", [hot], max_tokens=2))
        plan = sched.schedule()
        if plan is not None:
            fold(sched, plan)
        if admitted_at is None and starved.status is not ReqStatus.WAITING:
            admitted_at = step
    assert admitted_at is not None and admitted_at <= AGING_STEPS + 4
    while sched.has_work():
        fold(sched, sched.schedule())
    assert starved.status is ReqStatus.FINISHED


# ---- prefetch --------------------------------------------------------------------------------


def test_prefetch_loads_queued_adapters_in_queue_order_bounded_per_step(monkeypatch):
    monkeypatch.setattr("radixlora.sched.scheduler.PREFETCH_ROWS_PER_STEP", 3)
    adapters = [fake_adapter(k) for k in range(12)]
    sched = make_scheduler(rows=16, max_running=2)
    reqs = [make_req(f"r{k}", [a], max_tokens=4) for k, a in enumerate(adapters)]
    for req in reqs:
        sched.add(req)
    first = sched.schedule()
    assert loaded_ids(first.adapter_loads) == [a.adapter_id for a in adapters[:2]]
    assert loaded_ids(first.prefetch_loads) == [a.adapter_id for a in adapters[2:5]]
    step_plan = first.to_step_plan(1)
    assert [load.adapter_id for load in step_plan.prefetch_loads] == loaded_ids(
        first.prefetch_loads)
    assert all(reqs[k].status is ReqStatus.WAITING for k in range(2, 12))
    read = {r for groups in step_plan.adapter_sets for g in groups.values() for r in g.rows}
    for load in step_plan.prefetch_loads:  # no item of the plan reads a prefetched row
        assert read.isdisjoint(bytes_to_ids(load.rows).tolist())
    second = sched.schedule()  # overlap: planned before the first's results
    assert loaded_ids(second.prefetch_loads) == [a.adapter_id for a in adapters[5:8]]
    fold(sched, first)
    fold(sched, second)
    while reqs[2].status is ReqStatus.WAITING:
        plan = sched.schedule()
        assert not plan.adapter_loads  # every admitted adapter was prefetched before
        fold(sched, plan)
    assert sched.num_prefetches >= 8
    while sched.has_work():
        fold(sched, sched.schedule())
    assert all(r.status is ReqStatus.FINISHED for r in reqs)


def test_requests_wait_for_their_prefetch_reads_while_other_work_runs():
    """A request whose adapter is still being read for a prefetch load is not scheduled while
    other requests run (its step would stop for the read); it is once the read ended or once
    nothing else can run. Aged, it still waits for the read, and stops admissions behind it."""
    a, b = fake_adapter(0), fake_adapter(1)
    sched = make_scheduler(rows=4, max_running=2)
    long = make_req("long", [a], max_tokens=2 * AGING_STEPS)
    short, held = make_req("short", [a], max_tokens=1), make_req("held", [b], max_tokens=1)
    for req in (long, short, held):
        sched.add(req)
    first = sched.schedule()
    assert [i.req.rid for i in first.items] == ["long", "short"]
    assert loaded_ids(first.prefetch_loads) == [b.adapter_id]
    fold(sched, first, unread=[b.adapter_id])  # short finishes: a slot is free
    second = sched.schedule()
    assert [i.req.rid for i in second.items] == ["long"] and held.status is ReqStatus.WAITING
    fold(sched, second)  # the read has ended
    third = sched.schedule()
    assert [i.req.rid for i in third.items] == ["long", "held"] and not third.adapter_loads

    lone = make_scheduler(rows=4, max_running=2)  # nothing else to run: no wait
    waiting = [make_req("r0", [a], max_tokens=1), make_req("r1", [a], max_tokens=1),
               make_req("r2", [b], max_tokens=1)]
    for req in waiting:
        lone.add(req)
    plan = lone.schedule()
    fold(lone, plan, unread=[b.adapter_id])
    assert [i.req.rid for i in lone.schedule().items] == ["r2"]

    aged = make_scheduler(rows=4, max_running=2)
    for req in (make_req("long", [a], max_tokens=4 * AGING_STEPS),
                make_req("short", [a], max_tokens=1), make_req("held", [b], max_tokens=1)):
        aged.add(req)
    for _ in range(AGING_STEPS + 1):
        fold(aged, aged.schedule(), unread=[b.adapter_id])
    held = next(r for r in aged.waiting if r.rid == "held")
    behind = make_req("behind", [a], max_tokens=1)
    aged.add(behind)
    plan = aged.schedule()
    assert [i.req.rid for i in plan.items] == ["long"] and behind.status is ReqStatus.WAITING
    fold(aged, plan)  # the read has ended
    assert [i.req.rid for i in aged.schedule().items] == ["long", "held"]


def test_requests_on_adapters_only_on_disk_wait_for_a_prefetch_read():
    """A request whose adapter is neither resident nor in the executor's host tier (as its
    results report it: note_host) is held beside running work while its adapter is prefetched
    (read in the background), and runs once the read ended; one whose adapter is in the host
    tier is admitted at once, its load a copy."""
    a, on_disk, in_host = fake_adapter(0), fake_adapter(1), fake_adapter(2)
    sched = make_scheduler(rows=8, max_running=4)
    sched.add(make_req("long", [a], max_tokens=8))
    fold(sched, sched.schedule())
    sched.reads.note_host([in_host.adapter_id, on_disk.adapter_id], [])
    sched.reads.note_host([], [on_disk.adapter_id])  # the host tier dropped it again
    sched.add(make_req("disk", [on_disk]))
    sched.add(make_req("host", [in_host]))
    plan = sched.schedule()
    assert [i.req.rid for i in plan.items] == ["long", "host"]
    assert loaded_ids(plan.adapter_loads) == [in_host.adapter_id]
    assert loaded_ids(plan.prefetch_loads) == [on_disk.adapter_id]
    fold(sched, plan, unread=[on_disk.adapter_id])
    plan = sched.schedule()
    assert [i.req.rid for i in plan.items] == ["long", "host"]
    fold(sched, plan)  # the read has ended
    plan = sched.schedule()
    assert [i.req.rid for i in plan.items] == ["long", "host", "disk"]
    assert not plan.adapter_loads


def test_host_cache_reports_what_entered_and_left():
    cache = HostAdapterCache(budget_bytes=64, pin=False)
    packed = [PackedAdapter(f"{k:064x}", {"qkv": 1}, torch.zeros(8)) for k in range(3)]
    mirror: set[str] = set()

    def apply():
        added, dropped = cache.drain_changes()
        mirror.difference_update(dropped)
        mirror.update(added)
        return added, dropped

    cache.put(packed[0])
    cache.put(packed[1])
    assert apply() == ([packed[0].adapter_id, packed[1].adapter_id], [])
    cache.put(packed[2])  # 96 bytes > 64: the oldest leaves
    assert apply() == ([packed[2].adapter_id], [packed[0].adapter_id])
    cache.put(packed[0])  # back in, and packed[1] out, within one drain
    cache.put(packed[1])
    apply()
    assert mirror == set(cache.ids()) and apply() == ([], [])


def test_prefetch_takes_only_free_or_unneeded_rows():
    adapters = [fake_adapter(k, rank=2) for k in range(6)]
    sched = make_scheduler(rows=6, max_running=1)
    for k in (0, 1, 2, 3):
        sched.add(make_req(f"r{k}", [adapters[k]], max_tokens=8))
    plan = sched.schedule()  # r0 runs; r1 and r2 prefetched; no rows for r3
    assert loaded_ids(plan.prefetch_loads) == [adapters[1].adapter_id, adapters[2].adapter_id]
    sched.waiting.clear()  # r1, r2 leave: their adapters are needed by no one now
    sched.add(make_req("r4", [adapters[4]], max_tokens=8))
    plan = sched.schedule()
    assert loaded_ids(plan.prefetch_loads) == [adapters[4].adapter_id]
    assert not sched.residency.is_resident(adapters[1].adapter_id)  # least recently used
    assert sched.residency.is_resident(adapters[2].adapter_id)
    assert sched.residency.refs(adapters[0].adapter_id) == 1  # running: never a victim


def test_eviction_order_unneeded_lru_then_furthest_back_never_pinned_or_referenced():
    residency = AdapterResidency(10)
    a, b, c, d, pinned, new = (fake_adapter(k, rank=2) for k in range(6))
    residency.pin(pinned.adapter_id)
    residency.acquire([pinned, a])
    for adapter in (b, c, d):
        residency.prefetch(adapter, {}, 0)
    residency.release([pinned.adapter_id])
    assert residency.rows.num_free() == 0
    needs = {b.adapter_id: 1, c.adapter_id: 5}
    assert residency.prefetch(new, needs, position=5) is not None  # d: needed by no one
    assert not residency.is_resident(d.adapter_id)
    needs[new.adapter_id] = 5
    assert residency.prefetch(fake_adapter(7, rank=2), needs, position=5) is None  # b, c: <= 5
    residency.acquire([fake_adapter(8, rank=2)], needs)  # c first: needed furthest back
    assert not residency.is_resident(c.adapter_id) and residency.is_resident(b.adapter_id)
    assert residency.is_resident(pinned.adapter_id) and residency.refs(a.adapter_id) == 1


def test_prefetch_takes_swap_tokens_after_admissions():
    adapters = [fake_adapter(k) for k in range(8)]
    sched = make_scheduler(rows=16, max_running=1)
    sched.swap_cap = SwapCap(1e-9, lambda adapter: 1.0, burst=3)  # no refill within the test
    for k, a in enumerate(adapters):
        sched.add(make_req(f"r{k}", [a], max_tokens=4))
    plan = sched.schedule()
    assert len(plan.adapter_loads) == 1 and len(plan.prefetch_loads) == 2
    assert sched.swap_cap.bucket.available(0) == 0


def test_no_prefetch_while_the_swap_cap_holds_an_admission_back():
    adapters = [fake_adapter(k) for k in range(4)]
    sched = make_scheduler(rows=16, max_running=4)
    sched.swap_cap = SwapCap(1e-9, lambda adapter: 1.0, burst=1)
    for k, a in enumerate(adapters):
        sched.add(make_req(f"r{k}", [a], max_tokens=4))
    plan = sched.schedule()
    assert len(plan.adapter_loads) == 1 and sched.num_swap_deferred == 3
    assert not plan.prefetch_loads


def reads(*rows: int) -> list[dict[str, GroupRows]]:
    """A step's adapter sets: one set reading `rows`."""
    return [{"qkv": GroupRows(list(rows), [1.0] * len(rows))}]


class FakeEvent:
    def __init__(self):
        self.records = 0

    def record(self, stream) -> None:
        self.records += 1


def test_pool_event_covers_prefetch_copies_only_for_steps_that_read_them(monkeypatch):
    """The CUDA bookkeeping of AdapterPool, with the copies stubbed: a step's loads record the
    event its forward waits on; prefetch copies queued after it are not waited for, until a
    step reads their rows (or has loads of its own), which records an event covering them."""
    pool = AdapterPool(ModelConfig.from_hf(TINY_CONFIG), 8, torch.float32, "cpu", 0)
    event = FakeEvent()
    monkeypatch.setattr(pool, "_copy", lambda adapter, rows: None)
    pool.load_stream, pool._loaded = object(), event
    pool.write_all([(None, np.array([0]))], reads(0))
    assert event.records == 1 and pool._loads_pending
    pool._loads_pending = False  # wait_loads() on the compute stream
    pool.prefetch([(None, np.array([4, 5]))])
    pool.write_all([], reads(0, 1))  # reads no prefetched row: nothing to wait for
    assert event.records == 1 and not pool._loads_pending
    pool.write_all([], reads(5))
    assert event.records == 2 and pool._loads_pending and not pool._uncovered
    pool.prefetch([(None, np.array([6]))])
    pool.write_all([(None, np.array([2]))], reads(2))  # its own load: the event covers row 6
    assert event.records == 3 and not pool._uncovered


# ---- state machine ---------------------------------------------------------------------------

RANKS = (1, 2, 3, 1, 2, 1, 3, 2)
PINNED = 0  # adapter 0 is pinned: once resident, never evicted


class PrefetchMachine(RuleBasedStateMachine):
    """Arrivals on adapters (one or two stacked), planning (up to two plans in flight, as with
    overlap), results folded in plan order, aborts and evictions. A fake device (row ->
    adapter) executes each plan as the worker does: its loads, then its prefetch loads; every
    row a plan reads must hold the adapter it reads."""

    @initialize(rows=st.integers(4, 10), max_running=st.integers(1, 4))
    def setup(self, rows: int, max_running: int):
        self.adapters = [fake_adapter(k, rank) for k, rank in enumerate(RANKS)]
        self.sched = make_scheduler(rows=rows, max_running=max_running, max_batch_tokens=12)
        self.sched.residency.pin(self.adapters[PINNED].adapter_id)
        self.device: dict[int, str] = {}
        self.in_flight: deque[BatchPlan] = deque()
        self.reqs: list[Req] = []
        self.pinned_loaded = False

    @rule(k=st.integers(0, len(RANKS) - 1), other=st.none() | st.integers(0, len(RANKS) - 1),
          prompt=st.integers(1, 9), max_tokens=st.integers(1, 4))
    def arrive(self, k: int, other: int | None, prompt: int, max_tokens: int):
        ks = sorted({k, other} - {None})
        if sum(RANKS[i] for i in ks) > self.sched.residency.rows.num_rows - RANKS[PINNED]:
            ks = [k]  # a set that cannot fit beside the pinned adapter would wait forever
        req = make_req(f"r{len(self.reqs)}", [self.adapters[i] for i in ks], prompt, max_tokens)
        self.sched.add(req)
        self.reqs.append(req)

    @precondition(lambda self: len(self.in_flight) < 2)
    @rule()
    def plan(self):
        plan = self.sched.schedule()
        if plan is not None:
            self.execute(plan)
            self.in_flight.append(plan)

    @precondition(lambda self: self.in_flight)
    @rule()
    def fold(self):
        fold(self.sched, self.in_flight.popleft())

    @rule(index=st.integers(0, 1000))
    def abort(self, index: int):
        live = [r for r in self.reqs if r.status is not ReqStatus.FINISHED]
        if live:
            self.sched.abort(live[index % len(live)])

    @rule(k=st.integers(1, len(RANKS) - 1))
    def evict(self, k: int):
        adapter_id = self.adapters[k].adapter_id
        held = any(a.adapter_id == adapter_id for r in self.sched.running
                   for a in r.adapter_set.adapters)
        assert self.sched.residency.evict(adapter_id) is not held

    def execute(self, plan: BatchPlan):
        step = plan.to_step_plan(0)
        for load in step.adapter_loads:
            self.device.update(dict.fromkeys(bytes_to_ids(load.rows).tolist(), load.adapter_id))
        for item in plan.items:
            for adapter in item.req.adapter_set.adapters:
                rows = self.sched.residency.rows_of(adapter.adapter_id).tolist()
                assert all(self.device.get(r) == adapter.adapter_id for r in rows)
        for load in step.prefetch_loads:
            self.device.update(dict.fromkeys(bytes_to_ids(load.rows).tolist(), load.adapter_id))

    @invariant()
    def rows_are_accounted(self):
        residency = self.sched.residency
        owned = [int(r) for e in residency.resident.values() for r in e.rows]
        free = residency.rows.free_rows()
        assert len(owned) == len(set(owned)) and set(owned).isdisjoint(free)
        assert len(owned) + len(free) == residency.rows.num_rows == len(set(owned) | set(free))

    @invariant()
    def running_requests_hold_their_adapters(self):
        residency = self.sched.residency
        holders: dict[str, int] = {}
        for req in self.sched.running:
            for adapter in req.adapter_set.adapters:
                holders[adapter.adapter_id] = holders.get(adapter.adapter_id, 0) + 1
        assert {k: e.refs for k, e in residency.resident.items() if e.refs} == holders

    @invariant()
    def pinned_adapter_stays(self):
        resident = self.sched.residency.is_resident(self.adapters[PINNED].adapter_id)
        assert resident or not self.pinned_loaded
        self.pinned_loaded = resident

    def teardown(self):
        """Arrivals stop: every request finishes within a bounded number of steps."""
        sched = getattr(self, "sched", None)
        if sched is None:
            return
        for _ in range(2 * AGING_STEPS + 20 * len(self.reqs) + 10):
            if not sched.has_work():
                break
            if self.in_flight:
                self.fold()
            self.plan()
        assert not sched.has_work()
        assert all(r.status is ReqStatus.FINISHED for r in self.reqs)
        assert all(e.refs == 0 for e in sched.residency.resident.values())


PrefetchMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50,
                                             deadline=None)
test_prefetch_state_machine = PrefetchMachine.TestCase


# ---- the Engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefetch")
    model = build_tiny_model(root / "model")
    return model, {f"n{k}": build_tiny_adapter(model, root / f"n{k}", rank=2, seed=300 + k)
                   for k in range(40)}


PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
NAMES = [f"n{(7 * k) % 40}" for k in range(80)]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (3 + k % 5,), generator=gen).tolist() for k in range(80)]


def engine_outputs(engine: Engine) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in engine.generate(prompts(), PARAMS, adapters=NAMES)]


def small_pool_engine(model, adapters) -> Engine:
    """Rows for 6 of the 40 rank-2 adapters, 4 of them held by running requests."""
    return Engine(model, adapters=adapters, adapter_rows=12, max_running=4, kv_pages=512,
                  max_batch_tokens=64)


@pytest.fixture(scope="module")
def reference(many_adapters) -> list[list[int]]:
    """Outputs of an engine whose pool holds every adapter."""
    model, adapters = many_adapters
    engine = Engine(model, adapters=adapters, adapter_rows=96, max_running=4, kv_pages=512,
                    max_batch_tokens=64)
    out = engine_outputs(engine)
    assert_all_free(engine)
    return out


def test_engine_with_a_small_pool_equals_one_holding_every_adapter(many_adapters, reference):
    engine = small_pool_engine(*many_adapters)
    assert engine_outputs(engine) == reference
    assert engine.scheduler.num_prefetches > 0 and engine.scheduler.residency.num_evictions > 0
    assert not engine.executor.reader.owed
    assert engine.scheduler.reads.in_host == set(engine.executor.runner.adapter_pool.host.ids())
    assert_all_free(engine)


def watched_source(engine: Engine, fail_in_background: set[str], fail_always: set[str]):
    """Wrap the executor's adapter source: background reads are slow (steps outrun them) and
    fail for `fail_in_background`; every read fails for `fail_always`. Returns the reads made,
    by thread kind."""
    source = engine.executor.reader.source
    reads = {"background": 0, "step": 0}

    def read(load):
        background = threading.current_thread().name.startswith("adapter-prefetch")
        reads["background" if background else "step"] += 1
        if background:
            time.sleep(0.02)
        if load.name in fail_always or background and load.name in fail_in_background:
            raise AdapterError(load.name, "unreadable")
        return source(load)

    engine.executor.reader.source = read
    return reads


def test_steps_complete_owed_prefetch_loads_they_need(many_adapters, reference):
    """Background reads lag and some fail: a step that reads the rows of an owed prefetch load
    reads its adapter itself first, and the outputs do not change."""
    engine = small_pool_engine(*many_adapters)
    reads = watched_source(engine, fail_in_background={f"n{k}" for k in range(0, 40, 3)},
                           fail_always=set())
    assert engine_outputs(engine) == reference
    assert reads["background"] > 0 and reads["step"] > 0
    assert_all_free(engine)


def test_a_failed_prefetch_read_fails_the_step_that_needs_its_adapter(many_adapters):
    """n28 is only ever prefetched (never a step's own load): its read fails, and the step
    that reads its rows does not run, naming it."""
    engine = small_pool_engine(*many_adapters)
    watched_source(engine, fail_in_background=set(), fail_always={"n28"})
    failed_id = engine.adapters["n28"].adapter_id
    plans = []
    submit = engine.executor.submit
    engine.executor.submit = lambda plan: submit(plans.append(plan) or plan)
    with pytest.raises(RadixLoraError, match=failed_id):
        engine_outputs(engine)
    assert any(load.adapter_id == failed_id for p in plans for load in p.prefetch_loads)
    assert all(load.adapter_id != failed_id for p in plans for load in p.adapter_loads)


def test_swap_cap_counts_full_size_swaps_not_loads():
    """Each load costs its share of a full-size swap: a burst of 2 swaps admits 16 loads of
    1/8 swap; a load costing more than the burst waits for a full bucket, never forever."""
    sched = make_scheduler(rows=64, max_running=64)
    sched.swap_cap = SwapCap(1e-9, lambda adapter: adapter.rank / 8, burst=2)
    for k in range(20):
        sched.add(make_req(f"s{k}", [fake_adapter(k, rank=1)], max_tokens=4))
    plan = sched.schedule()
    assert len(plan.adapter_loads) == 16 and sched.num_swap_deferred == 4
    big = SwapCap(1e-9, lambda adapter: adapter.rank / 8, burst=2)
    assert big.allows(3.0)  # full bucket: a 3-swap load may go, taking the bucket below zero
    big.take(3.0)
    assert not big.allows(0.125)
