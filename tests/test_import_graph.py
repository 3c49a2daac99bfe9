"""The floor plan holds over every file of the three packages: no import cycle among module-level
imports (type-only ones included), no import that runs back up between rooms (sub-packages and
top-level modules), no library module (outside server/ and the command line) importing server/,
and kernels that import nothing of the project."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import import_graph  # noqa: E402


def test_the_floor_plan_holds_over_every_file():
    mods = import_graph.modules()
    assert {"radixlora.text.detokenize", "radixlora.server.procs.launcher",
            "radixlora.sched.scheduler", "radixlora.worker.model_runner",
            "radixlora_kernels.sgmv_shrink", "radixlora_frontend.runtime"} <= set(mods)
    every, top = (import_graph.imports(mods, module_level=m) for m in (False, True))
    assert import_graph.cycles(top) == []
    assert import_graph.upward(every) == []
    assert import_graph.into_server(every) == []
    assert import_graph.kernels_out(every) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    edges = {"radixlora.a": {"radixlora.b"}, "radixlora.b": {"radixlora.a"},
             "radixlora.engine": {"radixlora.server.chat"},
             "radixlora.cli": {"radixlora.server.launcher"}}
    assert import_graph.cycles(edges) == [["radixlora.a", "radixlora.b", "radixlora.a"]]
    assert import_graph.into_server(edges) == [("radixlora.engine", "radixlora.server.chat")]
    rooms = {"radixlora.sched.intake": {"radixlora.worker.sampler"},
             "radixlora.worker.executor": {"radixlora.sched.request"},
             "radixlora.worker.sampler": {"radixlora.config"},
             "radixlora.server.http.api": {"radixlora.server.args"}}
    assert import_graph.upward(rooms) == [
        ("radixlora.sched.intake", "radixlora.worker.sampler"),
        ("radixlora.worker.executor", "radixlora.sched.request")]
    assert import_graph.kernels_out({"radixlora_kernels.a": {"radixlora.config",
                                                             "radixlora_kernels.b"}}) == [
        ("radixlora_kernels.a", "radixlora.config")]
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import radixlora.b\n")
    b.write_text("import radixlora.a\n")
    top = import_graph.imports({"radixlora.a": a, "radixlora.b": b}, module_level=True)
    assert import_graph.cycles(top) == [["radixlora.a", "radixlora.b", "radixlora.a"]]
