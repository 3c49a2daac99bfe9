"""Multi-node tensor parallel on the CPU (gloo), two "nodes" on this machine: a head
`radixlora serve --tp-size 2 --nnodes 2 --node-rank 0 --dist-init-addr 127.0.0.1:PORT` and a
headless `... --node-rank 1`, whose ranks meet at the head's TCPStore. Through the official
openai client the pair answers the single-device Engine's greedy tokens and logprobs, for the
base, a start-up adapter and one loaded over HTTP (snapshotted in --state-dir, which every
node reads); killing node 1 makes the head answer 503 and exit 1. Under torchrun (one process
per node, the node flags from its environment, its store as the rendezvous) the pair serves the
same, and node 1 exits 1 once the head dies; nothing hangs. The flags' checks and torchrun's
environment are also checked without processes."""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from radixlora import SamplingParams
from radixlora.cli import main
from radixlora.cli.flags import multinode
from radixlora.distributed import local_device
from radixlora.server.args import ServerArgs
from radixlora.structured import Structure
from radixlora.topology import node_ranks
from tests.server_harness import (
    ENGINE_FLAGS,
    MODEL_NAME,
    ServerProcess,
    alive,
    build_checkpoints,
    engine_like_server,
    free_port,
    terminate,
    wait_health_503,
)

PROMPT = "A radix cache shares prefix KV"
MAX_TOKENS = 6
TOL = 1e-4
STOP_S = 20  # a node must be gone this long after the other one died


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("multinode"))


RADIXLORA = [sys.executable, "-m", "radixlora.cli"]


def torchrun(node_rank: int, port: int) -> list[str]:
    """torchrun's static rendezvous at 127.0.0.1:port, one radixlora process per node."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
            "1", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port",
            str(port), "-m", "radixlora.cli"]


class Node:
    """`radixlora serve` run by `launcher` (a headless node > 0, or a head under torchrun)."""

    def __init__(self, model: Path, adapters: dict[str, Path], log_path: Path, *flags: str,
                 launcher: list[str] = RADIXLORA):
        cmd = [*launcher, "serve", "--log-level", "info", *ENGINE_FLAGS, "--model", str(model),
               *flags]
        for name, path in adapters.items():
            cmd += ["--adapter", f"{name}={path}"]
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 (lives as long as the node)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, ready=None, timeout_s: float = 120) -> None:
        """Until ready() (default: this node > 0 logged that its ranks are ready)."""
        deadline = time.monotonic() + timeout_s
        while not (ready() if ready else "ready: its worker ranks follow node 0" in self.logs()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node exited or never got ready:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        """SIGTERM first: torchrun passes it on to its process."""
        terminate(self.proc, 10)
        self.log.close()


def start_pair(checkpoints, tmp: Path) -> tuple[ServerProcess, Node]:
    """Node 1 and the head, "support" given at start-up, "legal" loadable over HTTP."""
    model, adapters = checkpoints
    start = {"support": adapters["support"]}
    group = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{rdzv_port()}",
             "--dtype", "float32", "--state-dir", str(tmp / "shared")]
    (tmp / "shared").mkdir()
    node = Node(model, start, tmp / "node1.log", *group, "--node-rank", "1")
    head = ServerProcess(model, start, tmp / "head.log", *group, "--node-rank", "0",
                         "--allowed-adapter-root", str(adapters["legal"].parent))
    return head, node


@pytest.fixture
def pair(checkpoints, tmp_path):
    head, node = start_pair(checkpoints, tmp_path)
    try:
        head.wait_ready()
        node.wait_ready()
        yield head, node
    finally:
        head.stop()
        node.stop()


@pytest.fixture(scope="module")
def engine(checkpoints):
    return engine_like_server(*checkpoints)


def completion_equals_engine(client, engine, model: str, adapters: str | None) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    want = engine.generate(PROMPT, params, adapters=adapters)[0].outputs[0]
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                    temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True}).choices[0]
    assert got.text == want.text, model
    assert got.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=TOL), model


def structured_equals_engine(client, engine) -> None:
    """A regular expression's output: every rank masks with the late masks rank 0 hands over,
    so the tokens equal the single-device Engine's."""
    regex = r"[a-c]{2,4}-[0-9]{2}"
    structure = Structure("regex", regex, param="regex")
    params = SamplingParams(max_tokens=16, temperature=0.0, structure=structure)
    want = engine.generate(PROMPT, params, adapters="support")[0].outputs[0].text
    got = client.completions.create(model="support", prompt=PROMPT, max_tokens=16,
                                    temperature=0,
                                    extra_body={"structured_outputs": {"regex": regex}})
    assert got.choices[0].text == want and re.fullmatch(regex, want)


def test_two_nodes_serve_the_single_device_tokens_and_stop_together(pair, checkpoints, engine,
                                                                    tmp_path):
    import openai

    head, node = pair
    load = {"lora_name": "legal", "lora_path": str(checkpoints[1]["legal"])}
    loaded = head.http.post("/v1/load_lora_adapter", json=load,
                            headers={"authorization": f"Bearer {head.admin_key}"})
    assert loaded.status_code == 200, loaded.text
    (state,) = (tmp_path / "shared").iterdir()
    assert any((state / "adapters").iterdir())  # the snapshot node 1's rank reads
    client = openai.OpenAI(base_url=head.url + "/v1", api_key="none", max_retries=0)
    for model, adapters in ((MODEL_NAME, None), ("support", "support"), ("legal", "legal")):
        completion_equals_engine(client, engine, model, adapters)
    structured_equals_engine(client, engine)
    ranks = children(node.proc.pid)
    assert ranks, node.logs()
    node.proc.send_signal(signal.SIGKILL)  # the whole node: its ranks die with their launcher
    wait_health_503(head, 10)
    assert head.proc.wait(STOP_S) == 1, head.logs()
    assert "worker process" in head.logs()
    assert not any(alive(pid) for pid in ranks)
    assert not state.exists()


def test_under_torchrun_node_1_exits_when_the_head_dies(checkpoints, engine, tmp_path):
    """The nodes from torchrun's environment (its store as the rendezvous), no node flags."""
    import httpx
    import openai

    model, _ = checkpoints
    port, http_port = rdzv_port(), free_port()
    group = ["--tp-size", "2", "--dtype", "float32"]
    node = Node(model, {}, tmp_path / "node1.log", *group, launcher=torchrun(1, port))
    head = Node(model, {}, tmp_path / "head.log", *group, "--port", str(http_port),
                launcher=torchrun(0, port))
    url = f"http://127.0.0.1:{http_port}"
    try:
        head.wait_ready(lambda: healthy(httpx, url))
        node.wait_ready()
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        completion_equals_engine(client, engine, MODEL_NAME, None)
        (launcher,) = children(head.proc.pid)  # torchrun's one process on node 0
        os.kill(launcher, signal.SIGKILL)
        assert node.proc.wait(STOP_S) != 0, node.logs()
        assert "rank 1 lost rank 0" in node.logs()
    finally:
        head.stop()
        node.stop()


def rdzv_port() -> int:
    """A free port below the ephemeral range (32768 up), so that no connection of another
    process takes it in the seconds before rank 0 (or torchrun) listens on it."""
    while True:
        port = random.randrange(20000, 32768)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def healthy(httpx, url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def test_each_node_runs_its_share_of_the_ranks_on_its_own_devices():
    assert [list(node_ranks(8, 2, n)) for n in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(node_ranks(2, 1, 0)) == [0, 1]
    assert local_device(torch.device("cuda"), 6, 8, 2) == torch.device("cuda", 2)
    assert local_device(torch.device("cpu"), 6, 8, 2) == torch.device("cpu")


@pytest.mark.parametrize(("flags", "error"), [
    ({"tensor_parallel_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "does not split over"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"},
     "--node-rank 2 is out of range"),
    ({"tensor_parallel_size": 2, "nnodes": 2}, "needs --dist-init-addr"),
    ({"tensor_parallel_size": 2, "dist_init_addr": "10.0.0.1:29500"}, "not a loopback"),
    ({"tensor_parallel_size": 2, "dist_init_addr": "head:29500"}, "not a loopback"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "dist_init_addr": "head"}, "expects HOST:PORT"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "dist_init_addr": "head:0"}, "expects HOST:PORT"),
    ({"tensor_parallel_size": 4, "nnodes": 2, "data_parallel_size": 2, "dist_init_addr": "h:1"},
     "--data-parallel-size"),
])
def test_bad_node_flags_are_refused(flags, error):
    with pytest.raises(ValueError, match=error):
        ServerArgs(model="m", **flags)


@pytest.mark.parametrize("flags", [
    {"tensor_parallel_size": 2, "dist_init_addr": "127.0.0.1:29500"},
    {"tensor_parallel_size": 2, "dist_init_addr": "[::1]:29500"},
    {"tensor_parallel_size": 2, "dist_init_addr": "localhost:29500"},
    {"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 1, "dist_init_addr": "head:29500"},
    {"tensor_parallel_size": 4, "nnodes": 4, "node_rank": 3, "dist_init_addr": "[fd00::1]:1"},
])
def test_good_node_flags_are_accepted(flags):
    ServerArgs(model="m", **flags)


@pytest.mark.parametrize(("flags", "error"), [
    (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:29500"],
     "--tensor-parallel-size 3 does not split"),
    (["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", "h:1", "--state-dir", "/nowhere"],
     "--state-dir /nowhere is not a directory"),
])
def test_bad_flags_fail_before_anything_starts(checkpoints, flags, error):
    model, _ = checkpoints
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(model), *flags])
    assert f"radixlora serve: error: {error}" in str(exc.value)


TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2",
            "GROUP_RANK": "1", "MASTER_ADDR": "head", "MASTER_PORT": "29500"}


def flags(nnodes=None, node_rank=None, dist_init_addr=None) -> argparse.Namespace:
    return argparse.Namespace(nnodes=nnodes, node_rank=node_rank, dist_init_addr=dist_init_addr)


def test_nodes_come_from_the_flags_without_torchrun():
    assert multinode(flags(), {"MASTER_ADDR": "x", "RANK": "3"}) == (1, 0, None)
    assert multinode(flags(2, 1, "head:1"), {}) == (2, 1, "head:1")


def test_nodes_come_from_torchruns_environment():
    assert multinode(flags(), TORCHRUN) == (2, 1, "head:29500")
    assert multinode(flags(2, 1, "head:29500"), TORCHRUN) == (2, 1, "head:29500")
    one_node = TORCHRUN | {"GROUP_WORLD_SIZE": "1", "GROUP_RANK": "0"}
    assert multinode(flags(), one_node) == (1, 0, None)  # the ranks meet in a private file
    with pytest.raises(SystemExit, match="--node-rank 0 disagrees"):
        multinode(flags(node_rank=0), TORCHRUN)
    with pytest.raises(SystemExit, match="--nproc-per-node 1"):
        multinode(flags(), TORCHRUN | {"LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(SystemExit, match="not complete"):
        multinode(flags(), {k: v for k, v in TORCHRUN.items() if k != "GROUP_RANK"})
