"""`radixlora serve --tp-size 2` on the CPU (gloo), driven through HTTP with the official openai
client: the bundled demo model (4 heads, 2 KV heads) and its trained adapters give the same
greedy tokens as the single-device Engine, for the base, adapters, a stack and an adapter
loaded while serving; every KV slot and adapter reference comes back; a dying rank stops the
server like any dead core child."""

from __future__ import annotations

import os
import signal
import time

import pytest

from radixlora import Engine, SamplingParams
from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from tests.server_harness import ServerProcess, alive, assert_all_kv_free, wait_health_503

TEXT = "the red fox ate 42 fish"
SPECS = [None, "upper", "reverse", [("upper", 1.0), ("reverse", 1.0)], [("digits", 0.6)]]
MAX_TOKENS = 24


def body(spec) -> dict:
    """Chat request fields of an adapter spec (the model by name, or SGLang's adapters list)."""
    if spec is None:
        return {"model": "demo"}
    if isinstance(spec, str):
        return {"model": spec}
    return {"model": "demo", "extra_body": {"adapters": [{"name": n, "weight": w}
                                                         for n, w in spec]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("tp") / "server.log"
    proc = ServerProcess(None, {"upper": DEMO_ADAPTERS["upper"],
                                "reverse": DEMO_ADAPTERS["reverse"]}, log,
                         str(DEMO_MODEL_DIR), "--served-model-name", "demo", "--tp-size", "2",
                         "--dtype", "float32", "--allowed-adapter-root",
                         str(DEMO_ADAPTERS["digits"].parent))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_two_ranks_serve_the_single_device_tokens(server):
    import openai

    engine = Engine(DEMO_MODEL_DIR, adapters={"upper": DEMO_ADAPTERS["upper"],
                                              "reverse": DEMO_ADAPTERS["reverse"],
                                              "digits": DEMO_ADAPTERS["digits"]},
                    dtype="float32", kv_pages=600, max_running=16, adapter_rows=64)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    load = {"lora_name": "digits", "lora_path": str(DEMO_ADAPTERS["digits"])}
    loaded = server.http.post("/v1/load_lora_adapter", json=load,  # hot-swap: while serving
                              headers={"authorization": f"Bearer {server.admin_key}"})
    assert loaded.status_code == 200, loaded.text
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": TEXT}]
    for spec in SPECS:
        out = client.chat.completions.create(messages=messages, max_tokens=MAX_TOKENS,
                                             temperature=0, **body(spec))
        assert out.choices[0].message.content == engine_chat(engine, messages, params, spec), spec
        if spec == "reverse":  # what the adapter was trained to do
            assert out.choices[0].message.content.strip() == "fish 42 ate fox red the"
    assert_all_kv_free(server.wait_idle())


def engine_chat(engine: Engine, messages: list[dict], params: SamplingParams, spec) -> str:
    """The single-device answer to a chat request, rendered as the server renders it."""
    from radixlora.text.chat import ChatTemplate

    rendered = ChatTemplate.from_dir(DEMO_MODEL_DIR).render(messages)
    ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
    return engine.generate(ids, params, adapters=spec)[0].outputs[0].text


def test_a_dying_rank_stops_the_server(server):
    pids = server.info()["pids"]
    assert set(pids) >= {"worker", "worker-tp1"}
    children = [pid for name, pid in pids.items() if name != "api"]
    os.kill(pids["worker-tp1"], signal.SIGKILL)
    wait_health_503(server, 10)
    assert server.proc.wait(20) == 1, server.logs()
    assert "worker-tp1 process" in server.logs()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in children)
