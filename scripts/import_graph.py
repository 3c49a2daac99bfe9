"""The import graph of the radixlora package: its modules, the radixlora modules each imports,
the cycles among module-level imports, and the imports of server/ from outside it (server/
holds processes and transport; everything else is library code the Engine, batch runs, the
frontend and the server share, and never imports server/; the command line is the exception,
since it launches the server).

    python3 scripts/import_graph.py      # prints the summary; exit 1 on a cycle or such import
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "radixlora"
# may import server/: the command line starts it
LAUNCHERS = ("radixlora.server", "radixlora.cli")


def modules() -> dict[str, Path]:
    """Module name -> file, for the package's own files (not the links to kernels/ and
    frontend/, which are packages of their own)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if any(p.is_symlink() for p in (path, *path.parents) if ROOT in p.parents):
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports(mods: dict[str, Path], module_level: bool) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (module_level: only those imported at the
    top of the file, which is what can make a cycle at import time)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        nodes = tree.body if module_level else ast.walk(tree)
        for node in nodes:
            for target in _targets(node):
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target.startswith("radixlora") and target != name and not (
                        name.startswith(target + ".")):
                    edges[name].add(target)
    return edges


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


def into_server(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets
                  if b.startswith("radixlora.server") and not a.startswith(LAUNCHERS))


def main() -> int:
    mods = modules()
    every, top = imports(mods, False), imports(mods, True)
    loops, upward = cycles(top), into_server(every)
    print(f"{len(mods)} modules, {sum(map(len, every.values()))} imports between them")
    print(f"cycles among module-level imports: {len(loops)}")
    for loop in loops:
        print("  " + " -> ".join(loop))
    print(f"imports of radixlora.server from library code: {len(upward)}")
    for a, b in upward:
        print(f"  {a} -> {b}")
    return 1 if loops or upward else 0


if __name__ == "__main__":
    sys.exit(main())
