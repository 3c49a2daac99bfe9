"""Tensor parallel on the CPU (gloo): worker ranks fed the StepPlans of a single-device Engine
run, over the ranks' own plan broadcast, answer the same greedy tokens (and logprobs within
float32 rounding), for the base, each adapter kind, a stack and a hot-swapped adapter, on
Llama, Qwen2 and Mistral with 2 ranks and on a model with 2 KV heads with 4 (KV heads
replicated); the single-device run itself equals transformers + PEFT.

Run as a module, this file is one worker rank: `python -m tests.test_tensor_parallel JOB RANK`.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.config import EngineConfig, ModelConfig
from radixlora.distributed import TensorParallel, check_shardable
from radixlora.errors import AdapterError, ModelLoadError
from radixlora.step_plan import StepPlan, StepResult
from scripts.checkpoints import build_peft_adapter, hf_config
from tests.oracle import logprobs, merged_logprobs, peft_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
MIX = [None, "a", "b", "c", "d", [("a", 0.7), ("c", 1.3)]]
STACK = {"a": 0.7, "c": 1.3}
TOL = 1e-4
RANK_TIMEOUT_S = 120


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (length,), generator=g).tolist()


class Recorded(msgspec.Struct):
    plans: list[StepPlan]
    results: list[StepResult]


def record_engine_run(engine: Engine, swapped: Path) -> tuple[Recorded, list, list]:
    """Every plan the engine's executor launches and every result it answers, over a mixed
    batch (base, each adapter kind, a stack), then the same after "a" is re-published with
    other weights (hot swap: the next plans load the new version into pool rows)."""
    rec = Recorded([], [])
    launch, finish = engine.executor.launch, engine.executor.finish

    def recording_launch(plan):
        rec.plans.append(msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan))
        return launch(plan)

    def recording_finish(step):
        result = finish(step)
        rec.results.append(result)
        return result

    engine.executor.launch, engine.executor.finish = recording_launch, recording_finish
    prompts = [prompt(10 + i, 5 + 3 * i) for i in range(len(MIX))]
    before = engine.generate(prompts, GREEDY, adapters=MIX)
    engine.load_adapter("a", swapped)
    after = engine.generate(prompts[1], GREEDY, adapters="a")
    return rec, [(p, spec, o.outputs[0]) for p, spec, o in zip(prompts, MIX, before)], [
        (prompts[1], "a", after[0].outputs[0])]


def run_ranks(tmp: Path, model: Path, config: EngineConfig, rec: Recorded, size: int,
              unreadable: str | None = None) -> list:
    """Start `size` worker ranks on the recorded plans; rank 0's results. unreadable: an
    adapter the last rank fails to read."""
    plans_path, out_path = tmp / f"plans-{size}.msgpack", tmp / f"results-{size}.msgpack"
    plans_path.write_bytes(msgspec.msgpack.encode(rec.plans))
    job = {"model": str(model), "size": size, "rendezvous": f"file://{tmp}/rendezvous-{size}",
           "plans": str(plans_path), "out": str(out_path),
           "config": msgspec.to_builtins(config), "unreadable": unreadable}
    job_path = tmp / f"job-{size}.json"
    job_path.write_text(json.dumps(job))
    root = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "-m", "tests.test_tensor_parallel", str(job_path),
                               str(rank)], cwd=root, stderr=subprocess.PIPE)
             for rank in range(size)]
    errors = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        if proc.returncode != 0:
            errors.append(f"rank {rank}: {err.decode()[-3000:]}")
    assert not errors, "\n".join(errors)
    return msgspec.msgpack.decode(out_path.read_bytes(), type=list[StepResult])


def serve_rank(job_path: str, rank: int) -> None:
    """One worker rank: rank 0 reads the plans and broadcasts them one by one, as the worker
    process does; every rank executes each plan; rank 0 writes its results. The base is served
    as the job's EngineConfig asks (--quantization at load, --qlora-mismatch), as there."""
    from radixlora.lora.adapter import load_adapter
    from radixlora.server.procs.worker_proc import submit
    from radixlora.worker.executor import StepExecutor
    from radixlora.worker.model_runner import ModelRunner

    job = json.loads(Path(job_path).read_text())
    config = msgspec.convert(job["config"], EngineConfig)
    model_cfg = ModelConfig.from_dir(job["model"]).served(config)
    tp = TensorParallel.init(rank, job["size"], model_cfg, job["rendezvous"], torch.device("cpu"))
    runner = ModelRunner(job["model"], model_cfg, config, tp)

    def read(load):
        if load.name == job["unreadable"] and rank == job["size"] - 1:
            raise AdapterError(load.name, "unreadable on this rank")
        return load_adapter(load.name, load.path, model_cfg, config.max_rank)

    executor = StepExecutor(runner, read)
    plans = msgspec.msgpack.decode(Path(job["plans"]).read_bytes(), type=list[StepPlan])
    results = []
    for plan in plans:
        if rank == 0:
            tp.send_plans([plan])
        for received in [plan] if rank == 0 else tp.recv_plans():
            submit(executor, received)
        results += executor.collect(keep=0)
    if rank == 0:
        Path(job["out"]).write_bytes(msgspec.msgpack.encode(results))
    tp.close()


def check_same_results(ours: list[StepResult], single: list[StepResult]) -> None:
    assert len(ours) == len(single)
    for got, want in zip(ours, single):
        assert got.error is None and not got.failed_adapters, got
        assert np.array_equal(np.frombuffer(got.token_ids, "<i4"),
                              np.frombuffer(want.token_ids, "<i4")), f"step {got.step}"
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=TOL)
        for g, w in zip(got.top_logprobs or [], want.top_logprobs or []):
            np.testing.assert_allclose(g, w, atol=TOL)


def check_oracle(ref_model, runs) -> None:
    """Greedy tokens and their logprobs equal transformers + PEFT."""
    for ids, spec, out in runs:
        full = ids + out.token_ids
        if isinstance(spec, list):
            ref = merged_logprobs(ref_model, full, STACK)
        else:
            ref = logprobs(ref_model, full, None if spec is None else [spec])
        for step, token in enumerate(out.token_ids):
            row = ref[len(ids) - 1 + step]
            assert token == int(row.argmax()), f"{spec}: greedy token differs at step {step}"
            assert abs(out.logprobs[step] - float(row[token])) <= TOL


@pytest.fixture(scope="module")
def swapped(tmp_path_factory, checkpoints) -> dict[str, Path]:
    """arch -> another adapter, re-published as "a" mid-run."""
    root = tmp_path_factory.mktemp("swapped")
    return {arch: build_peft_adapter(base, root / arch, seed=99, r=8, lora_alpha=32)
            for arch, base in checkpoints.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_two_ranks_match_single_device_and_peft(arch, checkpoints, adapters, swapped, tmp_path):
    engine = Engine(checkpoints[arch], adapters=adapters[arch], dtype="float32", kv_pages=256,
                    max_running=8, adapter_rows=160)
    rec, before, after = record_engine_run(engine, swapped[arch])
    sizes = [2, 4] if arch == "llama" else [2]  # llama: 2 KV heads, 4 ranks replicate them
    for size in sizes:
        check_same_results(run_ranks(tmp_path, checkpoints[arch], engine.config, rec, size),
                           rec.results)
    check_oracle(peft_model(checkpoints[arch], adapters[arch]), before)
    check_oracle(peft_model(checkpoints[arch], {"a": swapped[arch]}), after)


def test_a_load_failing_on_one_rank_fails_the_step_on_every_rank(checkpoints, adapters,
                                                                  tmp_path):
    """The ranks agree before a step that loads adapters: the step whose load fails on rank 1
    alone runs nowhere (rank 0 answers an error) and the ranks stay in step, ending normally;
    the steps before it are unaffected."""
    engine = Engine(checkpoints["llama"], adapters=adapters["llama"], dtype="float32",
                    kv_pages=256, max_running=8, adapter_rows=160)
    rec = Recorded([], [])
    launch = engine.executor.launch
    engine.executor.launch = lambda plan: rec.plans.append(plan) or launch(plan)
    engine.generate([prompt(1, 7), prompt(2, 5)], GREEDY, adapters=[None, None])
    engine.generate(prompt(3, 6), GREEDY, adapters="b")
    first_b = next(k for k, p in enumerate(rec.plans) if p.adapter_loads)
    results = run_ranks(tmp_path, checkpoints["llama"], engine.config, rec, 2, unreadable="b")
    assert all(r.error is None for r in results[:first_b])
    assert "another tensor-parallel rank" in results[first_b].error
    assert not results[first_b].token_ids


def test_a_vocabulary_that_does_not_split_evenly(tmp_path):
    """251 ids over 2 ranks: the last rank's embedding and LM head rows are padded, the padding
    logits cut off after the gather; greedy tokens equal the single-device run's."""
    import transformers

    torch.manual_seed(0)
    model_dir = tmp_path / "odd-vocab"
    config = hf_config("llama", vocab_size=251, intermediate_size=128, initializer_range=0.1)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    engine = Engine(model_dir, dtype="float32", kv_pages=128, max_running=4)
    rec = Recorded([], [])
    launch, finish = engine.executor.launch, engine.executor.finish
    engine.executor.launch = lambda plan: rec.plans.append(plan) or launch(plan)
    engine.executor.finish = lambda step: rec.results.append(finish(step)) or rec.results[-1]
    engine.generate([[i % 251 for i in prompt(4, 9)], [250, 249, 3, 125, 126]], GREEDY)
    check_same_results(run_ranks(tmp_path, model_dir, engine.config, rec, 2), rec.results)


def test_unshardable_model_is_refused(checkpoints):
    cfg = ModelConfig.from_dir(checkpoints["llama"])  # 4 heads, 2 KV heads
    check_shardable(cfg, 4)
    with pytest.raises(ModelLoadError, match="num_attention_heads"):
        check_shardable(cfg, 8)
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):
        check_shardable(cfg.__class__(**{**cfg.__dict__, "num_kv_heads": 3}), 2)


def test_close_frees_the_process_groups(checkpoints, tmp_path):
    """A group still referenced after destroy_process_group is torn down with the interpreter,
    its threads running, and aborts the rank's exit (a flaky failure of the rank tests)."""
    cfg = ModelConfig.from_dir(checkpoints["llama"])
    tp = TensorParallel.init(0, 1, cfg, f"file://{tmp_path}/rendezvous", torch.device("cpu"))
    try:
        group = weakref.ref(tp.group)
        tp.close()
        gc.collect()
        assert group() is None
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serve_rank(sys.argv[1], int(sys.argv[2]))
    # The rank's results are written and its group closed. Interpreter teardown can still
    # destroy a gloo thread that has not been joined, which aborts the process ("terminate
    # called without an active exception", 1 rank in a few hundred), so skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
