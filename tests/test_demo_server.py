"""`radixlora serve` with no arguments serves the bundled demo; concurrent mixed traffic over
the base and every adapter (and a stack) through the real server is checked by each task's
checker, which catches routing and cache-isolation bugs that logit tests on random weights can
miss: a response served with the wrong adapter, or over another adapter's cached KV, fails."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI

from radixlora.demo import TASKS, format_prompt, sample_inputs
from radixlora.demo.tasks import reverse_words
from tests.server_harness import running_server

BASE = "radixlora-demo"
PER_TASK = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(None, {}, tmp_path_factory.mktemp("demo") / "server.log") as proc:
        yield proc


def complete(client: OpenAI, model: str, text: str, **extra) -> str:
    out = client.completions.create(model=model, prompt=format_prompt(text), max_tokens=48,
                                    temperature=0, extra_body=extra or None)
    return out.choices[0].text.strip()


def test_no_argument_serve_lists_the_demo(server):
    ids = [m["id"] for m in server.http.get("/v1/models").json()["data"]]
    assert ids[0] == BASE and set(ids[1:]) == set(TASKS)


def test_mixed_concurrent_traffic_passes_every_checker(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    inputs = sample_inputs(PER_TASK, seed=7, heldout=True)
    jobs = [(model, text) for text in inputs for model in [BASE, *TASKS]]
    with ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(lambda job: complete(client, *job), jobs))
    results: dict[str, list[tuple[str, str]]] = {}
    for (model, text), output in zip(jobs, outputs, strict=True):
        results.setdefault(model, []).append((text, output))
    for name, task in TASKS.items():
        accuracy = sum(task.check(t, o) for t, o in results[name]) / PER_TASK
        assert accuracy >= 0.9, (name, results[name])
        base_does_it = sum(task.check(t, o) for t, o in results[BASE]) / PER_TASK
        assert base_does_it <= 0.1, (name, results[BASE])
    assert sum(o == t for t, o in results[BASE]) / PER_TASK >= 0.9  # the base echoes


def test_stack_and_model_forms(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    text = "the red fox ate 42 fish"
    assert complete(client, f"{BASE}:reverse", text) == reverse_words(text)
    stacked = complete(client, BASE, text, adapters=[{"name": "upper", "weight": 1.0},
                                                     {"name": "reverse", "weight": 1.0}])
    assert stacked == reverse_words(text).upper()


def test_the_tokenizer_process_runs_without_torch(server):
    """The tokenizer process tokenizes, renders chat templates and checks contexts without
    torch (importing it costs seconds at start), and the scheduler without Triton or the
    model's modules; after traffic their memory maps show neither library."""
    complete(OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0), BASE, "hi")
    pids = server.info()["pids"]
    maps = {name: Path(f"/proc/{pid}/maps").read_text() for name, pid in pids.items()}
    assert "libtorch" not in maps["tokenizer"]
    assert "libtorch" in maps["worker"]  # what the check looks for is what torch maps
    assert "libtriton" not in maps["scheduler"]  # it plans steps; the kernels are the worker's
