"""The examples of docs/frontend.md and docs/batch.md run: each page's ```python blocks (not the
ones marked ```python skip) are executed in order, in one namespace, on the tiny model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(page: str) -> list[str]:
    return BLOCK.findall((DOCS / page).read_text())


@pytest.mark.parametrize("page", ["frontend.md", "batch.md"])
def test_examples_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(page)
    assert blocks, f"no runnable examples in {page}"
    namespace: dict = {"__name__": f"docs_{page.removesuffix('.md')}"}
    try:
        for i, code in enumerate(blocks):
            exec(compile(code, f"{page}[block {i}]", "exec"), namespace)
    finally:
        runtime = namespace.get("runtime")
        if runtime is not None:
            runtime.shutdown()
    assert capsys.readouterr().out  # the examples print what they show


def test_skipped_blocks_are_not_collected():
    assert all("RuntimeEndpoint(" not in code for code in python_blocks("frontend.md"))
