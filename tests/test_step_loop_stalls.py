"""The warnings for a stalled step loop: a worker launch that blocked its thread (and so the
answer to the step before it), named on CUDA past SLOW_LAUNCH_S with the allocators' counts,
never on the CPU, whose launches run the step to the end; a scheduler turn past SLOW_TURN_S.
And a step the worker has run is answered before the next plan of the same turn runs."""

from __future__ import annotations

import logging
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from radixlora.sampling_params import SamplingParams
from radixlora.server.procs import scheduler_proc, worker_proc
from radixlora.step_plan import PlanItem, StepPlan, StepResult, ids_to_bytes
from radixlora.worker.executor import InFlight, StepExecutor


class StubExecutor:
    """Takes `seconds` to launch each plan."""

    def __init__(self, device: str, seconds: float):
        self.runner = SimpleNamespace(device=torch.device(device),
                                      cfg=SimpleNamespace(vocab_size=100),
                                      kv_pool=SimpleNamespace(k_cache=[torch.zeros(16, 1, 1)]))
        self.seconds = seconds
        self.in_flight: list[StepPlan] = []

    def submit(self, plan: StepPlan) -> None:
        time.sleep(self.seconds)
        self.in_flight.append(plan)


def plan(step: int) -> StepPlan:
    item = PlanItem(extend_len=3, start=0, sample=True, params=SamplingParams(max_tokens=2),
                    seed=0, out_index=0, adapter_set=0)
    return StepPlan(step=step, items=[item], input_ids=ids_to_bytes([3, 4, 5]),
                    kv_slots=ids_to_bytes([1, 2, 3]))


@pytest.mark.parametrize(("device", "seconds", "warned"), [
    ("cuda", worker_proc.SLOW_LAUNCH_S + 0.02, True),
    ("cuda", 0.0, False),
    ("cpu", worker_proc.SLOW_LAUNCH_S + 0.02, False),
])
def test_slow_launch_warned_on_cuda_only(monkeypatch, caplog, device, seconds, warned):
    monkeypatch.setattr(worker_proc, "allocator_counts", lambda _: "COUNTS")
    executor = StubExecutor(device, seconds)
    executor.in_flight.append(plan(6))  # launched before, not answered yet
    with caplog.at_level(logging.WARNING, logger=worker_proc.log.name):
        worker_proc.submit(executor, plan(7))
    assert [p.step for p in executor.in_flight] == [6, 7]
    lines = [r.getMessage() for r in caplog.records]
    assert bool(lines) is warned
    if warned:
        assert "step 7 (3 tokens, 1 requests)" in lines[0] and "1 earlier steps" in lines[0]
        assert lines[0].endswith("COUNTS")


class StubService:
    """A scheduler service whose planning takes `seconds`."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.compiling = False
        self.held, self.wanted = {}, []
        self.loop = SimpleNamespace(can_plan=lambda: True, num_steps=3)

    def next_plan(self):
        time.sleep(self.seconds)
        return None


@pytest.mark.parametrize(("seconds", "warned"), [(scheduler_proc.SLOW_TURN_S + 0.02, True),
                                                 (0.0, False)])
def test_slow_scheduler_turn_warned(caplog, seconds, warned):
    loop = scheduler_proc.SchedulerLoop.__new__(scheduler_proc.SchedulerLoop)
    loop.service, loop.stalled, loop.events = StubService(seconds), False, None
    loop.poller = SimpleNamespace(poll=lambda timeout: {})
    loop.inbox = SimpleNamespace(sock=object())
    loop.admin_queue = []
    loop.maybe_send_stats = loop.check_worker_alive = lambda: None
    with caplog.at_level(logging.WARNING, logger=scheduler_proc.log.name):
        assert loop.turn() == 3
    lines = [r.getMessage() for r in caplog.records]
    assert bool(lines) is warned
    if warned:
        assert lines[0].startswith("a scheduler turn took") and "0 messages" in lines[0]


def test_a_step_run_is_answered_before_the_next_plan_of_the_turn_runs():
    """Two plans taken in one turn (the scheduler plans two at once after taking two results
    in): on the CPU a launch runs its step, and the first step's answer must not wait for the
    second step to run."""
    events = []
    executor = StepExecutor.__new__(StepExecutor)
    executor.runner = SimpleNamespace(device=torch.device("cpu"), graphs=None,
                                      config=SimpleNamespace(warm_up=False),
                                      cfg=SimpleNamespace(vocab_size=100),
                                      kv_pool=SimpleNamespace(k_cache=[torch.zeros(16, 1, 1)]))
    executor.in_flight = deque()

    def launch(p: StepPlan) -> InFlight:
        events.append(f"ran {p.step}")
        return InFlight(p.step, result=StepResult(step=p.step))

    executor.launch = launch
    inbox = SimpleNamespace(recv_within=lambda ms: [plan(1), plan(2)], recv_nowait=lambda: [])
    outbox = SimpleNamespace(send=lambda result: events.append(f"answered {result.step}"))
    loop = worker_proc.WorkerLoop(executor, inbox, outbox)
    assert loop.turn() == 2
    assert events == ["ran 1", "answered 1", "ran 2", "answered 2"]
