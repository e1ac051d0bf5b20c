"""Every ```python block of README.md and docs/*.md runs, each in a fresh process (``helpers.zygote``: forked from
an interpreter that has imported torch, Lightning and lightning_sgdtp, so that no block pays the import).

- A block fenced as ```python runs as a script (cwd = the repository root) and must exit 0.
- A block fenced as ```python no-run is only compiled (it needs GPUs or several machines).
- A ```text output block right after a python block is what that block prints: each of its lines must
  appear in the block's stdout, so quoted messages (errors, log lines) stay the real ones.

Blocks run two at a time (one thread each); the whole file takes about three minutes on 2 CPU cores (330 s with
a fresh interpreter per block, issue 22).
"""

from __future__ import annotations

import re
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import REPO
from helpers.launch import job_env, run_python

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK_TIMEOUT = 300  # a 4-process example took 138 s with the suite running beside it
# The module fixture runs every block (two at a time) in the first test that needs it: that test's time limit is
# the whole set's, not pytest-timeout's default for one test. Each block is still bounded by BLOCK_TIMEOUT.
pytestmark = pytest.mark.timeout(3600)
FENCE = re.compile(r"^\s*```(?!`)\s*([\w+-]*)\s*(.*?)\s*$")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    flags: str
    code: str
    expected: str | None = None  # the ```text output block that follows, if any

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang == "python" and "no-run" not in self.flags.split()


def parse(path: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].lstrip().startswith("```"):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{path}:{start + 1}: unclosed code fence"
        block = Block(path, start + 1, m.group(1), m.group(2), textwrap.dedent("\n".join(body)) + "\n")
        if block.lang == "text" and "output" in block.flags.split() and blocks and blocks[-1].lang == "python":
            assert blocks[-1].expected is None, f"{path}:{start + 1}: two output blocks after one python block"
            assert blocks[-1].runs, f"{path}:{start + 1}: an output block after a no-run block is never checked"
            blocks[-1].expected = block.code
        blocks.append(block)
        i += 1
    return blocks


ALL = [b for path in DOCS for b in parse(path)]
PYTHON = [b for b in ALL if b.lang == "python"]
RUNNABLE = [b for b in PYTHON if b.runs]


def run_block(block: Block) -> tuple[int, str, str, float]:
    """Run one block as a script in a fresh process (``helpers.launch.run_python``); kill its whole process group
    on timeout."""
    with tempfile.TemporaryDirectory(prefix="sgdtp-doc-") as tmp:
        script = Path(tmp) / f"block_{block.path.stem}_{block.line}.py"
        script.write_text(block.code)
        begin = time.monotonic()
        rc, out, err, timed_out = run_python([str(script)], job_env(), BLOCK_TIMEOUT, merge_stderr=False)
        if timed_out:
            return -9, out, err + f"\n[timed out after {BLOCK_TIMEOUT}s]", time.monotonic() - begin
        return rc, out, err, time.monotonic() - begin


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[int, str, str, float]]:
    """All runnable blocks, two at a time, run once for the module."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip([b.id for b in RUNNABLE], pool.map(run_block, RUNNABLE)))


def test_docs_exist_and_have_runnable_blocks() -> None:
    names = {p.name for p in DOCS}
    assert {"README.md", "index.md", "options.md", "how-it-works.md", "lightning-features.md"} <= names, names
    assert len(RUNNABLE) > 0, "no runnable ```python block found"
    skipped = [b.id for b in PYTHON if not b.runs]
    assert len(skipped) <= len(RUNNABLE) // 3, f"too many no-run blocks: {skipped}"


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_block_compiles(block: Block) -> None:
    compile(block.code, block.id, "exec")


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs(block: Block, results: dict[str, tuple[int, str, str, float]]) -> None:
    rc, out, err, seconds = results[block.id]
    assert rc == 0, (
        f"{block.id} failed (rc={rc}, {seconds:.0f}s)\n--- code\n{block.code}--- stdout\n{out[-3000:]}--- stderr\n{err[-6000:]}"
    )
    if block.expected is not None:
        missing = [line.strip() for line in block.expected.splitlines() if line.strip() and line.strip() not in out]
        assert not missing, (
            f"{block.id}: the output block says lines the code did not print: {missing}\n--- stdout\n{out[-3000:]}"
        )


def test_all_runnable_blocks_ran(results: dict[str, tuple[int, str, str, float]]) -> None:
    assert len(results) == len(RUNNABLE) > 0
    ran = sum(1 for rc, *_ in results.values() if rc == 0)
    print(
        f"\n{ran}/{len(RUNNABLE)} doc blocks ran; slowest: "
        + ", ".join(f"{k} {v[3]:.0f}s" for k, v in sorted(results.items(), key=lambda kv: -kv[1][3])[:3])
    )
    assert ran == len(RUNNABLE)


def test_readme_commands_match_ci() -> None:
    """The README's two set-up commands are what .ci/run installs and runs."""
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "pip install torch==2.13.0 && pip install -e . && python examples/train_gpt.py" in readme
    assert 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q' in readme
    assert "pip install --quiet torch==2.13.0" in ci
    assert 'pip install --quiet -e ".[test]"' in ci
    assert re.search(r"^python -m pytest -q$", ci, re.MULTILINE)
