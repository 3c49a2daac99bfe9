"""Every family against transformers + PEFT (fp32, CPU), on tiny random checkpoints saved by
transformers itself: Qwen3, Gemma 2, Gemma 3 (gemma3_text, and the language model of a
multimodal gemma3 checkpoint), Phi-3 with fused qkv / gate_up tensors, partial rotary and
longrope. One batch mixes the base, two adapters of different ranks (one rsLoRA), their stack and
a DoRA adapter; greedy tokens equal and logprobs within 1e-4 with the radix cache on and off;
two tensor-parallel ranks over gloo answer what one device does. Prompts are longer than the
sliding windows, so sliding layers drop what falls out of them."""

from __future__ import annotations

import msgspec
import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.config import ModelConfig
from radixlora.errors import AdapterError, ModelLoadError
from radixlora.step_plan import StepPlan
from scripts.checkpoints import (
    FAMILY_TARGETS,
    LANGUAGE_ONLY,
    build_fp8_model,
    build_hf_model,
    build_peft_adapter,
)
from tests.conftest import assert_all_free
from tests.oracle import logprobs, peft_model
from tests.test_int8_pool import INT8_TOL
from tests.test_quant_nf4 import greedy_against, transformers_nf4
from tests.test_tensor_parallel import Recorded, check_same_results, run_ranks

FAMILIES = ("qwen3", "gemma2", "gemma3_text", "gemma3", "phi3")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
MIX = [None, "a", "b", ["a", "b"], "dora"]
TOL = 1e-4
ENGINE = dict(dtype="float32", kv_pages=512, max_running=8, adapter_rows=96)


def prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 250, (length,), generator=g).tolist()


def targets(arch: str, subset: bool = False):
    if arch == "gemma3":
        return LANGUAGE_ONLY
    modules = FAMILY_TARGETS.get(arch, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"))
    return list(modules[::2] if subset else modules)


def family_builder(root, seed: int):
    """arch -> (model dir, {adapter name: dir}) under `root`, built on first use: a rank-8
    LoRA, a rank-4 rsLoRA on half the targets and a DoRA adapter, made by PEFT."""
    built = {}

    def get(arch: str):
        if arch not in built:
            model = build_hf_model(root / arch, arch)
            specs = {"a": dict(r=8, lora_alpha=16, target_modules=targets(arch)),
                     "b": dict(r=4, lora_alpha=8, use_rslora=True,
                               target_modules=targets(arch, subset=True)),
                     "dora": dict(r=4, lora_alpha=8, use_dora=True,
                                  target_modules=targets(arch))}
            built[arch] = model, {name: build_peft_adapter(model, root / f"{arch}-{name}",
                                                           seed=seed + i, **spec)
                                  for i, (name, spec) in enumerate(specs.items())}
        return built[arch]

    return get


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return family_builder(tmp_path_factory.mktemp("families"), seed=20)


def mixed_batch(engine: Engine):
    prompts = [prompt(30 + i, 12 + 5 * i) for i in range(len(MIX))]
    specs = [[(n, 1.0) for n in s] if isinstance(s, list) else s for s in MIX]
    outs = engine.generate(prompts, GREEDY, adapters=specs)
    return [(p, spec, o.outputs[0]) for p, spec, o in zip(prompts, MIX, outs)]


def check_oracle(ref_model, runs) -> None:
    for ids, spec, out in runs:
        active = None if spec is None else spec if isinstance(spec, list) else [spec]
        ref = logprobs(ref_model, ids + out.token_ids, active)
        for step, token in enumerate(out.token_ids):
            row = ref[len(ids) - 1 + step]
            assert token == int(row.argmax()), f"{spec}: greedy token differs at step {step}"
            assert abs(out.logprobs[step] - float(row[token])) <= TOL, (spec, step)
            for tok, lp in out.top_logprobs[step]:
                assert abs(lp - float(row[tok])) <= TOL, (spec, step, tok)


def engine_config(arch: str) -> dict:
    """Phi-3's longrope takes its short factors while the served context fits the original
    one (transformers: while the sequence does)."""
    return {**ENGINE, "context_length": 64} if arch == "phi3" else ENGINE


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_mixed_batch_equals_peft_with_the_cache_on_and_off(arch, family):
    model, adapters = family(arch)
    ref = peft_model(model, adapters)
    for cache in (True, False):
        engine = Engine(model, adapters=adapters, enable_radix_cache=cache,
                        **engine_config(arch))
        runs = mixed_batch(engine)
        check_oracle(ref, runs)
        again = mixed_batch(engine)  # the second pass reads the first one's cached prefixes
        assert [o.token_ids for *_, o in again] == [o.token_ids for *_, o in runs]
        check_oracle(ref, again)
        assert_all_free(engine)


def test_longrope_past_the_original_context_takes_the_long_factors(family):
    """Served past original_max_position_embeddings (64), Phi-3 rotates with the long factors,
    as transformers does for a sequence longer than that."""
    model, adapters = family("phi3")
    engine = Engine(model, adapters=adapters, **ENGINE)
    assert engine.model_cfg.rope.use_long
    ids = prompt(5, 70)
    runs = [(ids, spec, engine.generate(ids, GREEDY, adapters=spec)[0].outputs[0])
            for spec in (None, "dora")]
    check_oracle(peft_model(model, adapters), runs)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_two_ranks_answer_what_one_device_does(arch, family, tmp_path):
    check_two_ranks(*family(arch), engine_config(arch), tmp_path)


def check_two_ranks(model, adapters, config: dict, tmp_path, batch=mixed_batch) -> None:
    """Two tensor-parallel ranks over gloo answer the mixed batch's steps (`batch`'s) as one
    device."""
    engine = Engine(model, adapters=adapters, **config)
    rec = Recorded([], [])
    launch, finish = engine.executor.launch, engine.executor.finish

    def recording_launch(plan):
        rec.plans.append(msgspec.msgpack.decode(msgspec.msgpack.encode(plan), type=StepPlan))
        return launch(plan)

    def recording_finish(step):
        rec.results.append(finish(step))
        return rec.results[-1]

    engine.executor.launch, engine.executor.finish = recording_launch, recording_finish
    batch(engine)
    check_same_results(run_ranks(tmp_path, model, engine.config, rec, 2), rec.results)


def test_unsupported_architectures_and_targets_are_refused_by_name(family, tmp_path):
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'qwen2_moe'.*closest is "
                                             r"'qwen3_moe'"):
        ModelConfig.from_hf({"model_type": "qwen2_moe"})
    model, adapters = family("qwen3")
    embed = build_peft_adapter(model, tmp_path / "embed", seed=3, r=4, lora_alpha=8,
                               target_modules=["q_proj", "embed_tokens"])
    saved = build_peft_adapter(model, tmp_path / "saved", seed=4, r=4, lora_alpha=8,
                               target_modules=["q_proj"], modules_to_save=["lm_head"])
    engine = Engine(model, **ENGINE)
    with pytest.raises(AdapterError, match="LoRA on 'embed_tokens' is not supported"):
        engine.load_adapter("embed", embed)
    with pytest.raises(AdapterError, match=r"modules_to_save \(lm_head\) are not supported"):
        engine.load_adapter("saved", saved)
    phi3, _ = family("phi3")
    with pytest.raises(AdapterError, match="target module 'qkv_proj' is not supported on Qwen3"):
        engine.load_adapter("fused", build_peft_adapter(phi3, tmp_path / "fused", seed=5, r=4,
                                                        lora_alpha=8,
                                                        target_modules=["qkv_proj"]))


@pytest.mark.parametrize("arch", FAMILIES)
def test_prompt_logprobs_equal_peft_with_final_softcap(arch, family):
    """score(): every prompt token's logprob given those before it, through the same final
    norm, LM head and (Gemma 2) final soft-capping as the sampled ones."""
    model, adapters = family(arch)
    ref = peft_model(model, adapters)
    engine = Engine(model, adapters=adapters, **engine_config(arch))
    ids = prompt(7, 30)
    for spec in (None, "a", "dora"):
        got = engine.score(ids, 1, adapters=spec)[0]
        want = logprobs(ref, ids, None if spec is None else [spec])
        assert len(got) == len(ids) - 1
        assert max(abs(g - float(want[i, t])) for i, (g, t) in
                   enumerate(zip(got, ids[1:]))) <= TOL, spec
    assert_all_free(engine)


@pytest.mark.parametrize("arch", FAMILIES)
def test_nf4_at_load_equals_bitsandbytes_on_the_family(arch, family):
    model, _ = family(arch)
    engine = Engine(model, quantization="nf4", **engine_config(arch))
    assert greedy_against(engine, transformers_nf4(model), prompt(9, 20), max_tokens=8) <= TOL


@pytest.mark.parametrize("strategy", ["channel", "block"])  # block: Qwen's FP8 checkpoints' form
@pytest.mark.parametrize("arch", FAMILIES)
def test_fp8_checkpoint_equals_its_dequantized_twin(arch, family, tmp_path, strategy):
    model, adapters = family(arch)
    path, ref = build_fp8_model(tmp_path / "fp8", model, strategy, (24, 16))
    engine = Engine(path, adapters=adapters, **engine_config(arch))
    twin = Engine(ref, adapters=adapters, **engine_config(arch))
    assert engine.model_cfg.quantization == "fp8"
    ids = prompt(11, 20)
    for spec in (None, "a"):
        ours = engine.generate(ids, GREEDY, adapters=spec)[0].outputs[0]
        theirs = twin.generate(ids, GREEDY, adapters=spec)[0].outputs[0]
        assert ours.token_ids == theirs.token_ids
        assert max(abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs)) <= 1e-6


@pytest.mark.parametrize("arch", FAMILIES)
def test_int8_pool_is_within_int8_error_of_peft(arch, family):
    model, adapters = family(arch)
    check_int8_pool(model, adapters, engine_config(arch))


def check_int8_pool(model, adapters, config: dict) -> None:
    """The int8 adapter pool (tests/test_int8_pool.py's tolerance and near-tie rule)."""
    engine = Engine(model, adapters=adapters, lora_dtype="int8", **config)
    ref = peft_model(model, adapters)
    ids = prompt(13, 15)
    for spec in ("a", "b", ["a", "b"]):
        chosen = [[(name, 1.0) for name in spec]] if isinstance(spec, list) else spec
        out = engine.generate(ids, GREEDY, adapters=chosen)[0].outputs[0]
        want = logprobs(ref, ids + out.token_ids, spec if isinstance(spec, list) else [spec])
        for step, token in enumerate(out.token_ids):
            row = want[len(ids) - 1 + step]
            assert abs(out.logprobs[step] - float(row[token])) <= INT8_TOL, (spec, step)
            top2 = row.topk(2).values
            if top2[0] - top2[1] > 2 * INT8_TOL:
                assert token == int(row.argmax()), (spec, step)
    assert_all_free(engine)


def test_graphs_share_one_logits_buffer_and_keep_the_final_softcap(family):
    """Every graph's logits go to StaticInputs' one buffer (the graphs' static path run eagerly,
    the Triton kernels under the interpreter), soft-capped in place as Gemma 2's head does:
    greedy tokens and logprobs equal PEFT's; the head's logits into a buffer equal the head's
    own, also through a head that is not one Linear (a tensor-parallel one)."""
    from radixlora.worker.cuda_graph import StaticInputs

    buffers = set()

    class EagerStaticInputs(StaticInputs):
        def forward(self, key, *args, **kw):
            out = self.static_forward(key, *args, **kw)
            buffers.add(out.logits.untyped_storage().data_ptr())
            return out

    model, adapters = family("gemma2")
    engine = Engine(model, adapters=adapters, attention_backend="triton", lora_backend="triton",
                    **ENGINE)
    graphs = engine.runner.graphs = EagerStaticInputs(engine.runner, max_batch=8,
                                                      max_context=512, max_rows=32)
    check_oracle(peft_model(model, adapters), mixed_batch(engine))
    assert buffers == {graphs.logits.untyped_storage().data_ptr()}
    lm = engine.runner.model
    h = torch.randn(3, lm.cfg.hidden_size)
    want = lm.logits(h)
    assert lm.cfg.final_softcap and torch.equal(lm.logits(h, torch.empty_like(want)), want)
    lm.lm_head = torch.nn.Sequential(lm.lm_head)
    assert torch.equal(lm.logits(h, torch.empty_like(want)), want)
    assert_all_free(engine)
