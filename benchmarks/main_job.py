"""The README's main job end to end, sgdtp against Lightning's ``ddp``: cold and warm, and compile time by depth.

    python benchmarks/main_job.py                 # 2 rounds of ddp / sgdtp cold / sgdtp warm, alternated (~20 min)
    python benchmarks/main_job.py --rounds 1
    python benchmarks/main_job.py --depth         # time to the first finished step, example GPT at 4 and 16 layers
    python benchmarks/main_job.py --reread FILE   # print a saved result again, running nothing

Each run is the unchanged command a user types, ``python examples/train_gpt.py`` (360 steps, validation, the final
checkpoint and evaluation), timed from launch to exit by this driver:

- ``ddp``: ``--strategy ddp``;
- ``sgdtp cold``: a new, empty compile cache (``SGDTP_COMPILE_CACHE`` names a fresh folder, as a user's first run
  finds its cache folder empty), a fresh Inductor cache and a fresh temporary folder: nothing compiled before;
- ``sgdtp warm``: the second run, default settings: the compile cache the cold run of the same round wrote, a new
  Inductor cache and temporary folder (what a later job on the same machine has: only the compile cache is kept).

The order alternates between rounds (ddp first, then last) so that neither strategy always runs on a warmer
machine. Rank 0's ``sgdtp: compile:`` line gives each sgdtp run's compile seconds.

``--depth``: ``--max_steps 1 --limit_val_batches 1`` at ``--n_layer`` 4 and 16, cold, regional compile on (the
default) and off (``--no_regional_compile``); the figure is rank 0's first optimizer step (``sgdtp: compile:``).

The targets (issue 42): cold sgdtp / ddp <= 1.0, warm <= 0.95; 16 layers <= 1.3x the time of 4. Results go to
``benchmarks/results/main_job_DATE.json`` (``--out``), printed as a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import REPO, cpu_busy, git_commit, run_reaped, worker_env

COMPILE = re.compile(r"sgdtp: compile: ([\d.]+) s of the first optimizer step's ([\d.]+) s")
FINAL = re.compile(r"final val_loss ([\d.]+)\s+val_ppl ([\d.]+)")


def run(kind: str, work: Path, name: str, extra: list[str], cache: Path | None) -> dict[str, Any]:
    """One run of the main job; ``kind`` ``ddp`` or ``sgdtp``; ``cache``: the compile cache folder (sgdtp)."""
    folder = work / name
    (folder / "tmp").mkdir(parents=True, exist_ok=True)
    env = worker_env(TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"), TMPDIR=str(folder / "tmp"))
    if cache is not None:
        env["SGDTP_COMPILE_CACHE"] = str(cache)
    cmd = [sys.executable, str(REPO / "examples" / "train_gpt.py"), "--strategy", kind]
    cmd += ["--default_root_dir", str(folder / "runs"), *extra]
    busy = cpu_busy(0.5)
    start = time.perf_counter()
    rc = run_reaped(cmd, REPO, env, folder / "log.txt", timeout=3600)
    wall = time.perf_counter() - start
    log = (folder / "log.txt").read_text(errors="replace")
    if rc != 0:
        raise SystemExit(f"{name} failed (rc={rc}); log: {folder / 'log.txt'}\n{log[-3000:]}")
    compiled = COMPILE.search(log)
    final = FINAL.search(log)
    return {
        "run": name,
        "strategy": kind,
        "wall_s": round(wall, 1),
        "compile_s": float(compiled.group(1)) if compiled else None,
        "first_step_s": float(compiled.group(2)) if compiled else None,
        "val_ppl": float(final.group(2)) if final else None,
        "cpu_busy_before": round(busy, 3),
        "log_lines": [line for line in log.splitlines() if line.startswith("sgdtp: ")][:40],
    }


def main_job(rounds: int, work: Path) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        cache = work / f"compile-cache-{r}"
        plan = [("ddp", None), ("cold", cache), ("warm", cache)]
        if r % 2:
            plan = plan[1:] + plan[:1]
        for what, folder in plan:
            kind = "ddp" if what == "ddp" else "sgdtp"
            result = run(kind, work, f"r{r}-{what}", [], folder)
            result["round"], result["what"] = r, what
            runs.append(result)
            print(f"round {r} {what:5s} {result['wall_s']:7.1f} s  compile {result['compile_s']} s", flush=True)
    wall = {w: statistics.median(x["wall_s"] for x in runs if x["what"] == w) for w in ("ddp", "cold", "warm")}
    per_round = [
        {w: next(x["wall_s"] for x in runs if x["round"] == r and x["what"] == w) for w in ("ddp", "cold", "warm")}
        for r in range(rounds)
    ]
    return {
        "mode": "main_job",
        "runs": runs,
        "median_wall_s": wall,
        "cold_over_ddp": round(wall["cold"] / wall["ddp"], 3),
        "warm_over_ddp": round(wall["warm"] / wall["ddp"], 3),
        "per_round_ratios": [
            {"cold": round(p["cold"] / p["ddp"], 3), "warm": round(p["warm"] / p["ddp"], 3)} for p in per_round
        ],
        "targets": {"cold_over_ddp": 1.0, "warm_over_ddp": 0.95},
    }


def depth(work: Path) -> dict[str, Any]:
    runs = []
    for regional in (True, False):
        for layers in (4, 16):
            extra = ["--n_layer", str(layers), "--max_steps", "1", "--limit_val_batches", "1"]
            extra += [] if regional else ["--no_regional_compile"]
            name = f"depth-{layers}-{'regional' if regional else 'whole'}"
            result = run("sgdtp", work, name, extra, work / f"cache-{name}")
            result |= {"layers": layers, "regional": regional}
            runs.append(result)
            print(f"{name:22s} first step {result['first_step_s']} s (compile {result['compile_s']} s)", flush=True)

    def first(layers: int, regional: bool) -> float:
        return next(x["first_step_s"] for x in runs if x["layers"] == layers and x["regional"] == regional)

    return {
        "mode": "depth",
        "runs": runs,
        "regional_16_over_4": round(first(16, True) / first(4, True), 3),
        "whole_16_over_4": round(first(16, False) / first(4, False), 3),
        "regional_over_whole_at_16": round(first(16, True) / first(16, False), 3),
        "target": {"regional_16_over_4": 1.3},
    }


def report(result: dict[str, Any]) -> None:
    if result["mode"] == "main_job":
        print("\nrun        wall s   compile s  first step s  val ppl")
        for x in result["runs"]:
            print(
                f"r{x['round']} {x['what']:6s} {x['wall_s']:8.1f} {x['compile_s'] or '-':>11} "
                f"{x['first_step_s'] or '-':>13} {x['val_ppl']}"
            )
        print(
            f"median wall: ddp {result['median_wall_s']['ddp']} s, sgdtp cold {result['median_wall_s']['cold']} s"
            f" ({result['cold_over_ddp']}x ddp; target <= 1.0), warm {result['median_wall_s']['warm']} s"
            f" ({result['warm_over_ddp']}x; target <= 0.95); per round {result['per_round_ratios']}"
        )
    else:
        print("\nrun                     first step s  compile s")
        for x in result["runs"]:
            print(f"{x['run']:22s} {x['first_step_s']:>13} {x['compile_s']:>10}")
        print(
            f"16 / 4 layers: regional {result['regional_16_over_4']}x (target <= 1.3), whole graph"
            f" {result['whole_16_over_4']}x; regional / whole at 16 layers {result['regional_over_whole_at_16']}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--depth", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--reread", type=Path, default=None)
    args = parser.parse_args()
    if args.reread is not None:
        result = json.loads(args.reread.read_text())
        report(result)
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
        return
    with tempfile.TemporaryDirectory(prefix="sgdtp-main-job-") as tmp:
        result = depth(Path(tmp)) if args.depth else main_job(args.rounds, Path(tmp))
    result |= {"commit": git_commit(), "date": time.strftime("%Y-%m-%d")}
    name = f"main_job{'_depth' if args.depth else ''}_{result['date']}.json"
    out = args.out or REPO / "benchmarks" / "results" / name
    out.write_text(json.dumps(result, indent=1))
    report(result)
    print(f"saved {out}")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))


if __name__ == "__main__":
    main()
