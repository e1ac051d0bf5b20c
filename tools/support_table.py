"""The support table: every mode x feature of the strategy, tested (the test that shows it), refused (the
strategy's own error) or untested, written to ``docs/support.md``. Nothing in the page is typed by hand.

    python tools/support_table.py           # write docs/support.md
    python tools/support_table.py --check   # exit 1, with the difference, when docs/support.md is not current

**Tested** cells come from the tests' ``covers`` marks (registered in pyproject.toml), read from the source with
``ast``: no test is imported or run, so the page takes seconds. A mark says that the test runs the mode with the
feature and checks the result::

    @pytest.mark.covers("pipeline", "gradient clipping", param="1f1b_accumulate_clip")  # one case of a table
    @pytest.mark.covers("tensor", "resume on another layout", target="data", param="resume_tp_to_dp")
    pytest.param("x", marks=pytest.mark.covers("data", "validate"))  # a case of a literal parameter list

``param`` names the case of a parametrized test (its id) where the cases are built by ``helpers.launch.tiered``;
``target`` is the layout a resume goes to (a mode); ``note`` is shown after the test (what else the case has). A test
marked ``slow``, or a case ``tiered`` puts in the slow tier, is shown as such.

**Refused** cells are triggered here, in this process, with no process group and no process started: each entry of
``REFUSALS`` builds what the user builds (``SGDTPStrategy(...)``, ``Trainer(strategy=..., ...)``) with the mode's
options and the feature's, or calls the check the strategy runs at setup on what it would be given (the pipeline's
LightningModule contract, the pipelined engine's predict step). The cell quotes the first sentence of the message
(the rest names the fix); where it is raised (file and function, from the traceback) is listed under the table.
No refusal is quoted from a string constant: each one is raised by the code.

A cell marked tested that the code refuses, a mark naming an unknown mode, feature, case or target, or a ``covers``
mark where this script cannot read it: an error, so the table cannot say something the tests do not.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
PAGE = REPO / "docs" / "support.md"


@dataclass(frozen=True)
class Mode:
    """A column: the strategy's options and the devices (CPU processes) it runs on."""

    options: dict[str, Any]
    devices: int


MODES: dict[str, Mode] = {
    "data": Mode({}, 2),
    "data + sharding full": Mode({"sharding": "full"}, 2),
    "data + sharding optimizer": Mode({"sharding": "optimizer"}, 2),
    "tensor": Mode({"parallelism": "tensor"}, 2),
    "hybrid": Mode({"parallelism": "hybrid", "tensor_parallel_size": 2}, 4),
    "pipeline": Mode({"pipeline_stages": 2}, 2),
    "pipeline x data": Mode({"pipeline_stages": 2}, 4),
    "pipeline x tensor": Mode({"pipeline_stages": 2, "parallelism": "tensor"}, 4),
}

#: The rows, with what a test must check to count for the row.
FEATURES: dict[str, str] = {
    "validate": "the validation loop (during `fit` or `trainer.validate`), its logged loss compared with a reference",
    "test": "`trainer.test`, its loss compared with a reference",
    "predict": "`trainer.predict`, its outputs compared with a reference",
    "gradient accumulation": "`Trainer(accumulate_grad_batches=2)`, the trained parameters compared with a reference",
    "gradient clipping": "`Trainer(gradient_clip_val=...)` with clipping acting, compared with a reference",
    "activation checkpointing": "`activation_checkpointing=True`, applied (the plan) and compared with a reference",
    "bf16-mixed": "`Trainer(precision='bf16-mixed')`, compared with a reference",
    "compile cache": "`compile_cache=DIR`: a later job starts warm from the bundle and trains the same",
    "regional compile": "`regional_compile=True` (the default): one region compiled for every block, compared with a"
    " reference",
    "resume on another layout": "a checkpoint of this mode resumed in the mode named after the arrow, as one run",
    "consolidate": "the mode's checkpoint made one whole file (`sgdtp consolidate`), equal to the saved weights",
    "manual optimization": "`automatic_optimization = False` with `manual_backward`, compared with a reference",
    "SyncBatchNorm": "`Trainer(sync_batchnorm=True)`",
}

MARK = "covers"


class TableError(Exception):
    """A mark this script cannot read or place: the message names the file, the test and the fix."""


# ----------------------------------------------------------------------------------------------- the tests' marks
@dataclass(frozen=True)
class Cover:
    """One ``covers`` mark: the test (and its case) that shows a mode with a feature."""

    mode: str
    feature: str
    path: str  # from the repository root, e.g. tests/distributed/test_data_parallel.py
    function: str
    param: str | None
    slow: bool
    target: str | None = None
    note: str | None = None

    @property
    def node_id(self) -> str:
        return f"{self.path}::{self.function}" + (f"[{self.param}]" if self.param else "")


@dataclass(frozen=True)
class Case:
    """A case of a parametrized test: its id, whether it is in the slow tier, its own ``covers`` marks."""

    id: str | None
    slow: bool
    covers: tuple[ast.Call, ...] = ()


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _is_mark(node: ast.AST, name: str) -> bool:
    """``pytest.mark.NAME`` or ``pytest.mark.NAME(...)`` (``mark.NAME`` after ``from pytest import mark``)."""
    target = node.func if isinstance(node, ast.Call) else node
    return _dotted(target) in (f"pytest.mark.{name}", f"mark.{name}")


def _strings(node: ast.AST, names: dict[str, ast.AST], seen: frozenset[str] = frozenset()) -> list[str]:
    """The strings an expression of a test module stands for, in order: literals, module-level names, ``list(...)``,
    ``set(...)``, a dict's keys, ``&`` / ``|`` / ``-`` of sets. Anything else: TableError."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [s for element in node.elts for s in _strings(element, names, seen)]
    if isinstance(node, ast.Dict):
        return [s for key in node.keys if key is not None for s in _strings(key, names, seen)]
    if isinstance(node, ast.Name) and node.id in names and node.id not in seen:
        return _strings(names[node.id], names, seen | {node.id})
    if isinstance(node, ast.Call) and _dotted(node.func) in ("list", "set", "tuple", "sorted") and len(node.args) == 1:
        return _strings(node.args[0], names, seen)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.Sub)):
        left, right = _strings(node.left, names, seen), _strings(node.right, names, seen)
        if isinstance(node.op, ast.BitAnd):
            return [s for s in left if s in right]
        if isinstance(node.op, ast.Sub):
            return [s for s in left if s not in right]
        return left + [s for s in right if s not in left]
    raise TableError(f"cannot read {ast.unparse(node)!r} without running the test module")


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _marks(node: ast.AST | None) -> list[ast.AST]:
    if node is None:
        return []
    return list(node.elts) if isinstance(node, (ast.List, ast.Tuple)) else [node]


def _cases(parametrize: ast.Call, names: dict[str, ast.AST]) -> list[Case]:
    """The cases of ``@pytest.mark.parametrize(argnames, argvalues, ids=...)``: ``tiered(names, slow)`` or a literal
    list of values and ``pytest.param(...)``."""
    values = parametrize.args[1] if len(parametrize.args) > 1 else _keyword(parametrize, "argvalues")
    if isinstance(values, ast.Call) and _dotted(values.func) == "tiered":
        slow_arg = values.args[1] if len(values.args) > 1 else _keyword(values, "slow")
        slow = set(_strings(slow_arg, names)) if slow_arg is not None else set()
        return [Case(n, n in slow) for n in _strings(values.args[0], names)]
    if isinstance(values, ast.Name) and values.id in names:
        values = names[values.id]
    if not isinstance(values, (ast.List, ast.Tuple)):
        raise TableError(f"cannot read the cases {ast.unparse(values)!r} without running the test module")
    ids_node = _keyword(parametrize, "ids")
    ids = _strings(ids_node, names) if ids_node is not None else []
    cases = []
    for i, value in enumerate(values.elts):
        case_id = ids[i] if i < len(ids) else None
        marks: list[ast.AST] = []
        if isinstance(value, ast.Call) and _dotted(value.func) in ("pytest.param", "param"):
            marks = _marks(_keyword(value, "marks"))
            given = _keyword(value, "id")
            if isinstance(given, ast.Constant) and isinstance(given.value, str):
                case_id = given.value
            value = value.args[0] if len(value.args) == 1 else value
        if case_id is None and isinstance(value, ast.Constant) and isinstance(value.value, str):
            case_id = value.value
        covers = tuple(m for m in marks if isinstance(m, ast.Call) and _is_mark(m, MARK))
        cases.append(Case(case_id, any(_is_mark(m, "slow") for m in marks), covers))
    return cases


def _cover(call: ast.Call, path: str, function: str, param: str | None, slow: bool) -> Cover:
    where = f"{path}::{function}"
    if len(call.args) != 2 or not all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in call.args):
        raise TableError(f"{where}: write the mark as covers(MODE, FEATURE, ...) with two string literals")
    mode, feature = (a.value for a in call.args)  # type: ignore[attr-defined]
    kwargs: dict[str, str] = {}
    for k in call.keywords:
        if k.arg not in ("param", "target", "note") or not isinstance(k.value, ast.Constant):
            raise TableError(f"{where}: covers() takes param=, target= and note= (string literals), not {k.arg}=")
        kwargs[k.arg] = k.value.value
    if mode not in MODES:
        raise TableError(f"{where}: covers({mode!r}, ...): the modes are {list(MODES)}")
    if feature not in FEATURES:
        raise TableError(f"{where}: covers(..., {feature!r}): the features are {list(FEATURES)}")
    target = kwargs.get("target")
    if (feature == "resume on another layout") != (target is not None):
        raise TableError(f"{where}: target= (a mode) goes with 'resume on another layout', and only there")
    if target is not None and target not in MODES:
        raise TableError(f"{where}: target={target!r}: the modes are {list(MODES)}")
    return Cover(mode, feature, path, function, kwargs.get("param", param), slow, target, kwargs.get("note"))


def read_covers(path: Path, root: Path = REPO) -> list[Cover]:
    """Every ``covers`` mark of one test file, read with ``ast`` (the file is not imported); paths from ``root``."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(root).as_posix()
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            names[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            names[node.target.id] = node.value
    found: list[Cover] = []
    read: set[int] = set()
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        slow = any(_is_mark(d, "slow") for d in node.decorator_list)
        marks = [d for d in node.decorator_list if isinstance(d, ast.Call) and _is_mark(d, MARK)]
        cases: list[Case] | None = None
        problem = ""
        for d in node.decorator_list:
            if isinstance(d, ast.Call) and _is_mark(d, "parametrize"):
                try:
                    cases = [*(cases or []), *_cases(d, names)]
                except TableError as exc:
                    problem = str(exc)
        for case in cases or []:
            for call in case.covers:
                if case.id is None:
                    raise TableError(f"{rel}::{node.name}: a pytest.param with a covers mark needs an id")
                found.append(_cover(call, rel, node.name, case.id, slow or case.slow))
                read.add(id(call))
        for call in marks:
            cover = _cover(call, rel, node.name, None, slow)
            if cover.param is not None:
                if cases is None:
                    raise TableError(f"{rel}::{node.name}: param={cover.param!r}, but {problem or 'no parametrize'}")
                case = next((c for c in cases if c.id == cover.param), None)
                if case is None:
                    known = [c.id for c in cases]
                    raise TableError(f"{rel}::{node.name}: param={cover.param!r} is not one of its cases {known}")
                cover = Cover(**{**cover.__dict__, "slow": slow or case.slow})
            elif cases:  # the whole parametrized test: slow only when every case is
                cover = Cover(**{**cover.__dict__, "slow": slow or all(c.slow for c in cases)})
            found.append(cover)
            read.add(id(call))
    stray = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _is_mark(n, MARK) and id(n) not in read]
    if stray:
        raise TableError(
            f"{rel}:{stray[0].lineno}: a covers mark outside a test function's decorators or its pytest.param cases"
        )
    return found


def collect(root: Path = TESTS) -> list[Cover]:
    return [c for path in sorted(root.rglob("test_*.py")) for c in read_covers(path)]


# ------------------------------------------------------------------------------------------------------ refusals
@dataclass(frozen=True)
class Refused:
    error: str  # the exception's class
    sentence: str  # the first sentence of its message
    message: str  # all of it
    file: str  # where it is raised: the file (lightning_sgdtp/...)
    function: str  # and the function (its qualified name)


def first_sentence(message: str) -> str:
    """The message up to its first '.', '!' or '?' that ends it or is followed by a space and a capital letter or
    '(' (so ``torch 2.13``, ``e.g. 25`` and ``model.ckpt`` do not end a sentence)."""
    m = re.search(r"[.!?](?=\s+[A-Z(]|\s*$)", message)
    return message[: m.end()] if m else message


def _raised(trigger: Callable[[], object]) -> Refused | None:
    """The strategy's own refusal (its error classes) raised by ``trigger``; None when it raises nothing. Any other
    error propagates: a crash is no refusal."""
    from lightning_sgdtp.config import NotAvailableYetError, SGDTPConfigError
    from lightning_sgdtp.parallel.pipeline.contract import PipelineContractError
    from lightning_sgdtp.parallel.tensor.plan import TensorPlanError

    try:
        trigger()
    except (SGDTPConfigError, NotAvailableYetError, PipelineContractError, TensorPlanError) as exc:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        assert tb is not None
        code = tb.tb_frame.f_code
        parts = Path(code.co_filename).parts  # from the package's folder on: the same installed or in the checkout
        package = len(parts) - 1 - parts[::-1].index("lightning_sgdtp") if "lightning_sgdtp" in parts else -1
        where = "/".join(parts[package:])
        name = getattr(code, "co_qualname", code.co_name)  # Python >= 3.11
        message = str(exc)
        return Refused(type(exc).__name__, first_sentence(message), message, where, name)
    return None


def _strategy(mode: Mode, **extra: Any) -> Any:
    from lightning_sgdtp import SGDTPStrategy

    return SGDTPStrategy(**mode.options, **extra)


def _trainer(mode: Mode, **trainer: Any) -> Any:
    import lightning.pytorch as L

    kwargs = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
    return L.Trainer(strategy=_strategy(mode), accelerator="cpu", devices=mode.devices, **kwargs, **trainer)


def _engine(mode: Mode) -> type:
    """The step engine the strategy picks for the mode (the one choice in ``frontends/trainer.py``'s ``_step_engine``, on the same
    dims, resolved here as ``_configure_launcher`` resolves them before any process starts)."""
    from lightning_sgdtp.engine.compiled import CompiledStep
    from lightning_sgdtp.engine.pipelined import PipelinedStep
    from lightning_sgdtp.mesh.dims import ParallelDims

    dims = ParallelDims.resolve(_strategy(mode).config, mode.devices, mode.devices)
    return PipelinedStep if dims.pp_enabled else CompiledStep


def _manual_module() -> Any:
    import lightning.pytorch as L
    import torch

    class MyLightningModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.layer = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.manual_backward(self(batch).sum())

    return MyLightningModule()


def _pipeline_contract(mode: Mode) -> Refused | None:
    """The LightningModule contract the pipelined engine checks at setup, on a manual-optimization module."""
    from lightning_sgdtp.engine.pipelined import PipelinedStep
    from lightning_sgdtp.parallel.pipeline.contract import check_pipeline_contract

    if _engine(mode) is not PipelinedStep:
        return None
    return _raised(lambda: check_pipeline_contract(_manual_module()))


def _pipelined_predict(mode: Mode) -> Refused | None:
    """The pipelined engine's predict step: it refuses before it reads any of its state (set at setup, with the
    process group), so it runs here on an engine that was never set up."""
    engine = _engine(mode)
    from lightning_sgdtp.engine.pipelined import PipelinedStep

    if engine is not PipelinedStep:
        return None
    unset = object.__new__(engine)
    return _raised(lambda: unset.eval_step("predict_step", (), {}, lambda: None, contextlib.nullcontext))


@dataclass(frozen=True)
class Probe:
    """How the script asks the code about a feature in a mode (``how``, shown under the table) and the call that does
    it: a Refused, or None where the code accepts it (the cell is then tested or untested)."""

    how: str
    trigger: Callable[[Mode], Refused | None]


REFUSALS: dict[str, Probe] = {
    "activation checkpointing": Probe(
        "`SGDTPStrategy(<mode>, activation_checkpointing=True)`",
        lambda mode: _raised(lambda: _strategy(mode, activation_checkpointing=True)),
    ),
    "compile cache": Probe(
        "`SGDTPStrategy(<mode>, compile_cache=DIR)`",
        lambda mode: _raised(lambda: _strategy(mode, compile_cache="sgdtp-compile-cache")),
    ),
    "SyncBatchNorm": Probe(
        "`Trainer(strategy=SGDTPStrategy(<mode>), devices=N, sync_batchnorm=True)`",
        lambda mode: _raised(lambda: _trainer(mode, sync_batchnorm=True)),
    ),
    "manual optimization": Probe(
        "the pipelined engine's setup check, `check_pipeline_contract`, on a module with `automatic_optimization ="
        " False`",
        _pipeline_contract,
    ),
    "predict": Probe(
        "the pipelined engine's `eval_step('predict_step', ...)`, on an engine not set up (it refuses first)",
        _pipelined_predict,
    ),
}


def refusals() -> dict[tuple[str, str], Refused]:
    found = {}
    for feature, probe in REFUSALS.items():
        for name, mode in MODES.items():
            refused = probe.trigger(mode)
            if refused is not None:
                found[name, feature] = refused
    return found


# ----------------------------------------------------------------------------------------------------- the page
@dataclass(frozen=True)
class Cell:
    covers: tuple[Cover, ...] = ()
    refused: Refused | None = None

    @property
    def kind(self) -> str:
        return "refused" if self.refused else "tested" if self.covers else "untested"


def cells(covers: list[Cover], refused: dict[tuple[str, str], Refused]) -> dict[tuple[str, str], Cell]:
    table = {}
    for mode in MODES:
        for feature in FEATURES:
            mine = sorted(
                (c for c in covers if (c.mode, c.feature) == (mode, feature)),
                key=lambda c: (list(MODES).index(c.target) if c.target else 0, c.slow, c.node_id, c.note or ""),
            )
            if mine and (mode, feature) in refused:
                raise TableError(
                    f"({mode}, {feature}) is marked tested by {mine[0].node_id}, and the code refuses it: "
                    f"{refused[mode, feature].sentence}"
                )
            table[mode, feature] = Cell(tuple(mine), refused.get((mode, feature)))
    return table


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def _test(cover: Cover) -> str:
    link = f"[`{cover.node_id}`](../{cover.path})"
    extra = [x for x in (cover.note, "slow tier" if cover.slow else None) if x]
    head = f"→ {cover.target}: " if cover.target else ""
    return head + link + (f" ({'; '.join(extra)})" if extra else "")


def render_cell(cell: Cell) -> str:
    if cell.refused:
        return f"refused: `{cell.refused.error}`: {_escape(cell.refused.sentence)}"
    if cell.covers:
        return "✓ tested: " + "<br>".join(_test(c) for c in cell.covers)
    return "untested"


def counts(table: dict[tuple[str, str], Cell]) -> dict[str, int]:
    kinds = [cell.kind for cell in table.values()]
    return {kind: kinds.count(kind) for kind in ("tested", "refused", "untested")}


def _options(mode: Mode) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in mode.options.items())
    return f"`SGDTPStrategy({args})` on {mode.devices} devices"


def render(table: dict[tuple[str, str], Cell]) -> str:
    n = counts(table)
    lines = [
        "# Support: every mode x every feature",
        "",
        (
            "Generated by `python tools/support_table.py`: do not edit by hand. `python tools/support_table.py --check` says"
            " whether the page is current, and `tests/unit/test_support_table.py` fails when it is not. Tested cells come"
            " from the tests' `@pytest.mark.covers(mode, feature)` marks, refused cells from the strategy's own errors,"
            " raised by the script in its own process (no process group, nothing started)."
        ),
        "",
        "Each cell is one of:",
        "",
        (
            "- **✓ tested**: the pytest node id of a test that runs the mode with the feature and checks the result,"
            " linked to its file (run it with `python -m pytest NODE_ID`); **(slow tier)**: left out of the default run,"
            " run by `python -m pytest -m slow` (tests/README.md). Several tests: one per line."
        ),
        (
            "- **refused**: the strategy stops with this error (its class, then the first sentence of its message; the"
            " rest names the fix) before any training step. Where the code raises it: below the table."
        ),
        "- **untested**: no test marks it. It may work; nothing in the test suite shows it.",
        "",
        "The modes (columns):",
        "",
        *[f"- **{name}**: {_options(mode)}" for name, mode in MODES.items()],
        "",
        "The features (rows), and what a test checks to count:",
        "",
        *[f"- **{name}**: {meaning}" for name, meaning in FEATURES.items()],
        "",
        f"{len(table)} cells: {n['tested']} tested, {n['refused']} refused, {n['untested']} untested.",
        "",
        "| feature | " + " | ".join(MODES) + " |",
        "| --- | " + " | ".join("---" for _ in MODES) + " |",
    ]
    for feature in FEATURES:
        lines.append(f"| **{feature}** | " + " | ".join(render_cell(table[m, feature]) for m in MODES) + " |")
    lines += ["", "## Where the refusals are raised", ""]
    seen: dict[tuple[str, str, str, str], list[str]] = {}
    for (mode, feature), cell in table.items():
        if cell.refused:
            key = (feature, cell.refused.error, cell.refused.function, cell.refused.file)
            seen.setdefault(key, []).append(mode)
    for (feature, error, function, file), modes in sorted(seen.items(), key=lambda kv: list(FEATURES).index(kv[0][0])):
        lines.append(
            f"- **{feature}** ({', '.join(modes)}): `{error}`, raised by `{function}()` in `{file}`; asked by"
            f" {REFUSALS[feature].how}"
        )
    return "\n".join(lines) + "\n"


def build() -> tuple[str, dict[tuple[str, str], Cell]]:
    """The page and its cells: the tests' marks (read statically) and the refusals (raised here)."""
    table = cells(collect(), refusals())
    return render(table), table


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """What Lightning says while the probe Trainers are built (GPU available: ..., srun is not used): not the
    script's output."""
    import logging

    logger = logging.getLogger("lightning.pytorch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write: exit 1 if docs/support.md differs")
    parser.add_argument("--out", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    try:
        with _quiet():
            page, table = build()
    except TableError as exc:
        print(f"support_table: {exc}", file=sys.stderr)
        return 2
    n = counts(table)
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current == page:
            print(f"{args.out} is current ({n['tested']} tested, {n['refused']} refused, {n['untested']} untested)")
            return 0
        diff = difflib.unified_diff(
            current.splitlines(keepends=True), page.splitlines(keepends=True), str(args.out), "generated"
        )
        sys.stdout.writelines(diff)
        print(f"\n{args.out} is stale: run `python tools/support_table.py` and commit the page", file=sys.stderr)
        return 1
    args.out.write_text(page)
    print(f"wrote {args.out}: {n['tested']} tested, {n['refused']} refused, {n['untested']} untested")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
