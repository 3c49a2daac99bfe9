"""Mixture-of-experts bases (Qwen3-MoE, Mixtral) against transformers + PEFT (fp32, CPU), on tiny
random checkpoints saved by transformers: one batch mixes the base, two attention adapters of
different ranks (one rsLoRA), their stack and a DoRA adapter, with the radix cache on and off.
The grouped expert GEMM (Triton, interpreter) against its torch reference. Two tensor-parallel ranks
(every expert's channels split) answer as one device; `radixlora serve` answers as the Engine,
and structured output holds on an MoE base. An FP8 checkpoint (scales per channel or per block,
experts included) answers as its dequantized twin. What is not served on these bases (LoRA on
a dense MLP layer, NF4 weights) is refused by name; LoRA on the router and the experts is
tests/test_moe_lora.py's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixlora import Engine, SamplingParams
from radixlora.config import ModelConfig
from radixlora.errors import AdapterError, ModelLoadError
from radixlora_kernels.moe import (
    CONFIGS,
    Fp8Experts,
    fp8_block_k,
    moe_align,
    moe_experts,
    moe_experts_ref,
    smem_block_k,
)
from tests.conftest import assert_all_free
from tests.oracle import peft_model
from tests.test_families import (
    ENGINE,
    check_int8_pool,
    check_oracle,
    check_two_ranks,
    family_builder,
    mixed_batch,
)

MOE = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def moe_family(tmp_path_factory):
    return family_builder(tmp_path_factory.mktemp("moe"), seed=50)


def test_configs_declare_their_experts(moe_family):
    qwen = ModelConfig.from_dir(moe_family("qwen3_moe")[0])
    assert (qwen.num_experts, qwen.experts_per_token, qwen.moe_intermediate_size) == (6, 2, 32)
    assert qwen.moe_layers == (True, False, True) and qwen.norm_topk_prob and qwen.qk_norm
    mixtral = ModelConfig.from_dir(moe_family("mixtral")[0])
    assert mixtral.moe_layers == (True, True) and mixtral.norm_topk_prob
    assert mixtral.lora_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "router",
                                    "experts.gate_up_proj", "experts.down_proj")


@pytest.mark.parametrize("arch", MOE)
def test_a_mixed_batch_equals_peft_with_the_cache_on_and_off(arch, moe_family):
    model, adapters = moe_family(arch)
    ref = peft_model(model, adapters)
    for cache in (True, False):
        engine = Engine(model, adapters=adapters, enable_radix_cache=cache, **ENGINE)
        runs = mixed_batch(engine)
        check_oracle(ref, runs)
        again = mixed_batch(engine)
        assert [o.token_ids for *_, o in again] == [o.token_ids for *_, o in runs]
        check_oracle(ref, again)
        assert_all_free(engine)


@pytest.mark.parametrize("arch", MOE)
def test_two_ranks_split_every_experts_channels(arch, moe_family, tmp_path):
    check_two_ranks(*moe_family(arch), ENGINE, tmp_path)


@pytest.mark.parametrize("arch", MOE)
def test_int8_pool_is_within_int8_error_of_peft(arch, moe_family):
    check_int8_pool(*moe_family(arch), ENGINE)


def stacked_twin(model, path):
    """The per-expert checkpoint at `model` with its experts stacked as transformers 5 keeps
    them in memory: experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    shutil.copytree(model, path)
    tensors = load_file(path / "model.safetensors")
    prefixes = {k.split(".experts.")[0] for k in tensors if ".experts." in k}
    for prefix in prefixes:
        count = len({k for k in tensors if k.startswith(prefix + ".experts.")}) // 3
        names = [f"{prefix}.experts.{e}" for e in range(count)]
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.stack([
            torch.cat([tensors.pop(f"{n}.gate_proj.weight"), tensors.pop(f"{n}.up_proj.weight")])
            for n in names])
        tensors[f"{prefix}.experts.down_proj"] = torch.stack([
            tensors.pop(f"{n}.down_proj.weight") for n in names])
    save_file(tensors, path / "model.safetensors")
    return path


def test_stacked_expert_checkpoints_load_as_per_expert_ones(moe_family, tmp_path):
    model, adapters = moe_family("qwen3_moe")
    twin = stacked_twin(model, tmp_path / "stacked")
    runs = [mixed_batch(Engine(m, adapters=adapters, **ENGINE)) for m in (model, twin)]
    for (_, _, a), (_, _, b) in zip(*runs, strict=True):  # the same function; CPU threads
        assert a.token_ids == b.token_ids  # may sum in another order run to run
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    (tmp_path / "ranks").mkdir()
    check_two_ranks(twin, adapters, ENGINE, tmp_path / "ranks")


def test_served_over_http_equals_the_engine(moe_family, tmp_path):
    """`radixlora serve` on the Qwen3-MoE checkpoint (a tokenizer added) with an attention
    adapter and PEFT's all-linear (router and experts too: the server sizes its pool for the
    experts from it), through the official openai client: the Engine's greedy tokens for the
    base and each adapter."""
    import openai

    from scripts.checkpoints import TINY_CORPUS, build_peft_adapter, build_tokenizer
    from tests.server_harness import engine_like_server, running_server

    model, adapters = moe_family("qwen3_moe")
    served = tmp_path / "served"
    shutil.copytree(model, served)
    build_tokenizer(TINY_CORPUS * 4, 256).save(str(served / "tokenizer.json"))
    given = {"a": adapters["a"],
             "all": build_peft_adapter(model, tmp_path / "all", seed=9, r=4, lora_alpha=8,
                                       target_modules="all-linear")}
    prompt = list(range(40, 60))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = engine_like_server(served, given)
    assert engine.runner.adapter_pool.groups[-2:] == ("experts_gate_up", "experts_down")
    want = {name: engine.generate(prompt, params, adapters=adapter)[0].outputs[0].token_ids
            for name, adapter in (("served", None), ("a", "a"), ("all", "all"))}
    assert want["served"] != want["a"] and want["served"] != want["all"]
    with running_server(served, given, tmp_path / "server.log") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for name, tokens in want.items():
            got = client.completions.create(
                model=name, prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            assert [int(t.removeprefix("token_id:")) for t in got.choices[0].logprobs.tokens] \
                == tokens


def test_structured_output_on_an_moe_base(tmp_path):
    """The demo's vocabulary and tokenizer on a Qwen3-MoE config, random weights
    (--load-format dummy): a json_object answer is JSON from its first token."""
    import openai

    from radixlora.demo import DEMO_MODEL_DIR
    from tests.server_harness import running_server

    model = tmp_path / "moe"
    shutil.copytree(DEMO_MODEL_DIR, model, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    (model / "config.json").write_text(json.dumps(config))
    with running_server(model, {}, tmp_path / "server.log", "--load-format", "dummy") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        answer = client.chat.completions.create(
            model="moe", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            response_format={"type": "json_object"})
        assert answer.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize(("tokens", "experts", "top_k"),
                         [(1, 6, 2), (5, 4, 2), (70, 8, 3), (200, 4, 2)])
def test_grouped_expert_gemm_equals_the_reference(tokens, experts, top_k):
    g = torch.Generator().manual_seed(tokens)
    hidden, inter = 32, 24
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k, -1)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(experts, hidden, inter, generator=g) * 0.2
    out = moe_experts(x, ids, weights, gate_up, down)
    torch.testing.assert_close(out, moe_experts_ref(x, ids, weights, gate_up, down),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("tokens", "scale_k"), [(3, 16), (70, 16), (40, 32), (9, 0)])
def test_fp8_experts_equal_their_dequantized_weights(tokens, scale_k):
    """FP8 expert weights with scales per row and block of scale_k columns (0: per row), in
    the grouped GEMM (K steps narrowed to the blocks) and the torch loop, against the same
    weights dequantized; blocks of 16 need a 16-column step where the config's is wider."""
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 4, 64, 48, 2
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=g), -1).topk(top_k, -1)

    def fp8(n, k):
        w8 = (torch.randn(experts, n, k, generator=g) * 100).to(torch.float8_e4m3fn)
        step = scale_k or k
        scale = torch.rand(experts, n, -(-k // step), generator=g) * 0.01 + 0.001
        return Fp8Experts(w8, scale, step)

    gate_up, down = fp8(2 * inter, hidden), fp8(hidden, inter)
    dense = [torch.stack([w[e] for e in range(experts)]) for w in (gate_up, down)]
    want = moe_experts_ref(x, ids, weights, *dense)
    torch.testing.assert_close(moe_experts_ref(x, ids, weights, gate_up, down), want)
    torch.testing.assert_close(moe_experts(x, ids, weights, gate_up, down), want,
                               rtol=1e-4, atol=1e-4)


def test_a_reduction_step_never_straddles_two_scale_blocks():
    assert fp8_block_k(64, 128, 2048) == 64
    assert fp8_block_k(256, 128, 2048) == 128
    assert fp8_block_k(256, 2048, 2048) == 256  # one block per row: any step
    with pytest.raises(ValueError, match="no reduction step"):
        fp8_block_k(64, 24, 96)


def test_fp32_tiles_fit_the_shared_memory_that_bf16_ones_do():
    """Hopper's 227 KiB per program: the decode tile of CONFIGS (16 x 128, K step 256, three
    stages) needs 288 KiB of buffers in fp32 (the launch failed with OutOfResources on an H100),
    so its step halves there and stays whole in bf16 and with FP8 weights; no limit, no change."""
    hopper = 232_448
    decode = CONFIGS[0][1]
    assert smem_block_k(decode.block_k, decode, 2, 2, hopper) == decode.block_k
    assert smem_block_k(decode.block_k, decode, 2, 1, hopper) == decode.block_k
    assert smem_block_k(decode.block_k, decode, 4, 4, hopper) == decode.block_k // 2
    assert smem_block_k(decode.block_k, decode, 4, 4, None) == decode.block_k
    for _, config in CONFIGS:
        step = smem_block_k(config.block_k, config, 4, 4, hopper)
        tiles = (config.block_m + config.block_n) * step * 4 * (config.num_stages - 1)
        assert tiles <= hopper and step >= 16


def test_the_reference_keeps_the_models_dtype():
    """The torch expert loop in bf16 (the routing weights are float32): bf16 out, near fp32."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=g)
    weights, ids = torch.softmax(torch.randn(6, 4, generator=g), -1).topk(2, -1)
    gate_up = torch.randn(4, 48, 32, generator=g) * 0.2
    down = torch.randn(4, 32, 24, generator=g) * 0.2
    want = moe_experts_ref(x, ids, weights, gate_up, down)
    half = [t.to(torch.bfloat16) for t in (x, gate_up, down)]
    got = moe_experts_ref(half[0], ids, weights, *half[1:])
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)


def test_alignment_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    rows, block_expert, used = moe_align(ids, num_experts=4, block_m=4)
    assert int(used) == 12  # experts 0, 1, 2: one block of 4 each; expert 3 none
    _check_alignment(ids, 4, 4, rows, block_expert, used)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"),
                         [(1, 128, 8, 16), (700, 8, 2, 16), (300, 64, 4, 64), (2100, 16, 8, 32)])
def test_alignment_places_every_row_once(tokens, experts, top_k, block_m):
    """More rows than the kernel's chunk of 1,024, experts left without rows, one token; more
    rows than ALIGN_ONE_PROGRAM_MAX_ROWS (torch's sort)."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randn(tokens, experts, generator=g).topk(top_k, -1).indices
    _check_alignment(ids, experts, block_m, *moe_align(ids, experts, block_m))


def test_experts_after_an_alignment_that_did_not_run_do_nothing(monkeypatch):
    """The compile cache's dry run launches no kernel variant it has not loaded: with the
    alignment kernel skipped, the grouped GEMMs that read its outputs must not read garbage
    rows (num_padded starts at 0, so every block is past the end)."""
    import radixlora_kernels.moe as moe

    class Skipped:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(moe, "_align", Skipped())
    g = torch.Generator().manual_seed(5)
    ids = torch.randn(6, 4, generator=g).topk(2, -1).indices
    rows, block_expert, used = moe.moe_align(ids, 4, 16)
    assert int(used) == 0
    x = torch.randn(6, 32, generator=g)
    out = moe.grouped_gemm(x, torch.randn(4, 24, 32, generator=g), (rows, block_expert, used),
                           12, 2, moe.gemm_config(12, 4))
    assert out.shape == (12, 24)


def _check_alignment(ids, experts, block_m, rows, block_expert, used):
    """Each expert's rows fill whole blocks of that expert, real rows first, then the sentinel
    M; every row exactly once; nothing in use past `used`."""
    m, flat = ids.numel(), ids.view(-1)
    counts = torch.bincount(flat, minlength=experts)
    assert int(used) == int(((counts + block_m - 1) // block_m * block_m).sum())
    blocks = rows[:int(used)].view(-1, block_m)
    for block, expert in zip(blocks, block_expert[:blocks.shape[0]].tolist(), strict=True):
        real = [r for r in block.tolist() if r < m]
        assert real and all(flat[r] == expert for r in real)
        assert all(r == m for r in block.tolist()[len(real):])
    assert sorted(r for r in rows.tolist() if r < m) == list(range(m))
    assert (rows[int(used):] == m).all()


def _expert_adapter(source, path, key: str):
    """An attention adapter with one more LoRA pair under `key` (a module PEFT adapts)."""
    shutil.copytree(source, path)
    tensors = load_file(path / "adapter_model.safetensors")
    a = next(t for k, t in tensors.items() if "lora_A" in k)
    tensors[f"base_model.model.{key}.lora_A.weight"] = a.clone()
    tensors[f"base_model.model.{key}.lora_B.weight"] = torch.zeros(32, a.shape[0])
    save_file(tensors, path / "adapter_model.safetensors")
    return path


@pytest.mark.parametrize(("key", "match"), [
    ("model.layers.1.mlp.gate_proj", r"model\.layers\.1\.mlp\.gate_proj: LoRA on .* a dense MLP"),
    ("model.layers.1.mlp.experts.0.gate_proj", r"layer 1 of the base has no expert 0"),
    ("model.layers.0.mlp.experts.9.up_proj", r"layer 0 of the base has no expert 9"),
])
def test_lora_on_a_dense_mlp_or_a_missing_expert_is_refused_by_name(key, match, moe_family,
                                                                    tmp_path):
    model, adapters = moe_family("qwen3_moe")  # layer 1 is dense; 6 experts
    bad = _expert_adapter(adapters["a"], tmp_path / "bad", key)
    with pytest.raises(AdapterError, match=match):
        Engine(model, adapters={"bad": bad}, **ENGINE)


@pytest.mark.parametrize("strategy", ["channel", "block"])
@pytest.mark.parametrize("arch", MOE)
def test_an_fp8_checkpoint_equals_its_dequantized_twin(arch, strategy, moe_family, tmp_path):
    """Every projection in FP8, the experts' too (kept FP8 in the stacked experts with their
    scales), against the twin saved with those weights dequantized, attention adapters beside
    it; under tensor parallel each rank dequantizes its share of the experts."""
    from scripts.checkpoints import build_fp8_model

    model, adapters = moe_family(arch)
    path, ref = build_fp8_model(tmp_path / "fp8", model, strategy, (24, 16))
    stored = load_file(path / "model.safetensors")
    assert sum(".experts." in k and v.dtype == torch.float8_e4m3fn for k, v in stored.items())
    engine = Engine(path, adapters=adapters, **ENGINE)
    assert engine.model_cfg.quantization == "fp8"
    experts = next(layer.mlp.experts for layer in engine.runner.model.layers
                   if hasattr(layer.mlp, "experts"))
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_scale.shape[2] == (
        1 if strategy == "channel" else -(-experts.gate_up_proj.shape[2] // 16))
    runs = [mixed_batch(e) for e in (engine, Engine(ref, adapters=adapters, **ENGINE))]
    for (_, _, a), (_, _, b) in zip(*runs, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    assert_all_free(engine)
    if arch == "qwen3_moe" and strategy == "block":
        (tmp_path / "ranks").mkdir()
        check_two_ranks(path, adapters, ENGINE, tmp_path / "ranks")


def test_target_parameters_and_unserved_features_are_refused(moe_family, tmp_path):
    model, adapters = moe_family("qwen3_moe")
    params = tmp_path / "params"
    shutil.copytree(adapters["a"], params)
    config = json.loads((params / "adapter_config.json").read_text())
    config["target_parameters"] = ["model.embed_tokens.weight"]
    (params / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=r"target_parameters model\.embed_tokens\.weight are "
                                           r"not supported.*gate_up_proj, down_proj, gate"):
        Engine(model, adapters={"p": params}, **ENGINE)
    with pytest.raises(ModelLoadError, match="nf4 base is not served on Qwen3-MoE"):
        Engine(model, quantization="nf4", **ENGINE)
