"""The package's import graph in figures: modules, edges, layers, cycles, root modules, the largest module.

    python tools/import_graph.py            # one line per figure, then one JSON line
    python tools/import_graph.py --layers   # also each layer's modules, bottom up

Read from the source with ``ast`` (nothing is imported). An edge is "module A imports module B", anywhere in A
(lazy imports inside functions included: they run too). A module's layer is one above the highest layer it
imports (a module that imports nothing of the package is layer 1), so "layers" is the longest chain of imports.
The same rules as ``tests/unit/test_architecture.py``, which asserts on them.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_sgdtp"


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports (``from a.b import c`` is ``a.b.c`` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([target] if target else [])])
            if not target.startswith(PACKAGE.name):
                continue
            subs = [f"{target}.{a.name}" for a in node.names]
            deps |= {s for s in subs if s in known}
            if any(s not in known for s in subs):
                deps.add(target)
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name in known}
    return deps - {name}


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(package)
    return {m: imports(p, m, known) for m, p in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        stack.append(m)
        for d in sorted(g.get(m, ())):
            if state.get(d) == "open":
                found.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    return found


def layers(g: dict[str, set[str]]) -> dict[str, int]:
    """Layer of each module (1 = imports nothing of the package); modules on a cycle count it once."""
    memo: dict[str, int] = {}

    def layer(m: str, seen: frozenset[str]) -> int:
        if m in memo:
            return memo[m]
        deps = [d for d in g.get(m, ()) if d not in seen and d in g]
        memo[m] = value = 1 + max((layer(d, seen | {m}) for d in deps), default=0)
        return value

    return {m: layer(m, frozenset()) for m in sorted(g)}


def figures(package: Path = PACKAGE) -> dict[str, object]:
    g = graph(package)
    known = modules(package)
    lay = layers(g)
    sizes = {m: len(p.read_text().splitlines()) for m, p in known.items()}
    root = sorted(p.name for p in package.glob("*.py"))
    biggest = max(sizes, key=sizes.get)
    return {
        "modules": len(g),
        "edges": sum(len(d) for d in g.values()),
        "layers": max(lay.values()),
        "cycles": len(cycles(g)),
        "root_modules": len(root),
        "root_lines_share": round(
            sum(sizes[m] for m, p in known.items() if p.parent == package) / sum(sizes.values()), 3
        ),
        "largest_module": f"{biggest} ({sizes[biggest]} lines)",
        "lines": sum(sizes.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", action="store_true")
    args = parser.parse_args()
    result = figures()
    for key, value in result.items():
        print(f"{key:17s} {value}")
    if args.layers:
        lay = layers(graph())
        for n in range(1, max(lay.values()) + 1):
            print(f"layer {n:2d}: " + " ".join(sorted(m for m, v in lay.items() if v == n)))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
