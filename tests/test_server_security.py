"""What a hostile or careless HTTP client can do to `radixlora serve` (the bundled demo): integers
out of range and deeply nested bodies are 400s naming the problem, unknown routes and methods
are OpenAI-shaped, --api-key guards everything but the health checks and /metrics, the admin
key guards the operator's endpoints, an abort reaches only its own key's requests, a drain
timeout answers 503s and stream error events, and fuzzed bodies never get a 5xx."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_harness import ADMIN_KEY, running_server

API_KEY = "sk-test-api-key"
BASE = "radixlora-demo"
HUGE = 2**31
ERROR_FIELDS = {"message", "type", "param", "code"}
OPERATOR_ENDPOINTS = [
    ("GET", "/get_server_info", None),
    ("POST", "/flush_cache", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
    ("POST", "/v1/pin_lora_adapter", {"lora_name": "x"}),
    ("POST", "/v1/unpin_lora_adapter", {"lora_name": "x"}),
]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """--api-key and admin on (the harness's admin key)."""
    log = tmp_path_factory.mktemp("keyed") / "server.log"
    with running_server(None, {}, log, "--api-key", API_KEY) as proc:
        yield proc


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """No key, admin off, a short drain timeout (test_drain_timeout stops it)."""
    log = tmp_path_factory.mktemp("open") / "server.log"
    with running_server(None, {}, log, "--drain-timeout", "0.2", admin=False) as proc:
        yield proc


def auth(key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"} if key else {}


def post(server, path: str, body, key: str | None = API_KEY, **kw) -> httpx.Response:
    return server.http.post(path, json=body, headers=auth(key), **kw)


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == ERROR_FIELDS and err["message"]
    return err


def completion(**fields) -> dict:
    return {"model": BASE, "prompt": "input: a cat\noutput:\n", "max_tokens": 4, **fields}


# ---- integer ranges and nesting ----------------------------------------------------------------


INT_CASES = [
    ("/v1/completions", completion(prompt=[5, HUGE]), "prompt"),
    ("/v1/completions", completion(prompt=[[5], [HUGE]]), "prompt"),
    ("/v1/completions", completion(prompt=[5, -HUGE - 1]), "prompt"),
    ("/v1/completions", completion(stop_token_ids=[HUGE]), "stop_token_ids"),
    ("/v1/completions", completion(stop_token_ids=[-1]), "stop_token_ids"),
    ("/v1/completions", completion(max_tokens=HUGE), "max_tokens"),
    ("/v1/completions", completion(n=-HUGE - 1), "n"),
    ("/v1/completions", completion(top_k=2**40), "top_k"),
    ("/v1/completions", completion(seed=2**64), "seed"),
    ("/v1/completions", completion(logprobs=HUGE), "logprobs"),
    ("/v1/completions", completion(best_of=10**30), "best_of"),
    ("/v1/chat/completions", {"model": BASE, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": HUGE}, "max_completion_tokens"),
    ("/generate", {"input_ids": [5, HUGE]}, "input_ids"),
    ("/generate", {"input_ids": [-7]}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": [HUGE]}},
     "sampling_params.stop_token_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"sampling_seed": -(2**64)}},
     "sampling_params.sampling_seed"),
    ("/generate", {"text": "hi", "top_logprobs_num": HUGE}, "top_logprobs_num"),
]


@pytest.mark.parametrize("path,body,param", INT_CASES, ids=[c[2] for c in INT_CASES])
def test_integers_out_of_range_are_400(keyed, path, body, param):
    err = error_of(post(keyed, path, body), 400)
    assert err["param"] == param, err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_deep_nesting_is_400(keyed, path):
    for depth in (65, 100_000):
        body = b'{"model": "' + BASE.encode() + b'", "prompt": ' + b"[" * depth + b"]" * depth
        resp = keyed.http.post(path, content=body + b"}", headers={
            **auth(API_KEY), "content-type": "application/json"})
        assert error_of(resp, 400)["code"] == "too_deep"
    shallow = completion(prompt=["x"], extra=[[[[{"a": [[1]]}]]]])
    assert error_of(post(keyed, "/v1/completions", shallow), 400)["code"] == "unknown_parameter"


# ---- routes, methods, keys ---------------------------------------------------------------------


def test_unknown_route_and_wrong_method_are_openai_shaped(keyed):
    assert error_of(keyed.http.get("/v1/nope"), 404)["code"] == "not_found"
    assert error_of(keyed.http.post("/nothing/here", json={}), 404)["code"] == "not_found"
    resp = keyed.http.get("/v1/completions", headers=auth(API_KEY))
    assert error_of(resp, 405)["code"] == "method_not_allowed"
    assert error_of(keyed.http.delete("/health"), 405)["code"] == "method_not_allowed"


def test_api_key_guards_inference(keyed):
    wrong = openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=BASE, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=keyed.url + "/v1", api_key=API_KEY, max_retries=0)
    assert right.completions.create(model=BASE, prompt="hi", max_tokens=2).usage
    assert right.chat.completions.create(
        model="upper", messages=[{"role": "user", "content": "a cat"}], max_tokens=2).choices
    assert BASE in [m.id for m in right.models.list()]
    for key in (None, "wrong"):
        for path, body in (("/v1/completions", completion()), ("/generate", {"text": "hi"}),
                           ("/v1/chat/completions", {"model": BASE, "messages": []})):
            assert error_of(post(keyed, path, body, key), 401)["code"] == "invalid_api_key"
        for path in ("/v1/models", "/get_model_info"):
            assert keyed.http.get(path, headers=auth(key)).status_code == 401
    assert post(keyed, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
                ).status_code == 200
    assert keyed.http.get("/get_model_info", headers=auth(API_KEY)).status_code == 200
    assert keyed.http.get("/health").json() == {"status": "ok"}
    assert keyed.http.get("/health_generate").status_code == 200
    assert "radixlora_requests_total" in keyed.http.get("/metrics").text


def test_the_zeromq_client_endpoint_needs_the_api_key(keyed):
    """With --api-key (and no --zmq-client-key) the ZeroMQ entry asks the same key: a client
    without it, or with another, gets a 401 and nothing runs; with it, generation."""
    from radixlora import SamplingParams
    from radixlora.server.client import RequestError, RuntimeClient

    info = keyed.http.get("/get_server_info", headers=auth(ADMIN_KEY)).json()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for key in (None, "wrong"):
        client = RuntimeClient(info["zmq_client_endpoint"], timeout_s=30, api_key=key)
        try:
            with pytest.raises(RequestError) as e:
                client.generate("hi", params)
            assert (e.value.error.status, e.value.error.code) == (401, "invalid_api_key")
        finally:
            client.close()
    client = RuntimeClient(info["zmq_client_endpoint"], timeout_s=30, api_key=API_KEY)
    try:
        assert len(client.generate("hi", params)[0].token_ids) == 3
    finally:
        client.close()


@pytest.mark.parametrize("method,path,body", OPERATOR_ENDPOINTS,
                         ids=[e[1] for e in OPERATOR_ENDPOINTS])
def test_operator_endpoints_need_the_admin_key(keyed, method, path, body):
    for key in (None, API_KEY, "wrong"):
        resp = keyed.http.request(method, path, json=body, headers=auth(key))
        assert error_of(resp, 401)["code"] == "invalid_api_key"
    resp = keyed.http.request(method, path, json=body, headers=auth(ADMIN_KEY))
    assert resp.status_code in (200, 403, 404), resp.text  # no adapter root, no adapter x
    assert resp.status_code == 200 or resp.json()["error"]["code"] != "not_found"


@pytest.mark.parametrize("method,path,body", OPERATOR_ENDPOINTS + [
    ("POST", "/abort_request", {"rid": "x"})], ids=[e[1] for e in OPERATOR_ENDPOINTS] + ["abort"])
def test_operator_endpoints_do_not_exist_without_admin(open_server, method, path, body):
    for key in (None, ADMIN_KEY):
        resp = open_server.http.request(method, path, json=body, headers=auth(key))
        assert error_of(resp, 404)["code"] == "not_found"


def test_abort_reaches_only_the_same_keys_requests(keyed):
    mine = {"text": "input: a cat\noutput:\n", "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with keyed.http.stream("POST", "/generate", json={**mine, "rid": "admins"},
                           headers=auth(ADMIN_KEY)) as theirs, \
            keyed.http.stream("POST", "/generate", json={**mine, "rid": "mine"},
                              headers=auth(API_KEY)) as own:
        theirs_lines, own_lines = theirs.iter_lines(), own.iter_lines()
        next(theirs_lines)
        next(own_lines)
        refused = post(keyed, "/abort_request", {"rid": "admins"})
        assert error_of(refused, 404)["param"] == "rid"
        assert error_of(post(keyed, "/abort_request", {"rid": "mine"}, "wrong"), 401)
        assert post(keyed, "/abort_request", {"rid": "mine"}).status_code == 200
        assert _finish(own_lines) == "abort"
        assert _finish(theirs_lines) == "length"


def _finish(lines) -> str:
    last = [line for line in lines if line.startswith("data: {")][-1]
    return msgspec.json.decode(last[6:])["meta_info"]["finish_reason"]["type"]


def test_admin_may_abort_any_request(keyed):
    body = {"text": "input: a cat\noutput:\n", "stream": True, "rid": "anyone",
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with keyed.http.stream("POST", "/generate", json=body, headers=auth(API_KEY)) as resp:
        lines = resp.iter_lines()
        next(lines)
        assert post(keyed, "/abort_request", {"rid": "anyone"}, ADMIN_KEY).status_code == 200
        assert _finish(lines) == "abort"


# ---- fuzzed bodies -----------------------------------------------------------------------------

NAMES = st.sampled_from([BASE, "upper", "reverse", f"{BASE}:json", "nope", ""])
EDGE_INTS = st.sampled_from([2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 10**30, 0, -1])
SCALARS = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | EDGE_INTS
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12) | NAMES)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
SMALL = st.integers(-2, 300) | EDGE_INTS
IDS = st.lists(st.integers(-2, 1000) | EDGE_INTS, max_size=6)
PROMPTS = (st.text(max_size=20) | IDS | st.lists(st.text(max_size=8), max_size=3)
           | st.lists(IDS, max_size=3))
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "wizard"]),
    "content": st.text(max_size=12) | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}),
        max_size=2)}), max_size=3)
ADAPTERS = st.lists(st.fixed_dictionaries({"name": NAMES, "weight": st.floats(-2, 2)}),
                    max_size=3)
SGL_PARAMS = st.dictionaries(st.sampled_from([
    "max_new_tokens", "temperature", "top_p", "top_k", "n", "stop_token_ids", "sampling_seed",
    "stop", "min_p", "repetition_penalty"]), SMALL | IDS | st.floats(-1, 3) | VALUES, max_size=4)
FIELD_VALUES = {"model": NAMES, "lora_path": NAMES, "prompt": PROMPTS, "text": PROMPTS,
                "input_ids": PROMPTS, "messages": MESSAGES, "adapters": ADAPTERS,
                "sampling_params": SGL_PARAMS, "stop": st.text(max_size=5) | st.lists(
                    st.text(max_size=5), max_size=3), "stop_token_ids": IDS}
FIELDS = {
    "/v1/completions": ["model", "prompt", "max_tokens", "n", "top_k", "seed", "logprobs",
                        "stop", "stop_token_ids", "temperature", "top_p", "adapters", "stream",
                        "best_of", "echo", "stream_options", "ignore_eos", "logit_bias"],
    "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "n",
                             "logprobs", "top_logprobs", "seed", "stop", "tools", "stream",
                             "response_format", "adapters", "stop_token_ids"],
    "/generate": ["text", "input_ids", "sampling_params", "lora_path", "adapters", "stream",
                  "return_logprob", "top_logprobs_num", "logprob_start_len", "rid"],
}
VALID = {
    "/v1/completions": {"model": BASE, "prompt": "a cat", "max_tokens": 2},
    "/v1/chat/completions": {"model": BASE, "messages": [{"role": "user", "content": "a"}],
                             "max_tokens": 2},
    "/generate": {"text": "a cat", "sampling_params": {"max_new_tokens": 2}},
}


def field_value(name: str):
    """A value of the field's shape (mostly) or of any JSON type."""
    return FIELD_VALUES.get(name, SMALL | st.booleans()) | VALUES


def bodies(path: str):
    fields = st.sampled_from(FIELDS[path]).flatmap(
        lambda name: field_value(name).map(lambda value: (name, value)))
    extra = st.dictionaries(st.text(max_size=10), VALUES, max_size=2)
    merged = st.builds(lambda f, e, keep: {**(VALID[path] if keep else {}), **e, **dict(f)},
                       st.lists(fields, max_size=4), extra, st.booleans())
    encoded = merged.map(msgspec.json.encode)
    nested = st.integers(60, 5000).map(lambda d: b'{"prompt": ' + b"[" * d + b"]" * d + b"}")
    return st.integers(0, 9).flatmap(lambda i: nested if i == 0 else encoded)


@pytest.mark.parametrize("path", list(FIELDS))
def test_fuzzed_bodies_never_5xx(keyed, path):
    with httpx.Client(base_url=keyed.url, timeout=60, headers={
            **auth(API_KEY), "content-type": "application/json"}) as http:

        @settings(max_examples=40, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(st.lists(bodies(path), min_size=1, max_size=4))
        def batch(raws):
            for raw in raws:
                resp = http.post(path, content=raw)
                assert resp.status_code < 500, (raw[:300], resp.text[:300])
            assert http.get("/health").status_code == 200

        batch()


# ---- drain timeout (last: it stops the open server) --------------------------------------------


def submitted(server) -> float:
    """Generations submitted so far, from /metrics."""
    text = server.http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("radixlora_requests_total"))


def wait_submitted(server, count: float, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while submitted(server) < count:
        assert time.monotonic() < deadline, f"fewer than {count} generations submitted"
        time.sleep(0.005)


def child_pid(parent: int, module: str) -> int:
    """The pid of the child process of `parent` running radixlora.server.<module>."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and module.encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no child of {parent} runs {module}")


def test_drain_timeout_answers_503_and_stream_error_events(open_server):
    """A stream that has started and three requests that have not finished when the drain
    times out: the worker is stopped once the stream's first chunk is out (it cannot finish
    200 tokens meanwhile), before the others are sent, so none can finish first."""
    long = {"model": BASE, "prompt": "input: a cat\noutput:\n", "max_tokens": 240, "n": 4,
            "ignore_eos": True}
    chat = {"model": BASE, "messages": [{"role": "user", "content": "a cat"}], "n": 4,
            "max_tokens": 200, "ignore_eos": True, "stream": True}
    answers: list[httpx.Response] = []
    before = submitted(open_server)
    worker = child_pid(open_server.proc.pid, "worker_proc")
    with open_server.http.stream("POST", "/v1/chat/completions", json=chat) as stream:
        lines = stream.iter_lines()
        next(lines)
        os.kill(worker, signal.SIGSTOP)
        try:
            threads = [threading.Thread(target=lambda: answers.append(
                open_server.http.post("/v1/completions", json=long))) for _ in range(3)]
            for t in threads:
                t.start()
            wait_submitted(open_server, before + 4)
            open_server.proc.send_signal(signal.SIGTERM)
            events = [line[6:] for line in lines if line.startswith("data: ")]
            for t in threads:
                t.join()
        finally:
            os.kill(worker, signal.SIGCONT)
    assert events[-1] == "[DONE]"
    err = msgspec.json.decode(events[-2])["error"]
    assert set(err) == ERROR_FIELDS and err["code"] == "drain_timeout"
    assert len(answers) == 3
    for resp in answers:
        assert error_of(resp, 503)["code"] == "drain_timeout"
    assert open_server.proc.wait(30) == 0
    assert "Traceback" not in open_server.logs()
