"""The worker process: owns the ModelRunner (weights, KV pool, adapter pool) and executes the
scheduler's StepPlans through a StepExecutor. Adapters are read from disk by path the first time
a plan loads them (on CUDA by packing processes) and must hash to the adapter id the scheduler
validated; read adapters stay packed in the adapter pool's host tier (--host-adapter-bytes) for
later loads."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
import zmq

from radixlora.config import ModelConfig
from radixlora.distributed import TensorParallel, local_device
from radixlora.errors import AdapterError
from radixlora.lora.adapter import LoraAdapter, load_adapter
from radixlora.lora.packer import ProcessPacker
from radixlora.lora.registration import iter_adapters
from radixlora.server.args import ServerArgs
from radixlora.server.ipc import (
    Heartbeats,
    Inbox,
    Outbox,
    child_main,
    send_ready,
    serve_forever,
)
from radixlora.server.messages import InvalidMessage, Sized, WorkerInbox
from radixlora.server.procs.adapter_store import snapshot_roots
from radixlora.startup import process_age_s
from radixlora.step_plan import AdapterLoad, StepMasks, StepPlan, StepResult
from radixlora.topology import rank_from_env, worker_rank_name
from radixlora.worker.adapter_reader import WARM_READERS
from radixlora.worker.executor import StepExecutor
from radixlora.worker.model_runner import ModelRunner
from radixlora.worker.sizing import (
    SIZED_FIELDS,
    adapter_dir_paths,
    available_host_bytes,
    with_host_tier,
    with_start_adapters,
)

log = logging.getLogger(__spec__.name)  # the module's name also when run with -m

BEAT_POLL_MS = 250  # an idle worker's loop comes round this often to beat
# A launch this long on CUDA blocked the thread that also answers steps: the steps before it,
# done on the device meanwhile, were answered that much later (their streams waited)
SLOW_LAUNCH_S = 0.1
PREFETCH_S = 10.0  # start-up adapters read into the host tier before Ready, at most this long


def make_executor(args: ServerArgs, rank: int = 0) -> StepExecutor:
    """The executor of tensor-parallel rank `rank` (the only one without tensor parallel)."""
    workers = args.data_parallel_size * args.tensor_parallel_size
    config = args.engine_config()
    if workers > 1:  # every worker of the host measures the same free memory at start
        config = with_host_tier(config, available_host_bytes(), workers)
    model_cfg = args.served_model(config, confined=True)
    config = with_start_adapters(config, [*args.adapters.values(),
                                        *adapter_dir_paths(args.adapter_dir)], model_cfg)
    tp, device = join_group(args, model_cfg, rank)
    runner = ModelRunner(Path(args.model), model_cfg, config, tp, device)

    def read(load: AdapterLoad) -> LoraAdapter:
        return load_adapter(load.name, load.path, model_cfg, config.max_rank)

    roots = snapshot_roots(args.state_dir, args.data_parallel_size > 1)
    return StepExecutor(runner, read, roots, make_packer(args, runner, model_cfg, rank))


def make_packer(args: ServerArgs, runner: ModelRunner, model_cfg: ModelConfig,
                rank: int) -> ProcessPacker | None:
    """On CUDA, adapters read while serving are packed in processes (radixlora.lora.packer),
    so the thread that launches steps keeps the GIL; on the CPU the steps are the bottleneck
    and the worker reads them itself. model_cfg: the full model's (adapters are validated
    against it, then packed for this rank's layout)."""
    if runner.device.type != "cuda" or not args.state_dir:
        return None
    root = Path(args.state_dir) / f"packing-{rank}"
    return ProcessPacker(root, model_cfg, runner.config.max_rank, WARM_READERS)


def join_group(args: ServerArgs, model_cfg: ModelConfig,
               rank: int) -> tuple[TensorParallel | None, torch.device | None]:
    """(this rank's tensor-parallel group, its device): (None, None) without tensor parallel.
    The ranks meet where the launcher says (a file in its private directory, or node 0's
    --dist-init-addr); on CUDA each node's ranks drive its cuda:0, cuda:1, ..."""
    size = args.tensor_parallel_size
    if size == 1:
        return None, None
    device = torch.device(args.engine_config().resolved_device())
    device = local_device(device, rank, size, args.nnodes)
    return TensorParallel.init(rank, size, model_cfg, args.dist_init_method, device), device


def run(args: ServerArgs, ctx: zmq.Context) -> None:
    rank = rank_from_env()
    imports = process_age_s()
    executor = make_executor(args, rank)
    runner = executor.runner
    if imports is not None:
        runner.phases["imports"] = imports
    if rank > 0:
        follow(executor, args, ctx, rank)
        return
    send_ready(ctx, args, "worker", ready_info(runner), kind=Sized)
    runner.warm_up(defer_graphs=runner.tp is None)  # ranks must capture in step
    with runner.phase("adapters"):
        prefetch_adapters(runner, args)
    inbox = Inbox(ctx, args.endpoints.worker, WorkerInbox)
    to_scheduler = Outbox(ctx, args.endpoints.scheduler)
    heart = Heartbeats(ctx, args, "worker")
    send_ready(ctx, args, "worker", ready_info(runner))
    if runner.device.type == "cuda":  # what a slow launch's counts are compared with
        log.info("allocators when ready: %s", allocator_counts(runner.device))
    serve_forever(heart, WorkerLoop(executor, inbox, to_scheduler, runner.tp).turn)


def follow(executor: StepExecutor, args: ServerArgs, ctx: zmq.Context, rank: int) -> None:
    """Tensor-parallel rank > 0: run every plan rank 0 hands over, in its order, and drop the
    results (rank 0 answers the scheduler). Rank 0 sends at least every BEAT_POLL_MS, so this
    loop beats while the server idles; once rank 0 is gone (its connection closes, or the
    broadcast times out) the rank exits 1."""
    runner, name = executor.runner, worker_rank_name(rank)
    runner.warm_up()
    prefetch_adapters(runner, args)
    heart = Heartbeats(ctx, args, name)
    send_ready(ctx, args, name, ready_info(runner))
    done = 0

    def turn() -> int:
        nonlocal done
        try:
            plans = runner.tp.recv_plans()
        except RuntimeError as e:  # what torch.distributed raises when a peer is lost
            log.error("rank %d lost rank 0 (node 0's worker stopped, or the network between "
                      "them failed): %s", rank, e)
            raise SystemExit(1) from None
        for msg in plans:
            run_message(executor, msg)
        done += len(executor.collect(keep=1, done_too=True))
        return done

    serve_forever(heart, turn)


def prefetch_adapters(runner: ModelRunner, args: ServerArgs,
                      time_budget_s: float = PREFETCH_S) -> int:
    """Read, validate and pack the start-up adapters (--adapter) into the host tier while it has
    room and for at most `time_budget_s` (Ready waits for this; the rest are read from disk on
    first use), so that a first request on one waits for a pinned copy, not a disk read. They
    are read on threads a few ahead, each hashed from its bytes (never from the hash cache).
    Their ids are their content hashes, so the scheduler's loads find them; one that fails to
    read is left to the scheduler, which refuses it with the reason."""
    started, pool = time.perf_counter(), runner.adapter_pool
    done = 0
    for _, adapter in iter_adapters(args.adapters, runner.cfg, runner.config.max_rank):
        if isinstance(adapter, AdapterError):
            continue
        packed = pool.pack(adapter)
        if pool.host.nbytes + packed.nbytes > pool.host.budget_bytes:
            break
        pool.host.put(packed)
        done += 1
        if time.perf_counter() - started >= time_budget_s:
            break
    if done:
        log.info("%d of %d start-up adapters read into the host tier in %.1f s", done,
                 len(args.adapters), time.perf_counter() - started)
    return done


def ready_info(runner: ModelRunner) -> dict:
    """The device, the pool and batch sizes the other processes must use, and what was sized."""
    return {
        "device": str(runner.device),
        "engine": {name: getattr(runner.config, name) for name in SIZED_FIELDS},
        "sizing": runner.sizing.to_dict() if runner.sizing else None,
        "phases": runner.phases,
    }


class WorkerLoop:
    """Launch each plan as soon as it arrives, behind the step still running on the device,
    and answer steps in order as they complete: the scheduler plans step N+1 (with placeholders
    for step N's tokens) while step N runs, so the device never waits for the host. A turn
    returns the number of steps answered, so a step that never ends silences the worker. Under
    tensor parallel, the plans go to the other ranks first (see `follow`), and at least every
    BEAT_POLL_MS, none if there are none; without it, the loop captures the graphs warm-up left
    while idle (IdleCapture)."""

    def __init__(self, executor: StepExecutor, inbox: Inbox, to_scheduler: Outbox,
                 tp: TensorParallel | None = None):
        self.executor = executor
        self.inbox = inbox
        self.to_scheduler = to_scheduler
        self.tp = tp
        runner = executor.runner
        self.idle = IdleCapture(runner.graphs if tp is None and runner.config.warm_up else None)
        self.answered = 0
        self.sent_at = time.monotonic()

    def turn(self) -> int:
        executor, tp = self.executor, self.tp
        plans = (self.inbox.recv_nowait() if executor.in_flight
                 else self.inbox.recv_within(self.idle.poll_ms(BEAT_POLL_MS)))
        self.idle.step(not plans and not executor.in_flight, time.monotonic())
        if tp is not None and (plans or time.monotonic() - self.sent_at >= BEAT_POLL_MS / 1000):
            tp.send_plans(plans)
            self.sent_at = time.monotonic()
        for msg in plans:
            run_message(executor, msg)
            # the steps done already (on the CPU, the one just launched) go now, not after
            # the turn's next plan has run
            self.answer(keep=len(executor.in_flight))
        self.answer(keep=1)
        return self.answered

    def answer(self, keep: int) -> None:
        """Send the results of the steps done and of all but the newest `keep` (waiting for
        them), oldest first."""
        for result in self.executor.collect(keep=keep, done_too=True):
            self.to_scheduler.send(result)
            self.answered += 1


class IdleCapture:
    """Captures the graphs warm-up left (ModelRunner.warm_up's defer_graphs), one turn at a
    time (a graph's eager pass, then its capture), once the worker has been idle IDLE_S: a
    client sending requests one after another is not delayed, and a request arriving later
    waits for one turn at most. A step that needs a graph not captured yet captures it
    itself."""

    IDLE_S = 0.2
    POLL_MS = 20

    def __init__(self, graphs) -> None:
        self.graphs = graphs
        self.left = graphs is not None and bool(graphs.pending())
        self.idle_since: float | None = None

    def poll_ms(self, default: int) -> int:
        return self.POLL_MS if self.left else default

    def step(self, idle: bool, now: float) -> None:
        if not (self.left and idle):
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        elif now - self.idle_since >= self.IDLE_S:
            self.left = self.graphs.capture_next()


def run_message(executor: StepExecutor, msg: StepPlan | StepMasks) -> None:
    if isinstance(msg, StepMasks):
        executor.give_masks(msg)
    else:
        submit(executor, msg)


def submit(executor: StepExecutor, plan: StepPlan) -> None:
    """Queue a plan; one that is out of range is answered with an error in its turn (a launch
    that fails is answered so by the executor), and the worker goes on."""
    try:
        check_ranges(plan, executor.runner)
    except InvalidMessage as e:
        log.error("step %d cannot run: %s", plan.step, e)
        error = StepResult(step=plan.step, error=f"{type(e).__name__}: {e}")
        executor.in_flight.append(executor.unrun(error))
        return
    unanswered, started = len(executor.in_flight), time.perf_counter()
    executor.submit(plan)
    seconds = time.perf_counter() - started
    device = executor.runner.device
    if device.type == "cuda" and seconds >= SLOW_LAUNCH_S:
        log.warning("step %d (%d tokens, %d requests) took %.0f ms to launch, and %d earlier "
                    "steps waited as long to be answered; since start: %s", plan.step,
                    len(plan.input_ids) // 4, len(plan.items), seconds * 1e3, unanswered,
                    allocator_counts(device))


def allocator_counts(device) -> str:
    """What in torch's allocators blocks a launching thread, counted since start: device
    memory allocations (cudaMalloc) and the retries that free the cache first (a device
    synchronization), pinned host allocations (cudaHostAlloc) and the longest of them."""
    dev = torch.cuda.memory_stats(device)
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    longest = host.get("host_alloc_time.max")
    return (f"{dev.get('segment.all.allocated', 0)} device allocations, "
            f"{dev.get('num_alloc_retries', 0)} allocator retries, "
            f"{host.get('num_host_alloc', '?')} pinned host allocations (longest "
            f"{'?' if longest is None else f'{longest / 1e3:.1f}'} ms)")


def check_ranges(plan: StepPlan, runner: ModelRunner) -> None:
    """Token ids below the vocabulary size (negative ones are placeholders for the previous
    step's tokens, clamped by the runner) and KV slots inside the pool: what only the worker
    knows. An id or slot out of range would fault the device, ending every later step."""
    ids = np.frombuffer(plan.input_ids, "<i4")  # views: validated to whole int32 words
    if len(ids) and ids.max() >= runner.cfg.vocab_size:
        raise InvalidMessage("input_ids", f"token ids must be below {runner.cfg.vocab_size}")
    slots = np.frombuffer(plan.kv_slots, "<i4")
    num_slots = runner.kv_pool.k_cache[0].shape[0]
    if len(slots) and (slots.min() < 0 or slots.max() >= num_slots):
        raise InvalidMessage("kv_slots", f"KV slots must be in [0, {num_slots})")


if __name__ == "__main__":
    # rank r > 0 logs as worker-tp<r>
    child_main(worker_rank_name(rank_from_env()), run, torch_threads=None)
