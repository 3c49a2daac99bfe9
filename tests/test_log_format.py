"""One log format for every process and uvicorn: each line of a demo server's output (start,
requests, an error, drain and stop) carries the time, the process, the level and the logger,
the module's own name also in the processes started with `python -m`."""

from __future__ import annotations

import re

from tests.server_harness import running_server

LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[(api|tokenizer|scheduler|worker|registry)\] "
    r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): \S"
)


def test_every_line_of_every_process_and_uvicorn_has_one_format(tmp_path):
    log_path = tmp_path / "server.log"
    with running_server(None, {}, log_path, "--log-level", "info", "--log-requests") as proc:
        body = {"model": "radixlora-demo:upper", "prompt": "input: a cat\noutput:\n",
                "max_tokens": 8}
        assert proc.http.post("/v1/completions", json=body).status_code == 200
        missing = {"model": "radixlora-demo:missing", "prompt": "x", "max_tokens": 2}
        assert proc.http.post("/v1/completions", json=missing).status_code == 404
        negative = {"model": "radixlora-demo", "prompt": "x", "max_tokens": -1}
        assert proc.http.post("/v1/completions", json=negative).status_code == 400
    lines = log_path.read_text(errors="replace").splitlines()
    bad = [line for line in lines if not LINE.match(line)]
    assert not bad, "\n".join(bad)
    seen = {(m[1], m[3]) for m in map(LINE.match, lines)}
    assert ("api", "uvicorn.error") in seen  # uvicorn's own start and stop lines
    assert ("api", "radixlora.server.http.stats_log") in seen  # --log-requests
    assert any(name == "worker" for name, _ in seen)
    assert ("worker", "radixlora.server.procs.worker_proc") in seen  # its own name, not __main__
    assert not any(logger == "__main__" for _, logger in seen)
    assert any("finish=error:adapter_not_found" in line for line in lines)
    rejected = [line.split(": ", 1)[1] for line in lines if ": rejected " in line]
    assert rejected == ["rejected POST /v1/completions status=400 code=invalid_request "
                        "param=max_tokens"]
