"""Every snippet of README.md and docs/*.md runs as written against `radixlora serve` with no
arguments (the bundled demo), started once for the module on a free port.

Per page, in order: each ```bash block that calls curl runs in `bash -e -o pipefail` and must
exit 0; the ```python blocks run in one namespace, as one program would. Only the port is
rewritten (localhost:30000 -> the test server's). Blocks that cannot run here (installs,
`make`, paths like path/to/hf-llama) are plain bash without curl, or marked ```bash skip /
```python skip. The README's curl block must print exactly the output column of its table.

A ```bash serve block starts its own server: the lines before its `radixlora serve` command
set up, the command runs (on a free port instead of --port 30000) until /health answers, then
the lines after it run as one script that must exit 0 and print every `# prints: TEXT` line's
TEXT; the server must then drain and exit 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server_harness import free_port, running_server

ROOT = Path(__file__).resolve().parent.parent
# The benchmark pages record measurements (GPU runs), not examples to run.
NOT_EXAMPLES = {"PERF.md", "perf-log.md"}
PAGES = ["README.md"] + sorted(
    f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name not in NOT_EXAMPLES
)
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
DEFAULT_PORT = "30000"


def blocks(page: str) -> list[tuple[str, str]]:
    """(kind, code) of each block that runs: kind "bash" (calls curl) or "python"."""
    out = []
    for info, code in FENCE.findall((ROOT / page).read_text()):
        words = info.split()
        if not words or "skip" in words[1:] or "serve" in words[1:]:
            continue
        if words[0] == "python" or (words[0] == "bash" and "curl " in code):
            out.append((words[0], code))
    return out


def serve_blocks(page: str) -> list[str]:
    return [code for info, code in FENCE.findall((ROOT / page).read_text())
            if info.split()[:2] == ["bash", "serve"]]


SERVE_BLOCKS = [(page, i) for page in PAGES for i in range(len(serve_blocks(page)))]


def with_port(code: str, port: int) -> str:
    for host in ("localhost", "127.0.0.1"):
        code = code.replace(f"{host}:{DEFAULT_PORT}", f"{host}:{port}")
    return code


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("docs_server") / "server.log"
    with running_server(None, {}, log) as proc:
        yield proc


def run_bash(code: str, cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{code}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("page", PAGES)
def test_page_snippets_run(page, server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{Path(page).stem}"}
    outputs = []
    try:
        for i, (kind, code) in enumerate(blocks(page)):
            code = with_port(code, server.port)
            if kind == "bash":
                outputs.append(run_bash(code, tmp_path))
            else:
                exec(compile(code, f"{page}[block {i}]", "exec"), namespace)
    finally:
        runtime = namespace.get("runtime")
        if hasattr(runtime, "shutdown"):
            runtime.shutdown()
    if page == "README.md":
        assert outputs[0].splitlines() == readme_table_outputs()


@pytest.mark.parametrize("page, index", SERVE_BLOCKS)
def test_serve_snippets_run(page, index, tmp_path):
    code = serve_blocks(page)[index]
    commands = code.replace("\\\n", " ").splitlines()
    at = next(i for i, line in enumerate(commands) if line.startswith("radixlora serve "))
    setup, serve, checks = commands[:at], commands[at], "\n".join(commands[at + 1:])
    port = free_port()
    assert f"--port {DEFAULT_PORT}" in serve
    serve = serve.replace(f"--port {DEFAULT_PORT}", f"--port {port}")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(["bash", "-e", "-c", "\n".join([*setup, f"exec {serve}"])],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(proc, port, tmp_path / "server.log")
        out = run_bash("\n".join([*setup, with_port(checks, port)]), tmp_path)
        for expected in re.findall(r"^# prints: (.*)$", checks, re.MULTILINE):
            assert expected in out.splitlines(), (expected, out)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        log.close()
    assert code == 0, (tmp_path / "server.log").read_text()[-3000:]


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(log.read_text()[-3000:])


def readme_table_outputs() -> list[str]:
    """The output column of the README's table (the rows after its header)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| model / adapters | output |"):].split("\n\n")[0]
    return [row.rsplit("| `", 1)[1].removesuffix("` |") for row in table.splitlines()[2:]]


def test_every_page_has_a_snippet_and_the_readme_table_six_rows():
    assert all(blocks(page) for page in ["README.md", "docs/frontend.md", "docs/batch.md",
                                          "docs/demo.md", "docs/server.md"])
    assert len(serve_blocks("docs/server.md")) >= 2  # the migration section's
    assert len(readme_table_outputs()) == 6


def test_architecture_names_every_module():
    """docs/architecture.md's module table lists exactly the runtime's Python files."""
    text = (ROOT / "docs/architecture.md").read_text()
    table = text[text.index("| module |"):].split("\n\n")[0].splitlines()[2:]
    listed = set()
    for row in table:
        names = re.findall(r"`([^`]+\.py)`", row.split(" | ")[0])
        if not names:  # a folder's heading row
            continue
        folder = names[0].rpartition("/")[0]
        listed |= {name if "/" in name else f"{folder}/{name}" for name in names}
    files = {str(p.relative_to(ROOT)) for folder in ("radixlora", "kernels", "frontend")
             for p in (ROOT / folder).rglob("*.py")}
    assert listed == files, {"not listed": files - listed, "gone": listed - files}


def test_every_adapter_rejection_reason_is_documented():
    """/health's adapters_rejected reasons, each with a row in docs/server.md."""
    from radixlora.server.procs.registry_proc import REJECT_REASONS

    text = (ROOT / "docs" / "server.md").read_text()
    for label in {label for _, label in REJECT_REASONS} | {"invalid_adapter"}:
        assert f"| `{label}` |" in text, label
