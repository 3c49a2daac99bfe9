"""RuntimeEndpoint and the batch command against a real `radixlora serve` (subprocess, tiny model,
adapters support and legal): programs give the text of the direct Engine request, and so does
every batch line."""

from __future__ import annotations

import json
import re

import pytest

from radixlora import SamplingParams
from radixlora.cli.run_batch import run_batch
from radixlora_frontend import RuntimeEndpoint, function, gen, select
from tests.server_harness import (
    MODEL_NAME,
    build_checkpoints,
    engine_like_server,
    running_server,
)

PROMPT = "A radix cache shares prefix KV between"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    model, adapters = checkpoints
    with running_server(model, adapters, tmp_path_factory.mktemp("logs") / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def engine(checkpoints):
    model, adapters = checkpoints
    return engine_like_server(model, adapters)


@pytest.fixture(scope="module")
def endpoint(server):
    return RuntimeEndpoint(server.url)


def direct(engine, prompt, adapters=None, max_tokens=8) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return engine.generate(prompt, params, adapters=adapters)[0].outputs[0].text


@function
def one_gen(s, adapter, stop=None):
    s += PROMPT
    s += gen("out", max_tokens=8, temperature=0.0, adapter=adapter, stop=stop)


@pytest.mark.parametrize("adapter", [None, "support", "legal"])
def test_gen_matches_engine(engine, endpoint, adapter):
    state = one_gen.run(adapter, backend=endpoint)
    assert state["out"] == direct(engine, PROMPT, adapter)
    assert state.get_meta_info("out")["prompt_tokens"] == len(engine.tokenizer.encode(PROMPT))


def test_stop_streaming_and_run_batch(engine, endpoint):
    full = direct(engine, PROMPT, "legal")
    stop = full[3:5]
    assert one_gen.run("legal", stop=stop, backend=endpoint)["out"] == full[: full.find(stop)]
    streamed = one_gen.run("support", backend=endpoint, stream=True)
    assert (
        "".join(streamed.text_iter("out")) == streamed["out"] == direct(engine, PROMPT, "support")
    )
    specs = [None, "support", "legal"] * 4
    states = one_gen.run_batch([{"adapter": a} for a in specs], backend=endpoint)
    assert [s["out"] for s in states] == [direct(engine, PROMPT, a) for a in specs]


def test_stacked_adapters_reach_the_server(engine, endpoint):
    stack = [("support", 1.0), ("legal", 0.5)]
    got = one_gen.run(stack, backend=endpoint)["out"]
    assert got == direct(engine, PROMPT, stack) != direct(engine, PROMPT)


def test_select_over_http_equals_in_process(checkpoints, endpoint):
    """select scores choices with /generate's prompt logprobs (return_logprob +
    logprob_start_len): the same pick and the same per-token logprobs as the in-process Runtime."""
    from radixlora_frontend import Runtime

    @function
    def pick(s):
        s += PROMPT + select("pick", choices=[" fox", " dog jumps", " cache"], adapter="legal")

    model, adapters = checkpoints
    with Runtime(model, adapters=adapters) as runtime:
        want = pick.run(backend=runtime)
    got = pick.run(backend=endpoint)
    assert got["pick"] == want["pick"]
    for a, b in zip(got.get_meta_info("pick")["token_logprobs"],
                    want.get_meta_info("pick")["token_logprobs"], strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_batch_against_the_server(engine, server, tmp_path):
    specs = {f"{MODEL_NAME}": None, f"{MODEL_NAME}:support": "support", "legal": "legal"}
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": f"{i} {PROMPT}", "max_tokens": 6, "temperature": 0},
        }
        for i, model in enumerate(list(specs) * 3)
    ]
    lines.append(
        {
            "custom_id": "bad-adapter",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "nope", "prompt": PROMPT, "max_tokens": 4},
        }
    )
    lines.append(
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL_NAME,
                "max_tokens": 4,
                "temperature": 0,
                "adapters": [{"name": "support"}, {"name": "legal", "weight": 0.5}],
                "messages": [{"role": "user", "content": "hi"}],
            },
        }
    )
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_batch(src, out, server.url, progress=False)
    assert (summary.succeeded, summary.failed) == (10, 1)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["bad-adapter"]["error"]["code"] == "adapter_not_found"
    for i, model in enumerate(list(specs) * 3):
        body = records[f"r{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == direct(engine, f"{i} {PROMPT}", specs[model], 6)


@function
def constrained(s, adapter, **structure):
    s += PROMPT
    s += gen("out", max_tokens=30, temperature=0.0, adapter=adapter, **structure)


@pytest.mark.parametrize("structure", [{"regex": "[a-z]{3}-[0-9]{2}"},
                                       {"json_schema": {"type": "object",
                                                        "properties": {"ok": {"type": "boolean"}},
                                                        "required": ["ok"],
                                                        "additionalProperties": False}}])
def test_gen_structured_over_http_equals_in_process(engine, endpoint, structure):
    """gen(regex=...) and gen(json_schema=...) reach the server's /generate and give what the
    same program gives on the in-process Engine; the output matches its structure."""
    from radixlora_frontend import Runtime

    over_http = constrained.run("legal", backend=endpoint, **structure)["out"]
    runtime = Runtime(engine)
    try:
        in_process = constrained.run("legal", backend=runtime, **structure)["out"]
    finally:
        runtime.shutdown()
    assert over_http == in_process
    if "regex" in structure:
        assert re.fullmatch(structure["regex"], over_http), over_http
    else:
        assert json.loads(over_http) == {"ok": json.loads(over_http)["ok"]}
