"""docs/support.md, the mode x feature table, is what ``tools/support_table.py`` generates now: every test it cites
exists, every refusal it quotes is what the code raises now, and the marks it reads are read strictly."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("support_table", REPO / "tools" / "support_table.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


st = _load()


@pytest.fixture(scope="module")
def built() -> tuple[str, dict]:
    with st._quiet():
        return st.build()


def test_the_page_is_what_the_generator_writes(built: tuple[str, dict]) -> None:
    page, _ = built
    assert st.PAGE.read_text() == page, "docs/support.md is stale: run `python tools/support_table.py`"


def test_every_cited_test_exists(built: tuple[str, dict]) -> None:
    _, table = built
    covers = [c for cell in table.values() for c in cell.covers]
    assert len(covers) >= 30, "fewer marks than the table was written with: is the reader broken?"
    page = st.PAGE.read_text()
    for path in sorted({c.path for c in covers}):
        assert (REPO / path).is_file(), path
        tree = ast.parse((REPO / path).read_text())
        functions = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        for cover in (c for c in covers if c.path == path):
            assert cover.function in functions, f"{cover.node_id}: no test function {cover.function} in {path}"
            assert cover.param is None or cover.param in strings, f"{cover.node_id}: no case {cover.param!r} in {path}"
            assert f"[`{cover.node_id}`](../{path})" in page, cover.node_id


def test_every_refusal_is_what_the_code_raises_now(built: tuple[str, dict]) -> None:
    _, table = built
    rows = {
        line.split("|")[1].strip(" *"): line for line in st.PAGE.read_text().splitlines() if line.startswith("| **")
    }
    refused = {key: cell.refused for key, cell in table.items() if cell.refused}
    assert {feature for _, feature in refused} == set(st.REFUSALS), "a probe that refuses in no mode"
    with st._quiet():
        for (mode, feature), cell in refused.items():
            now = st.REFUSALS[feature].trigger(st.MODES[mode])
            assert now is not None, f"({mode}, {feature}): the code no longer refuses it"
            assert now.message.startswith(now.sentence) and now.sentence == cell.sentence, (mode, feature)
            quoted = f"refused: `{now.error}`: {st._escape(now.sentence)}"
            assert quoted in rows[feature], f"({mode}, {feature}): the page does not quote {quoted!r}"


def test_first_sentence() -> None:
    assert st.first_sentence("on torch 2.13 it fails (e.g. 25 MiB). Use X.") == "on torch 2.13 it fails (e.g. 25 MiB)."
    assert st.first_sentence("Consolidate (sgdtp consolidate DIR model.ckpt) and go.") == (
        "Consolidate (sgdtp consolidate DIR model.ckpt) and go."
    )


MARKED = """
import pytest
from helpers.launch import tiered

CASES = {"a": 1, "b": 2}
SLOW = {"b"}


@pytest.mark.covers("data", "validate", param="b")
@pytest.mark.covers("pipeline", "resume on another layout", target="data", note="x", param="a")
@pytest.mark.parametrize("name", tiered(list(CASES), SLOW))
def test_table(name):
    pass


@pytest.mark.slow
@pytest.mark.covers("tensor", "test")
def test_plain():
    pass


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(1, marks=pytest.mark.covers("hybrid", "predict"), id="one"),
        pytest.param(2, marks=[pytest.mark.slow, pytest.mark.covers("hybrid", "test")], id="two"),
        3,
    ],
)
def test_literal(value):
    pass
"""


def _read(tmp_path: Path, source: str) -> list:
    path = tmp_path / "test_marked.py"
    path.write_text(source)
    return st.read_covers(path, root=tmp_path)


def test_marks_are_read_from_the_source(tmp_path: Path) -> None:
    found = {(c.node_id, c.mode, c.feature, c.slow, c.target, c.note) for c in _read(tmp_path, MARKED)}
    assert found == {
        ("test_marked.py::test_table[b]", "data", "validate", True, None, None),
        ("test_marked.py::test_table[a]", "pipeline", "resume on another layout", False, "data", "x"),
        ("test_marked.py::test_plain", "tensor", "test", True, None, None),
        ("test_marked.py::test_literal[one]", "hybrid", "predict", False, None, None),
        ("test_marked.py::test_literal[two]", "hybrid", "test", True, None, None),
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('"data", "validate"', '"dat", "validate"'), "the modes are"),
        (('"data", "validate"', '"data", "validation"'), "the features are"),
        (('param="b"', 'param="c"'), "is not one of its cases"),
        (('target="data", ', ""), "target= (a mode) goes with 'resume on another layout'"),
        (("tiered(list(CASES), SLOW)", "tiered(names(), SLOW)"), "cannot read"),
        (("def test_plain():\n    pass", "def test_plain():\n    pytest.mark.covers('data', 'test')"), "outside"),
    ],
)
def test_a_mark_that_cannot_be_placed_is_an_error(tmp_path: Path, change: tuple[str, str], message: str) -> None:
    old, new = change
    assert old in MARKED
    with pytest.raises(st.TableError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _read(tmp_path, MARKED.replace(old, new, 1))


def test_a_refused_cell_cannot_be_marked_tested() -> None:
    cover = st.Cover("pipeline", "predict", "tests/x.py", "test_x", None, False)
    refused = st.Refused("NotAvailableYetError", "no.", "no. Fix.", "lightning_sgdtp/x.py", "f")
    with pytest.raises(st.TableError, match="the code refuses it"):
        st.cells([cover], {("pipeline", "predict"): refused})
