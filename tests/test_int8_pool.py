"""The int8 adapter pool (--lora-dtype int8, M15): A and B rows in int8 with a scale per
(module, rank row), dequantized in the LoRA kernels. Served outputs stay within INT8_TOL of
transformers + PEFT in fp32 (the fp32 pool equals it within 1e-4: test_engine_peft) for single
adapters, every adapter kind and stacks; the trained demo adapters give the same greedy text;
tensor parallel stores the same int8 values as one device; the host tier holds packed int8 +
scales at the byte size the scheduler and the sizing count; at equal pool bytes about twice the
adapters are resident. (The int8 kernels themselves: tests/test_kernels_sgmv.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.config import MODULE_GROUPS, EngineConfig
from radixlora.lora.layout import bytes_per_row, group_row_bytes, load_bytes
from radixlora.sched.adapter_choice import parse_spec
from radixlora.sched.request import uses_adapter
from radixlora.worker.sizing import DeviceMemory, size_pools
from tests.conftest import assert_all_free
from tests.oracle import logprobs, merged_logprobs, peft_model
from tests.test_sizing import LLAMA_8B
from tests.test_tensor_parallel import check_same_results, record_engine_run, run_ranks

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
# logprob tolerance of the int8 pool against the fp32 oracle, over the chosen and top-5 tokens
# of every step: measured at most 0.024 (llama) and 0.027 (qwen2) on these random models, whose
# adapters move the logits far more than trained ones do; greedy tokens differed only where the
# oracle's top two were within 0.007 of each other
INT8_TOL = 0.04
SPECS = ["a", "b", "c", "d", [("a", 1.0), ("b", 1.0)], [("d", 0.7), ("c", -0.4), ("a", 1.5)]]


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (length,), generator=g).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, checkpoints, adapters):
    arch = request.param
    engine = Engine(checkpoints[arch], adapters=adapters[arch], max_rank=64, kv_pages=512,
                    lora_dtype="int8")
    yield engine, peft_model(checkpoints[arch], adapters[arch])
    assert_all_free(engine)


def oracle(ref_model, ids: list[int], spec) -> torch.Tensor:
    if isinstance(spec, str):
        return logprobs(ref_model, ids, [spec])
    return merged_logprobs(ref_model, ids, dict(spec))


@pytest.mark.parametrize("spec", SPECS, ids=["a", "b", "c", "d", "stack", "weighted_stack"])
def test_int8_pool_is_within_tolerance_of_peft(setup, spec):
    """Every generated step's logprobs (the chosen token and the top 5) are within INT8_TOL of
    the oracle on the same tokens, and the greedy token is the oracle's wherever its top two
    are further apart than 2 x INT8_TOL (random tiny models have near-ties, where an int8
    error may pick the other token)."""
    engine, ref_model = setup
    ids = prompt(1, 11)
    out = engine.generate(ids, GREEDY, adapters=spec)[0].outputs[0]
    ref = oracle(ref_model, ids + out.token_ids, spec)
    decided = 0
    for step, token in enumerate(out.token_ids):
        row = ref[len(ids) - 1 + step]
        assert abs(out.logprobs[step] - float(row[token])) <= INT8_TOL
        for tok, lp in out.top_logprobs[step]:
            assert abs(lp - float(row[tok])) <= INT8_TOL
        top2 = row.topk(2).values
        if top2[0] - top2[1] > 2 * INT8_TOL:
            assert token == int(row.argmax()), f"greedy token differs at step {step}"
            decided += 1
    assert decided >= len(out.token_ids) // 2


def test_demo_adapters_give_the_same_greedy_text():
    """The trained demo adapters (and a stack of two) answer the same text from an int8 pool
    as from the model-dtype pool."""
    from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR

    params = SamplingParams(max_tokens=40, temperature=0.0)
    prompts = ["input: the red fox ate 42 fish\noutput:\n",
               "input: a big cat sees 7 fish\noutput:\n"]
    specs = ["upper", "reverse", "digits", "json", [("upper", 1.0), ("reverse", 1.0)]]
    texts = {}
    for lora_dtype in ("auto", "int8"):
        engine = Engine(DEMO_MODEL_DIR, adapters=DEMO_ADAPTERS, lora_dtype=lora_dtype)
        outs = engine.generate([p for p in prompts for _ in specs], params,
                               adapters=specs * len(prompts))
        texts[lora_dtype] = [o.outputs[0].text for o in outs]
        assert_all_free(engine)
    assert texts["int8"] == texts["auto"]
    assert texts["int8"][0].strip() == "THE RED FOX ATE 42 FISH"


def test_hot_swap_and_prefix_cache_on_an_int8_pool(checkpoints, adapters, tmp_path):
    """Re-publishing "a" with other weights loads the new version into int8 rows (within
    tolerance of PEFT on the new weights); a repeated prompt hits the radix cache and answers
    the same tokens."""
    from scripts.checkpoints import build_peft_adapter

    base = checkpoints["llama"]
    engine = Engine(base, adapters=adapters["llama"], max_rank=64, kv_pages=512,
                    lora_dtype="int8")
    ids = prompt(4, 9)
    first = engine.generate(ids, GREEDY, adapters="a")[0]
    again = engine.generate(ids, GREEDY, adapters="a")[0]
    assert again.cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    swapped = build_peft_adapter(base, tmp_path / "a2", seed=99, r=8, lora_alpha=32)
    engine.load_adapter("a", swapped)
    out = engine.generate(ids, GREEDY, adapters="a")[0]
    assert out.cached_tokens == 0  # a new adapter version: a new cache namespace
    ref = logprobs(peft_model(base, {"a": swapped}), ids + out.outputs[0].token_ids, ["a"])
    for step, token in enumerate(out.outputs[0].token_ids):
        assert abs(out.outputs[0].logprobs[step] - float(ref[len(ids) - 1 + step][token])) \
            <= INT8_TOL
    assert_all_free(engine)


def test_tensor_parallel_int8_pool_equals_one_device(checkpoints, adapters, tmp_path):
    """Modules are quantized whole and then sliced, so 2 ranks hold the int8 values and scales
    of one device: the same tokens, logprobs within float32 rounding (as for the fp32 pool)."""
    from scripts.checkpoints import build_peft_adapter

    base = checkpoints["qwen2"]
    engine = Engine(base, adapters=adapters["qwen2"], dtype="float32", kv_pages=256,
                    max_running=8, adapter_rows=160, lora_dtype="int8")
    swapped = build_peft_adapter(base, tmp_path / "swapped", seed=99, r=8, lora_alpha=32)
    rec, _, _ = record_engine_run(engine, swapped)
    check_same_results(run_ranks(tmp_path, base, engine.config, rec, 2), rec.results)


def test_host_tier_holds_packed_int8_and_scales(checkpoints, adapters):
    """A packed adapter is its int8 rows plus a float32 scale per (module, rank row) of the
    groups it adapts: the bytes load_bytes counts (the scheduler's swap cost and host-tier
    budget), a quarter of the fp32 packing plus the scales; written into the pool it gives back
    each module's weights within int8 rounding."""
    engine = Engine(checkpoints["llama"], adapters=adapters["llama"], lora_dtype="int8")
    pool = engine.runner.adapter_pool
    adapter = engine.registry.by_name["d"]  # rank_pattern, alpha_pattern, one layer only
    packed = pool.packed(adapter)
    assert pool.host.get(adapter.adapter_id) is packed and packed.data.dtype == torch.int8
    cfg = engine.runner.cfg
    assert packed.nbytes == load_bytes(cfg, torch.int8, adapter.group_ranks)
    fp32 = load_bytes(cfg, torch.float32, adapter.group_ranks)
    scales = sum(len(MODULE_GROUPS[g]) * r for g, r in adapter.group_ranks.items()) * 4
    assert packed.nbytes == fp32 // 4 + scales * cfg.num_layers
    rows = torch.arange(adapter.rank)
    pool.write(packed, rows.numpy())
    for (layer, module), (lora_a, lora_b) in adapter.weights.items():
        group = next(g for g, mods in MODULE_GROUPS.items() if module in mods)
        i, r = MODULE_GROUPS[group].index(module), lora_a.shape[0]
        lo, hi = pool.out_offsets[group][i : i + 2]
        qs = pool.qscales[layer][group][i, :r]
        delta = (lora_b @ lora_a).float()  # what the pool's rows stand for: B A
        b_rows = pool.b[layer][group][:r, lo:hi].float().t() * qs
        got = b_rows @ pool.a[layer][group][i, :r].float()
        assert (got - delta).abs().max() <= 0.02 * delta.abs().max()


def test_equal_pool_bytes_hold_twice_the_adapters():
    """Llama-3-8B shapes: a rank row takes 81,920 int8 values and 7 float32 scales (one per
    module) per layer against 81,920 bf16 values; the bytes of a bf16 pool of 32 adapters of
    rank 64 hold 63 of rank 64 (255 of rank 16) in int8, and with the same --max-loras the KV
    pool gets the bytes int8 saves."""
    bf16 = bytes_per_row(LLAMA_8B, torch.bfloat16)
    int8 = bytes_per_row(LLAMA_8B, torch.int8)
    assert bf16 == 32 * 2 * 81920 and int8 == 32 * (81920 + 7 * 4)
    config = EngineConfig(max_running=256, max_batch_tokens=8192, host_adapter_bytes=0)
    memory = DeviceMemory(total=140 << 30, free=120 << 30)
    sized = {name: size_pools(config, memory, weights_bytes=16 << 30, activation_bytes=2 << 30,
                               graph_bytes=1 << 30, kv_slot_bytes=131072,
                               group_row_bytes=group_row_bytes(LLAMA_8B, dtype))[1]
             for name, dtype in (("bf16", torch.bfloat16), ("int8", torch.int8))}
    assert sized["bf16"].adapter_rows == sized["int8"].adapter_rows == 32 * 64
    saved = sized["bf16"].adapter_bytes - sized["int8"].adapter_bytes
    assert sized["int8"].kv_tokens - sized["bf16"].kv_tokens == saved // 131072
    same_bytes = dataclasses.replace(config, adapter_rows=sized["bf16"].adapter_bytes // int8)
    _, int8_sized = size_pools(same_bytes, memory, weights_bytes=16 << 30,
                               activation_bytes=2 << 30, graph_bytes=1 << 30,
                               kv_slot_bytes=131072,
                               group_row_bytes=group_row_bytes(LLAMA_8B, torch.int8))
    assert int8_sized.adapter_bytes <= sized["bf16"].adapter_bytes
    assert (sized["bf16"].adapters_of_rank(64), int8_sized.adapters_of_rank(64)) == (32, 63)
    assert (sized["bf16"].adapters_of_rank(16), int8_sized.adapters_of_rank(16)) == (128, 255)


def test_lora_dtype_flag_reaches_the_engine_config():
    from radixlora.cli import build_parser
    from radixlora.cli.flags import engine_overrides

    args = build_parser().parse_args(["serve", "--lora-dtype", "int8"])
    assert EngineConfig(**engine_overrides(args)).lora_dtype == "int8"
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        EngineConfig(lora_dtype="fp4")


def test_cache_namespace_names_the_int8_pool(checkpoints, adapters):
    """KV computed through int8 adapter rows is never found under the model-dtype pool's
    namespace of the same adapter set (one server has one pool, but the key stays honest);
    the base model's namespace does not depend on the pool."""
    namespaces = {}
    for lora_dtype in ("auto", "int8"):
        engine = Engine(checkpoints["llama"], adapters=adapters["llama"], lora_dtype=lora_dtype)
        for spec in (None, "a"):
            reqs, _ = engine.intake.requests("r", np.arange(2, 9, dtype=np.int32), GREEDY,
                                             parse_spec(spec))
            namespaces[lora_dtype, spec] = reqs[0].namespace
    assert namespaces["auto", None] == namespaces["int8", None]
    assert namespaces["auto", "a"] != namespaces["int8", "a"]
    assert dict(namespaces["int8", "a"])["adapter_pool"] == "int8"
    assert uses_adapter(namespaces["int8", "a"], engine.registry.by_name["a"].adapter_id)


def test_int8_expand_multiplies_in_the_activations_precision():
    """On CUDA the expands once rounded v to bfloat16 for every int8 b_pool, float32 models
    included: Triton and the torch backend then differed by up to 0.149 in logprob on an fp32
    model (scripts/check_quant_gpu.py measures it). A float32 model's product is fp32; a 16-bit
    model's rounds v to bfloat16 (as a 16-bit pool rounds it to its own dtype), also where the
    deltas go to a float32 buffer."""
    from radixlora_kernels.sgmv_expand import expand_fp32_dot

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert expand_fp32_dot(torch.int8, torch.float32, cuda)
    assert not expand_fp32_dot(torch.int8, torch.bfloat16, cuda)
    assert not expand_fp32_dot(torch.int8, torch.float16, cuda)
    assert not expand_fp32_dot(torch.bfloat16, torch.float32, cuda)  # a bf16 pool's own dtype
    assert expand_fp32_dot(torch.float32, torch.float32, cuda)
    assert expand_fp32_dot(torch.int8, torch.bfloat16, cpu)  # the interpreter: always fp32


@pytest.mark.parametrize("grouped", [False, True], ids=["per_segment", "grouped"])
def test_int8_deferred_delta_equals_the_torch_backend(grouped):
    """The Triton backend's deferred delta on an int8 pool (a float32 delta buffer) equals the
    torch backend's on the same pool, per-segment and grouped."""
    from radixlora_kernels.lora_ops import LoraBatchMeta, TorchLoraBackend, TritonLoraBackend
    from tests.test_kernels_sgmv import build_case, build_grouped_case, int8_pool

    build = build_grouped_case if grouped else build_case
    pool, x, _, segs = build("stacks_1_to_8" if grouped else "stacks", 3)
    quant, qscales, _ = int8_pool(pool)
    meta = LoraBatchMeta.from_segments(*segs, device="cpu", grouped=grouped)
    deltas = []
    for backend in (TritonLoraBackend(split_k=2), TorchLoraBackend()):
        delta = torch.zeros(x.shape[0], quant.b.shape[1])  # a zeroed workspace
        backend.deferred_delta(x, quant.a, quant.b, quant.out_offsets, meta, delta, qscales)
        deltas.append(delta)
    torch.testing.assert_close(deltas[0], deltas[1], rtol=1e-5, atol=1e-5)
