"""The import graph of the project's three packages (radixlora, kernels/radixlora_kernels,
frontend/radixlora_frontend): every module, the project modules each imports, and the checks
that keep the floor plan readable:

- no cycle among module-level imports, `if TYPE_CHECKING:` ones included;
- no arrow that runs back up: no cycle among the rooms (a room is a top-level module of
  radixlora, one of its sub-packages such as radixlora/sched/ or radixlora/worker/, a folder of
  radixlora/server/, or one of the other two packages), counting every import, however deep in
  a function;
- no import of radixlora.server from library code (the command line launches the server);
- radixlora_kernels imports nothing of the project (torch and Triton only).

    python3 scripts/import_graph.py      # prints the summary; exit 1 on any finding
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package name -> the folder it lives in
PACKAGES = {"radixlora": ROOT / "radixlora",
            "radixlora_kernels": ROOT / "kernels" / "radixlora_kernels",
            "radixlora_frontend": ROOT / "frontend" / "radixlora_frontend"}
LAUNCHERS = ("radixlora.server", "radixlora.cli")  # may import server/: the command line starts it


def modules() -> dict[str, Path]:
    """Module name -> file, for every file of the three packages."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(mods: dict[str, Path], module_level: bool) -> dict[str, set[str]]:
    """Module -> the project's modules it imports (module_level: those imported at the top of
    the file, `if TYPE_CHECKING:` blocks included; else every import anywhere)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        for node in (_top_level(tree) if module_level else ast.walk(tree)):
            for target in _targets(node):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    edges[name].add(target)
    return edges


def _top_level(tree: ast.Module):
    for node in tree.body:
        yield node
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` and the like
            yield from node.body


def _targets(node) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        stack.append(name)
        for target in sorted(edges.get(name, ())):
            if state.get(target) == 1:
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target, stack)
        stack.pop()
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [])
    return found


def room(module: str) -> str:
    """The room a module lives in: a top-level module of radixlora or of radixlora/server/, or
    the sub-folder it is in (radixlora.sched, radixlora.server.http), or a whole other package."""
    parts = module.split(".")
    if parts[0] != "radixlora":
        return parts[0]
    return ".".join(parts[:3] if parts[1:2] == ["server"] else parts[:2])


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The imports between rooms that make a cycle of rooms (an arrow back up the floors)."""
    rooms: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if room(a) != room(b):
                rooms[room(a)].add(room(b))
    looping = {r for loop in cycles(rooms) for r in loop}
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if room(a) != room(b) and {room(a), room(b)} <= looping
                  and _reaches(rooms, room(b), room(a)))


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def into_server(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if b.startswith("radixlora.server") and a.startswith("radixlora")
                  and not a.startswith(LAUNCHERS))


def kernels_out(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of the project's other packages from radixlora_kernels."""
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if a.startswith("radixlora_kernels") and not b.startswith("radixlora_kernels"))


def main() -> int:
    mods = modules()
    every, top = imports(mods, False), imports(mods, True)
    findings = {
        "cycles among module-level imports (type-only included)": [" -> ".join(c)
                                                                   for c in cycles(top)],
        "imports that run back up (rooms in a cycle)": [f"{a} -> {b}" for a, b in upward(every)],
        "imports of radixlora.server from library code": [f"{a} -> {b}"
                                                          for a, b in into_server(every)],
        "imports of the project from radixlora_kernels": [f"{a} -> {b}"
                                                          for a, b in kernels_out(every)],
    }
    rooms = {room(m) for m in mods}
    print(f"{len(mods)} modules in {len(rooms)} rooms, "
          f"{sum(map(len, every.values()))} imports between them")
    for what, found in findings.items():
        print(f"{what}: {len(found)}")
        for line in found:
            print("  " + line)
    return 1 if any(findings.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
