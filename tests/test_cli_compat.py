"""`radixlora serve` as vLLM's and SGLang's users call it: the model as a positional argument or
--model-path, --lora-modules / --lora-paths in all their forms, the adapter counts translated
into pool sizes, Hugging Face ids through the local cache; the compatibility endpoints
(/load_lora_adapter, /unload_lora_adapter, /tokenize, /detokenize, /version); and start-up
errors: argparse errors for bad values, one line naming the cause (and the flag) otherwise."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from radixlora import __version__
from radixlora.cli import StartError, build_parser, check_device, main, prepare
from radixlora.cli.flags import lora_modules, lora_paths, model_and_adapters, resolved_overrides
from radixlora.config import ModelConfig
from radixlora.demo import DEMO_ADAPTERS, DEMO_MODEL_DIR, format_prompt
from radixlora.engine import Engine
from radixlora.lora.layout import bytes_per_row
from radixlora.sampling_params import SamplingParams
from radixlora.server.procs.supervisor import StderrRelay
from radixlora.text.chat import ChatTemplate
from radixlora.text.tokenizer import Tokenizer
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.server_harness import ServerProcess, free_port

API_KEY = "compat-key"
PROMPT = format_prompt("the red fox ate 42 fish")
# the longest /health answer allowed while the api tokenizes on its threads (a busy moment of
# the 2-core CI machine alone has taken 0.2 s)
LOOP_GAP_S = 0.5


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def run_cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixlora.cli", *argv], capture_output=True,
                          text=True, timeout=timeout)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# ---- flags -----------------------------------------------------------------------------------


def test_lora_modules_and_lora_paths_forms():
    assert lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == {
        "a": "/x", "b": "/y"}
    assert lora_paths(["/adapters/sql/", "c=/z", '{"lora_name": "d", "lora_path": "/w"}']) == {
        "sql": "/adapters/sql/", "c": "/z", "d": "/w"}
    for bad in (["noequals"], ['{"name": "x"}'], ["{not json"]):
        with pytest.raises(SystemExit, match="--lora-modules"):
            lora_modules(bad)
    with pytest.raises(SystemExit, match="pin"):
        lora_paths(['{"lora_name": "d", "lora_path": "/w", "pinned": true}'])


def test_positional_model_and_every_adapter_flag():
    up, rev, dig, js = (str(DEMO_ADAPTERS[n]) for n in ("upper", "reverse", "digits", "json"))
    args = parse(str(DEMO_MODEL_DIR), "--lora-modules", f"upper={up}",
                 json.dumps({"name": "rev", "path": rev}), "--lora-paths", dig,
                 "--adapter", f"j={js}", "--enable-lora")
    model, adapters, served = model_and_adapters(args)
    assert str(model) == str(DEMO_MODEL_DIR) and served is None
    assert adapters == {"upper": up, "rev": rev, "digits": dig, "j": js}
    assert parse("--model-path", "m").model == "m"
    with pytest.raises(SystemExit, match="two models"):
        model_and_adapters(parse("a", "--model", "b"))
    with pytest.raises(SystemExit, match="no such file or directory"):
        model_and_adapters(parse("--model", "/no/such/model"))


def test_adapter_counts_become_pool_sizes():
    args = parse("--max-loras", "4", "--max-lora-rank", "16", "--max-loras-per-batch", "3",
                 "--max-cpu-loras", "10", "--dtype", "half")
    overrides = resolved_overrides(args, DEMO_MODEL_DIR)
    row_bytes = bytes_per_row(ModelConfig.from_dir(DEMO_MODEL_DIR), torch.float16)
    assert overrides == {"max_loras": 4, "max_rank": 16, "max_adapter_sets_per_batch": 3,
                         "dtype": "float16", "host_adapter_bytes": 10 * 16 * row_bytes}
    with pytest.raises(SystemExit, match="not both"):
        resolved_overrides(parse("--max-cpu-loras", "2", "--host-adapter-bytes", "9"),
                           DEMO_MODEL_DIR)


def test_ready_timeout_reaches_the_launcher():
    """A first start of a large model may need more than the default to compile and capture."""
    assert prepare(parse("--port", str(free_port()))).ready_timeout_s == 600.0
    assert prepare(parse("--ready-timeout", "1800", "--port",
                         str(free_port()))).ready_timeout_s == 1800.0
    with pytest.raises(SystemExit):
        parse("--ready-timeout", "0")


def test_step_and_weight_flags_reach_the_engine_config():
    args = parse("--itl-target-ms", "60", "--load-format", "dummy")
    overrides = resolved_overrides(args, DEMO_MODEL_DIR)
    assert overrides["itl_target_ms"] == 60.0 and overrides["load_format"] == "dummy"
    with pytest.raises(SystemExit):
        parse("--load-format", "pt")


def test_start_up_checks_of_adapters_leave_the_api_process_without_torch():
    """prepare() reads every start-up adapter's config and safetensors header in the process
    that becomes the api, which never needs torch (importing it costs seconds at start)."""
    argv = ["serve", "--port", str(free_port())]
    for name, path in DEMO_ADAPTERS.items():
        argv += ["--adapter", f"{name}={path}"]
    code = ("import sys; from radixlora.cli import build_parser, prepare; "
            f"prepare(build_parser().parse_args({argv!r})); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_hugging_face_ids_resolve_through_the_local_cache(tmp_path, monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abcd"
    build_tiny_model(snapshot)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model, _, served = model_and_adapters(parse("org/tiny", "--adapter",
                                                f"up={DEMO_ADAPTERS['upper']}"))
    assert model == str(snapshot) and served == "org/tiny"
    with pytest.raises(SystemExit, match="not in the Hugging Face cache"):
        model_and_adapters(parse("org/missing"))


def test_every_option_has_help_with_its_default():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            assert action.help, (name, action.option_strings)
            switch = action.nargs == 0 or action.required
            assert switch or "default" in sub._get_formatter()._get_help_string(action), (
                name, action.option_strings)
        assert "(default: 30000)" in text if name == "serve" else True
    assert "%" not in commands["serve"].format_help().replace("25%", "")


def test_bad_values_are_argparse_errors_and_version():
    done = run_cli("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"radixlora {__version__}"
    for flag, value in (("--dtype", "fp16"), ("--log-level", "verbose"), ("--device", "tpu"),
                        ("--port", "70000"), ("--max-num-seqs", "0")):
        done = run_cli("serve", flag, value)
        assert done.returncode == 2, done.stderr
        assert flag in done.stderr and "Traceback" not in done.stderr


def test_device_cuda_without_cuda_names_the_flag(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(StartError, match="--device cpu"):
        check_device({"device": "cuda"})
    check_device({"device": "cpu"})


# ---- start-up failures -----------------------------------------------------------------------


def test_busy_port_and_bad_model_fail_before_loading_in_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_cli("serve", "--port", str(port))
    assert done.returncode == 1
    assert last_line(done.stderr) == (f"radixlora serve: error: port {port} on 127.0.0.1 is "
                                      "already in use; choose another with --port")
    assert "starting the worker" not in done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    done = run_cli("serve", "--model", str(empty), "--port", "1")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert last_line(done.stderr) == (f"radixlora serve: error: no config.json in {empty} "
                                      "(set by --model)")


@pytest.fixture
def default_port_taken():
    """127.0.0.1:30000 held for the test (or already held by another process)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", 30000))
            sock.listen()
        except OSError:
            pass
        yield


@pytest.mark.parametrize("argv, message", [
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--adapter", f"a:b={DEMO_ADAPTERS['upper']}"], "may not contain"),
    (["--kv-pages", "-1"], "--kv-pages")])
def test_a_bad_flag_is_reported_while_the_default_port_is_taken(default_port_taken, argv,
                                                                message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    said = f"{exit_.value.code} {capsys.readouterr().err}"
    assert message in said and "already in use" not in said


@pytest.mark.parametrize("flag", ["--api-key", "--admin-api-key"])
@pytest.mark.parametrize("key", ["", "  "])
def test_an_empty_key_is_refused_not_taken_for_no_key(flag, key):
    args = parse(flag, key, "--enable-admin", "--port", str(free_port()))
    with pytest.raises(StartError, match=f"{flag} is empty"):
        prepare(args)


@pytest.mark.parametrize("env", ["RADIXLORA_API_KEY", "RADIXLORA_ADMIN_API_KEY",
                                 "RADIXLORA_ZMQ_CLIENT_KEY"])
def test_an_empty_key_in_the_environment_is_refused_not_taken_for_no_key(env, monkeypatch):
    """`RADIXLORA_API_KEY=$KEY radixlora serve` with $KEY unset must not serve without a key."""
    monkeypatch.setenv(env, "")
    args = parse("--enable-admin", "--admin-api-key", "k", "--port", str(free_port()))
    if env == "RADIXLORA_ADMIN_API_KEY":
        args = parse("--enable-admin", "--port", str(free_port()))
    with pytest.raises(StartError, match=f"{env} is set but empty"):
        prepare(args)


@pytest.mark.parametrize("adapter, message", [("a:b", "may not contain"),
                                              ("radixlora-demo", "served model's name")])
def test_bad_adapter_names_fail_before_any_process_starts(adapter, message):
    args = parse("--adapter", f"{adapter}={DEMO_ADAPTERS['upper']}", "--port", str(free_port()))
    with pytest.raises(StartError, match=message):
        prepare(args)


def nan_adapter(model, path):
    """An adapter whose config and safetensors header are right and whose values are not:
    only the full validation, in the scheduler process, refuses it."""
    adapter = build_tiny_adapter(model, path, rank=4, seed=3)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    save_file(tensors, weights)
    return adapter


def test_a_childs_start_up_failure_is_printed_once_last(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    broken = nan_adapter(model, tmp_path / "broken")
    done = run_cli("serve", str(model), "--adapter", f"broken={broken}", "--port",
                   str(free_port()), "--kv-pages", "64", timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = last_line(done.stderr)
    assert "start-up failed: the scheduler process cannot start: adapter 'broken'" in last
    assert done.stderr.count(last.split("cannot start: ")[1]) == 1  # the cause, once
    assert "starting the worker process" in done.stderr and "pools sized" in done.stderr


def test_a_wrong_adapter_is_refused_before_any_process_starts(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    done = run_cli("serve", str(model), "--adapter", f"broken={broken}", "--port",
                   str(free_port()), "--kv-pages", "64", timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert last_line(done.stderr).startswith("radixlora serve: error: adapter 'broken':")
    assert "starting the worker process" not in done.stderr


@pytest.fixture(scope="module")
def engine():
    return Engine(DEMO_MODEL_DIR, adapters={"upper": DEMO_ADAPTERS["upper"]})


def test_stderr_relay_holds_back_the_start_up_cause(capsys):
    read, write = os.pipe()
    holding = threading.Event()
    holding.set()
    relay = StderrRelay(os.fdopen(read, "rb"), holding)
    os.write(write, b"a line\ncapture 1/3\rcapture 2/3\r")
    os.write(write, b"x [worker] ERROR ipc: worker process cannot start: no GPU memory\n")
    os.write(write, b"ValueError: bad\ntail")
    os.close(write)
    assert relay.done.wait(10)
    err = capsys.readouterr().err
    assert err == "a line\ncapture 1/3\rcapture 2/3\rValueError: bad\ntail\n"
    assert (relay.cause, relay.last_error) == ("no GPU memory", "ValueError: bad")


# ---- a server started the vLLM way -----------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = DEMO_ADAPTERS["upper"].parent
    log = tmp_path_factory.mktemp("compat") / "server.log"
    proc = ServerProcess(
        None, {}, log, str(DEMO_MODEL_DIR), "--served-model-name", "demo",
        "--lora-modules", f"upper={DEMO_ADAPTERS['upper']}",
        json.dumps({"name": "digits", "path": str(DEMO_ADAPTERS["digits"])}),
        "--lora-paths", str(DEMO_ADAPTERS["reverse"]), "--enable-lora",
        "--max-loras", "4", "--max-cpu-loras", "6", "--max-loras-per-batch", "3",
        "--api-key", API_KEY, "--allowed-adapter-root", str(root))
    proc.http.headers["authorization"] = f"Bearer {API_KEY}"
    try:
        proc.wait_ready()
        yield proc
    finally:
        assert proc.stop() == 0, proc.logs()


def test_served_adapters_and_sizes(server):
    names = {m["id"] for m in server.http.get("/v1/models").json()["data"]}
    assert names == {"demo", "upper", "digits", "reverse"}
    engine = server.info()["engine"]
    row_bytes = bytes_per_row(ModelConfig.from_dir(DEMO_MODEL_DIR), torch.float32)
    assert engine["max_adapter_sets_per_batch"] == 3
    assert engine["host_adapter_bytes"] == 6 * engine["max_rank"] * row_bytes


def test_the_openai_client_picks_adapters_on_a_vllm_style_server(server):
    """The server started with vLLM's flags, driven with the official client: an adapter by
    `model`, by SGLang's `lora_path` through extra_body, and a stack."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)

    def chat(model: str = "demo", **extra) -> str:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "the red fox ate 42 fish"}],
            max_tokens=40, temperature=0, extra_body=extra or None)
        return out.choices[0].message.content.strip()

    assert chat() == "the red fox ate 42 fish"
    assert chat("upper") == "THE RED FOX ATE 42 FISH"
    assert chat(lora_path="reverse") == "fish 42 ate fox red the"
    stack = [{"name": "upper", "weight": 1}, {"name": "reverse", "weight": 1}]
    assert chat(adapters=stack) == "FISH 42 ATE FOX RED THE"


def test_tokenize_detokenize_version(server):
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    got = server.http.post("/tokenize", json={"model": "demo", "prompt": PROMPT,
                                              "return_token_strs": True}).json()
    ids = tokenizer.encode(PROMPT)
    assert got["tokens"] == ids and got["count"] == len(ids)
    assert got["max_model_len"] == ModelConfig.from_dir(DEMO_MODEL_DIR).max_position
    assert len(got["token_strs"]) == len(ids)
    messages = [{"role": "user", "content": "the red fox ate 42 fish"}]
    chat = server.http.post("/tokenize", json={"messages": messages}).json()
    rendered = ChatTemplate.from_dir(DEMO_MODEL_DIR).render(messages)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    back = server.http.post("/detokenize", json={"tokens": ids}).json()
    assert back == {"prompt": tokenizer.decode(ids)}
    bad = server.http.post("/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert server.http.post("/tokenize", json={}).status_code == 400
    unknown = server.http.post("/tokenize", json={"prompt": "x", "frobnicate": []})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_parameter"
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_tokenize_refuses_what_cannot_fit_and_never_holds_the_event_loop(server):
    """A 7 MB prompt is refused from its length (as generation refuses it) and the largest
    accepted prompt, with its token strings, is tokenized while /health keeps answering."""
    tokenizer = Tokenizer.from_dir(DEMO_MODEL_DIR)
    max_len = ModelConfig.from_dir(DEMO_MODEL_DIR).max_position
    huge = server.http.post("/tokenize", json={"prompt": "fox " * 1_750_000,
                                               "return_token_strs": True})
    assert huge.status_code == 400, huge.text
    assert huge.json()["error"]["code"] == "context_length_exceeded"
    largest = "x" * (max_len * tokenizer.max_bytes_per_token)
    # the expected answer is worked out before the poller starts: this process's own work
    # would hold the GIL against the poller's thread and count in its gaps
    want = tokenizer.encode(largest)
    want_strs = [tokenizer.decode([i], skip_special_tokens=False) for i in want]
    gaps, done, answers = [], threading.Event(), []

    def poll():
        while not done.is_set():
            start = time.perf_counter()
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            gaps.append(time.perf_counter() - start)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(5):
            answers.append(server.http.post("/tokenize", json={
                "prompt": largest, "return_token_strs": True}).json())
    finally:
        done.set()
        poller.join()
    for got in answers:
        assert got["tokens"] == want and got["token_strs"] == want_strs
    assert gaps and max(gaps) < LOOP_GAP_S, max(gaps)


def test_sglang_load_and_unload_lora_adapter(server):
    admin = {"authorization": f"Bearer {server.admin_key}"}
    body = {"lora_name": "shout", "lora_path": str(DEMO_ADAPTERS["upper"]), "pinned": True}
    loaded = server.http.post("/load_lora_adapter", json=body, headers=admin)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["success"] is True and loaded.json()["pinned"] is True
    out = server.http.post("/v1/completions", json={
        "model": "shout", "prompt": PROMPT, "max_tokens": 40, "temperature": 0}).json()
    assert out["choices"][0]["text"] == "THE RED FOX ATE 42 FISH"
    gone = server.http.post("/unload_lora_adapter", json={"lora_name": "shout"}, headers=admin)
    assert gone.status_code == 200 and gone.json()["success"] is True
    assert server.http.post("/unload_lora_adapter", json={"lora_name": "shout"},
                            headers=admin).status_code == 404
    assert server.http.post("/load_lora_adapter", json=body).status_code == 401


@pytest.mark.parametrize("stop", [["fox"], ["x", "42 f"], ["ate 4", "ate"], ["zzz"]])
def test_offline_stop_strings_equal_the_servers(server, engine, stop):
    """SamplingParams(stop=...) on the offline Engine gives the server's text and reason."""
    for adapter in (None, "upper"):
        params = SamplingParams(max_tokens=40, temperature=0.0, stop=stop)
        offline = engine.generate(PROMPT, params, adapters=adapter)[0].outputs[0]
        body = {"model": adapter or "demo", "prompt": PROMPT, "max_tokens": 40,
                "temperature": 0, "stop": stop}
        online = server.http.post("/v1/completions", json=body).json()["choices"][0]
        assert (offline.text, offline.finish_reason) == (online["text"],
                                                         online["finish_reason"]), adapter



def test_vllm_and_sglang_flags_map_onto_the_engine_config():
    config = resolved_overrides(parse("--block-size", "4", "--seed", "7", "--disable-radix-cache",
                                      "--enable-prefix-caching", "--trust-remote-code"),
                                DEMO_MODEL_DIR)
    assert config == {"page_size": 4, "seed": 7, "enable_radix_cache": False}
    assert resolved_overrides(parse("--random-seed", "0"), DEMO_MODEL_DIR) == {"seed": 0}
    assert resolved_overrides(parse("--enable-prefix-caching"), DEMO_MODEL_DIR) == {}
    for backend in ("--guided-decoding-backend guidance", "--grammar-backend llguidance"):
        assert resolved_overrides(parse(*backend.split()), DEMO_MODEL_DIR) == {}


@pytest.mark.parametrize("argv, code, reason", [
    (("--pipeline-parallel-size", "2"), 2, "--tensor-parallel-size or --data-parallel-size"),
    (("-pp", "2"), 2, "pipeline parallelism is not supported"),
    (("--fully-sharded-loras",), 2, "each rank holds its slice"),
    (("--lora-backend", "triton"), 2, "chosen per device"),
    (("--tool-call-parser", "xlam"), 2, "invalid choice: 'xlam'"),
    (("--grammar-backend", "xgrammar"), 2, "invalid choice: 'xgrammar'"),
    (("--chat-template", "no/such/file.jinja"), 1, "no such file, and not a Jinja template"),
    (("--chat-template", "{% for m in messages %}"), 1, "does not compile"),
    (("--tokenizer", "/"), 1, "no tokenizer.json"),
])
def test_a_refused_flag_names_itself_and_the_reason(argv, code, reason):
    """Flags without a counterpart are usage errors (2); a flag's bad value stops the launch
    before any process starts (1); either way the last line names the flag and why."""
    done = run_cli("serve", *argv)
    assert done.returncode == code, done.stderr
    assert argv[0] in last_line(done.stderr) and reason in last_line(done.stderr), done.stderr
    assert "Traceback" not in done.stderr


def test_tokenizer_chat_template_and_no_radix_cache_flags(tmp_path):
    """--tokenizer (a directory of its own), --chat-template (a file) and
    --disable-radix-cache, as vLLM's and SGLang's launch lines give them."""
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (DEMO_MODEL_DIR / name).is_file():
            (tokenizer_dir / name).write_bytes((DEMO_MODEL_DIR / name).read_bytes())
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    proc = ServerProcess(None, {}, tmp_path / "server.log", str(DEMO_MODEL_DIR),
                         "--tokenizer", str(tokenizer_dir), "--chat-template", str(template),
                         "--disable-radix-cache", "--seed", "3")
    try:
        proc.wait_ready()
        messages = [{"role": "user", "content": "the red fox"}]
        got = proc.http.post("/tokenize", json={"messages": messages}).json()
        tokenizer = Tokenizer.from_dir(tokenizer_dir)
        assert got["tokens"] == tokenizer.encode("THE RED FOX", add_special_tokens=False)
        model = proc.http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        for _ in range(2):
            resp = proc.http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert proc.info()["engine"]["seed"] == 3
    finally:
        assert proc.stop() == 0, proc.logs()


def test_the_openai_client_on_an_sglang_style_server(tmp_path):
    """`--model-path` and `--lora-paths` as SGLang takes them, driven with the official client:
    an adapter by `model` and by `lora_path`."""
    import openai

    lora = json.dumps({"lora_name": "rev", "lora_path": str(DEMO_ADAPTERS["reverse"])})
    proc = ServerProcess(None, {}, tmp_path / "server.log", "--model-path", str(DEMO_MODEL_DIR),
                         "--lora-paths", f"upper={DEMO_ADAPTERS['upper']}", lora,
                         "--max-loras-per-batch", "2")
    try:
        proc.wait_ready()
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id

        def complete(name: str, **extra) -> str:
            out = client.completions.create(model=name, prompt=PROMPT, max_tokens=40,
                                            temperature=0, extra_body=extra or None)
            return out.choices[0].text.strip()

        assert complete(model) == "the red fox ate 42 fish"
        assert complete("upper") == "THE RED FOX ATE 42 FISH"
        assert complete(model, lora_path="rev") == "fish 42 ate fox red the"
    finally:
        assert proc.stop() == 0, proc.logs()
