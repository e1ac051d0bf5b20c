"""The support matrix: every zoo model (tests/helpers/zoo.py) in every mode, compared with single-process training,
written to ``docs/model-support.md`` from the run. Nothing in the page is typed by hand.

    python tools/model_support.py --resume             # the whole matrix (about 3.5 hours on 2 CPU cores), continued
                                                       # from docs/model-support.json (the cells measured so far)
    python tools/model_support.py --models llama gpt2 --modes data pipeline-1f1b --out /tmp/page.md
    python tools/model_support.py --resume --again --models t5 --modes "pipeline 1f1b"   # measure a cell again
    python tools/model_support.py --resume --jobs 2    # two cells at a time (a data-parallel cell leaves a core idle
                                                       # while one rank compiles for both)

Each cell runs ``tests/distributed/jobs/zoo.py`` (the job the zoo tests run): the launching process trains the
reference on one device with Lightning's shuffled order, then the sgdtp ranks train the same model on the same
global batches; the cell compares the parameter updates (``rel`` = ||delta_sgdtp - delta_ref|| / ||delta_ref||, the
whole state dict, buffers included) and the first step's gradients. A cell is:

- **works**: the job ran and ``rel`` is within the mode's tolerance (fp32 1e-3, bf16 0.15), with SGD (Adam-type
  optimizers turn noise-level gradient differences into lr-sized steps);
- **refused**: the strategy stopped at setup or at the first step with its own error that names the module and the
  reason (``SGDTPConfigError``, ``PipelineContractError``, ``TensorPlanError``, ``NotAvailableYetError``);
- **FAILS** / **WRONG**: anything else (a crash deep inside torch, or a result off the reference). The page lists
  them; each is a bug to fix or to turn into a refusal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers.launch import finish, job_env, rel_update_diff, start
from helpers.zoo import ZOO

REFUSALS = ("SGDTPConfigError", "PipelineContractError", "TensorPlanError", "NotAvailableYetError")


@dataclass(frozen=True)
class Mode:
    """A column: devices, data-parallel size (the reference's global batch), options, Trainer options."""

    devices: int
    dp: int
    sgdtp: dict[str, Any]
    trainer: dict[str, Any] = field(default_factory=dict)
    layers: int = 2
    batch: int = 4

    @property
    def tolerance(self) -> float:
        return 0.15 if self.trainer.get("precision") == "bf16-mixed" else 1e-3


PP = {"pipeline_stages": 2, "pipeline_chunks": 4}
MODES: dict[str, Mode] = {  # in the order they run
    "data": Mode(2, 2, {}),
    "tensor": Mode(2, 1, {"parallelism": "tensor"}),
    "pipeline 1f1b": Mode(2, 1, {**PP, "pipeline_schedule": "1f1b"}, batch=8),
    "hybrid (dp 2 x tp 2)": Mode(4, 2, {"parallelism": "hybrid", "tensor_parallel_size": 2}),
    "pipeline x data (2 x 2)": Mode(4, 2, {"pipeline_stages": 2, "pipeline_chunks": 2}),
    "pipeline interleaved": Mode(2, 1, {**PP, "pipeline_schedule": "interleaved_1f1b"}, layers=4, batch=8),
    "pipeline gpipe": Mode(2, 1, {**PP, "pipeline_schedule": "gpipe"}, batch=8),
    "data + activation checkpointing": Mode(2, 2, {"activation_checkpointing": True}),
    "data + bf16-mixed": Mode(2, 2, {}, {"precision": "bf16-mixed"}),
    "data + accumulate 2": Mode(2, 2, {}, {"accumulate_grad_batches": 2}),
    "sharding full": Mode(2, 2, {"sharding": "full"}),
    "sharding optimizer": Mode(2, 2, {"sharding": "optimizer"}),
    "hybrid + full": Mode(4, 2, {"parallelism": "hybrid", "tensor_parallel_size": 2, "sharding": "full"}),
    "pipeline + full (2 x 2)": Mode(4, 2, {"pipeline_stages": 2, "pipeline_chunks": 2, "sharding": "full"}),
    # 4-rank layouts of large jobs (issue 55): 4 stages (one per rank), tp 4 (fewer key/value heads than tp where the
    # model has 2 or 1), pp 2 x tp 2
    "pipeline 4 stages": Mode(4, 1, {"pipeline_stages": 4, "pipeline_chunks": 4}, layers=4, batch=8),
    "tensor 4": Mode(4, 1, {"parallelism": "tensor"}),
    "pp 2 x tp 2": Mode(4, 1, {"pipeline_stages": 2, "pipeline_chunks": 4, "parallelism": "tensor"}, batch=8),
}
#: The modes that are for dividing the model: their cells also show the most any rank holds of the parameter bytes
#: (counted from every rank's tensors after fit).
DIVIDING = {"tensor", "pipeline 1f1b", "pipeline interleaved", "pipeline gpipe", "sharding full", "sharding optimizer",
            "hybrid + full", "pipeline + full (2 x 2)", "hybrid (dp 2 x tp 2)", "pipeline x data (2 x 2)",
            "pipeline 4 stages", "tensor 4", "pp 2 x tp 2"}  # fmt: skip


def run_cell(model: str, mode: Mode, out: Path, timeout: float) -> dict[str, Any]:
    scenario = {
        "model": model, "devices": mode.devices, "dp": mode.dp, "sgdtp": mode.sgdtp, "trainer": mode.trainer,
        "layers": mode.layers, "batch": mode.batch, "steps": 4, "optimizer": "sgd", "lr": 0.1,
    }  # fmt: skip
    if ZOO[model].batch_norm and mode.dp > 1 and "pipeline_stages" not in mode.sgdtp:
        # BatchNorm's batch statistics are per data-parallel replica (as with DDP): the reference is DDP on the same
        # ranks, which exists where every rank is a replica.
        if mode.dp != mode.devices:
            return {"status": "not compared", "seconds": 0.0, "error": "BatchNorm statistics per replica; no DDP"
                    " reference with tensor parallel inside the replicas"}  # fmt: skip
        scenario["reference"] = "ddp"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scenario.json").write_text(json.dumps(scenario))
    started = time.perf_counter()
    # its own session, killed whole on timeout, every process reaped (the tests' launcher)
    proc = start([sys.executable, str(REPO / "tests/distributed/jobs/zoo.py"), str(out)], env=job_env())
    output, _, timed_out = finish(proc, timeout)
    code = proc.returncode if not timed_out else -1
    if timed_out:
        output += f"\nTIMEOUT after {timeout:.0f} s"
    seconds = time.perf_counter() - started
    (out / "output.txt").write_text(output)
    if code == 0 and (out / "sgdtp.pt").exists():
        return {"status": "works", "seconds": seconds, **_compare(out, mode)}
    error = _error_line(str(output))
    refused = any(error.startswith(f"{name}:") for name in REFUSALS)
    return {"status": "refused" if refused else "FAILS", "seconds": seconds, "error": error}


def _compare(out: Path, mode: Mode) -> dict[str, Any]:
    import torch

    init, ref, got = (torch.load(out / f"{n}.pt") for n in ("init", "ref", "sgdtp"))
    ref_grads, grads = torch.load(out / "ref_grads.pt"), torch.load(out / "grads.pt")
    rel = rel_update_diff(init, ref, got)
    common = [k for k in ref_grads if k in grads]
    num = sum(float((ref_grads[k].float() - grads[k].float()).norm() ** 2) for k in common) ** 0.5
    den = sum(float(ref_grads[k].float().norm() ** 2) for k in common) ** 0.5 or 1.0
    plan = json.loads((out / "info.json").read_text())["plan"]
    info = json.loads((out / "info.json").read_text())
    result = {"rel": rel, "grad_rel": num / den, "grads_compared": len(common), "grads_expected": len(ref_grads)}
    if info.get("held"):
        result["held"] = max(h["parameters"] for h in info["held"]) / max(info["whole_parameter_bytes"], 1)
    if plan.get("tensor"):
        result["split_fraction"] = plan["tensor"]["split_fraction"]
    if rel > mode.tolerance or len(common) != len(ref_grads):
        result["status"] = "WRONG"
    result["graph_breaks"] = len(plan.get("graph_breaks", []) or [])
    return result


def _error_line(output: str) -> str:
    """The strategy's own refusal, wherever a rank printed it (a peer may quote it); else the last exception line
    of the output (``Type: message``), without the ``[rankN]:`` prefixes."""
    refusal = re.search(rf"({'|'.join(REFUSALS)}): .*", output)
    if refusal:  # (a peer quoting it adds its own words after a closing parenthesis)
        return refusal.group(0).split(") and this rank")[0].strip()[:400]
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in output.splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", line) or "TIMEOUT" in line]
    return (errors[-1] if errors else (lines[-1] if lines else "no output")).strip()[:400]


def _commit() -> str:
    """The code a cell ran: the checkout's commit, with ``+changes`` when files differ from it."""
    import subprocess

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    changed = git("status", "--porcelain", "-uno", "--", "lightning_sgdtp", "tests", "tools")  # not the results
    return git("rev-parse", "--short", "HEAD") + ("+changes" if changed else "")


def _versions() -> dict[str, str]:
    import lightning
    import torch
    import transformers

    return {
        "python": platform.python_version(), "torch": torch.__version__, "lightning": lightning.__version__,
        "transformers": transformers.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
    }  # fmt: skip


def cell_commits(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, int]:
    """The commits the cells ran on (``+changes``: with uncommitted code), and how many cells each; '' for a cell
    that recorded none."""
    counts: dict[str, int] = {}
    for row in results.values():
        for cell in row.values():
            counts[cell.get("commit", "")] = counts.get(cell.get("commit", ""), 0) + 1
    return counts


def age(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The page's first statement: which code the cells measured and how old it is. A full matrix is about seven
    hours of CPU, longer than a working session, so the page is not regenerated on every commit; it says instead
    what it measured (``tests/integration/test_docs.py`` checks that it names every commit of the cells)."""
    import subprocess

    counts = cell_commits(results)
    dated = []
    for commit in sorted(c for c in counts if c):
        sha = commit.removesuffix("+changes")
        when = subprocess.run(
            ["git", "log", "-1", "--format=%cI", sha], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip()
        dated.append((when, commit))
    dated.sort()
    named = ", ".join(f"`{c}` ({counts[c]} cells, {when[:10]})" for when, c in dated)
    dirty = sum(n for c, n in counts.items() if c.endswith("+changes"))
    unrecorded = counts.get("", 0)
    newest = dated[-1][1].removesuffix("+changes") if dated else "HEAD"
    return (
        f"**How old this is.** The cells ran on {len(dated)} commits: {named}"
        + (f"; {dirty} cells ran with uncommitted changes (`+changes`)" if dirty else "")
        + (f"; {unrecorded} cells, measured before commits were recorded, name none" if unrecorded else "")
        + f". The code has changed since: `git log --oneline {newest}..HEAD -- lightning_sgdtp` lists the commits this"
        " page has not measured. To measure a mode again: `python tools/model_support.py --resume --again --modes"
        " MODE`."
    )


def render(
    results: dict[str, dict[str, dict[str, Any]]], versions: dict[str, str], started: str, took: float, jobs: int = 1
) -> str:
    modes = [m for m in MODES if any(m in row for row in results.values())]
    lines = [
        "# Model support",
        "",
        "Generated by `python tools/model_support.py` from real runs (the cells: `docs/model-support.json`, the run:",
        "`docs/model-support.run.json`); do not edit by hand.",
        "",
        age(results),
        "",
        "Each cell trains an unchanged",
        "third-party model (`tests/helpers/zoo.py`, tiny configs, dropout off) inside the LightningModule users write",
        "(`self.log` of the loss, 4 steps of SGD lr 0.1, CPU, gloo) with `SGDTPStrategy` in that mode, and compares it",
        "with the same model trained in one process on the same global batches. SGD, not AdamW: Adam-type optimizers",
        "turn noise-level gradients (summation order) into lr-sized steps and hide the comparison.",
        "",
        f"Run: {started}, {took / 60:.0f} min of cells"
        + (f" (summed; up to {jobs} cells at a time)" if jobs > 1 else "")
        + ". "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + ".",
        "",
        "Cell: **ok** `rel` = relative difference of the parameter updates after 4 steps, whole state dict (buffers",
        "included), tolerance 1e-3 (fp32) / 0.15 (bf16-mixed); **refused** = the strategy's own error at setup (reason",
        "below); **FAILS** / **WRONG** = a crash / a result off the reference (a bug, listed below); n/c = not compared",
        "(BatchNorm in hybrid: no reference). BatchNorm models are compared with Lightning's DDP on the same ranks where",
        "every rank is a data-parallel replica (batch statistics per rank), with one process elsewhere.",
        "",
        "`holds` = the most any rank holds of the parameter bytes after fit (counted from every rank's tensors), in the",
        "modes that are for dividing the model; the last column: the share of the parameter bytes tensor parallel splits.",
        "",
        "| model | " + " | ".join(modes) + " | tensor split |",
        "| --- | " + " | ".join("---" for _ in modes) + " | --- |",
    ]
    notes: list[str] = []
    for model, row in sorted(results.items(), key=lambda item: list(ZOO).index(item[0])):
        cells = []
        for mode in modes:
            cell = row.get(mode)
            if cell is None:
                cells.append("")
            elif cell["status"] == "works":
                held = f", holds {cell['held']:.0%}" if mode in DIVIDING and "held" in cell else ""
                cells.append(f"ok {cell['rel']:.0e}{held}")
            elif cell["status"] == "not compared":
                cells.append("n/c")
            else:
                if cell["status"] == "not compared":
                    continue
                notes.append(f"- **{model} / {mode}** ({cell['status']}): `{cell.get('error', '')}`"
                             if cell["status"] != "WRONG" else
                             f"- **{model} / {mode}** (WRONG): rel {cell['rel']:.2e}, gradients compared"
                             f" {cell['grads_compared']}/{cell['grads_expected']}")  # fmt: skip
                cells.append(f"{cell['status']} [{len(notes)}]")
        split = row.get("tensor", {}).get("split_fraction")
        cells.append(f"{split:.0%}" if split is not None else "")
        lines.append(f"| {model}: {ZOO[model].family} | " + " | ".join(cells) + " |")
    missing = [m for m in MODES if m not in modes]
    blank = sum(1 for row in results.values() for m in modes if m not in row) + sum(
        1 for m in ZOO if m not in results
    ) * len(modes)
    if missing or blank:
        lines += [
            "",
            f"Not run in this run (it was cut short; `python tools/model_support.py --resume` continues it): {blank}"
            " blank cell(s) above" + (f", and the modes {', '.join(missing)}" if missing else "") + ".",
        ]
    commits = sorted({c["commit"] for row in results.values() for c in row.values() if "commit" in c})
    if commits:
        lines += ["", "Commits the cells ran on: " + ", ".join(f"`{c}`" for c in commits) + "."]
    lines += ["", "## What did not work, and why", ""] + (notes or ["Every cell worked."])
    lines += ["", "Seconds per cell (both trainings, compile included):", ""]
    for model, row in results.items():
        lines.append(f"- {model}: " + ", ".join(f"{m} {c['seconds']:.0f}" for m, c in row.items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(ZOO), choices=list(ZOO))
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "model-support.md")
    parser.add_argument("--work", type=Path, default=Path("/tmp/sgdtp-model-support"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    parser.add_argument(
        "--results", type=Path, default=REPO / "docs" / "model-support.json",
        help="the cells measured so far (kept in the repo: a full run takes longer than one sitting)",
    )  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="keep the cells RESULTS has already")
    parser.add_argument(
        "--again", action="store_true", help="with --resume: measure the selected cells again (code they ran changed)"
    )
    parser.add_argument(
        "--jobs", type=int, default=1,
        help="cells run at once (2 fills the core a data-parallel cell leaves idle while one rank compiles for both;"
        " each cell's seconds then include the other's load)",
    )  # fmt: skip
    parser.add_argument(
        "--render", action="store_true", help="run nothing: write the page from RESULTS (a run cut short)"
    )
    args = parser.parse_args()
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    saved = args.results
    if (
        not args.render
        and args.out.resolve() != REPO / "docs" / "model-support.md"
        and saved.resolve() == REPO / "docs" / "model-support.json"
    ):
        # A page written elsewhere (a subset, a check) keeps its cells beside it: the repo's matrix stays whole.
        saved = args.out.with_suffix(".json")
        print(f"cells go to {saved} (--out is not the repo's page; --results names another file)")
    args.work.mkdir(parents=True, exist_ok=True)
    jobs = max(1, args.jobs)
    if args.resume and saved.exists():
        results = json.loads(saved.read_text())
        if (saved.with_suffix(".run.json")).exists():  # the page says when the first of the resumed runs began
            earlier = json.loads(saved.with_suffix(".run.json").read_text())
            started, jobs = earlier["started"], max(jobs, earlier.get("jobs", 1))
    if args.render:  # the cells a run cut short left, with their own timing: only what was measured
        results = json.loads(saved.read_text())
        meta = json.loads(saved.with_suffix(".run.json").read_text())
        args.out.write_text(render(results, meta["versions"], meta["started"], meta["seconds"], meta.get("jobs", 1)))
        print(f"wrote {args.out}")
        return
    # column by column: a run cut short leaves whole columns
    todo = [
        (model, mode)
        for mode in args.modes
        for model in args.models
        if args.again or mode not in results.get(model, {})
    ]
    commit = _commit()

    def one(model: str, mode: str) -> tuple[str, str, dict[str, Any]]:
        slug = re.sub(r"[^a-z0-9]+", "-", f"{model}-{mode}".lower())
        return model, mode, {**run_cell(model, MODES[mode], args.work / slug, args.timeout), "commit": commit}

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # each cell is its own process tree
        for model, mode, cell in (f.result() for f in as_completed([pool.submit(one, *c) for c in todo])):
            results.setdefault(model, {})[mode] = cell
            print(
                f"{model:8s} {mode:32s} {cell['status']:8s} {cell.get('rel', cell.get('error', ''))!s:.160}", flush=True
            )
            saved.write_text(json.dumps(results, indent=1))
            seconds = sum(c["seconds"] for row in results.values() for c in row.values())
            meta = {"versions": _versions(), "started": started, "seconds": seconds, "jobs": jobs}
            saved.with_suffix(".run.json").write_text(json.dumps(meta))
    seconds = sum(c["seconds"] for row in results.values() for c in row.values())
    args.out.write_text(render(results, _versions(), started, seconds, jobs))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
