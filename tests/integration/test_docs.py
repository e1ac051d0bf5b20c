"""Every ```python block of README.md and docs/*.md runs, each in a fresh process (``helpers.zygote``: forked from
an interpreter that has imported torch, Lightning and lightning_sgdtp, so that no block pays the import).

- A block fenced as ```python runs as a script (cwd = the repository root) and must exit 0.
- A block fenced as ```python no-run is only compiled (it needs GPUs or several machines).
- A ```text output block right after a python block is what that block prints: each of its lines must
  appear in the block's stdout, so quoted messages (errors, log lines) stay the real ones.

Blocks run two at a time (one thread each); the whole file takes about three minutes on 2 CPU cores (330 s with
a fresh interpreter per block, issue 22).

Two checks run nothing and take seconds: every relative link resolves (``test_relative_links_resolve``), and every
figure the docs state names its source (``test_every_figure_names_its_source``).
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


# --- Relative links ------------------------------------------------------------------------------------------------

LINKED = [*DOCS, *(REPO / d / "README.md" for d in ("examples", "benchmarks", "tests"))]
MD_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target)
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")  # [name]: target
PY_MENTION = re.compile(r"(?<![\w-])((?:docs|benchmarks|tests|examples|tools)/[\w./-]*?\.md)(#[\w-]+)?")
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)  # http:, https:, mailto:, ...
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")


def prose(path: Path) -> list[tuple[int, str]]:
    """(1-based line number, line) of every line of a markdown file outside its fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line) or (fenced and line.lstrip().startswith("```")):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (a link shows its text, html tags vanish), lowercase, every character
    but letters, digits, '-', '_' and spaces removed, each space turned into '-'."""
    text = re.sub(r"<[^>]+>", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)).strip().lower()
    return "".join(c for c in text if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """A markdown file's anchors: its headings' slugs (a repeated slug gets -1, -2, ... as on GitHub) and explicit
    ``<a id="...">`` / ``<a name="...">`` targets."""
    found: set[str] = set()
    seen: dict[str, int] = {}  # slug -> headings with it so far
    for _, line in prose(path):
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
        if m := HEADING.match(line):
            slug = github_slug(m.group(1))
            found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return found


def link_targets() -> list[tuple[str, Path, str]]:
    """(where, file the link points at, anchor or '') for every relative link: ``[text](target)`` and
    ``[name]: target`` outside code in LINKED, and ``docs/....md[#anchor]`` mentions in lightning_sgdtp/**/*.py
    (relative to the repository root)."""
    found: list[tuple[str, Path, str]] = []
    for path in LINKED:
        for number, line in prose(path):
            line = CODE_SPAN.sub("", line)
            for target in [*MD_LINK.findall(line), *REF_DEF.findall(line)]:
                if not EXTERNAL.match(target):
                    file, _, anchor = target.partition("#")
                    where = f"{path.relative_to(REPO)}:{number}: {target}"
                    found.append((where, (path.parent / file).resolve() if file else path, anchor))
    for path in sorted((REPO / "lightning_sgdtp").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for file, anchor in PY_MENTION.findall(line):
                found.append((f"{path.relative_to(REPO)}:{number}: {file}{anchor}", REPO / file, anchor[1:]))
    return found


def test_relative_links_resolve() -> None:
    """Every relative link of the docs, and every docs/....md its source names, points at a file that exists, and at
    a heading of it (GitHub's slug) when it has a #anchor. Links to http(s)/mailto are not checked."""
    targets = link_targets()
    assert len(targets) > 100, f"only {len(targets)} links found: is the parser broken?"
    broken = []
    for where, file, anchor in targets:
        if not file.exists():
            broken.append(f"{where} -> {file.relative_to(REPO) if file.is_relative_to(REPO) else file} does not exist")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{where} -> no heading '#{anchor}' in {file.relative_to(REPO)}")
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken)


# --- Figures and their sources -------------------------------------------------------------------------------------

_N = r"(?<![\w.=/~-])~?\d+(?:[.,]\d+)*"  # a number that does not follow '=' or a word (v2, bf16, H100)
FIGURE = re.compile(
    "|".join(
        [
            _N + r"\s?%",  # 54%
            _N + r"\s?(?:ms|µs|us|s|min|h)(?!\w)",  # 330 s, 10 ms, 3 min
            _N + r"\s?(?:[KMGT]i?B|kB)(?!\w)",  # 4 MiB, 80 GB
            _N + r"\s?(?:k\s?)?(?:tokens|tok|samples|steps|it)/s(?!\w)",  # 12k tokens/s
            _N + r"[x×](?!\s?\d|\w)",  # 1.3x (not 2x8, a mesh)
            r"(?<![\w.])[x×]\d+(?:\.\d+)?(?![\w.])",  # x1.3
            r"(?<![\w.])\d(?:\.\d+)?e-\d+(?!\w)",  # 5e-07
        ]
    )
)
SOURCE_PATH = re.compile(r"(?:^|[\s/(\"'])(?:tests|benchmarks|tools)/\S")  # a path under tests/, benchmarks/, tools/
SOURCE_COMMAND = re.compile(r"^(?:\S*/)?(?:python3?|pytest|sgdtp)\s")  # `python ...`, `pytest ...`, `sgdtp ...`
SOURCE_DOC = re.compile(r"(?:^|/)(?:model-)?support\.md(?:#|$)")  # the measured support matrix
SOURCE_WORDS = re.compile(r"\buntested\b|\bnot measured\b|\bexample\b", re.IGNORECASE)
# Scripts whose name alone (in backticks) names a source: the files under tests/, benchmarks/, tools/.
SOURCE_FILES = {p.name for d in ("tests", "benchmarks", "tools") for p in (REPO / d).rglob("*.py")}
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
TABLE_ROW = re.compile(r"^\s*\|")
# Phrases of a doc that look like figures but are no measurement ((doc, phrase): why). Found by the check, each
# read by hand; a phrase (not a line number) so that edits around it do not move it.
NOT_FIGURES: dict[tuple[str, str], str] = {
    ("options.md", "25 MiB"): "the fallback bucket cap, a constant of the code (comm.DEFAULT_CAP_BYTES, as DDP's)",
    ("sharding.md", "25 MiB"): "the same constant",
    ("pipeline-parallel.md", "at least 5%"): "a rule of the split, a constant (pipeline_split.INSIDE_GAIN)",
}


@dataclass
class Unit:
    """A paragraph, list item or table row of a doc (outside code blocks): what one figure's source must be near."""

    path: Path
    line: int  # 1-based first line
    text: str
    context: str = ""  # a table row's caption paragraph (just above the table) and header row

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def units(path: Path) -> list[Unit]:
    """The paragraphs, list items and table rows of a markdown file outside code blocks. Headings are no unit (their
    numbers are names, not claims). A table's caption is the paragraph that ends on the line above it, or one blank
    line above it."""
    found: list[Unit] = []
    current: Unit | None = None  # the paragraph or list item being read
    end = 0  # last line of `current`
    table: str | None = None  # caption and header row of the table being read
    last = 0  # the previous prose line
    for number, line in prose(path):
        if number != last + 1 or not line.strip() or HEADING.match(line):  # a blank line, a code block, a heading
            table = None
            if HEADING.match(line):
                current = None
        last = number
        if not line.strip() or HEADING.match(line):
            continue
        if TABLE_ROW.match(line):
            if table is None:
                caption = current.text if current is not None and end >= number - 2 else ""
                table = caption + "\n" + line
            elif not re.fullmatch(r"[\s|:-]+", line):  # not the |---| line
                found.append(Unit(path, number, line.strip(), table))
            current = None
            continue
        if current is None or number != end + 1 or LIST_ITEM.match(line):
            current = Unit(path, number, line.strip())
            found.append(current)
        else:
            current.text += " " + line.strip()
        end = number
    return found


def figures(text: str) -> list[str]:
    """The measured numbers of a text: percentages, times, sizes, throughputs, speed-ups and relative errors,
    outside code spans (option values and defaults are written as code) and link targets."""
    text = CODE_SPAN.sub(" ", text)
    text = re.sub(r"\]\([^)]*\)|<[^>]*>", "] ", text)  # link targets, html tags
    return [m.group().strip() for m in FIGURE.finditer(text)]


def names_source(text: str) -> bool:
    """Whether a text names where its figures come from: a link or a code span naming a file under tests/,
    benchmarks/ or tools/ (or the support matrix, docs/model-support.md), a command in a code span, or words that
    say the figure is not a measurement ("untested", "not measured", "example")."""
    links = [t for t in re.findall(r"\]\(([^)\s]+)", text) if not EXTERNAL.match(t)]
    spans = [m.group()[1:-1].strip("` ") for m in CODE_SPAN.finditer(text)]
    return (
        any(SOURCE_PATH.search(" " + t) or SOURCE_DOC.search(t) for t in links)
        or any(SOURCE_PATH.search(" " + s) or SOURCE_COMMAND.match(s + " ") or SOURCE_DOC.search(s) for s in spans)
        or any(re.split(r"[\s:]", s)[0] in SOURCE_FILES for s in spans)
        or bool(SOURCE_WORDS.search(CODE_SPAN.sub(" ", text)))
    )


def test_every_figure_names_its_source() -> None:
    """A figure the docs state is one somebody measured, and its paragraph says how to measure it again.

    Checked: each paragraph, list item and table row of README.md and docs/*.md, outside code blocks, that states a
    figure (``figures``: a percentage, a time in s/ms/min/h, a size in KiB/MiB/GiB/GB/MB, a throughput in tokens/s
    or samples/s, a speed-up 1.3x / x1.3, a relative error 5e-07). It must name its source (``names_source``): a
    file under tests/, benchmarks/ or tools/ (linked, or in backticks), a command in backticks (`python ...`,
    `pytest ...`, `sgdtp ...`), a link to docs/model-support.md, or say "untested" / "not measured" / "example".
    A table row may name it in its own cells (a "Source" column) or take it from the table's caption paragraph or
    header row; a page generated by a script (first paragraph "Generated by `python tools/...`") names it for every
    unit of the page.

    Not figures: numbers in code spans (defaults, option values: `bucket_cap_mb=25`) or right after '=', numbers in
    headings, and numbers without one of those units ("2 layers", "4 steps", versions, dates). A false positive
    (a constant of the code, arithmetic) goes into NOT_FIGURES with the reason."""
    checked, unsourced = 0, []
    for path in DOCS:
        page = units(path)
        # A page generated by a measuring script names it once, in its first paragraph, for all of it.
        generated = page[0].text if page and page[0].text.startswith("Generated by") else ""
        for unit in page:
            text = unit.text
            for doc, phrase in NOT_FIGURES:
                text = text.replace(phrase, " ") if doc == path.name else text
            found = figures(text)
            if not found:
                continue
            checked += 1
            if not names_source(f"{unit.text}\n{unit.context}\n{generated}"):
                unsourced.append(f"{unit.id}: {', '.join(found)}: {unit.text[:100]!r}")
    assert checked > 10, f"only {checked} units with a figure found: is the parser broken?"
    assert not unsourced, f"{len(unsourced)} doc units state a figure without its source:\n" + "\n".join(unsourced)
