"""The house's boundaries hold: no import cycle among the package's module-level imports, and
no library module (outside server/ and the command line) imports server/."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import import_graph  # noqa: E402


def test_no_cycle_and_no_library_import_of_the_server():
    mods = import_graph.modules()
    assert "radixlora.text.detokenize" in mods and "radixlora.server.launcher" in mods
    assert not any(name.startswith(("radixlora.kernels", "radixlora.lang")) for name in mods)
    assert import_graph.cycles(import_graph.imports(mods, module_level=True)) == []
    assert import_graph.into_server(import_graph.imports(mods, module_level=False)) == []


def test_the_checks_find_what_they_look_for():
    edges = {"radixlora.a": {"radixlora.b"}, "radixlora.b": {"radixlora.a"},
             "radixlora.engine": {"radixlora.server.chat"},
             "radixlora.cli": {"radixlora.server.launcher"}}
    assert import_graph.cycles(edges) == [["radixlora.a", "radixlora.b", "radixlora.a"]]
    assert import_graph.into_server(edges) == [("radixlora.engine", "radixlora.server.chat")]
