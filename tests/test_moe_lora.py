"""LoRA on an MoE base's router and stacked experts, as PEFT trains it (target_parameters on the
experts, all-linear, and adapters with a pair on each expert's own module): the kernels
(Triton, interpreter) against their torch reference and a per-row loop; Qwen3-MoE and Mixtral
against transformers + PEFT (fp32, CPU) in one batch mixing the base, an attention adapter, an
expert adapter, their stack, an rsLoRA adapter on both and PEFT's all-linear, with the radix
cache on and off, over two tensor-parallel ranks, in the int8 pool and through the CUDA graphs'
static buffers; the pool's expert rows (none unless targeted)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixlora import Engine, SamplingParams
from radixlora.config import EngineConfig, ModelConfig
from radixlora.errors import AdapterError, InvalidRequestError
from radixlora.lora.layout import quantize_rows
from radixlora.worker.sizing import with_start_adapters
from radixlora_kernels.lora_ops import LoraBatchMeta, LoraGroups
from radixlora_kernels.moe import align_blocks
from radixlora_kernels.moe_lora import expert_lora, expert_lora_ref, token_rows
from scripts.checkpoints import EXPERT_TARGETS as EXPERTS
from scripts.checkpoints import build_hf_model, build_peft_adapter
from tests.conftest import assert_all_free
from tests.oracle import logprobs, peft_model
from tests.test_families import ENGINE, TOL, check_two_ranks, prompt

MOE = ("qwen3_moe", "mixtral")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
MIX = [None, "attn", "experts", ["attn", "experts"], "both", "all", ["all", "attn"]]


@pytest.fixture(scope="module")
def expert_family(tmp_path_factory):
    root, built = tmp_path_factory.mktemp("moe-lora"), {}

    def get(arch: str):
        if arch not in built:
            model = build_hf_model(root / arch, arch)
            specs = {"attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
                     "experts": dict(r=4, lora_alpha=8, target_modules=[],
                                     target_parameters=EXPERTS),
                     "both": dict(r=6, lora_alpha=12, use_rslora=True,
                                  target_modules=["k_proj", "o_proj"],
                                  target_parameters=EXPERTS[::-1]),
                     # PEFT's all-linear on an MoE base: attention, the router (mlp.gate) and
                     # the experts, gate_up at twice the rank (its rank_pattern)
                     "all": dict(r=4, lora_alpha=8, target_modules="all-linear")}
            built[arch] = model, {name: build_peft_adapter(model, root / f"{arch}-{name}",
                                                           seed=70 + i, **spec)
                                  for i, (name, spec) in enumerate(specs.items())}
        return built[arch]

    return get


def mixed_batch(engine: Engine):
    prompts = [prompt(80 + i, 11 + 4 * i) for i in range(len(MIX))]
    specs = [[(n, 1.0) for n in s] if isinstance(s, list) else s for s in MIX]
    outs = engine.generate(prompts, GREEDY, adapters=specs)
    return [(p, spec, o.outputs[0]) for p, spec, o in zip(prompts, MIX, outs)]


# PEFT loads adapters with target_parameters into one model only when they target the same
# parameters: one oracle model per such set
ORACLE_SETS = (("attn", "experts", "both"), ("all", "attn"))


def oracles(model, adapters) -> list:
    return [peft_model(model, {k: adapters[k] for k in names}) for names in ORACLE_SETS]


def check_oracle(refs: list, runs) -> None:
    for ids, spec, out in runs:
        active = None if spec is None else spec if isinstance(spec, list) else [spec]
        ref_model = next(r for r, names in zip(refs, ORACLE_SETS, strict=True)
                         if set(active or ()) <= set(names))
        ref = logprobs(ref_model, ids + out.token_ids, active)
        for step, token in enumerate(out.token_ids):
            row = ref[len(ids) - 1 + step]
            assert token == int(row.argmax()), f"{spec}: greedy token differs at step {step}"
            assert abs(out.logprobs[step] - float(row[token])) <= TOL, (spec, step)


def expert_engine(model, adapters, **kw) -> Engine:
    return Engine(model, adapters=adapters, **{**ENGINE, **kw})


@pytest.mark.parametrize("arch", MOE)
def test_expert_adapters_in_a_mixed_batch_equal_peft(arch, expert_family):
    model, adapters = expert_family(arch)
    ref = oracles(model, adapters)
    base = logprobs(ref[0], prompt(1, 12))
    moved = logprobs(ref[0], prompt(1, 12), ["experts"])
    assert (base - moved).abs().max() > 0.05  # the expert adapter changes the answers
    for cache in (True, False):
        engine = expert_engine(model, adapters, enable_radix_cache=cache)
        runs = mixed_batch(engine)
        check_oracle(ref, runs)
        again = mixed_batch(engine)
        assert [o.token_ids for *_, o in again] == [o.token_ids for *_, o in runs]
        assert_all_free(engine)


def test_the_pool_holds_expert_rows_only_when_targeted(expert_family):
    model, adapters = expert_family("qwen3_moe")
    cfg = ModelConfig.from_dir(model)
    assert cfg.lora_groups == ("qkv", "o", "router", "experts_gate_up", "experts_down")
    sized = EngineConfig(adapter_rows=40, max_rank=8)
    assert sized.group_rows(cfg.lora_groups) == {"qkv": 40, "o": 40, "router": 40,
                                                 "experts_gate_up": 0, "experts_down": 0}
    inferred = with_start_adapters(EngineConfig(), [adapters["experts"]], cfg)
    assert inferred.lora_target_modules == ("experts.gate_up_proj", "experts.down_proj")
    inferred = with_start_adapters(EngineConfig(), [adapters["attn"], adapters["experts"]], cfg)
    assert inferred.lora_target_modules == ("q_proj", "k_proj", "v_proj",
                                            "experts.gate_up_proj", "experts.down_proj")
    assert with_start_adapters(EngineConfig(), [adapters["attn"]], cfg).lora_target_modules == (
        "q_proj", "k_proj", "v_proj")
    # the experts only when an adapter asks
    assert with_start_adapters(EngineConfig(), [], cfg).lora_target_modules is None
    # sized for attention only: an expert adapter is refused by request, naming the flag
    engine = expert_engine(model, {"attn": adapters["attn"], "experts": adapters["experts"]},
                           lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(InvalidRequestError, match=r"experts\.gate_up_proj, experts\.down_proj.*"
                                                  r"--lora-target-modules"):
        engine.generate(prompt(2, 8), GREEDY, adapters="experts")
    assert engine.generate(prompt(2, 8), GREEDY, adapters="attn")[0].outputs[0].token_ids
    assert_all_free(engine)


@pytest.mark.parametrize("arch", MOE)
def test_two_ranks_split_the_expert_adapters(arch, expert_family, tmp_path):
    check_two_ranks(*expert_family(arch), ENGINE, tmp_path, mixed_batch)


def int8_twin(adapter: Path, path: Path, experts: int) -> Path:
    """The adapter with each rank row rounded as the int8 pool stores it (quantize_rows over a
    row of A and a column of B, an expert adapter's row spanning every expert): PEFT on it is
    what the int8 pool computes. (Against the float adapter, int8's error can flip a later
    layer's top-k routing at a near-tie, which moves a logprob far past int8's own error.)"""
    shutil.copytree(adapter, path)
    tensors = load_file(path / "adapter_model.safetensors")
    for key in [k for k in tensors if ".lora_A." in k]:
        a, b = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
        count = experts if ".experts." in key else 1
        rank, in_dim, out_dim = a.shape[0] // count, a.shape[1], b.shape[0]
        a = a.reshape(count, rank, in_dim).transpose(0, 1).reshape(rank, -1)
        b_t = b.reshape(out_dim, rank, count).permute(1, 2, 0).reshape(rank, -1)
        a, b_t = ((q.float() * scale[:, None]) for q, scale in map(quantize_rows, (a, b_t)))
        a = a.reshape(rank, count, in_dim).transpose(0, 1)
        tensors[key] = a.reshape(-1, in_dim).contiguous()
        tensors[key.replace(".lora_A.", ".lora_B.")] = (
            b_t.reshape(rank, count, out_dim).permute(2, 0, 1).reshape(out_dim, -1).contiguous())
    save_file(tensors, path / "adapter_model.safetensors")
    return path


@pytest.mark.parametrize("arch", MOE)
def test_int8_pool_equals_peft_on_the_rounded_adapters(arch, expert_family, tmp_path):
    model, adapters = expert_family(arch)
    experts = ModelConfig.from_dir(model).num_experts
    twins = {name: int8_twin(path, tmp_path / name, experts) for name, path in adapters.items()}
    engine = expert_engine(model, adapters, lora_dtype="int8")
    check_oracle(oracles(model, twins), mixed_batch(engine))
    assert_all_free(engine)


def test_dora_on_the_router_is_refused(expert_family, tmp_path):
    model, _ = expert_family("qwen3_moe")
    dora = build_peft_adapter(model, tmp_path / "dora", seed=3, r=4, lora_alpha=8,
                              use_dora=True, target_modules=["q_proj"])
    tensors = load_file(dora / "adapter_model.safetensors")
    router = "base_model.model.model.layers.0.mlp.gate"
    tensors[f"{router}.lora_A.weight"] = torch.randn(4, 64)
    tensors[f"{router}.lora_B.weight"] = torch.randn(6, 4)
    tensors[f"{router}.lora_magnitude_vector"] = torch.ones(6)
    save_file(tensors, dora / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"mlp\.gate: DoRA on the router is not supported"):
        expert_engine(model, {"dora": dora})


def random_meta(tokens: int, grouped: bool, rank_rows: int):
    """Requests of 1-4 tokens over three adapter sets and no adapter; a stack's rows too."""
    g = torch.Generator().manual_seed(tokens)
    lens, left = [], tokens
    while left:
        lens.append(min(left, int(torch.randint(1, 5, (1,), generator=g))))
        left -= lens[-1]
    sets = [[], list(range(0, 4)), list(range(4, 12)), list(range(0, 4)) + list(range(12, 18))]
    scales = [[], [1.0] * 4, [0.5] * 8, [1.0] * 4 + [0.7] * 6]
    pick = [int(torch.randint(0, 4, (1,), generator=g)) for _ in lens]
    seg_rows = [[r % rank_rows for r in sets[k]] for k in pick]
    return LoraBatchMeta.from_segments(lens, seg_rows, [scales[k] for k in pick], "cpu",
                                       grouped=grouped), lens, seg_rows, [scales[k] for k in pick]


def per_row(x, rows_per_a, topk_ids, a_pool, b_pool, lens, seg_rows, seg_scales, y, out_scale,
            qscales):
    """The expert deltas one row at a time (the module docstring's formula)."""
    top_k, out = topk_ids.shape[1], y.clone().float()
    tokens = [s for s, n in enumerate(lens) for _ in range(n)]
    experts = a_pool.shape[-1] // x.shape[1]
    a = a_pool[0].float().reshape(a_pool.shape[1], experts, -1)
    b = b_pool.float().reshape(b_pool.shape[0], experts, -1)
    for m, e in enumerate(topk_ids.reshape(-1).tolist()):
        seg = tokens[m // top_k]
        for row, w in zip(seg_rows[seg], seg_scales[seg]):
            scale = w * (1.0 if qscales is None else float(qscales[0, row]))
            v = float(a[row, e] @ x[m // rows_per_a].float()) * scale
            out[m] += v * b[row, e] * (1.0 if out_scale is None else float(out_scale[m]))
    return out


@pytest.mark.parametrize(("tokens", "top_k", "int8"), [(1, 2, False), (9, 2, False),
                                                      (23, 3, True), (60, 2, False)])
def test_expert_kernels_equal_the_reference_and_a_per_row_loop(tokens, top_k, int8):
    """Both kernel pairs: a program per row, and blocks of one (expert, adapter set)."""
    g = torch.Generator().manual_seed(7)
    experts, hidden, inter, rows = 5, 24, 20, 18
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g)
    a_pool = torch.randn(1, rows, experts * hidden, generator=g) * 0.3
    b_pool = torch.randn(rows, experts * 2 * inter, generator=g) * 0.3
    qscales = None
    if int8:
        a_pool, b_pool = (t.mul(40).round().clamp(-127, 127).to(torch.int8)
                          for t in (a_pool, b_pool))
        qscales = torch.rand(1, rows, generator=g) * 1e-3
    out_scale = torch.rand(tokens * top_k, generator=g)
    y = torch.randn(tokens * top_k, 2 * inter, generator=g)
    for grouped in (False, True):
        meta, lens, seg_rows, seg_scales = random_meta(tokens, grouped, rows)
        want = per_row(x, top_k, ids, a_pool, b_pool, lens, seg_rows, seg_scales, y, out_scale,
                       qscales)
        runs = (expert_lora_ref, partial(expert_lora, blocked=False),
                partial(expert_lora, blocked=True))
        for run in runs:
            got = y.clone()
            run(x, top_k, ids, a_pool, b_pool, token_rows(meta), got, out_scale, qscales)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_token_rows_of_groups_equal_those_of_segments():
    for tokens in (1, 7, 40):
        segments, *_ = random_meta(tokens, False, 18)
        grouped, *_ = random_meta(tokens, True, 18)
        s, g = token_rows(segments), token_rows(grouped)
        assert torch.equal(s.count, g.count)
        for t in range(tokens):
            n = int(s.count[t])
            for field in ("row_ids", "row_scales"):
                assert torch.equal(getattr(s, field)[s.start[t]:s.start[t] + n],
                                   getattr(g, field)[g.start[t]:g.start[t] + n])


def test_token_rows_key_equal_sets_alike():
    """Tokens share a set id only if their rows and weights are equal; in a grouped batch a
    set's tokens share one id across the groups it is split into (40 tokens: sets of more
    than GROUP_TOKENS)."""
    for grouped in (False, True):
        meta, lens, seg_rows, seg_scales = random_meta(40, grouped, 18)
        rows = token_rows(meta)
        seg = [s for s, n in enumerate(lens) for _ in range(n)]
        content = [(tuple(seg_rows[s]), tuple(seg_scales[s])) for s in seg]
        ids = rows.set_id.tolist()
        assert all(0 <= i < rows.num_sets for i, c in zip(ids, content) if c[0])
        assert all(i == -1 for i, c in zip(ids, content) if not c[0])
        by_id = {}
        for i, c in zip(ids, content):
            assert by_id.setdefault(i, c) == c
        if grouped:
            assert len({i for i in ids if i >= 0}) == len({c for c in content if c[0]})


# (rows, scales) of adapter sets that differ only in a weight, a prefix of rows or a stack
NEAR_SETS = [([], []), (list(range(4)), [1.0] * 4), (list(range(4)), [0.5] * 4),
             (list(range(12)), [1.0] * 4 + [0.7] * 8), (list(range(12)), [1.0] * 4 + [0.3] * 8),
             (list(range(3)), [1.0] * 3), (list(range(20, 36)) + list(range(4)), [0.9] * 20)]


def stale_buffers(meta: LoraBatchMeta, pool_rows: int) -> LoraBatchMeta:
    """The meta's groups as a CUDA graph's static buffers hold them: longer than the batch,
    with earlier steps' entries (random here) past num_groups."""
    g, tokens = meta.groups, meta.token_seg.shape[0]
    gen = torch.Generator().manual_seed(tokens)
    cap = tokens * 32 + 1

    def pad(t, n, hi):
        return torch.cat([t, torch.randint(0, hi, (n - t.numel(),), generator=gen).to(t.dtype)])

    groups = LoraGroups(g.num_groups, pad(g.group_indptr, tokens + 1, tokens + 1),
                        pad(g.token_ids, tokens, tokens), pad(g.row_indptr, tokens + 1, cap),
                        pad(g.row_ids, cap, pool_rows),
                        torch.cat([g.row_scales, torch.rand(cap - g.row_scales.numel(),
                                                            generator=gen)]))
    return dataclasses.replace(meta, groups=groups, max_rows=32)


@pytest.mark.parametrize(("tokens", "top_k", "rows_per_a"), [(33, 2, 2), (70, 1, 1)])
def test_blocked_kernels_keep_near_sets_apart_in_graph_buffers(tokens, top_k, rows_per_a):
    """Requests up to 40 tokens (groups split past GROUP_TOKENS) on sets that differ only in a
    weight or a prefix, the blocked and per-row kernels on the eager meta and on stale graph
    buffers, against the reference; then a grouped batch with no adapter at all."""
    g = torch.Generator().manual_seed(tokens)
    lens, left = [], tokens
    while left:
        lens.append(min(left, int(torch.randint(1, 40, (1,), generator=g))))
        left -= lens[-1]
    pick = [int(torch.randint(0, len(NEAR_SETS), (1,), generator=g)) for _ in lens]
    seg_rows, seg_scales = [NEAR_SETS[k][0] for k in pick], [NEAR_SETS[k][1] for k in pick]
    x = torch.randn(tokens * top_k // rows_per_a, 24, generator=g)
    ids = torch.randint(0, 3, (tokens, top_k), generator=g)
    a_pool = torch.randn(1, 40, 3 * 24, generator=g) * 0.3
    b_pool = torch.randn(40, 3 * 20, generator=g) * 0.3
    y = torch.randn(tokens * top_k, 20, generator=g)
    meta = LoraBatchMeta.from_segments(lens, seg_rows, seg_scales, "cpu")
    want = y.clone()
    expert_lora_ref(x, rows_per_a, ids, a_pool, b_pool, token_rows(meta), want)
    for m in (meta, stale_buffers(meta, 40)):
        for blocked in (False, True):
            got = y.clone()
            expert_lora(x, rows_per_a, ids, a_pool, b_pool, token_rows(m), got, blocked=blocked)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    none = LoraBatchMeta.from_segments(lens, [[]] * len(lens), [[]] * len(lens), "cpu")
    got = y.clone()
    expert_lora(x, rows_per_a, ids, a_pool, b_pool, token_rows(none), got, blocked=True)
    assert torch.equal(got, y)


def test_alignment_blocks_hold_one_key_each():
    keys = torch.tensor([5, -1, 2, 5, 5, 2, -1, 9, 5, 5, 5])
    rows, used = align_blocks(keys, block_m=4, max_keys=3)
    m = keys.numel()
    assert int(used) == 16  # key 5: two blocks (6 rows), keys 2 and 9 one each
    for block in rows[:16].view(4, 4).tolist():
        real = [r for r in block if r < m]
        assert block[0] < m and len({int(keys[r]) for r in real}) == 1
        assert block[len(real):] == [m] * (4 - len(real))
    assert sorted(r for r in rows.tolist() if r < m) == [r for r in range(m) if keys[r] >= 0]


def test_graph_buffers_serve_expert_adapters_as_the_eager_path(expert_family):
    """The static buffers CUDA graphs replay (run eagerly here, the Triton kernels under the
    interpreter): each token's expert rows come from the groups in buffers that earlier steps
    left stale past the batch's own."""
    from radixlora.worker.cuda_graph import CudaGraphRunner, StaticInputs

    replays, expert_launches = [], []

    class EagerStaticInputs(StaticInputs):
        def forward(self, key, *args, **kw):
            launched = len(expert_launches)
            out = self.static_forward(key, *args, **kw)
            replays.append((key, len(expert_launches) > launched))
            return out

    model, adapters = expert_family("qwen3_moe")
    ref = oracles(model, adapters)
    engine = expert_engine(model, adapters, attention_backend="triton", lora_backend="triton",
                           max_batch_tokens=24, page_size=2, kv_pages=256)
    assert engine.runner.adapter_pool.groups == ("qkv", "o", "router", "experts_gate_up",
                                                 "experts_down")
    engine.runner.graphs = EagerStaticInputs(engine.runner, max_batch=8, max_context=512,
                                             max_rows=32)
    backend = engine.runner.lora_backend
    launch = backend.expert_lora
    backend.expert_lora = lambda *a, **kw: (expert_launches.append(1), launch(*a, **kw))[1]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    for specs in ([None, "experts", [("attn", 1.0), ("experts", 1.0)], "all"], [None, "attn"]):
        prompts = [prompt(60 + i, 9 + 3 * i) for i in range(len(specs))]
        outs = engine.generate(prompts, params, adapters=specs)
        runs = [(p, ["attn", "experts"] if isinstance(s, list) else s, o.outputs[0])
                for p, s, o in zip(prompts, specs, outs, strict=True)]
        check_oracle(ref, runs)
    # decode steps with expert adapters replay graphs that launch the expert LoRA; those with
    # attention adapters only, graphs that do not
    assert {(key.experts, launched) for key, launched in replays if key.rows} == {
        (True, True), (False, False)}
    # the twins are captured after ready (or on first use), so start-up captures no more
    startup = CudaGraphRunner.startup_keys(engine.runner.graphs)
    assert startup and not any(k.experts for k in startup)
    assert any(k.experts for k in engine.runner.graphs.all_keys())
    assert_all_free(engine)


def expert_by_expert(stacked: Path, path: Path, arch: str, experts: int) -> Path:
    """The stacked-experts adapter at `stacked` written as adapters trained before transformers
    5 stacked the experts are: a LoRA pair on each expert's gate / up / down module (Mixtral:
    block_sparse_moe's w1 / w3 / w2), gate and up sharing the stacked pair's A."""
    path.mkdir()
    config = json.loads((stacked / "adapter_config.json").read_text())
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    config.update(target_modules=list(names), target_parameters=None)
    (path / "adapter_config.json").write_text(json.dumps(config))
    tensors, out = load_file(stacked / "adapter_model.safetensors"), {}
    hidden = ModelConfig.from_dir(Path(config["base_model_name_or_path"])).hidden_size
    for key in [k for k in tensors if ".lora_A." in k]:
        a, b = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
        layer = key.split(".layers.")[1].split(".")[0]
        rank = a.shape[0] // experts
        a = a.reshape(experts, rank, -1)
        b = b.reshape(b.shape[0], rank, experts)
        moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
        for e in range(experts):
            prefix = f"base_model.model.model.layers.{layer}.{moe}.experts.{e}"
            if a.shape[-1] == hidden:  # gate_up: gate's rows of B, then up's
                gate, up = b[:, :, e].chunk(2)
                pairs = {names[0]: gate, names[1]: up}
            else:
                pairs = {names[2]: b[:, :, e]}
            for module, lora_b in pairs.items():
                out[f"{prefix}.{module}.lora_A.weight"] = a[e].clone()
                out[f"{prefix}.{module}.lora_B.weight"] = lora_b.contiguous()
    save_file(out, path / "adapter_model.safetensors")
    return path


@pytest.mark.parametrize("arch", MOE)
def test_expert_by_expert_adapters_equal_their_stacked_form(arch, expert_family, tmp_path):
    """An adapter on each expert's own modules is served as PEFT converts it: the stacked
    experts' gate_up at gate's plus up's rank (A stacked, B block diagonal). The oracle is
    PEFT on the stacked adapter it was written from."""
    model, adapters = expert_family(arch)
    experts = ModelConfig.from_dir(model).num_experts
    own = expert_by_expert(adapters["experts"], tmp_path / "own", arch, experts)
    engine = expert_engine(model, {"own": own, "attn": adapters["attn"]})
    specs = [None, "own", [("own", 1.0), ("attn", 1.0)]]
    prompts = [prompt(90 + i, 13 + 3 * i) for i in range(len(specs))]
    outs = engine.generate(prompts, GREEDY, adapters=specs)
    runs = [(p, s, o.outputs[0]) for p, s, o in
            zip(prompts, [None, "experts", ["experts", "attn"]], outs, strict=True)]
    check_oracle(oracles(model, adapters), runs)
    assert engine.registry.by_name["own"].group_ranks["experts_gate_up"] == 8  # 4 + 4
    assert_all_free(engine)
