"""QLoRA adapters (seed incident 4): an adapter trained by PEFT on a bitsandbytes NF4 base is
served on the NF4 base with PEFT + bitsandbytes' outputs; on the dense base its outputs drift,
so that mismatch is refused by default and, under --qlora-mismatch serve, served and reported."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from radixlora import Engine, SamplingParams
from radixlora.errors import AdapterError
from scripts.checkpoints import TARGETS, build_nf4_model
from tests.server_harness import free_port
from tests.test_cli_compat import last_line, run_cli
from tests.test_quant_nf4 import TOL, greedy_against, transformers_bnb

PROMPT = [5, 9, 17, 33, 65, 129, 7]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)


def train_qlora(model, steps: int = 8, seed: int = 0):
    """A LoRA on every projection of a bitsandbytes NF4 model, trained a few Adam steps on one
    random sequence (PEFT's zero-initialised B must move for the adapter to matter)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS)))
    ids = torch.randint(2, 256, (1, 24), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.Adam([p for p in peft.parameters() if p.requires_grad], lr=2e-2)
    peft.train()
    for _ in range(steps):
        opt.zero_grad()
        peft(ids, labels=ids).loss.backward()
        opt.step()
    return peft.eval()


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """(NF4 base, its dense original, the QLoRA adapter, PEFT + bitsandbytes with it)."""
    root = tmp_path_factory.mktemp("qlora")
    nf4 = build_nf4_model(root / "nf4", "llama")
    peft = train_qlora(transformers_bnb(nf4))
    peft.save_pretrained(root / "adapter")
    return nf4, root / "nf4-dense", root / "adapter", peft


def test_qlora_adapter_on_the_nf4_base_matches_peft_bitsandbytes(qlora):
    nf4, _, adapter, peft = qlora
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(nf4)  # how the NF4 training is detected
    engine = Engine(nf4, adapters={"q": adapter}, kv_pages=128)
    assert engine.adapters["q"].trained_on == "nf4"
    assert engine.adapters["q"].base_mismatch == ""
    assert greedy_against(AdapterSpec(engine, "q"), peft, PROMPT) <= TOL


def test_qlora_adapter_on_the_dense_base_is_refused_by_default(qlora):
    _, dense, adapter, _ = qlora
    with pytest.raises(AdapterError, match="trained on a nf4 base, served on a dense base") as e:
        Engine(dense, adapters={"q": adapter}, kv_pages=128)
    assert e.value.code == "quantization_mismatch"


def test_qlora_adapter_served_on_the_dense_base_drifts_and_says_so(qlora):
    nf4, dense, adapter, _ = qlora
    matched = Engine(nf4, adapters={"q": adapter}, kv_pages=128)
    served = Engine(dense, adapters={"q": adapter}, kv_pages=128, qlora_mismatch="serve")
    assert served.adapters["q"].base_mismatch == "trained on a nf4 base, served on a dense base"
    right = matched.generate(PROMPT, GREEDY, adapters="q")[0]
    drifted = served.generate(PROMPT, GREEDY, adapters="q")[0]
    assert drifted.outputs[0].token_ids != right.outputs[0].token_ids
    assert drifted.base_mismatch == "q: trained on a nf4 base, served on a dense base"
    assert right.base_mismatch == ""
    assert served.generate(PROMPT, GREEDY)[0].base_mismatch == ""  # the base alone: no claim


def test_explicit_base_quantization_key_marks_a_qlora_adapter(qlora, tmp_path):
    nf4, dense, adapter, _ = qlora
    marked = shutil.copytree(adapter, tmp_path / "marked")
    config = json.loads((marked / "adapter_config.json").read_text())
    config.update(base_model_name_or_path="some-org/some-hub-model", base_quantization="nf4")
    (marked / "adapter_config.json").write_text(json.dumps(config))
    assert Engine(nf4, adapters={"q": marked}, kv_pages=128).adapters["q"].trained_on == "nf4"
    with pytest.raises(AdapterError, match="quantization_mismatch|trained on a nf4 base"):
        Engine(dense, adapters={"q": marked}, kv_pages=128)


def test_the_server_refuses_a_qlora_adapter_on_the_dense_base_at_start(qlora):
    _, dense, adapter, _ = qlora
    done = run_cli("serve", str(dense), "--adapter", f"q={adapter}", "--port", str(free_port()),
                   "--kv-pages", "64", timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert ("radixlora serve: error: adapter 'q': trained on a nf4 base, served on a dense "
            "base" in last_line(done.stderr))


class AdapterSpec:
    """An Engine whose generate always uses one adapter (for greedy_against)."""

    def __init__(self, engine: Engine, adapter: str):
        self.engine, self.adapter = engine, adapter

    def generate(self, prompt, params):
        return self.engine.generate(prompt, params, adapters=self.adapter)


def test_the_scheduler_and_registry_apply_quantization_at_load(qlora, tmp_path):
    """--quantization nf4 on a dense checkpoint reaches the scheduler's and the registry's
    adapter validation (not only the worker's): the QLoRA adapter is registered and published;
    without it the registry rejects the adapter under its own label."""
    import msgspec

    from radixlora.server.args import ServerArgs
    from radixlora.server.procs.registry_proc import make_core
    from radixlora.server.procs.scheduler_proc import SchedulerService
    from tests.server_harness import registry_turn, sized

    nf4, dense, adapter, _ = qlora
    watched = tmp_path / "watched"
    shutil.copytree(adapter, watched / "q")
    for quantization, kind in (("nf4", "added"), (None, "rejected")):
        state = tmp_path / f"state-{quantization}"
        state.mkdir()
        engine = {"kv_pages": 64} | ({"quantization": quantization} if quantization else {})
        # the training base's config is read inside an allowed root only
        args = sized(ServerArgs(model=str(dense), engine=engine, state_dir=str(state),
                                allowed_adapter_roots=[str(nf4)]))
        if quantization:
            service = SchedulerService(msgspec.structs.replace(args, adapters={"q": str(adapter)}))
            assert service.adapters.by_name["q"].base_mismatch == ""
        events = []
        core = make_core(msgspec.structs.replace(args, adapter_dir=str(watched)), events.append)
        core.on_changed(core.names_on_disk())
        registry_turn(core, 0.0)
        assert [e.kind for e in events] == [kind]
        if kind == "rejected":
            assert events[0].reason == "quantization_mismatch"


def test_the_server_serves_a_mismatched_adapter_and_says_so(qlora, tmp_path):
    """--qlora-mismatch serve: the QLoRA adapter runs on the dense base and every response on it
    names the mismatch (OpenAI body field, /generate meta_info, a metric); the base's do not."""
    from tests.server_harness import running_server

    _, dense, adapter, _ = qlora
    note = "q: trained on a nf4 base, served on a dense base"
    with running_server(dense, {"q": adapter}, tmp_path / "server.log",
                        "--qlora-mismatch", "serve") as server:
        body = {"model": "q", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        reply = server.http.post("/v1/completions", json=body).json()
        assert reply.get("adapter_base_mismatch") == note and "adapter_fallback" not in reply, reply
        base = server.http.post("/v1/completions", json={**body, "model": dense.name})
        assert "adapter_base_mismatch" not in base.json()
        native = server.http.post("/generate", json={
            "input_ids": PROMPT, "lora_path": "q",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
        assert native["meta_info"]["adapter_base_mismatch"] == note
        counted = [float(line.rsplit(" ", 1)[1])
                   for line in server.http.get("/metrics").text.splitlines()
                   if line.startswith("radixlora_base_mismatch_requests_total{")]
        # labelled "q", or "other" while the api has not yet heard the adapter's name
        assert sum(counted) == 2.0


def test_a_base_path_outside_the_roots_is_a_name_never_read(qlora, tmp_path):
    """Served with roots (an --adapter-dir or admin-loaded adapter), base_model_name_or_path is
    opened only inside them: outside, the NF4 base it names is not read, so nothing about that
    path leaks through a quantization_mismatch; inside, the mismatch is found as before."""
    import dataclasses

    from radixlora.config import ModelConfig
    from radixlora.lora.adapter import load_adapter

    nf4, dense, adapter, _ = qlora
    dense_cfg = ModelConfig.from_dir(dense)
    outside = dataclasses.replace(dense_cfg, base_roots=(str(dense), str(tmp_path)))
    assert load_adapter("q", adapter, outside, 64).trained_on is None
    inside = dataclasses.replace(dense_cfg, base_roots=(str(dense), str(nf4.parent)))
    with pytest.raises(AdapterError, match="trained on a nf4 base") as e:
        load_adapter("q", adapter, inside, 64)
    assert e.value.code == "quantization_mismatch"
