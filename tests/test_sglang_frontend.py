"""SGLang's own frontend language, unmodified (the `sglang` package, installed without its
dependencies by `make test`), against the bundled demo server through `RuntimeEndpoint`:
`gen`, `select` (prompt logprobs with `return_text_in_logprobs`), `fork`, streaming and
`run_batch`. It runs in a child interpreter: importing `sglang` patches transformers and sets
cache variables, which must not leak into the other tests."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from radixlora.demo import format_prompt
from tests.server_harness import running_server

WORDS = ["the red fox ate 42 fish", "a big cat sees 7 fish", "lamp sun on 4 car"]

PROGRAM = r'''
import json, sys
import sglang as sgl

sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
prompts = json.loads(sys.argv[2])


@sgl.function
def echo(s, prompt):
    s += prompt
    s += sgl.gen("out", max_tokens=40, temperature=0, stop="\n")


@sgl.function
def pick(s, prompt, choices):
    s += prompt
    s += sgl.select("choice", choices=choices)


@sgl.function
def fork(s, prompt):
    s += prompt
    forks = s.fork(2)
    forks[0] += sgl.gen("first", max_tokens=3, temperature=0)
    forks[1] += sgl.gen("all", max_tokens=40, temperature=0, stop="\n")
    forks.join()
    s += "first: " + forks[0]["first"] + " all: " + forks[1]["all"]


out = {"gen": echo.run(prompt=prompts[0])["out"]}
choices = ["THE RED FOX", "the red fox", "fish 42 ate"]
state = pick.run(prompt=prompts[0], choices=choices)
out["select"] = state["choice"]
out["select_meta"] = sorted(state.get_meta_info("choice"))
state = fork.run(prompt=prompts[0])
out["fork"] = state.text()[len(prompts[0]):]
stream = echo.run(prompt=prompts[1], stream=True)
out["stream"] = list(stream.text_iter("out"))
states = echo.run_batch([{"prompt": p} for p in prompts], num_threads=3)
out["batch"] = [s["out"] for s in states]
print("RESULT " + json.dumps(out))
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(None, {}, tmp_path_factory.mktemp("sgl") / "server.log") as proc:
        yield proc


def test_sglang_frontend_runs_unmodified(server):
    prompts = [format_prompt(w) for w in WORDS]
    done = subprocess.run([sys.executable, "-c", PROGRAM, server.url, json.dumps(prompts)],
                          capture_output=True, text=True, timeout=240)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT "):])
    assert out["gen"] == WORDS[0]
    assert out["select"] == "the red fox"
    assert {"normalized_prompt_logprobs", "input_token_logprobs"} <= set(out["select_meta"])
    first, _, rest = out["fork"].partition(" all: ")
    assert first.startswith("first: ") and WORDS[0].startswith(first[len("first: "):].strip())
    assert rest == WORDS[0]
    # how many chunks the frontend yields follows the pace of the server and of the frontend's
    # reader thread: several, or one when the whole answer was in before it looked (a loaded
    # machine); their text is the answer either way
    assert out["stream"] and "".join(out["stream"]) == WORDS[1]
    assert out["batch"] == WORDS
