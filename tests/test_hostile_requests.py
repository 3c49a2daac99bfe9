"""No client request takes the server down or holds everyone else up: grammars that crash or
stall the grammar library, prompt-logprob floods, adapter files with gigabytes of trailing
bytes, admin loads over start-up names, DoRA adapters whose norms vanish, template variables
that shadow the server's. Each is tried against `radixlora serve` with the bundled demo while
two streams run; each is a 4xx or served, /health answers within HEALTH_S all along, no
stream waits more than GAP_S for a token, no process restarts and none keeps the memory a
refused request made it take."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR
from radixlora.errors import AdapterError
from radixlora.lora.adapter import read_adapter_files
from radixlora.server.procs.adapter_store import FilesChanged
from scripts.checkpoints import build_tiny_adapter
from tests.server_harness import current_rss, running_server, stream_gaps, streaming
from tests.test_grammar_limits import alias_chain, properties, ref_chain

KEY = "hostile-admin-key"
BASE = "radixlora-demo"
HEALTH_S = 0.5  # /health answers within this, however busy the server is
GAP_S = 2.0  # the longest a stream may wait for its next token (a loaded 2-core machine)
MEMORY_SLACK = 200 << 20  # what a process may grow by over refused requests


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    watched, allowed = root / "watched", root / "allowed"
    watched.mkdir()
    allowed.mkdir()
    return root, watched, allowed


@pytest.fixture(scope="module")
def server(dirs):
    root, watched, allowed = dirs
    with running_server(None, {}, root / "server.log", "--enable-admin", "--admin-api-key", KEY,
                        "--allowed-adapter-root", str(allowed), "--adapter-dir", str(watched),
                        "--adapter-quiet", "0.2", "--watchdog-timeout", "5",
                        "--grammar-compile-timeout", "3") as server:
        server.pids = server.info()["pids"]
        stream_gaps(server.url, BASE)  # compiled and warm
        yield server


@contextlib.contextmanager
def under_load(server):
    """Two streams and a /health poller for the block; then the checks every row shares."""
    health: list[float] = []
    done = threading.Event()

    def poll():
        with httpx.Client(base_url=server.url, timeout=30) as http:
            while True:
                started = time.monotonic()
                assert http.get("/health").status_code == 200
                health.append(time.monotonic() - started)
                if done.wait(0.1):
                    return

    poller = threading.Thread(target=poll)
    with streaming(server.url, BASE) as gaps:
        poller.start()
        try:
            yield
        finally:
            deadline = time.monotonic() + 30
            while not gaps and time.monotonic() < deadline:  # a short block: one stream ends
                time.sleep(0.1)
            done.set()
            poller.join()
    assert health and max(health) < HEALTH_S, max(health)
    assert gaps and max(gaps) < GAP_S, max(gaps)
    assert server.info()["pids"] == server.pids  # no process died and was restarted
    assert server.http.get("/health").json()["status"] == "ok"


def error(resp: httpx.Response, status: int, code: str | None = None, param: str | None = None):
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert code is None or body["code"] == code, body
    assert param is None or body["param"] == param, body
    return body


def completion(server, **fields) -> httpx.Response:
    body = {"model": BASE, "prompt": "input: the red fox\noutput:\n", "max_tokens": 4,
            "temperature": 0, **fields}
    return server.http.post("/v1/completions", json=body)


def test_grammars_that_crash_or_stall_the_library_are_refused_or_served(server):
    with under_load(server):
        schema = {"type": "json_schema",
                  "json_schema": {"name": "chain", "schema": json.loads(ref_chain(1000))}}
        error(completion(server, response_format=schema), 400, param="response_format")
        error(completion(server, guided_grammar=alias_chain(6000)), 400,
              param="guided_grammar")
        error(completion(server, prompt=["x"] * 64, guided_regex="(a{1000}){1000}"), 400,
              param="guided_regex")
        deep = '{"type": "object", "properties": {"x": ' * 2000 + '{"type": "string"}' + \
            "}}" * 2000
        error(completion(server, guided_json=deep), 400, param="guided_json")
        rules = "\n".join(["start: r0", *(f'r{i}: "x{i}" r{i + 1} | "y"' for i in range(3000)),
                           'r3000: "a"'])
        error(completion(server, guided_grammar=rules), 400, param="guided_grammar")
        shared = completion(server, prompt=["input: a cat\noutput:\n"] * 64,
                            guided_json=json.loads(properties(3000)))
        assert shared.status_code == 200 and len(shared.json()["choices"]) == 64, shared.text
        for costly in ({"guided_json": json.loads(properties(10_000))},
                       {"guided_choice": [f"c{i}" for i in range(50_000)]}):
            resp = completion(server, **costly)
            assert resp.status_code == 200 or (
                error(resp, 400, "grammar_too_costly")["message"].endswith(
                    "(--grammar-compile-timeout)")), resp.text


def test_prompt_logprob_floods_are_refused_and_big_answers_keep_the_loop_free(server):
    ids = [[5 + (i * 7 + j) % 800 for j in range(250)] for i in range(64)]
    flood = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
             "top_logprobs_num": 20, "sampling_params": {"max_new_tokens": 4, "n": 4}}
    largest = {"input_ids": ids[0][:200], "return_logprob": True, "logprob_start_len": 0,
               "top_logprobs_num": 20,
               "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}}
    api = server.pids["api"]
    with under_load(server):
        body = error(server.http.post("/generate", json=flood), 400, "too_many_logprobs",
                     "logprobs")
        assert "--max-logprob-entries" in body["message"]
        resp = server.http.post("/generate", json=largest)
        assert resp.status_code == 200, resp.text
        meta = resp.json()["meta_info"]
        assert len(meta["input_top_logprobs"]) == 200 and len(meta["output_top_logprobs"]) == 50
        before = current_rss(api)
        with httpx.Client(base_url=server.url, timeout=60) as http:
            threads = [threading.Thread(target=lambda: [
                http.post("/generate", json=largest).raise_for_status() for _ in range(5)])
                for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    assert current_rss(api) - before < MEMORY_SLACK


def trailing_bytes_adapter(path: Path, gib: int) -> Path:
    """The demo's upper adapter followed by `gib` GiB of bytes its header does not declare (a
    sparse hole: costless on disk)."""
    shutil.copytree(DEMO_ADAPTERS["upper"], path)
    tensors = path / "adapter_model.safetensors"
    os.truncate(tensors, tensors.stat().st_size + (gib << 30))
    return path


def test_adapter_files_are_read_no_further_than_their_tensors(server, dirs):
    _, watched, allowed = dirs
    trailing = trailing_bytes_adapter(allowed / "trailing", gib=2)
    admin = {"authorization": f"Bearer {KEY}"}
    scheduler, registry = server.pids["scheduler"], server.pids["registry"]
    before = current_rss(scheduler), current_rss(registry)
    with under_load(server):
        for _ in range(10):
            started = time.monotonic()
            resp = server.http.post("/v1/load_lora_adapter", headers=admin,
                                    json={"lora_name": "trailing", "lora_path": str(trailing)})
            body = error(resp, 400, param="lora_path")
            assert "bytes after its tensors" in body["message"]
            assert time.monotonic() - started < 1.0  # the 2 GiB are never read
        trailing_bytes_adapter(watched / ".dropped", gib=2)
        os.rename(watched / ".dropped", watched / "dropped")
        deadline = time.monotonic() + 30
        while "dropped" not in server.http.get("/health").json().get("adapters_rejected", {}):
            assert time.monotonic() < deadline, "the dropped adapter was never examined"
            time.sleep(0.1)
    assert current_rss(scheduler) - before[0] < MEMORY_SLACK
    assert current_rss(registry) - before[1] < MEMORY_SLACK


def test_an_admin_load_replaces_a_start_adapter_only_when_asked(server, dirs):
    _, _, allowed = dirs
    admin = {"authorization": f"Bearer {KEY}"}
    reverse = shutil.copytree(DEMO_ADAPTERS["reverse"], allowed / "reverse")
    upper = shutil.copytree(DEMO_ADAPTERS["upper"], allowed / "upper")
    before = completion(server, model="upper", max_tokens=12).json()["choices"][0]["text"]
    body = {"lora_name": "upper", "lora_path": str(reverse)}
    error(server.http.post("/v1/load_lora_adapter", headers=admin, json=body), 409,
          "name_taken")
    assert completion(server, model="upper", max_tokens=12).json()["choices"][0]["text"] == before
    resp = server.http.post("/v1/load_lora_adapter", headers=admin,
                            json={**body, "replace": True})
    assert resp.status_code == 200, resp.text
    assert completion(server, model="upper", max_tokens=12).json()["choices"][0]["text"] != before
    resp = server.http.post("/v1/load_lora_adapter", headers=admin,
                            json={"lora_name": "upper", "lora_path": str(upper), "replace": True})
    assert resp.status_code == 200, resp.text


def vanishing_dora(path: Path) -> Path:
    """A DoRA adapter on the demo model whose W + s B A is zero on row 0 of layer 0's q_proj:
    A's first row is W's first row, B's first row cancels it."""
    build_tiny_adapter(DEMO_MODEL_DIR, path, rank=2, seed=3, dora=True)
    tensors = load_file(path / "adapter_model.safetensors")
    weight = load_file(DEMO_MODEL_DIR / "model.safetensors")[
        "model.layers.0.self_attn.q_proj.weight"]
    config = json.loads((path / "adapter_config.json").read_text())
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
    a[0], b[0] = weight[0], 0.0
    b[0, 0] = -config["r"] / config["lora_alpha"]
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def test_a_dora_adapter_whose_norms_vanish_is_refused_with_a_400(server, dirs):
    """Its norms need the base weights, which only the worker holds: it is refused where they
    are first computed, before any step runs with it, and counts as rejected from then on."""
    _, _, allowed = dirs
    admin = {"authorization": f"Bearer {KEY}"}
    path = vanishing_dora(allowed / "vanishing")
    resp = server.http.post("/v1/load_lora_adapter", headers=admin,
                            json={"lora_name": "vanishing", "lora_path": str(path)})
    assert resp.status_code == 200, resp.text
    with under_load(server):
        body = error(completion(server, model="vanishing"), 400, "invalid_adapter")
        assert "vanishes" in body["message"]
        body = error(completion(server, model="vanishing"), 404, "adapter_not_found")
        assert "rejected" in body["message"] and "vanishes" in body["message"]
        assert completion(server, model="upper").status_code == 200


def test_chat_template_kwargs_cannot_shadow_what_the_server_passes(server):
    def chat(kwargs):
        return server.http.post("/v1/chat/completions", json={
            "model": BASE, "messages": [{"role": "user", "content": "a cat"}], "max_tokens": 2,
            "chat_template_kwargs": kwargs})

    for name in ("raise_exception", "eos_token", "bos_token", "messages", "tools",
                 "strftime_now"):
        body = error(chat({name: None}), 400, param="chat_template_kwargs")
        assert name in body["message"]
    assert chat({"enable_thinking": False}).status_code == 200
    resp = server.http.post("/tokenize", json={
        "model": BASE, "messages": [{"role": "user", "content": "a cat"}],
        "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.status_code == 200 and resp.json()["count"] > 0, resp.text
    error(server.http.post("/tokenize", json={
        "model": BASE, "messages": [{"role": "user", "content": "a cat"}],
        "chat_template_kwargs": {"eos_token": "x"}}), 400, param="chat_template_kwargs")


def test_a_template_that_fails_on_the_request_is_a_400():
    from radixlora.errors import InvalidRequestError
    from radixlora.text.chat import ChatTemplate

    template = ChatTemplate("{{ messages[0]['content'] | int // 0 }}{{ undefined_call() }}")
    with pytest.raises(InvalidRequestError, match="ZeroDivisionError|UndefinedError|failed"):
        template.prompt([{"role": "user", "content": "3"}])


def test_files_vanishing_while_an_admin_load_reads_them_are_a_409(tmp_path, monkeypatch):
    """The race of a load with the files' removal, made deterministic: the adapter's files
    disappear between the directory listing and the stat of an entry (then between the
    header check and the read)."""
    from radixlora.server.procs import adapter_store

    src = shutil.copytree(DEMO_ADAPTERS["upper"], tmp_path / "upper")
    scandir = os.scandir

    def vanishing(path):
        entries = list(scandir(path))
        for entry in entries:
            os.unlink(entry.path)
        return iter(entries)

    monkeypatch.setattr(adapter_store.os, "scandir", vanishing)
    with pytest.raises(FilesChanged):
        adapter_store.file_signature(src, "upper")
    monkeypatch.undo()
    shutil.rmtree(src)
    src = shutil.copytree(DEMO_ADAPTERS["upper"], tmp_path / "upper")
    real_open = os.open

    def open_after_removal(path, *args, **kwargs):
        if str(path).endswith("adapter_model.safetensors"):
            os.unlink(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_after_removal)
    with pytest.raises(AdapterError) as e:
        read_adapter_files("upper", src)
    assert e.value.code == "adapter_changing"


def test_an_admin_load_of_vanishing_files_answers_409(tmp_path, monkeypatch):
    from radixlora.server.args import ServerArgs
    from radixlora.server.messages import AdminReq
    from radixlora.server.procs import adapter_store
    from radixlora.server.procs.scheduler_proc import SchedulerService
    from tests.server_harness import sized

    service = SchedulerService(sized(ServerArgs(
        model=str(DEMO_MODEL_DIR), state_dir=str(tmp_path / "state"),
        allowed_adapter_roots=[str(tmp_path)])))
    src = shutil.copytree(DEMO_ADAPTERS["upper"], tmp_path / "mine")
    scandir = os.scandir

    def vanishing(path):
        entries = list(scandir(path))
        if Path(path) == src:
            for entry in entries:
                os.unlink(entry.path)
        return iter(entries)

    monkeypatch.setattr(adapter_store.os, "scandir", vanishing)
    reply = service.lifecycle.admin(AdminReq(qid=1, op="load", name="mine", path=str(src)))
    assert reply.status == 409 and reply.code == "adapter_changing", reply
