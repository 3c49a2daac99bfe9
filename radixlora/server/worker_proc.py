"""The worker process: owns the ModelRunner (weights, KV pool, adapter pool) and executes the
scheduler's StepPlans through a StepExecutor. Adapters are read from disk by path the first time
a plan loads them and must hash to the adapter id the scheduler validated; read adapters stay
packed in the adapter pool's host tier (--host-adapter-bytes) for later loads."""

from __future__ import annotations

from pathlib import Path

import zmq

from radixlora.config import ModelConfig
from radixlora.executor import StepExecutor
from radixlora.lora.adapter import LoraAdapter, load_adapter
from radixlora.model_runner import ModelRunner
from radixlora.server.args import ServerArgs
from radixlora.server.ipc import Inbox, Outbox, child_main, send_ready
from radixlora.server.messages import WorkerInbox
from radixlora.step_plan import AdapterLoad


def make_executor(args: ServerArgs) -> StepExecutor:
    config = args.engine_config()
    model_cfg = ModelConfig.from_dir(args.model)
    runner = ModelRunner(Path(args.model), model_cfg, config)

    def read(load: AdapterLoad) -> LoraAdapter:
        return load_adapter(load.name, load.path, model_cfg, config.max_rank)

    return StepExecutor(runner, read)


def run(args: ServerArgs, ctx: zmq.Context) -> None:
    executor = make_executor(args)
    inbox = Inbox(ctx, args.endpoints.worker, WorkerInbox)
    to_scheduler = Outbox(ctx, args.endpoints.scheduler)
    send_ready(ctx, args, "worker", {"device": str(executor.runner.device)})
    serve(executor, inbox, to_scheduler)


def serve(executor: StepExecutor, inbox: Inbox, to_scheduler: Outbox) -> None:
    """Launch each plan as soon as it arrives, behind the step still running on the device,
    and answer steps in order as they complete: the scheduler plans step N+1 (with placeholders
    for step N's tokens) while step N runs, so the device never waits for the host."""
    while True:
        if not executor.in_flight:
            executor.submit(inbox.recv())
        for plan in inbox.recv_nowait():
            executor.submit(plan)
        for result in executor.collect(keep=1, done_too=True):
            to_scheduler.send(result)


if __name__ == "__main__":
    child_main("worker", run)
