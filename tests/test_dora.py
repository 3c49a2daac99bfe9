"""DoRA adapters (PEFT's use_dora=True) equal transformers + PEFT (fp32, CPU): alone, in batches
mixed with LoRA adapters and the base, after eviction and reload, with the prefix cache, through
the static-buffer (CUDA graph) forward, on an NF4 base against PEFT + bitsandbytes and under
tensor parallelism; stacks are refused, and broken DoRA files are named."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixlora import Engine, SamplingParams
from radixlora.errors import AdapterError, InvalidRequestError
from radixlora.lora.adapter import load_adapter
from radixlora.lora.host_cache import read_packed, write_packed
from radixlora.lora.layout import PoolLayout
from scripts.checkpoints import build_nf4_model, build_peft_adapter
from tests.conftest import assert_all_free
from tests.oracle import logprobs, peft_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
TOL = 1e-4
PROMPTS = [[5, 9, 17, 33, 65, 129, 7], [3, 44, 12, 91, 8], [200, 6, 6, 71, 30, 11, 2, 19],
           [13, 57, 101]]


def dora_adapters(base, root) -> dict:
    """x: every module, r 8; y: q, v and down only, r 4 with rsLoRA; p: a plain LoRA."""
    return {
        "x": build_peft_adapter(base, root / "x", seed=3, r=8, lora_alpha=16, use_dora=True),
        "y": build_peft_adapter(base, root / "y", seed=4, r=4, lora_alpha=8, use_dora=True,
                                use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
        "p": build_peft_adapter(base, root / "p", seed=5, r=8, lora_alpha=16),
    }


@pytest.fixture(scope="module")
def dora(tmp_path_factory, checkpoints) -> dict:
    """arch -> adapter name -> directory."""
    root = tmp_path_factory.mktemp("dora")
    return {arch: dora_adapters(base, root / arch) for arch, base in checkpoints.items()}


def check(ref_model, prompt: list[int], spec, out) -> None:
    """Greedy tokens and every step's top logprobs equal the oracle's."""
    ref = logprobs(ref_model, prompt + out.token_ids, None if spec is None else [spec])
    for step, token in enumerate(out.token_ids):
        row = ref[len(prompt) - 1 + step]
        assert token == int(row.argmax()), f"{spec}: greedy token differs at step {step}"
        assert abs(out.logprobs[step] - float(row[token])) <= TOL
        for tok, lp in out.top_logprobs[step]:
            assert abs(lp - float(row[tok])) <= TOL


def strip_dora(src, dst):
    """The same adapter as a plain LoRA: no magnitude vectors, use_dora false."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    tensors = load_file(dst / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k},
              str(dst / "adapter_model.safetensors"))
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_dora_alone_and_mixed_with_lora_and_base_matches_peft(arch, checkpoints, dora):
    engine = Engine(checkpoints[arch], adapters=dora[arch], max_rank=64, kv_pages=512)
    ref = peft_model(checkpoints[arch], dora[arch])
    assert engine.adapters["x"].dora_groups == ("qkv", "o", "gate_up", "down")
    assert engine.adapters["y"].dora_groups == ("qkv", "down")
    specs = ["x", "y", "p", None]
    for prompt, spec, out in zip(PROMPTS, specs, engine.generate(PROMPTS, GREEDY, adapters=specs)):
        check(ref, prompt, spec, out.outputs[0])
    for spec in ("x", "y"):  # alone in its batch
        check(ref, PROMPTS[0], spec, engine.generate(PROMPTS[0], GREEDY, adapters=spec)[0]
              .outputs[0])
    assert_all_free(engine)


def test_the_magnitudes_change_the_outputs(checkpoints, dora, tmp_path):
    """The oracle check means something: the same A and B served as a plain LoRA answer
    otherwise."""
    base = checkpoints["llama"]
    plain = strip_dora(dora["llama"]["x"], tmp_path / "plain")
    engine = Engine(base, adapters={"x": dora["llama"]["x"], "plain": plain}, kv_pages=256)
    got = engine.generate([PROMPTS[0]] * 2, GREEDY, adapters=["x", "plain"])
    gap = max(abs(a - b) for a, b in zip(got[0].outputs[0].logprobs, got[1].outputs[0].logprobs))
    assert gap > 1e-2


def test_eviction_and_reload_and_the_prefix_cache(checkpoints, dora):
    """A pool of 9 rows holds one DoRA adapter of rank 8 (its rank rows and its magnitude row):
    x, y and x again evict each other, from the host tier; outputs equal PEFT's, and the same
    requests with the prefix cache off answer the same."""
    base = checkpoints["qwen2"]
    ref = peft_model(base, dora["qwen2"])
    shared = PROMPTS[0] + PROMPTS[1]
    runs = [(shared + [7], "x"), (shared + [8], "y"), (shared + [9], "x"), (shared + [10], None)]
    results = {}
    for cache in (True, False):
        engine = Engine(base, adapters=dora["qwen2"], kv_pages=256, adapter_rows=9,
                        enable_radix_cache=cache)
        outs = [engine.generate(p, GREEDY, adapters=s)[0].outputs[0] for p, s in runs]
        for (prompt, spec), out in zip(runs, outs):
            check(ref, prompt, spec, out)
        assert engine.scheduler.residency.num_evictions >= 2
        results[cache] = [(o.token_ids, o.logprobs) for o in outs]
        assert_all_free(engine)
    for (tokens, lps), (tokens_off, lps_off) in zip(results[True], results[False]):
        assert tokens == tokens_off
        assert max(abs(a - b) for a, b in zip(lps, lps_off)) <= TOL


def test_the_graph_forward_scales_dora_tokens(checkpoints, dora):
    """The static-buffer forward a CUDA graph replays, run eagerly, with DoRA, LoRA and base
    requests in its decode and extend steps."""
    from radixlora.worker.cuda_graph import StaticInputs

    class Eager(StaticInputs):
        forward = StaticInputs.static_forward

    base = checkpoints["llama"]
    ref = peft_model(base, dora["llama"])
    engine = Engine(base, adapters=dora["llama"], kv_pages=256, attention_backend="triton",
                    lora_backend="triton")
    engine.runner.graphs = Eager(engine.runner, max_batch=8, max_context=128, max_rows=64)
    keys = []
    forward = engine.runner.graphs.forward
    engine.runner.graphs.forward = lambda *a, **k: keys.append(a[0]) or forward(*a, **k)
    specs = ["x", "p", None, "y"]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = engine.generate([p[:4] for p in PROMPTS], params, adapters=specs)
    for prompt, spec, out in zip(PROMPTS, specs, outs):
        check(ref, prompt[:4], spec, out.outputs[0])
    assert sum(k.dora for k in keys) >= 3  # the prefill and every decode step
    assert_all_free(engine)


def test_a_stack_or_weight_with_a_dora_adapter_is_refused(checkpoints, dora):
    engine = Engine(checkpoints["llama"], adapters=dora["llama"], kv_pages=128)
    for spec in ([("x", 1.0), ("p", 1.0)], [("x", 0.5)], [("x", 1.0), ("y", 1.0)]):
        with pytest.raises(InvalidRequestError, match="DoRA adapter") as e:
            engine.generate(PROMPTS[0], GREEDY, adapters=spec)
        assert e.value.code == "dora_not_stackable"
    assert engine.generate(PROMPTS[0], GREEDY, adapters=[("x", 1.0)])[0].outputs[0].token_ids
    assert_all_free(engine)


def test_int8_pool_keeps_dora_within_the_int8_tolerance(checkpoints, dora):
    from tests.test_int8_pool import INT8_TOL

    base = checkpoints["mistral"]
    ref = peft_model(base, dora["mistral"])
    engine = Engine(base, adapters=dora["mistral"], kv_pages=256, lora_dtype="int8")
    for prompt, spec in zip(PROMPTS, ["x", "y"]):
        out = engine.generate(prompt, GREEDY, adapters=spec)[0].outputs[0]
        full = logprobs(ref, prompt + out.token_ids, [spec])
        for step, token in enumerate(out.token_ids):
            assert abs(out.logprobs[step] - float(full[len(prompt) - 1 + step][token])) <= INT8_TOL
    assert_all_free(engine)


def test_packed_files_carry_the_magnitudes(checkpoints, dora, tmp_path):
    engine = Engine(checkpoints["llama"], kv_pages=64)
    adapter = load_adapter("x", dora["llama"]["x"], engine.model_cfg, 64)
    layout = PoolLayout(engine.model_cfg, torch.bfloat16)
    packed = layout.pack(adapter)
    assert packed.dora_groups == adapter.dora_groups and layout.holds(packed)
    write_packed(tmp_path, layout.key, packed)
    back = read_packed(tmp_path, layout.key, adapter.adapter_id, pin=False)
    assert back.dora_groups == packed.dora_groups and layout.holds(back)
    assert torch.equal(back.data.view(torch.uint8), packed.data.view(torch.uint8))  # NaN: bytes
    plain = load_adapter("p", dora["llama"]["p"], engine.model_cfg, 64)
    assert len(packed.data) > len(layout.pack(plain).data)


def test_qlora_dora_on_the_nf4_base_matches_peft_bitsandbytes(tmp_path):
    """A DoRA adapter on an NF4 base: its norms are of the dequantized weights, as PEFT
    takes them."""
    from peft import PeftModel

    from tests.test_qlora import AdapterSpec
    from tests.test_quant_nf4 import greedy_against, transformers_bnb

    nf4 = build_nf4_model(tmp_path / "nf4", "llama")
    adapter = build_peft_adapter(tmp_path / "nf4-dense", tmp_path / "dora", seed=7, r=8,
                                 lora_alpha=16, use_dora=True)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config,
                                                             "base_quantization": "nf4"}))
    peft = PeftModel.from_pretrained(transformers_bnb(nf4), adapter).eval()
    engine = Engine(nf4, adapters={"q": adapter}, kv_pages=128)
    assert greedy_against(AdapterSpec(engine, "q"), peft, PROMPTS[0]) <= TOL


def test_two_tensor_parallel_ranks_match_one_device(checkpoints, dora, tmp_path):
    """Column-parallel ranks take their rows' norms, row-parallel ones sum their partial
    squares over the ranks: the same results as one device, which equals PEFT."""
    from tests.test_tensor_parallel import Recorded, check_same_results, run_ranks

    base = checkpoints["qwen2"]
    engine = Engine(base, adapters=dora["qwen2"], dtype="float32", kv_pages=256, max_running=8)
    rec = Recorded([], [])
    launch, finish = engine.executor.launch, engine.executor.finish
    engine.executor.launch = lambda plan: rec.plans.append(plan) or launch(plan)
    engine.executor.finish = lambda step: rec.results.append(finish(step)) or rec.results[-1]
    specs = ["x", "y", "p", None]
    outs = engine.generate(PROMPTS, GREEDY, adapters=specs)
    ref = peft_model(base, dora["qwen2"])
    for prompt, spec, out in zip(PROMPTS, specs, outs):
        check(ref, prompt, spec, out.outputs[0])
    check_same_results(run_ranks(tmp_path, base, engine.config, rec, 2), rec.results)


def test_served_over_http_equals_the_engine_and_refuses_stacks(tmp_path):
    """`radixlora serve` with a DoRA adapter at start and one loaded at run time (admin API),
    through the official openai client: the Engine's text; a stack naming one is a 400."""
    import openai

    from tests.server_harness import build_checkpoints, engine_like_server, running_server

    model, adapters = build_checkpoints(tmp_path)
    at_start = build_peft_adapter(model, tmp_path / "dora-a", seed=8, r=8, lora_alpha=16,
                                  use_dora=True)
    later = build_peft_adapter(model, tmp_path / "dora-b", seed=9, r=4, lora_alpha=8,
                               use_dora=True, target_modules=["q_proj", "o_proj", "up_proj"])
    engine = engine_like_server(model, {**adapters, "dora-a": at_start, "dora-b": later})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = {n: engine.generate(PROMPTS[0], params, adapters=n)[0].outputs[0].text
            for n in ("dora-a", "dora-b", "support")}
    assert len(set(want.values())) == 3
    with running_server(model, {**adapters, "dora-a": at_start}, tmp_path / "server.log",
                        "--allowed-adapter-root", str(tmp_path)) as srv:
        loaded = srv.http.post("/v1/load_lora_adapter",
                               json={"lora_name": "dora-b", "lora_path": str(later)},
                               headers={"authorization": f"Bearer {srv.admin_key}"})
        assert loaded.status_code == 200, loaded.text
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert cards["dora-a"].dora and cards["dora-b"].dora and not cards["support"].dora
        for name, text in want.items():
            got = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
            assert got.choices[0].text == text
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(
                model="tiny", prompt=PROMPTS[0], max_tokens=4,
                extra_body={"adapters": [{"name": "dora-a"}, {"name": "support"}]})
        assert e.value.body["code"] == "dora_not_stackable"


def _edit(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        t = load_file(dst / "adapter_model.safetensors")
        save_file(tensors(t), str(dst / "adapter_model.safetensors"))
    return dst


def _magnitude(t, f):
    key = next(k for k in t if "magnitude" in k)
    return {**t, key: f(t[key])}


@pytest.mark.parametrize("edit, message", [
    (dict(config={"use_dora": False}), "does not set use_dora"),
    (dict(tensors=lambda t: {k: v for i, (k, v) in enumerate(t.items())
                             if "magnitude" not in k or i > 3}), "has no lora_magnitude_vector"),
    (dict(tensors=lambda t: _magnitude(t, lambda m: m[:-1])), "must be floating point of shape"),
    (dict(tensors=lambda t: _magnitude(t, lambda m: m.fill_(float("nan")))), "NaN"),
    (dict(tensors=lambda t: _magnitude(t, lambda m: m.to(torch.int32))), "floating point"),
])
def test_broken_dora_files_are_named(checkpoints, dora, tmp_path, edit, message):
    engine = Engine(checkpoints["llama"], kv_pages=64)
    path = _edit(dora["llama"]["y"], tmp_path / "bad", **edit)
    with pytest.raises(AdapterError, match=message):
        load_adapter("bad", path, engine.model_cfg, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("bias, deferred", [(False, False), (True, False), (True, True)])
def test_dora_scale_kernel_matches_its_reference(dtype, bias, deferred):
    """Under TRITON_INTERPRET: tokens without a magnitude row untouched, bias kept out of the
    scale, a deferred delta scaled with y, int8 rows dequantized per slice."""
    from radixlora.lora.layout import quantize_rows
    from radixlora_kernels.dora_scale import dora_scale, dora_scale_ref

    g = torch.Generator().manual_seed(0)
    offsets = [0, 24, 32, 40]
    act = torch.float32 if dtype == torch.int8 else dtype
    y = torch.randn(6, 40, generator=g).to(act)
    gm1 = torch.randn(5, 40, generator=g) * 0.1
    qscales = None
    if dtype == torch.int8:
        parts = [quantize_rows(gm1[:, a:b]) for a, b in zip(offsets, offsets[1:])]
        b_pool = torch.cat([q for q, _ in parts], 1)
        qscales = torch.stack([s for _, s in parts])
    else:
        b_pool = gm1.to(dtype)
    rows = torch.tensor([3, -1, 0, 4, -1, 3], dtype=torch.int32)
    args = dict(bias=torch.randn(40, generator=g).to(act) if bias else None,
                qscales=qscales)
    delta = torch.randn(6, 40, generator=g) if deferred else None
    want_y, got_y = y.clone(), y.clone()
    want_d, got_d = (None, None) if delta is None else (delta.clone(), delta.clone())
    dora_scale_ref(want_y, b_pool, offsets, rows, delta=want_d, **args)
    dora_scale(got_y, b_pool, offsets, rows, delta=got_d, **args)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got_y, want_y, atol=tol, rtol=tol)
    if deferred:
        torch.testing.assert_close(got_d, want_d, atol=1e-6, rtol=1e-6)
        assert not torch.equal(got_d, delta)
    else:
        assert not torch.equal(got_y[0], y[0])
    assert torch.equal(got_y[1], y[1]) and torch.equal(got_y[4], y[4])


def test_row_parallel_scales_wait_for_the_first_step_that_reads_them(checkpoints, dora):
    """Under tensor parallelism the ranks write adapters when their reads end (not in the same
    order), so a row-parallel group's partial squares wait in the pool and are summed by one
    all-reduce at the first step that reads the adapter; a write over the row drops them. Here
    one rank stands for all: its all-reduce is the identity, so the scales must equal the
    single-device pool's."""
    import numpy as np

    from radixlora.step_plan import GroupRows

    base = checkpoints["llama"]
    engine = Engine(base, kv_pages=64, adapter_rows=32)
    single = Engine(base, kv_pages=64, adapter_rows=32).runner.adapter_pool
    pool = engine.runner.adapter_pool
    x, y = (load_adapter(n, dora["llama"][n], engine.model_cfg, 64) for n in ("x", "y"))
    reduced = []

    class Ranks:
        @staticmethod
        def all_reduce(t):
            reduced.append(t.numel())
            return t

    fake = type("Linear", (), {"tp": Ranks})()
    pool.dora_base.row_parallel = lambda group: fake if group in ("o", "down") else None
    x_rows, y_rows = np.arange(0, 9, dtype=np.int32), np.arange(9, 14, dtype=np.int32)
    for p in (pool, single):
        p.write(x, x_rows)
        p.write(y, y_rows)
    assert set(pool._dora_pending) == {8, 13} and not reduced
    assert torch.equal(pool.b_all["qkv"][:, 8], single.b_all["qkv"][:, 8])  # column-parallel
    assert not torch.equal(pool.b_all["o"][:, 8], single.b_all["o"][:, 8])
    step = [{"o": GroupRows(list(range(8)), [1.0] * 8, 8)}]
    pool.finish_dora(step)
    assert len(reduced) == 1 and set(pool._dora_pending) == {13}
    for group in ("o", "down"):
        torch.testing.assert_close(pool.b_all[group][:, 8], single.b_all[group][:, 8])
    pool.finish_dora(step)  # nothing left to finish for this step: no collective
    assert len(reduced) == 1
    pool.write(x, np.arange(10, 19, dtype=np.int32))  # over y's rows: y's wait is void
    assert set(pool._dora_pending) == {18}
