"""Every ```python block of README.md and docs/*.md runs, each in a fresh process (``helpers.zygote``: forked from
an interpreter that has imported torch, Lightning and lightning_sgdtp, so that no block pays the import).

- A block fenced as ```python runs as a script (cwd = the repository root) and must exit 0.
- A block fenced as ```python no-run is only compiled (it needs GPUs or several machines).
- A ```text output block right after a python block is what that block prints: each of its lines must
  appear in the block's stdout, so quoted messages (errors, log lines) stay the real ones. A ```text stderr block
  after them is what it logs (Lightning's and the strategy's log lines go to stderr). In both, ``[...]`` marks a cut
  (what differs from run to run, a time): each part of the line must appear.
- A ```text saved=PATH block quotes a saved run (a log under benchmarks/results/, a test's output): each of its lines
  must appear in that file (``[...]`` marks a cut: each part must). For output no docs block can produce (GPUs,
  SLURM, several machines, minutes of training).
- Any other ```text block is declared ```text sketch (a diagram, a shape, a command to type): never program output
  (``test_every_text_block_is_checked_or_a_sketch``).

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
from collections.abc import Iterator
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
    logged: str | None = None  # the ```text stderr block that follows, if any

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
        ran = next((b for b in reversed(blocks) if b.lang == "python"), None) if blocks else None
        if block.lang == "text" and "stderr" in block.flags.split() and ran is not None:
            assert blocks[-1] is ran or blocks[-1].flags.split()[:1] == ["output"], f"{path}:{start + 1}: not after"
            assert ran.runs and ran.logged is None, f"{path}:{start + 1}: a stderr block after a no-run block"
            ran.logged = block.code
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
    for quoted, printed, name in ((block.expected, out, "stdout"), (block.logged, err, "stderr")):
        missing = [line.strip() for line in (quoted or "").splitlines() if not _quoted_in(line, printed)]
        assert not missing, f"{block.id}: lines the code did not print on {name}: {missing}\n---\n{printed[-3000:]}"


def _quoted_in(line: str, text: str) -> bool:
    """A quoted line is in a text: each part of it between ``[...]`` cuts (a blank line is in any text)."""
    return all(part.strip() in text for part in line.strip().split("[...]"))


def test_all_runnable_blocks_ran(results: dict[str, tuple[int, str, str, float]]) -> None:
    assert len(results) == len(RUNNABLE) > 0
    ran = sum(1 for rc, *_ in results.values() if rc == 0)
    print(
        f"\n{ran}/{len(RUNNABLE)} doc blocks ran; slowest: "
        + ", ".join(f"{k} {v[3]:.0f}s" for k, v in sorted(results.items(), key=lambda kv: -kv[1][3])[:3])
    )
    assert ran == len(RUNNABLE)


TEXT_KINDS = ("output", "stderr", "sketch")


def _saved(block: Block) -> Path | None:
    path = next((f.split("=", 1)[1] for f in block.flags.split() if f.startswith("saved=")), None)
    return REPO / path if path else None


def test_every_text_block_is_checked_or_a_sketch() -> None:
    """No ```text block quotes program output unchecked: each is `output` (checked against the python block above
    it), `saved=PATH` (checked against a saved run) or `sketch` (not output)."""
    plain = [
        b.id for b in ALL if b.lang == "text" and not _saved(b) and not any(k in b.flags.split() for k in TEXT_KINDS)
    ]
    assert not plain, f"```text blocks that say neither output, saved=PATH nor sketch: {plain}"


@pytest.mark.parametrize("block", [b for b in ALL if _saved(b)], ids=[b.id for b in ALL if _saved(b)])
def test_saved_output_is_in_its_file(block: Block) -> None:
    saved = _saved(block)
    assert saved is not None and saved.is_file(), f"{block.id}: {saved} does not exist"
    assert saved.is_relative_to(REPO / "benchmarks" / "results") or saved.is_relative_to(REPO / "tests"), saved
    text = saved.read_text(errors="replace")
    missing = [line.strip() for line in block.code.splitlines() if not _quoted_in(line, text)]
    assert not missing, f"{block.id}: lines not in {saved.relative_to(REPO)}: {missing}"


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


def links_and_spans(text: str) -> tuple[list[str], list[str]]:
    """A text's relative link targets and the contents of its code spans."""
    links = [t for t in re.findall(r"\]\(([^)\s]+)", text) if not EXTERNAL.match(t)]
    return links, [m.group()[1:-1].strip("` ") for m in CODE_SPAN.finditer(text)]


def says_not_measured(text: str) -> bool:
    """Words outside code that say a figure is no measurement ("untested", "not measured", "example")."""
    return bool(SOURCE_WORDS.search(CODE_SPAN.sub(" ", text)))


def names_source(text: str) -> bool:
    """Whether a text names where its figures come from: a link or a code span naming a file under tests/,
    benchmarks/ or tools/ (or the support matrix, docs/model-support.md), a command in a code span, or words that
    say the figure is not a measurement (:func:`says_not_measured`)."""
    links, spans = links_and_spans(text)
    return (
        any(SOURCE_PATH.search(" " + t) or SOURCE_DOC.search(t) for t in links)
        or any(SOURCE_PATH.search(" " + s) or SOURCE_COMMAND.match(s + " ") or SOURCE_DOC.search(s) for s in spans)
        or any(re.split(r"[\s:]", s)[0] in SOURCE_FILES for s in spans)
        or says_not_measured(text)
    )


def stated_figures() -> Iterator[tuple[Unit, list[str], str]]:
    """(unit, its figures, its page's "Generated by" paragraph or '') for every unit of the docs that states a figure
    (NOT_FIGURES left out). A page generated by a measuring script names it once, in its first paragraph, for all
    of it."""
    for path in DOCS:
        page = units(path)
        generated = page[0].text if page and page[0].text.startswith("Generated by") else ""
        for unit in page:
            text = unit.text
            for doc, phrase in NOT_FIGURES:
                text = text.replace(phrase, " ") if doc == path.name else text
            if found := figures(text):
                yield unit, found, generated


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
    for unit, found, generated in stated_figures():
        checked += 1
        if not names_source(f"{unit.text}\n{unit.context}\n{generated}"):
            unsourced.append(f"{unit.id}: {', '.join(found)}: {unit.text[:100]!r}")
    assert checked > 10, f"only {checked} units with a figure found: is the parser broken?"
    assert not unsourced, f"{len(unsourced)} doc units state a figure without its source:\n" + "\n".join(unsourced)


# --- Figures against their saved results ---------------------------------------------------------------------------

# A figure's unit, and what a saved file may hold instead of it (the same quantity in another unit: a sum of seconds
# shown in minutes, a byte count shown in GiB, a fraction shown as a percentage).
_SCALES: dict[str, tuple[float, ...]] = {
    "%": (1.0, 100.0),
    "ms": (1.0, 1e3),
    "µs": (1.0, 1e6),
    "us": (1.0, 1e6),
    "s": (1.0, 1e-3),
    "min": (1.0, 1 / 60),
    "h": (1.0, 1 / 3600),
    "KiB": (1.0, 2**-10),
    "MiB": (1.0, 2**-20),
    "GiB": (1.0, 2**-30),
    "TiB": (1.0, 2**-40),
    "kB": (1.0, 1e-3),
    "KB": (1.0, 1e-3),
    "MB": (1.0, 1e-6),
    "GB": (1.0, 1e-9),
    "TB": (1.0, 1e-12),
}
_FIGURE_VALUE = re.compile(r"(\d+(?:,\d{3})*(?:\.(\d+))?)(?:e(-?\d+))?\s?(%|[µu]s|ms|min|h|s|[KMGT]i?B|kB)?")
_FILE_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def figure_value(figure: str) -> tuple[float, float, str]:
    """A figure's value, half a unit of its last digit (what rounding it may hide), and its unit ('' if none)."""
    m = _FIGURE_VALUE.search(figure.replace("×", "x"))
    assert m, figure
    digits, decimals, exponent, unit = m.group(1).replace(",", ""), m.group(2) or "", m.group(3), m.group(4) or ""
    scale = 10.0 ** int(exponent) if exponent else 1.0
    return float(digits) * scale, 0.5 * 10.0 ** -len(decimals) * scale, unit


def numbers_in(files: list[Path]) -> list[float]:
    found: list[float] = []
    for file in files:
        found += [float(n) for n in _FILE_NUMBER.findall(file.read_text(errors="replace"))]
    return found


def in_numbers(figure: str, numbers: list[float]) -> bool:
    """Whether a figure is one of the numbers, as shown: rounded to its digits, in its unit or the file's."""
    value, half, unit = figure_value(figure)
    return any(abs(n * scale - value) <= half * (1 + 1e-9) for scale in _SCALES.get(unit, (1.0,)) for n in numbers)


def cited_files(text: str, page: Path) -> list[Path]:
    """The repository files a text cites: relative links, paths in code spans, and the scripts its commands run."""
    found: list[Path] = []
    links, spans = links_and_spans(text)
    for target in links:
        file = (page.parent / target.partition("#")[0]).resolve()
        found += [file] if file.is_file() else []
    for span in spans:
        for word in re.split(r"[\s:]", span):
            file = REPO / word
            found += [file] if word and file.is_file() else []
    return found


def test_every_figure_is_in_its_saved_result() -> None:
    """A measured figure is in the file its paragraph cites: a saved run (benchmarks/results/..., the support
    matrix's docs/model-support.json, a saved test log) or, for a bound a test asserts, that test. Checked for every
    unit ``test_every_figure_names_its_source`` checks, except those that say the figure is no measurement
    ("untested", "not measured", "example"): each figure, rounded as shown, must equal a number of a cited file, in
    its unit or in the file's (seconds shown as minutes, bytes as GiB, a fraction as a percentage)."""
    checked, missing = 0, []
    for unit, found, generated in stated_figures():
        if says_not_measured(unit.text):
            continue
        checked += 1
        files = cited_files(f"{unit.text}\n{unit.context}\n{generated}", unit.path)
        numbers = numbers_in(sorted(set(files)))
        absent = [f for f in found if not in_numbers(f, numbers)]
        if absent:
            names = sorted({str(f.relative_to(REPO)) for f in files}) or ["no file"]
            missing.append(f"{unit.id}: {', '.join(absent)} not in {', '.join(names)}: {unit.text[:90]!r}")
    assert checked > 10, f"only {checked} units with a figure found: is the parser broken?"
    assert not missing, f"{len(missing)} doc units state a figure their cited files do not hold:\n" + "\n".join(missing)


def test_the_support_matrix_says_how_old_it_is() -> None:
    """docs/model-support.md is measured on older commits (a full matrix is hours of CPU; it is not regenerated per
    commit), so it says so first: its "How old this is" paragraph names every commit its cells ran on, with the
    count of cells on uncommitted code, exactly as ``docs/model-support.json`` records them, and every commit is
    in this history. The pages that link it say that it was measured on earlier commits."""
    import json
    import subprocess

    cells = [c for row in json.loads((REPO / "docs" / "model-support.json").read_text()).values() for c in row.values()]
    commits = {c["commit"] for c in cells if "commit" in c}
    page = (REPO / "docs" / "model-support.md").read_text()
    head = next((u.text for u in units(REPO / "docs" / "model-support.md") if u.text.startswith("**How old")), "")
    assert head and page.index(head[:40]) < page.index("| model |"), "the page must say how old it is before its table"
    named = set(re.findall(r"`([0-9a-f]{7,}(?:\+changes)?)`", head))
    assert named == commits, f"the page names {sorted(named)}, its cells ran on {sorted(commits)}: re-render it"
    dirty = sum(1 for c in cells if c.get("commit", "").endswith("+changes"))
    assert not dirty or f"{dirty} cells ran with uncommitted changes" in head, head
    git = (REPO / ".git").exists()
    for commit in sorted(commits) if git else []:
        sha = commit.removesuffix("+changes")
        assert subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=REPO, check=False).returncode == 0, (
            sha
        )
    if git:
        newest = max(commits, key=lambda c: subprocess.run(
            ["git", "log", "-1", "--format=%ct", c.removesuffix("+changes")], cwd=REPO, capture_output=True, text=True,
            check=False).stdout.strip())  # fmt: skip
        since = subprocess.run(
            ["git", "rev-list", "--count", f"{newest.removesuffix('+changes')}..HEAD", "--", "lightning_sgdtp"],
            cwd=REPO, capture_output=True, text=True, check=False,
        ).stdout.strip()  # fmt: skip
        print(f"\nthe support matrix's newest cells ran on {newest}; {since} commits changed lightning_sgdtp/ since")
    for path in (REPO / "README.md", REPO / "docs" / "index.md"):
        for unit in units(path):
            if "model-support.md" in unit.text:
                assert "commit" in unit.text, (
                    f"{unit.id} links the support matrix without saying it is of older commits"
                )
