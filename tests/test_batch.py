"""The batch command: a 200-line OpenAI batch file with mixed adapters, stacks and 3 bad lines,
killed mid-run (`python -m radixlora.cli.batch`) and resumed in-process, ends with exactly one
result per line, each equal to the direct Engine request."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from radixlora import Engine, SamplingParams
from radixlora.cli.batch import main
from radixlora.cli.run_batch import completed_ids, parse_line, run_batch
from radixlora.text.chat import ChatTemplate
from scripts.checkpoints import build_tiny_adapter, build_tiny_model

PROMPT = "A radix cache shares prefix KV between"
MODELS = {  # body fields -> the Engine adapter spec they mean
    "base": ({"model": "tiny"}, None),
    "colon": ({"model": "tiny:a0"}, "a0"),
    "name": ({"model": "a1"}, "a1"),
    "stack": (
        {"model": "tiny", "adapters": [{"name": "a1", "weight": 0.5}, {"name": "a2"}]},
        [("a1", 0.5), ("a2", 1.0)],
    ),
}
BAD = {  # 0-based line index -> (raw line, expected custom_id, expected error code)
    17: ("{this is not json", "line-18", "invalid_json"),
    88: (None, "r88", "adapter_not_found"),
    150: (None, "r150", "invalid_url"),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    model = build_tiny_model(root / "tiny")
    adapters = {
        f"a{i}": build_tiny_adapter(model, root / f"a{i}", 4 + 4 * i, seed=i) for i in range(3)
    }
    return model, adapters


@pytest.fixture(scope="module")
def engine(checkpoints):
    model, adapters = checkpoints
    return Engine(model, adapters=adapters)


def request_line(i: int) -> tuple[str, object]:
    """(JSONL line, the Engine adapter spec it asks for) of the i-th request."""
    if i in BAD:
        raw, custom_id, _ = BAD[i]
        if raw is not None:
            return raw, None
        url = "/v1/embeddings" if i == 150 else "/v1/completions"
        body = {"model": "nope", "prompt": PROMPT, "max_tokens": 4}
        return json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
        ), None
    fields, spec = list(MODELS.values())[i % len(MODELS)]
    body = {**fields, "max_tokens": 8, "temperature": 0}
    if i % 5 == 0:
        url = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"Question {i}"}]
    else:
        url = "/v1/completions"
        body["prompt"] = f"{i}: {PROMPT}"
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}), spec


def expected_texts(engine, lines: dict[int, object]) -> dict[int, str]:
    """Line index -> text of the direct Engine request, for lines {index: adapter spec}."""
    template = ChatTemplate.from_dir(engine.model_path)
    prompts = []
    for i in lines:
        if i % 5 == 0:
            text = template.render([{"role": "user", "content": f"Question {i}"}])
            prompts.append(engine.tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(f"{i}: {PROMPT}")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outs = engine.generate(prompts, params, adapters=list(lines.values()))
    return {i: out.outputs[0].text for i, out in zip(lines, outs)}


def count_lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def start_cli(checkpoints, src, out) -> subprocess.Popen:
    model, adapters = checkpoints
    cmd = [
        sys.executable,
        "-m",
        "radixlora.cli.batch",
        "--input",
        str(src),
        "--output",
        str(out),
        "--model",
        str(model),
        "--concurrency",
        "2",
        "--no-progress",
    ]
    for name, path in adapters.items():
        cmd += ["--adapter", f"{name}={path}"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_interrupted_and_resumed_run_has_one_result_per_line(checkpoints, engine, tmp_path):
    lines = [request_line(i) for i in range(200)]
    src, out = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("".join(raw + "\n" for raw, _ in lines))

    proc = start_cli(checkpoints, src, out)
    deadline = time.monotonic() + 60
    while count_lines(out) < 20 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    before = count_lines(out)
    assert 20 <= before < 200, proc.stderr.read().decode()[-2000:]
    with open(out, "a") as f:  # a record torn by the kill, as a crash mid-write leaves it
        f.write('{"id": "batch_req_torn", "custom_id": "r199", "resp')

    summary = run_batch(src, out, engine, progress=True)
    assert (summary.total, summary.skipped) == (200, before)
    assert summary.succeeded + summary.failed == 200 - before

    records = [json.loads(line) for line in out.read_text().splitlines()]
    ids = [r["custom_id"] for r in records]
    assert len(records) == 200 and len(set(ids)) == 200
    errors = {r["custom_id"]: r["error"]["code"] for r in records if r["error"] is not None}
    assert errors == {cid: code for _, cid, code in BAD.values()}
    by_id = {r["custom_id"]: r for r in records}
    expected = expected_texts(
        engine, {i: spec for i, (_, spec) in enumerate(lines) if i not in BAD}
    )
    for i, want in expected.items():
        response = by_id[f"r{i}"]["response"]
        assert response["status_code"] == 200
        choice = response["body"]["choices"][0]
        assert (choice["message"]["content"] if i % 5 == 0 else choice["text"]) == want, i

    again = run_batch(src, out, engine, progress=False)
    assert (again.skipped, again.succeeded, again.failed) == (200, 0, 0)
    assert count_lines(out) == 200


def test_line_errors(engine, tmp_path):
    seen: set[str] = set()
    assert parse_line(1, '{"custom_id": "a", "url": "/v1/completions", "body": {}}', seen)
    assert (
        parse_line(2, '{"custom_id": "a", "url": "/v1/completions", "body": {}}', seen).error.code
        == "duplicate_custom_id"
    )
    assert parse_line(3, '{"url": "/v1/completions", "body": {}}', seen).custom_id == "line-3"
    assert (
        parse_line(
            4, '{"custom_id": "m", "method": "GET", "url": "/v1/completions", "body": {}}', seen
        ).error.code
        == "invalid_method"
    )
    assert parse_line(5, "[1, 2]", seen).error.code == "invalid_request"

    bodies = {
        "max_tokens": {"model": "tiny", "prompt": PROMPT, "max_tokens": 0},
        "type": {"model": "tiny", "prompt": 5},
        "stacked_and_named": {"model": "a1", "prompt": PROMPT, "adapters": [{"name": "a2"}]},
        "too_long": {"model": "tiny", "prompt": PROMPT, "max_tokens": 10**6},
    }
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        "".join(
            json.dumps({"custom_id": k, "method": "POST", "url": "/v1/completions", "body": b})
            + "\n"
            for k, b in bodies.items()
        )
    )
    summary = run_batch(src, out, engine, progress=False)
    assert (summary.succeeded, summary.failed) == (0, len(bodies))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["response"] is None and r["error"]["message"] for r in records)


def test_logprobs_n_and_usage(engine, tmp_path):
    body = {
        "model": "a2",
        "prompt": [PROMPT, "Another"],
        "max_tokens": 3,
        "n": 2,
        "seed": 5,
        "logprobs": 2,
    }
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": body})
        + "\n"
    )
    run_batch(src, out, engine, progress=False)
    result = json.loads(out.read_text())["response"]["body"]
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    assert all(len(c["logprobs"]["top_logprobs"]) == 3 for c in result["choices"])
    assert result["usage"]["completion_tokens"] == 12
    body["return_tokens_as_token_ids"] = True
    src.write_text(json.dumps({"custom_id": "y", "method": "POST", "url": "/v1/completions",
                               "body": body}) + "\n")
    run_batch(src, out, engine, progress=False)
    as_ids = json.loads(out.read_text().splitlines()[-1])["response"]["body"]
    for plain, ids in zip(result["choices"], as_ids["choices"], strict=True):
        assert [engine.tokenizer.decode([int(t.removeprefix("token_id:"))],
                                        skip_special_tokens=False)
                for t in ids["logprobs"]["tokens"]] == plain["logprobs"]["tokens"]
        assert all(t.startswith("token_id:") for row in ids["logprobs"]["top_logprobs"]
                   for t in row)


def test_unreachable_server_stops_the_run_without_records(tmp_path):
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": PROMPT},
    }
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("{bad json\n" + json.dumps(line) + "\n")
    with pytest.raises(httpx.ConnectError):
        run_batch(src, out, "http://127.0.0.1:9", progress=False)
    assert completed_ids(out) == {"line-1"}  # the bad line's record; x is retried on resume


def test_cli_rejects_url_with_model():
    with pytest.raises(SystemExit):
        main(["--input", "a", "--output", "b", "--url", "http://x", "--model", "m"])


@pytest.mark.parametrize("case", ["missing input", "output is a directory", "no server"])
def test_bad_paths_and_urls_are_one_line_before_any_model_loads(tmp_path, case):
    """As `serve` reports a bad flag: one line on stderr and exit status 1, with no traceback
    and nothing loaded (the demo model would be loaded for the first two otherwise)."""
    good = tmp_path / "in.jsonl"
    good.write_text("")
    argv = {"missing input": ["--input", str(tmp_path / "nope.jsonl"), "--output",
                              str(tmp_path / "out.jsonl")],
            "output is a directory": ["--input", str(good), "--output", str(tmp_path)],
            "no server": ["--input", str(good), "--output", str(tmp_path / "out.jsonl"),
                          "--url", "http://127.0.0.1:9"]}[case]
    run = subprocess.run([sys.executable, "-m", "radixlora.cli", "batch", *argv],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("radixlora batch: "), run.stderr
    assert {"missing input": "no such file", "output is a directory": "is a directory",
            "no server": "no server answers"}[case] in lines[0]
