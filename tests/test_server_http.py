"""`radixlora serve` end to end: one real server (subprocess) on the tiny model with two adapters,
driven by the official openai client, httpx and the ZeroMQ client; outputs are compared with
the offline Engine, every bad input must be a 4xx with an OpenAI-shaped body, and after
disconnects every KV slot must be free."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import msgspec
import openai
import pytest
import zmq

from radixlora import SamplingParams
from radixlora.server.client import RequestError, RuntimeClient
from scripts.checkpoints import build_tiny_adapter
from tests.server_harness import (
    MODEL_NAME,
    assert_all_kv_free,
    build_checkpoints,
    engine_like_server,
    running_server,
)

PROMPT = "A radix cache shares prefix KV"
STACK = [{"name": "support", "weight": 1.0}, {"name": "legal", "weight": 0.5}]
SPECS = {
    "base": (MODEL_NAME, None, None),
    "support": (f"{MODEL_NAME}:support", None, "support"),
    "legal": ("legal", None, "legal"),
    "stack": (MODEL_NAME, STACK, [("support", 1.0), ("legal", 0.5)]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    model, adapters = checkpoints
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(model, adapters, log) as proc:
        yield proc


@pytest.fixture(scope="module")
def engine(checkpoints):
    model, adapters = checkpoints
    return engine_like_server(model, adapters)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _extra(adapters, **more):
    body = dict(more)
    if adapters is not None:
        body["adapters"] = adapters
    return body


# ---- outputs equal the offline Engine ----------------------------------------------------------


@pytest.mark.parametrize("spec", list(SPECS))
def test_completion_equals_engine(spec, client, engine):
    model, adapters, engine_spec = SPECS[spec]
    for params in (SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                   SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11,
                                  ignore_eos=True)):
        want = engine.generate(PROMPT, params, adapters=engine_spec)[0].outputs[0]
        got = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=8, temperature=params.temperature,
            top_p=params.top_p, seed=params.seed, extra_body=_extra(adapters, ignore_eos=True),
        )
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == 8


def test_steps_overlap(server):
    """Decode steps are planned while the previous step runs (placeholders for its tokens)."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True}
    server.http.post("/v1/completions", json=body).raise_for_status()
    sched = server.info()["scheduler"]
    assert sched["overlapped_steps"] >= 10 and sched["steps"] > sched["overlapped_steps"]
    recent = sched["recent_steps"]  # [fold time, seconds, requests, tokens]
    assert 10 <= len(recent) <= sched["steps"]
    assert all(s[1] >= 0 for s in recent) and [s[0] for s in recent] == sorted(s[0] for s in recent)
    assert any(s[3] > s[2] for s in recent) and any(s[3] == s[2] >= 1 for s in recent)


def test_adapters_change_outputs(server):
    outs = set()
    for model, adapters, _ in SPECS.values():
        body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, **_extra(adapters)}
        outs.add(server.http.post("/v1/completions", json=body).json()["choices"][0]["text"])
    assert len(outs) == len(SPECS)


def test_token_ids_and_logprobs_equal_engine(server, engine):
    ids = [5, 17, 33, 2, 90, 41]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True, logprobs=3)
    want = engine.generate(ids, params, adapters="support")[0].outputs[0]
    body = {"input_ids": ids, "lora_path": "support", "return_logprob": True,
            "top_logprobs_num": 3, "sampling_params": {"max_new_tokens": 6, "temperature": 1.0,
                                                       "sampling_seed": 5, "ignore_eos": True}}
    got = server.http.post("/generate", json=body).json()
    assert got["output_ids"] == want.token_ids
    lps = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx(want.logprobs, abs=1e-5)
    top = got["meta_info"]["output_top_logprobs"]
    assert [[t for _, t, _ in row] for row in top] == [[t for t, _ in r] for r in want.top_logprobs]


def test_completion_logprobs(client, engine):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    want = engine.generate(PROMPT, params, adapters="legal")[0].outputs[0]
    got = client.completions.create(model="legal", prompt=PROMPT, max_tokens=5, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert all(len(row) == 2 for row in lp.top_logprobs)
    assert "".join(lp.tokens) == got.choices[0].text


def test_n_samples(client, engine):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=77, n=3, ignore_eos=True)
    want = [o.text for o in engine.generate(PROMPT, params, adapters="support")[0].outputs]
    got = client.completions.create(model="support", prompt=PROMPT, max_tokens=6, n=3,
                                    temperature=1.0, seed=77, extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == want
    assert len(set(texts)) > 1


def test_batch_prompts(client, engine):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = ["The quick brown fox", "Legal, medical"]
    want = [o.outputs[0].text for o in engine.generate(prompts, params)]
    got = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want


# ---- chat and streaming --------------------------------------------------------------------------


def test_chat_streaming_equals_non_streaming(client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a fox."}]
    kwargs = dict(model=f"{MODEL_NAME}:legal", messages=messages, max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_logprobs_and_n(client):
    out = client.chat.completions.create(
        model="support", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2,
        temperature=1.0, seed=3, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    for choice in out.choices:
        assert len(choice.logprobs.content) == 4
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_completion_streaming(client):
    kwargs = dict(model="support", prompt=PROMPT, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs))
    assert streamed == full


def test_stop_strings(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[5:8]
    cut = full[: full.index(stop)]
    got = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert (got.text, got.finish_reason) == (cut, "stop")
    chunks = list(client.completions.create(stop=[stop], stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sglang_generate(server):
    body = {"text": ["The quick", "A radix"], "lora_path": ["support", None],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    outs = server.http.post("/generate", json=body).json()
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [4, 4]
    assert outs[0]["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    single = {"text": "The quick", "lora_path": "support", "sampling_params": body[
        "sampling_params"], "stream": True}
    texts = []
    with server.http.stream("POST", "/generate", json=single) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                texts.append(msgspec.json.decode(line[6:])["text"])
    assert texts[-1] == outs[0]["text"]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative, as SGLang
    prefix = server.http.post("/generate", json={"text": "The quick",
                                                 "sampling_params": {"max_new_tokens": 0}})
    assert prefix.json()["meta_info"]["prompt_tokens"] == outs[0]["meta_info"]["prompt_tokens"]
    assert prefix.json()["text"] == ""  # RuntimeEndpoint.cache_prefix


def test_generate_prompt_logprobs_equal_engine_score(server, engine):
    ids = engine.tokenizer.encode(PROMPT)
    body = {"input_ids": ids, "lora_path": "support", "return_logprob": True,
            "logprob_start_len": 2, "sampling_params": {"max_new_tokens": 0}}
    out = server.http.post("/generate", json=body).json()
    want = engine.score(ids, 2, adapters="support")[0]
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[2:]
    assert [e[0] for e in entries] == pytest.approx(want, abs=1e-5)
    assert out["text"] == "" and out["meta_info"]["completion_tokens"] == 0


def test_vllm_prompt_logprobs_equal_engine_score(server, engine):
    """vLLM's prompt_logprobs on completions and chat: null for the first token, then each
    prompt token's logprob (as Engine.score), with the k most likely tokens ranked; the
    output's own logprobs only when asked."""
    ids = engine.tokenizer.encode(PROMPT)
    body = {"model": "legal", "prompt": ids, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2}
    out = server.http.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    assert choice["logprobs"] is None
    rows = choice["prompt_logprobs"]
    want = engine.score(ids, 1, adapters="legal")[0]
    assert rows[0] is None and len(rows) == len(ids)
    for token, row, logprob in zip(ids[1:], rows[1:], want):
        assert row[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-5)
        ranks = sorted(e["rank"] for t, e in row.items() if e["rank"] is not None)
        assert ranks == [1, 2] and len(row) in (2, 3)
        best = max(row.values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1 and best["logprob"] >= row[str(token)]["logprob"]
    chat = server.http.post("/v1/chat/completions", json={
        "model": "support", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 2
    assert all(len(row) == 1 for row in chat["prompt_logprobs"][1:])
    streamed = server.http.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 400
    assert streamed.json()["error"]["param"] == "prompt_logprobs"


def test_models_and_model_info(client, server):
    ids = {m.id for m in client.models.list().data}
    assert {MODEL_NAME, "support", "legal"} <= ids <= {MODEL_NAME, "support", "legal", "fickle"}
    info = server.http.get("/get_model_info").json()
    assert info["is_generation"] and info["model_path"].endswith(MODEL_NAME)


def test_zmq_client_equals_http(server, client):
    endpoint = server.info()["zmq_client_endpoint"]
    rc = RuntimeClient(endpoint, timeout_s=30)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        got = rc.generate(PROMPT, params, adapters="legal")
        want = client.completions.create(model="legal", prompt=PROMPT, max_tokens=6,
                                         temperature=0, extra_body={"ignore_eos": True})
        assert got[0].text == want.choices[0].text
        with pytest.raises(RequestError) as err:
            rc.generate(PROMPT, params, adapters="missing")
        assert err.value.error.status == 404
    finally:
        rc.close()


def test_metrics(server, client):
    client.completions.create(model="support", prompt=PROMPT, max_tokens=3, temperature=0)
    text = server.http.get("/metrics").text
    for name in ('radixlora_requests_total{adapter="support"}',
                 'radixlora_generation_tokens_total{adapter="support"}',
                 "radixlora_time_to_first_token_seconds_bucket",
                 "radixlora_inter_token_latency_seconds_bucket",
                 "radixlora_kv_usage_ratio", "radixlora_radix_hit_rate"):
        assert name in text, name


def test_adapter_changed_on_disk_fails_only_its_requests(checkpoints, tmp_path):
    """The worker reads an adapter's files when a load misses its host tier; files that no
    longer hash to the validated version fail only that adapter's requests. (With room in the
    host tier, start-up adapters are read once before ready and this never happens: the
    1-byte tier keeps none of them.)"""
    model, adapters = checkpoints
    fickle = build_tiny_adapter(model, tmp_path / "fickle", rank=4, seed=9)
    other = build_tiny_adapter(model, tmp_path / "other", rank=4, seed=10)
    with running_server(model, {"support": adapters["support"], "fickle": fickle},
                        tmp_path / "server.log", "--host-adapter-bytes", "1") as server:
        shutil.copy(other / "adapter_model.safetensors", fickle / "adapter_model.safetensors")
        body = {"model": "fickle", "prompt": "hi", "max_tokens": 3}
        resp = server.http.post("/v1/completions", json=body)
        assert resp.status_code == 500
        assert resp.json()["error"]["code"] == "adapter_load_failed"
        support = {**body, "model": "support"}
        assert server.http.post("/v1/completions", json=support).status_code == 200
        ids = {m["id"] for m in server.http.get("/v1/models").json()["data"]}
        assert "fickle" not in ids and "support" in ids
        assert server.http.post("/v1/completions", json=body).status_code == 404
        assert_all_kv_free(server.wait_idle())


# ---- errors ------------------------------------------------------------------------------------

J = {"content-type": "application/json"}
OK_COMPLETION = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _c(**changes):
    return {**OK_COMPLETION, **changes}


BAD = [
    # 16: unknown adapter, in each spelling
    ("/v1/completions", _c(model="nope"), 404, "model"),
    ("/v1/completions", _c(model=f"{MODEL_NAME}:nope"), 404, "model"),
    ("/v1/completions", _c(adapters=[{"name": "nope"}]), 404, "adapters"),
    ("/v1/completions", _c(model="support", adapters=STACK), 400, "adapters"),
    ("/generate", {"text": "hi", "lora_path": "nope"}, 404, "lora_path"),
    # 17: more adapters than the stacking cap, duplicates
    ("/v1/completions", _c(adapters=[{"name": "support"}] * 9), 400, "adapters"),
    ("/v1/completions", _c(adapters=[{"name": "support"}, {"name": "support"}]), 400,
     "adapters"),
    # 18: too long for the context or the KV pool
    ("/v1/completions", _c(max_tokens=5000), 400, "max_tokens"),
    ("/v1/completions", _c(prompt=[3] * 1100), 400, "max_tokens"),
    ("/v1/completions", _c(max_tokens=700), 400, "max_tokens"),
    # 19: empty prompts
    ("/v1/completions", _c(prompt=""), 400, "prompt"),
    ("/v1/completions", _c(prompt=[]), 400, "prompt"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages"),
    ("/generate", {"text": ""}, 400, "prompt"),
    # 20: token ids outside the vocabulary
    ("/v1/completions", _c(prompt=[1, 512]), 400, "prompt"),
    ("/v1/completions", _c(prompt=[-1]), 400, "prompt"),
    ("/v1/completions", _c(stop_token_ids=[99999]), 400, "stop_token_ids"),
    ("/generate", {"input_ids": [1, 10**6]}, 400, "prompt"),
    # 21: n, logprobs, top_logprobs, max_tokens out of range or not integers
    ("/v1/completions", _c(n=0), 400, "n"),
    ("/v1/completions", _c(n=100000), 400, "n"),
    ("/v1/completions", _c(n=1.5), 400, "n"),
    ("/v1/completions", _c(prompt=["hi"] * 64, n=5), 400, "n"),  # 320 samples > 256
    ("/generate", {"text": ["hi"] * 3, "sampling_params": {"n": 128}}, 400, "n"),
    ("/v1/completions", _c(logprobs=-1), 400, "logprobs"),
    ("/v1/completions", _c(logprobs=1000), 400, "logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "logprobs": True, "top_logprobs": 50}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/completions", _c(max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", _c(max_tokens=-5), 400, "max_tokens"),
    ("/v1/completions", _c(max_tokens=10**30), 400, "max_tokens"),
    ("/v1/completions", _c(max_tokens="10"), 400, "max_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, 400, "max_tokens"),
    # 22: temperature, top_p, penalties out of range
    ("/v1/completions", _c(temperature=-1), 400, "temperature"),
    ("/v1/completions", _c(top_p=0), 400, "top_p"),
    ("/v1/completions", _c(top_p=1.5), 400, "top_p"),
    ("/v1/completions", _c(presence_penalty=2.5), 400, "presence_penalty"),
    ("/v1/completions", _c(frequency_penalty=-3.0), 400, "frequency_penalty"),
    ("/v1/completions", _c(top_k=-7), 400, "top_k"),
    # 24: thousands of stop strings
    ("/v1/completions", _c(stop=[f"s{i}" for i in range(5000)]), 400, "stop"),
    ("/v1/completions", _c(stop=["x" * 10000]), 400, "stop"),
    # malformed requests
    ("/v1/completions", {"model": 5, "prompt": "hi"}, 400, "model"),
    ("/v1/completions", _c(prompt=[[1], "x"]), 400, "prompt"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     400, "messages"),
    ("/generate", {"text": "hi", "input_ids": [1]}, 400, "text"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_inputs(server, path, body, status, param):
    resp = server.http.post(path, json=body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_malformed_bodies(server):
    cases = [
        (b"{not json", J, 400),
        (b"[1, 2]", J, 400),
        (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', J, 400),
        (b'{"model": "tiny", "prompt": "hi"}', {"content-type": "text/plain"}, 415),
        (b"x" * (9 << 20), J, 413),
    ]
    for body, headers, status in cases:
        resp = server.http.post("/v1/completions", content=body, headers=headers)
        assert resp.status_code == status, (body[:40], resp.text)
        assert resp.json()["error"]["message"]
    assert server.http.get("/health").status_code == 200


def test_streaming_errors_are_4xx(server):
    body = {**_c(model="nope"), "stream": True}
    resp = server.http.post("/v1/completions", json=body)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "adapter_not_found"


def test_request_ids(server):
    slow = {"text": "hi", "rid": "dup-1", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with server.http.stream("POST", "/generate", json=slow) as resp:
        lines = resp.iter_lines()  # keep it: a dropped iterator closes the connection
        next(lines)
        again = server.http.post("/generate", json={**slow, "stream": False})
        assert again.status_code == 409 and again.json()["error"]["param"] == "rid"
        assert _abort(server, "dup-1").status_code == 200
        last = [line for line in lines if line.startswith("data: {")][-1]
        assert msgspec.json.decode(last[6:])["meta_info"]["finish_reason"]["type"] == "abort"
    unknown = _abort(server, "never-seen")
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "rid"
    assert_all_kv_free(server.wait_idle())


def _abort(server, rid: str):
    headers = {"authorization": f"Bearer {server.admin_key}"}  # no --api-key: admin only
    return server.http.post("/abort_request", json={"rid": rid}, headers=headers)


# ---- disconnects and garbage -------------------------------------------------------------------


def test_disconnects_free_kv(server):
    long = {"model": "support", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    for _ in range(2):  # streaming: leave after the first chunks
        with server.http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
    with pytest.raises(httpx.ReadTimeout):  # not streaming: give up while it decodes
        server.http.post("/v1/completions", json=long, timeout=0.5)
    threads = [threading.Thread(target=_give_up, args=(server.url, long)) for _ in range(4)]
    for t in threads:  # several at once, some still queued or in prefill
        t.start()
    for t in threads:
        t.join()
    sched = server.wait_idle(timeout_s=5)
    assert_all_kv_free(sched)
    assert sched["steps"] < 2000  # aborted requests did not run to 400 tokens each


def _give_up(url: str, body: dict) -> None:
    with httpx.Client(base_url=url, timeout=0.05) as c, pytest.raises(httpx.TimeoutException):
        c.post("/v1/completions", json=body)


def test_garbage_on_every_socket_is_ignored(server, client):
    endpoints = server.info()["zmq_endpoints"]
    ctx = zmq.Context()
    payloads = [b"", b"\x00", b"\xff" * 64, b"not msgpack at all",
                msgspec.msgpack.encode({"type": "StepPlan", "step": "x"}),
                msgspec.msgpack.encode({"type": "StepResult", "step": 10**9}),
                msgspec.msgpack.encode([1, 2, 3]), bytes(range(256)) * 40]
    try:
        for name in ("api", "tokenizer", "scheduler", "worker"):
            sock = ctx.socket(zmq.PUSH)
            sock.connect(endpoints[name])
            for p in payloads:
                sock.send(p)
            sock.close(linger=2000)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoints["client"])
        for p in payloads:
            dealer.send(p)
            dealer.send_multipart([p, p, p])
        dealer.close(linger=2000)
    finally:
        ctx.term()
    time.sleep(0.5)
    assert server.http.get("/health").status_code == 200
    out = client.completions.create(model="legal", prompt=PROMPT, max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert "dropped" in server.logs()
