"""Every snippet of README.md and docs/*.md runs as written against `radixlora serve` with no
arguments (the bundled demo), started once for the module on a free port.

Per page, in order: each ```bash block that calls curl runs in `bash -e -o pipefail` and must
exit 0; the ```python blocks run in one namespace, as one program would. Only the port is
rewritten (localhost:30000 -> the test server's). Blocks that cannot run here (installs,
`make`, paths like path/to/hf-llama) are plain bash without curl, or marked ```bash skip /
```python skip. The README's curl block must print exactly the output column of its table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_harness import running_server

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
        if not words or "skip" in words[1:]:
            continue
        if words[0] == "python" or (words[0] == "bash" and "curl " in code):
            out.append((words[0], code))
    return out


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


def readme_table_outputs() -> list[str]:
    """The output column of the README's table (the rows after its header)."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| model / adapters | output |"):].split("\n\n")[0]
    return [row.rsplit("| `", 1)[1].removesuffix("` |") for row in table.splitlines()[2:]]


def test_every_page_has_a_snippet_and_the_readme_table_six_rows():
    assert all(blocks(page) for page in ["README.md", "docs/frontend.md", "docs/batch.md",
                                          "docs/demo.md", "docs/server.md"])
    assert len(readme_table_outputs()) == 6


def test_architecture_names_every_module():
    """docs/architecture.md's module table lists exactly the runtime's Python files."""
    text = (ROOT / "docs/architecture.md").read_text()
    table = text[text.index("| module |"):].split("\n\n")[0].splitlines()[2:]
    listed = set()
    for row in table:
        names = re.findall(r"`([^`]+\.py)`", row.split(" | ")[0])
        folder = names[0].rpartition("/")[0]
        listed |= {name if "/" in name else f"{folder}/{name}" for name in names}
    files = {str(p.relative_to(ROOT)) for pattern in ("radixlora/*.py", "radixlora/*/*.py",
                                                       "kernels/*.py", "frontend/*.py")
             for p in ROOT.glob(pattern)}
    assert listed == files, {"not listed": files - listed, "gone": listed - files}
