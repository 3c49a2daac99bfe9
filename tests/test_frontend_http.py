"""RuntimeEndpoint against a small HTTP server speaking SGLang's native /generate contract (text,
sampling_params, lora_path, stream with cumulative text, return_logprob with logprob_start_len
and max_new_tokens 0) plus radixlora's `adapters` field for stacks, answered by an in-process
Runtime. Programs on the endpoint give the same text as on the Runtime and the direct Engine
request; adapters reach the server as asked. (tests/test_frontend_server.py runs the parts the
real `radixlora serve` supports today.)"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from radixlora import Engine, SamplingParams
from radixlora.errors import AdapterError, InvalidRequestError
from radixlora_frontend import (
    EndpointError,
    Runtime,
    RuntimeEndpoint,
    assistant,
    function,
    gen,
    select,
    user,
)
from radixlora_frontend.ir import GenParams
from scripts.checkpoints import build_tiny_adapter, build_tiny_model

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STACK = (("a1", 0.5), ("a2", 1.0))
SPECS = {"base": None, "single": "a1", "stacked": STACK}
PROMPT = "A radix cache shares prefix KV between"


class FakeServer:
    """/generate and /get_model_info over a Runtime; keeps every request body it received."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.bodies: list[dict] = []
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, body: dict, send) -> None:
        self.bodies.append(body)
        texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
        adapters = body.get("lora_path") or _stack(body.get("adapters"))
        params = _params(body.get("sampling_params") or {})
        if body.get("stream"):
            return send.stream(self.stream(texts[0], params, adapters))
        if params.max_tokens == 0:
            outs = [self.prefill(t, body, adapters) for t in texts]
        else:
            outs = [self.generate(t, params, adapters) for t in texts]
        send.json(outs if isinstance(body["text"], list) else outs[0])

    def generate(self, text: str, params: GenParams, adapters, on_text=None) -> dict:
        sp = params.sampling_params()
        result = self.runtime.submit(text, sp, adapters, params.stop, on_text).result()[0]
        return {
            "text": result.text,
            "output_ids": result.token_ids,
            "meta_info": {
                "finish_reason": {"type": result.finish_reason, "matched": result.matched_stop},
                "prompt_tokens": result.prompt_tokens,
                "completion_tokens": result.completion_tokens,
                "cached_tokens": result.cached_tokens,
            },
        }

    def stream(self, text: str, params: GenParams, adapters):
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        done: list[dict] = []

        def run():
            done.append(self.generate(text, params, adapters, chunks.put))
            chunks.put(None)

        threading.Thread(target=run, daemon=True).start()
        so_far = ""
        while (chunk := chunks.get()) is not None:
            so_far += chunk
            yield {"text": so_far, "meta_info": {"finish_reason": None}}
        yield done[0]

    def prefill(self, text: str, body: dict, adapters) -> dict:
        tok = self.runtime.engine.tokenizer
        ids = tok.encode(text)
        meta = {
            "prompt_tokens": len(ids),
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 0},
        }
        if body.get("return_logprob"):
            start = max(body.get("logprob_start_len", 0), 1)
            logprobs = self.runtime.score_tokens(ids, start, adapters).result()
            meta["input_token_logprobs"] = [
                [lp, ids[i], tok.decode([ids[i]])]
                for i, lp in zip(range(start, len(ids)), logprobs)
            ]
        return {"text": "", "output_ids": [], "meta_info": meta}


def _stack(refs):
    return tuple((r["name"], r.get("weight", 1.0)) for r in refs) if refs else None


def _params(sp: dict) -> GenParams:
    return GenParams(
        max_tokens=sp.get("max_new_tokens", 128),
        temperature=sp.get("temperature", 1.0),
        top_p=sp.get("top_p", 1.0),
        top_k=sp.get("top_k", -1),
        min_p=sp.get("min_p", 0.0),
        seed=sp.get("sampling_seed"),
        stop=tuple(sp.get("stop") or ()),
        stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
        ignore_eos=sp.get("ignore_eos", False),
    )


def _handler(server: FakeServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path != "/get_model_info":
                return self._send(404, {"error": {"message": "no such route"}})
            self._send(200, {"model_path": str(server.runtime.engine.model_path)})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                server.answer(body, self)
            except (AdapterError, InvalidRequestError) as e:
                self._send(400, {"error": {"message": str(e), "code": e.code}})

        def json(self, obj):
            self._send(200, obj)

        def stream(self, events):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for event in events:
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def _send(self, status, obj):
            raw = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return Handler


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    model = build_tiny_model(root / "tiny")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    adapters = {f"a{i}": build_tiny_adapter(model, root / f"a{i}", 4, seed=i) for i in range(3)}
    with Runtime(Engine(model, adapters=adapters)) as rt:
        yield rt


@pytest.fixture(scope="module")
def server(runtime):
    fake = FakeServer(runtime)
    yield fake
    fake.httpd.shutdown()


@pytest.fixture
def endpoint(server):
    server.bodies.clear()
    return RuntimeEndpoint(server.url)


def direct(runtime, prompt, adapters=None, **params) -> str:
    sp = SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **params})
    return runtime.call(lambda e: e.generate(prompt, sp, adapters=adapters))[0].outputs[0].text


@function
def one_gen(s, adapter):
    s += PROMPT
    s += gen("out", max_tokens=8, temperature=0.0, adapter=adapter)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_gen_over_http_matches_runtime_and_engine(runtime, server, endpoint, spec):
    over_http = one_gen.run(spec, backend=endpoint)
    in_process = one_gen.run(spec, backend=runtime)
    assert over_http["out"] == in_process["out"] == direct(runtime, PROMPT, spec)
    body = server.bodies[0]
    assert body["text"] == PROMPT
    assert body["sampling_params"]["max_new_tokens"] == 8
    assert body.get("lora_path") == (spec if isinstance(spec, str) else None)
    stack = [{"name": n, "weight": w} for n, w in spec] if isinstance(spec, tuple) else None
    assert body.get("adapters") == stack


def test_stop_and_meta_over_http(runtime, endpoint):
    full = direct(runtime, PROMPT, "a2", max_tokens=12)
    stop = full[4:6]

    @function
    def stopped(s):
        s += PROMPT + gen("out", max_tokens=12, temperature=0.0, stop=stop, adapter="a2")

    state = stopped.run(backend=endpoint)
    assert state["out"] == full[: full.find(stop)]
    meta = state.get_meta_info("out")
    assert (meta["finish_reason"], meta["matched_stop"]) == ("stop", stop)


def test_select_over_http_equals_in_process(runtime, server, endpoint):
    @function
    def pick(s):
        s += PROMPT
        s += select("pick", choices=[" fox", " dog jumps over", " cache"], adapter="a1")

    over_http, in_process = pick.run(backend=endpoint), pick.run(backend=runtime)
    assert over_http["pick"] == in_process["pick"]
    got = over_http.get_meta_info("pick")["token_logprobs"]
    want = in_process.get_meta_info("pick")["token_logprobs"]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)
    prompt_tokens = len(runtime.engine.tokenizer.encode(PROMPT))
    scoring = server.bodies[-1]
    assert scoring["logprob_start_len"] == prompt_tokens and scoring["lora_path"] == "a1"
    assert scoring["sampling_params"]["max_new_tokens"] == 0


def test_streaming_over_http(runtime, endpoint):
    @function
    def story(s):
        s += PROMPT + gen("out", max_tokens=12, temperature=0.0, adapter="a1")

    state = story.run(backend=endpoint, stream=True)
    chunks = list(state.text_iter("out"))
    assert len(chunks) > 2
    assert "".join(chunks) == state["out"] == direct(runtime, PROMPT, "a1", max_tokens=12)


def test_roles_use_the_server_model_template(runtime, endpoint):
    @function
    def chat(s):
        s += user("What is a radix cache?")
        s += assistant(gen("answer", max_tokens=6, temperature=0.0))

    state = chat.run(backend=endpoint)
    asked = [{"role": "user", "content": "What is a radix cache?"}]
    prompt = runtime.chat_template.render(asked, add_generation_prompt=True)
    assert endpoint.chat_template.source == CHATML
    assert state["answer"] == direct(runtime, prompt, max_tokens=6)


def test_fork_join_and_run_batch_over_http(runtime, endpoint):
    @function
    def branches(s, i):
        s += f"{i}: {PROMPT}"
        forks = s.fork(2)
        for j, f in enumerate(forks):
            f += gen("x", max_tokens=4, temperature=0.0, adapter=f"a{j}")
        forks.join()

    states = branches.run_batch([{"i": i} for i in range(6)], backend=endpoint)
    for i, state in enumerate(states):
        prompt = f"{i}: {PROMPT}"
        assert state["x"] == [direct(runtime, prompt, f"a{j}", max_tokens=4) for j in range(2)]


def test_server_errors_raise_endpoint_error(endpoint):
    with pytest.raises(EndpointError) as info:
        one_gen.run("missing", backend=endpoint)
    assert info.value.status == 400 and info.value.code == "adapter_not_found"
