"""The house's rules, checked on the source (docs/architecture.md): folders by concern with the public API at the
root; no import cycles (imports inside functions included: a lazy import is still a dependency) and fewer layers than
the 12 of the flat package; Lightning imported by the two front ends alone (``frontends/trainer.py``,
``frontends/fabric.py``; the standalone-package twins are derived from them); the techniques under ``parallel/``
never reach up to the options, the planner or the front ends; the front ends thin (<= 450 lines, no run of lines
shared); no module over ~600 lines (a sign of two jobs in one file); and the mode decided in one place: config,
ParallelDims (mesh/dims.py, with the rank grid of mesh/topology.py), the planner and plan_part
(engine/parallelize.py). The graph is read by ``tools/import_graph.py``, the command that prints its figures."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from helpers import REPO

sys.path.insert(0, str(REPO / "tools"))
import import_graph

PACKAGE = import_graph.PACKAGE
FRONT_ENDS = ("trainer.py", "fabric.py")


def _modules() -> dict[str, Path]:
    return import_graph.modules()


def test_no_import_cycles_and_fewer_layers() -> None:
    graph = import_graph.graph()
    assert import_graph.cycles(graph) == []
    # The flat package (28 root modules) stood on 12 layers: the folders must not stack it higher.
    assert max(import_graph.layers(graph).values()) < 12


def test_the_cycle_check_sees_function_level_imports(tmp_path: Path) -> None:
    """The check can fail: two modules that import each other only inside functions make a cycle."""
    (tmp_path / "a.py").write_text("def f():\n    from lightning_sgdtp.b import g\n")
    (tmp_path / "b.py").write_text("def g():\n    import lightning_sgdtp.a\n")
    modules = {"lightning_sgdtp.a": tmp_path / "a.py", "lightning_sgdtp.b": tmp_path / "b.py"}
    graph = {m: import_graph.imports(p, m, modules) for m, p in modules.items()}
    assert graph == {"lightning_sgdtp.a": {"lightning_sgdtp.b"}, "lightning_sgdtp.b": {"lightning_sgdtp.a"}}
    assert import_graph.cycles(graph)
    assert import_graph.layers({"x": {"y"}, "y": {"z"}, "z": set()}) == {"x": 3, "y": 2, "z": 1}


def test_the_root_is_the_public_api() -> None:
    """At most 5 modules at the package root (``__init__``, ``config``, ``cli``, ...): the rest lives in a folder
    named for its concern."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 5, root
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert {
        "frontends",
        "mesh",
        "parallel",
        "engine",
        "sync",
        "compiler",
        "checkpoint",
        "runtime",
        "observe",
    } <= folders


def test_techniques_do_not_reach_up() -> None:
    """A technique (``parallel/``) is applied by the engine and read by config, the planner and the front ends;
    it imports none of them (config validates a technique's options through the technique's own checks)."""
    graph = import_graph.graph()
    above = ("lightning_sgdtp.config", "lightning_sgdtp.planner", "lightning_sgdtp.frontends")
    offenders = {
        m: sorted(d for d in deps if d.startswith(above))
        for m, deps in graph.items()
        if m.startswith("lightning_sgdtp.parallel")
    }
    assert {m: d for m, d in offenders.items() if d} == {}


def _shared_runs(a: str, b: str, length: int = 6) -> list[str]:
    """Runs of ``length`` consecutive non-blank lines (stripped) that stand in both sources."""

    def runs(source: str) -> dict[tuple[str, ...], int]:
        lines = [(i, line.strip()) for i, line in enumerate(source.splitlines(), 1) if line.strip()]
        return {tuple(x for _, x in lines[k : k + length]): lines[k][0] for k in range(len(lines) - length + 1)}

    theirs = runs(b)
    return [f"line {n}" for run, n in runs(a).items() if run in theirs]


def test_the_front_ends_are_thin() -> None:
    """Each front end keeps Lightning's vocabulary and delegates the rest to the shared core (``frontends/job.py``):
    <= 450 lines each, and no run of 6 lines stands in both."""
    sources = {name: (PACKAGE / "frontends" / name).read_text() for name in FRONT_ENDS}
    assert {n: len(s.splitlines()) for n, s in sources.items() if len(s.splitlines()) > 450} == {}
    assert _shared_runs(*sources.values()) == []


def test_the_shared_run_check_can_fail() -> None:
    body = "".join(f"x{i} = {i}\n" for i in range(6))
    assert _shared_runs("a = 1\n" + body, body + "b = 2\n") == ["line 2"]
    assert _shared_runs(body, body.replace("x5", "y5")) == []


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


def technique_checks(source: str) -> set[int]:
    """The lines of the ``check`` methods of ``source``'s classes (a technique's option checks, run by config)."""
    lines: set[int] = set()
    for cls in ast.walk(ast.parse(source)):
        if isinstance(cls, ast.ClassDef):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "check":
                    lines |= set(range(fn.lineno, (fn.end_lineno or fn.lineno) + 1))
    return lines


def test_the_mode_is_decided_in_one_place() -> None:
    """Outside config, ParallelDims, the planner and plan_part at most a handful of mode checks, each with a comment
    that says why it is there (on its line or the line above). A technique's option checks (``Technique.check``,
    which config runs: ``SGDTPConfig._check_techniques``) are config's decision, kept beside the technique."""
    outside: dict[str, list[int]] = {}
    uncommented = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in DECIDERS:
            continue
        source = path.read_text()
        lines = source.splitlines()
        option_checks = technique_checks(source)
        for line in mode_checks(source):
            if line in option_checks:
                continue
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
