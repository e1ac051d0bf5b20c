"""The module map's rules, checked on the source (see docs/how-it-works.md#the-map): no import cycles between
the package's modules, Lightning imported by strategy.py alone (the pytorch_lightning twin is derived from it),
and no module over ~600 lines (a sign of two jobs in one file)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_sgdtp"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _module_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports when it is imported (imports inside functions are lazy: not edges)."""
    deps: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_sgdtp"):
            subs = [f"{node.module}.{a.name}" for a in node.names]
            deps |= {s for s in subs if s in modules}
            if any(s not in modules for s in subs):
                deps.add(node.module)
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name in modules}
    return deps


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {m: _module_level_imports(p, modules) - {m} for m, p in modules.items()}
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, cycles


def test_only_the_strategy_imports_lightning() -> None:
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(n.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric") for n in names):
                offenders.append(name)
    assert sorted(set(offenders)) == ["lightning_sgdtp.strategy"]


def test_modules_stay_small() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > 600} == {}
    # The strategy is Lightning's hooks only: its class stays under ~500 lines.
    source = (PACKAGE / "strategy.py").read_text().splitlines()
    start = next(i for i, line in enumerate(source) if line.startswith("class SGDTPStrategy"))
    end = next(i for i, line in enumerate(source) if i > start and line.startswith("class "))
    assert end - start < 500
