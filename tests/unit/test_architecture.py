"""The module map's rules, checked on the source (see docs/how-it-works.md#the-map): no import cycles between
the package's modules (imports inside functions included: a lazy import is still a dependency), Lightning imported
by the two front ends alone, strategy.py (the Trainer's) and fabric_strategy.py (Fabric's; the standalone-package
twins are derived from them), no module over ~600 lines (a sign of two jobs
in one file), and the mode decided in one place: config, ParallelDims (layout.py, with the rank grid of
topology.py) and plan_part (engine/parallelize.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_sgdtp"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package modules ``path`` imports, anywhere in it (module level, or inside a function: lazy imports run
    too, and a cycle through one is a cycle). ``from .x import y`` is resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([target] if target else [])])
            if not target.startswith("lightning_sgdtp"):
                continue
            subs = [f"{target}.{a.name}" for a in node.names]
            deps |= {s for s in subs if s in modules}
            if any(s not in modules for s in subs):
                deps.add(target)
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name in modules}
    return deps - {name}


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {m: _imports(p, m, modules) for m, p in modules.items()}
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


def test_the_cycle_check_sees_function_level_imports(tmp_path: Path) -> None:
    """The check can fail: two modules that import each other only inside functions make a cycle."""
    (tmp_path / "a.py").write_text("def f():\n    from lightning_sgdtp.b import g\n")
    (tmp_path / "b.py").write_text("def g():\n    import lightning_sgdtp.a\n")
    modules = {"lightning_sgdtp.a": tmp_path / "a.py", "lightning_sgdtp.b": tmp_path / "b.py"}
    assert _imports(modules["lightning_sgdtp.a"], "lightning_sgdtp.a", modules) == {"lightning_sgdtp.b"}
    assert _imports(modules["lightning_sgdtp.b"], "lightning_sgdtp.b", modules) == {"lightning_sgdtp.a"}


#: Where the mode is decided: the options, the dimensions (and the rank grid they are built from), the part plan.
#: planner/: predicting and choosing a layout is deciding the mode (ARCHITECTURE.md's "planner": cost model + search)
DECIDERS = {
    "config.py",
    "mesh/dims.py",
    "mesh/topology.py",
    "engine/parallelize.py",
    *(f"planner/{name}.py" for name in ("memory", "search", "cost", "auto")),  # the planner decides the mode
}
#: A check of the mode: the options' parallelism/pipeline/sharding fields, a ParallelDims size or ``*_enabled``,
#: and the stand-ins that re-derive it (a mesh's None-ness, a module already split or sharded, a tensor or shard
#: plan's None-ness).
MODE_CHECK = re.compile(
    r"\.(parallelism|pipelined|sharded|shard_size)\b|\.sharding\b(?!\.)|_enabled\b"
    r"|\b(layout|dims|self)\.(tp|pp|dp|shard)\b\s*(>|<|==|!=|is)|\b(tp|pp|dp)\s*(>|==)\s*1|mesh\s+is\s+(not\s+)?None"
    r"|is_tensor_parallel\(|is_sharded\((?!path)|(shard|tensor)_plan\s+is\s+(not\s+)?None|\.grid\s+is\s+(not\s+)?None"
)
#: Outside the deciders (issue 23: 38 before): the strategy asks whether a module sits on its mesh already, from an
#: earlier trainer function (3), and picks the engine (1); the engines count what a sharded rank holds (1).
MODE_CHECKS_OUTSIDE = 5


def _serializes_an_optional(node: ast.AST) -> bool:
    """``x.to_dict() if x is not None else None``: an optional value written out, not a decision."""
    branches = (node.body, node.orelse) if isinstance(node, ast.IfExp) else ()
    return any(isinstance(b, ast.Constant) and b.value is None for b in branches)


def mode_checks(source: str) -> list[int]:
    """The lines of ``source`` whose condition (if / while / conditional expression / comprehension filter) checks
    the mode."""
    found = []
    for node in ast.walk(ast.parse(source)):
        tests = (
            [node.test]
            if isinstance(node, (ast.If, ast.While, ast.IfExp)) and not _serializes_an_optional(node)
            else []
        )
        tests += node.ifs if isinstance(node, ast.comprehension) else []
        found += [t.lineno for t in tests if MODE_CHECK.search(ast.get_source_segment(source, t) or "")]
    return sorted(found)


def test_the_mode_is_decided_in_one_place() -> None:
    """Outside config, ParallelDims and plan_part at most a handful of mode checks, each with a comment that says
    why it is there (on its line or the line above)."""
    outside: dict[str, list[int]] = {}
    uncommented = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in DECIDERS:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for line in mode_checks(source):
            outside.setdefault(rel, []).append(line)
            if "#" not in lines[line - 1] and not lines[line - 2].strip().startswith("#"):
                uncommented.append(f"{rel}:{line}: {lines[line - 1].strip()}")
    assert sum(map(len, outside.values())) <= MODE_CHECKS_OUTSIDE, outside
    assert not uncommented, uncommented


def test_the_mode_check_count_sees_the_stand_ins() -> None:
    """The count can fail: the stand-ins issue 23 found are each counted; writing an optional out is not."""
    assert len(mode_checks("if mesh is None:\n    pass\nif layout.tp > 1:\n    pass\n")) == 2
    assert len(mode_checks("if is_tensor_parallel(model) or self.shard_plan is not None:\n    pass\n")) == 1
    assert mode_checks("x = [p for p in ps if config.sharded]\ny = a if dims.pp_enabled else b\n") == [1, 2]
    assert mode_checks("d = plan.to_dict() if plan.tensor_plan is not None else None\n") == []


def test_only_the_strategy_imports_lightning() -> None:
    offenders = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if any(n.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric") for n in names):
                offenders.append(name)
    assert sorted(set(offenders)) == ["lightning_sgdtp.frontends.fabric", "lightning_sgdtp.frontends.trainer"]


def test_modules_stay_small() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > 600} == {}
    # The strategy is Lightning's hooks only: its class stays under ~500 lines.
    source = (PACKAGE / "frontends" / "trainer.py").read_text().splitlines()
    start = next(i for i, line in enumerate(source) if line.startswith("class SGDTPStrategy"))
    end = next(i for i, line in enumerate(source) if i > start and line.startswith("class "))
    assert end - start < 500
