"""Chaos against one real `radixlora serve` (the tiny model, --watchdog-timeout 3): every child
stopped (SIGSTOP) or killed (SIGKILL) in turn is noticed within the watchdog timeout with the
documented outcome (a core child: /health 503, a log line naming it, exit non-zero; the
registry: restarted, serving goes on); no process's command line holds a key; malformed and
out-of-range ZeroMQ messages on the client endpoint leave the server serving; a temporary
directory left by a killed launcher is removed at the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixlora.sampling_params import SamplingParams
from radixlora.server.args import ServerArgs
from radixlora.server.client import RuntimeClient
from radixlora.server.messages import (
    AdminReq,
    Codec,
    OutputBatch,
    ReqError,
    SchedulerInbox,
    TokenizedReq,
    WorkerInbox,
    bytes_to_ids,
    ids_to_bytes,
)
from radixlora.server.procs.scheduler_proc import SchedulerService
from radixlora.server.procs.worker_proc import make_executor, submit
from radixlora.step_plan import StepPlan
from tests.server_harness import (
    MODEL_NAME,
    ServerProcess,
    alive,
    build_checkpoints,
    free_port,
    sized,
)

WATCHDOG_S = 3.0
MARGIN_S = 2.0  # heartbeat interval, the launcher's watch interval, a loaded machine
ADMIN_KEY = "admin-secret-7f3a9c"
API_KEY = "api-secret-0b52e1"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("chaos"))


@pytest.fixture(scope="module")
def tmpdir_env():
    """A private TMPDIR for the servers (their temporary directories land there) and the keys,
    given only through the environment."""
    tmp = tempfile.mkdtemp(prefix="rl-chaos-")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", tmp)
        mp.setenv("RADIXLORA_ADMIN_API_KEY", ADMIN_KEY)
        mp.setenv("RADIXLORA_API_KEY", API_KEY)
        yield Path(tmp)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def stale_dirs(tmpdir_env):
    """One directory of a launcher that is gone, one of a live process (this one)."""
    stale = tmpdir_env / f"radixlora-{dead_pid()}-abcd1234"
    (stale / "state").mkdir(parents=True)
    (stale / "scheduler").write_text("a socket once")
    live = tmpdir_env / f"radixlora-{os.getpid()}-keepme12"
    live.mkdir()
    return stale, live


@pytest.fixture(scope="module")
def server(checkpoints, tmpdir_env, stale_dirs, tmp_path_factory):
    model, adapters = checkpoints
    adapter_dir = tmp_path_factory.mktemp("watched")
    log = tmp_path_factory.mktemp("logs") / "main.log"
    proc = ServerProcess(model, adapters, log, "--watchdog-timeout", str(WATCHDOG_S),
                         "--adapter-dir", str(adapter_dir), "--zmq-client-port",
                         str(free_port()), "--enable-admin")
    proc.http.headers.update(AUTH)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
        assert_tree_gone(proc)
        assert not list(tmpdir_env.glob(f"radixlora-{proc.proc.pid}-*"))  # removed at exit


def start_server(checkpoints, tmp_path) -> ServerProcess:
    model, adapters = checkpoints
    proc = ServerProcess(model, adapters, tmp_path / "log", "--watchdog-timeout", str(WATCHDOG_S))
    proc.http.headers.update(AUTH)
    proc.wait_ready()
    return proc


def children(launcher: int) -> dict[str, int]:
    """The launcher's child processes by name, from /proc (no endpoint needed)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if int(fields[1]) == launcher and len(cmdline) > 2:
            found[cmdline[2].decode().rsplit(".", 1)[-1].removesuffix("_proc")] = int(
                stat.parent.name)
    return found


def assert_tree_gone(server: ServerProcess) -> None:
    deadline = time.monotonic() + 10
    while children(server.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not children(server.proc.pid)


def health(server: ServerProcess) -> int | None:
    try:
        return server.http.get("/health", timeout=1).status_code
    except httpx.TransportError:
        return None


def complete(server: ServerProcess) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
    return server.http.post("/v1/completions", json=body, timeout=30)


def wait_for(condition, timeout_s: float) -> float:
    """Seconds until condition() held; fails after timeout_s."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - start


# ---- without a server: inboxes and the worker ---------------------------------------------------


def test_inbox_answers_or_drops_invalid_messages():
    rejected: list[ReqError] = []
    odd = TokenizedReq(rid="r", input_ids=b"\x01\x02\x03", params=SamplingParams())
    assert Codec(SchedulerInbox).decode(msgspec.msgpack.encode(odd), rejected.append) is None
    assert [(e.rid, e.status, e.param) for e in rejected] == [("r", 400, "input_ids")]
    admin = msgspec.msgpack.encode(AdminReq(qid=1, op="load", name="a"))
    assert Codec(SchedulerInbox).decode(admin.replace(b"load", b"drop")) is None
    short = StepPlan(step=0, items=[], input_ids=b"\0\0\0\0")  # ids no item accounts for
    assert Codec(WorkerInbox).decode(msgspec.msgpack.encode(short)) is None


def test_worker_answers_out_of_range_plans_in_turn(checkpoints):
    model, _ = checkpoints
    args = ServerArgs(model=str(model), engine={"kv_pages": 32})
    scheduler, worker = SchedulerService(sized(args)), make_executor(args)
    req = TokenizedReq(rid="r", input_ids=ids_to_bytes([3, 4, 5]),
                       params=SamplingParams(max_tokens=2))
    assert scheduler.add(req) is None
    plan = scheduler.next_plan()
    vocab = worker.runner.cfg.vocab_size
    slots = bytes_to_ids(plan.kv_slots).tolist()
    submit(worker, msgspec.structs.replace(plan, input_ids=ids_to_bytes([vocab, 4, 5])))
    submit(worker, msgspec.structs.replace(plan, kv_slots=ids_to_bytes(slots[:-1] + [1 << 30])))
    submit(worker, plan)
    results = worker.collect(keep=0)
    assert [r.error is not None for r in results] == [True, True, False]
    assert len(bytes_to_ids(results[2].token_ids)) == 1


# ---- one server: keys, stale directories, ZeroMQ fuzz, the registry ----------------------------


def test_stale_temp_dir_removed_at_start(server, stale_dirs, tmpdir_env):
    stale, live = stale_dirs
    assert not stale.exists()
    assert live.is_dir()
    own = list(tmpdir_env.glob(f"radixlora-{server.proc.pid}-*"))
    assert len(own) == 1 and (own[0].stat().st_mode & 0o777) == 0o700


def test_no_key_on_any_command_line(server):
    pids = [server.proc.pid, *children(server.proc.pid).values()]
    assert len(pids) == 5  # launcher, tokenizer, scheduler, worker, registry
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert ADMIN_KEY.encode() not in cmdline and API_KEY.encode() not in cmdline, pid


def generate_req(**fields) -> bytes:
    return msgspec.msgpack.encode({"type": "GenerateReq", "params": {"max_tokens": 2},
                                   **fields})


HOSTILE = [
    generate_req(rid="odd", input_ids=b"\x01\x02\x03\x04\x05"),
    generate_req(rid="big", input_ids=b"\xff\xff\xff\x7f"),
    generate_req(rid="neg", input_ids=b"\xff\xff\xff\xff"),
    generate_req(rid="start", input_ids=b"\x01\0\0\0", logprob_start=-1),
    generate_req(rid="n", input_ids=b"\x01\0\0\0", params={"n": -3}),
    generate_req(rid="two", prompt="hi", input_ids=b"\x01\0\0\0"),
    generate_req(rid="stop", prompt="hi", params={"stop_token_ids": [2**40]}),
    msgspec.msgpack.encode({"type": "AbortReq", "rid": "x", "index": -1}),
    msgspec.msgpack.encode({"type": "TokenBatch", "outputs": []}),
    msgspec.msgpack.encode({"type": "StepPlan", "step": 0, "items": []}),
    b"",
    b"\xc1",
]

structs = st.fixed_dictionaries({
    "rid": st.text(max_size=8),
    "input_ids": st.binary(max_size=12),
    "logprob_start": st.one_of(st.none(), st.integers(-5, 5)),
    "params": st.fixed_dictionaries({"max_tokens": st.integers(-2, 3),
                                     "n": st.integers(-1, 3)}),
}).map(lambda f: generate_req(**f))
anything = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                        | st.text(max_size=8)
                        | st.binary(max_size=8),
                        lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                        max_leaves=12).map(msgspec.msgpack.encode)
raw_messages = st.one_of(structs, anything, st.binary(max_size=64),
                         st.sampled_from(HOSTILE))


@pytest.fixture(scope="module")
def dealer(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(zmq_endpoint(server))
    yield sock
    ctx.destroy(linger=0)


def zmq_endpoint(server: ServerProcess) -> str:
    args = server.proc.args
    return f"tcp://127.0.0.1:{args[args.index('--zmq-client-port') + 1]}"


def drain(sock: zmq.Socket) -> list:
    codec = Codec(OutputBatch | ReqError)
    out = []
    while sock.poll(20):
        out.append(codec.decode(sock.recv()))
    return out


def keyed_send(dealer: zmq.Socket, raw: bytes) -> None:
    """A message as RuntimeClient(api_key=...) sends it: the key frame first (the server's
    --api-key is the ZeroMQ endpoint's key too)."""
    dealer.send_multipart([API_KEY.encode(), raw])


def test_odd_length_input_ids_answered_with_an_error(server, dealer):
    dealer.send(HOSTILE[0])  # without the key: a 401 at most, nothing about its validity
    if dealer.poll(2_000):
        assert Codec(OutputBatch | ReqError).decode(dealer.recv()).status == 401
    keyed_send(dealer, HOSTILE[0])
    assert dealer.poll(10_000)
    error = Codec(OutputBatch | ReqError).decode(dealer.recv())
    assert isinstance(error, ReqError) and error.rid == "odd" and error.status == 400
    assert "multiple of 4" in error.message


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=raw_messages)
def test_zmq_fuzz_leaves_the_server_serving(server, dealer, raw):
    keyed_send(dealer, raw)
    drain(dealer)
    assert server.proc.poll() is None, server.logs()


def test_serving_after_fuzz(server, dealer):
    time.sleep(0.5)
    drain(dealer)
    assert health(server) == 200, server.logs()
    assert complete(server).status_code == 200
    client = RuntimeClient(zmq_endpoint(server), timeout_s=30, api_key=API_KEY)
    try:
        samples = client.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0))
        assert len(samples[0].token_ids) == 3
    finally:
        client.close()
    assert "Traceback" not in server.logs()


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
def test_registry_fault_restarts_it(server, sig):
    old = children(server.proc.pid)["registry"]
    os.kill(old, sig)
    took = wait_for(lambda: children(server.proc.pid).get("registry") not in (None, old),
                    WATCHDOG_S + MARGIN_S + 2)  # + the first restart delays
    if sig == signal.SIGSTOP:
        assert took > WATCHDOG_S - 1.5
        assert f"registry process (pid {old}) sent no heartbeat" in server.logs()
    else:
        assert f"registry process (pid {old}) exited" in server.logs()
    assert complete(server).status_code == 200  # serving went on throughout
    wait_for(lambda: server.http.get("/health").json()["status"] == "ok", 15)


# ---- a server per fault of a core child --------------------------------------------------------


@pytest.mark.parametrize(("name", "sig"), [
    ("tokenizer", signal.SIGSTOP),
    ("scheduler", signal.SIGSTOP),
    ("worker", signal.SIGSTOP),
    ("tokenizer", signal.SIGKILL),
    ("scheduler", signal.SIGKILL),
])
def test_core_child_fault_stops_the_server(checkpoints, tmpdir_env, tmp_path, name, sig):
    server = start_server(checkpoints, tmp_path)
    try:
        pid = children(server.proc.pid)[name]
        os.kill(pid, sig)
        limit = (WATCHDOG_S if sig == signal.SIGSTOP else 0) + MARGIN_S
        took = wait_for(lambda: health(server) in (503, None), limit)
        assert sig == signal.SIGKILL or took > WATCHDOG_S - 1.5  # noticed by the watchdog
        response = complete(server) if health(server) == 503 else None
        assert response is None or response.status_code == 503
        assert server.proc.wait(15) == 1
        assert_tree_gone(server)
        assert not alive(pid)
        expected = "sent no heartbeat" if sig == signal.SIGSTOP else "exited"
        assert f"the {name} process (pid {pid}) {expected}" in server.logs()
        assert not list(tmpdir_env.glob(f"radixlora-{server.proc.pid}-*"))
    finally:
        server.stop()
