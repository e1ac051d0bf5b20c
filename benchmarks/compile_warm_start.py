"""Time to the first finished training step of the example GPT, cold vs warm, with ``compile_cache``.

    python benchmarks/compile_warm_start.py              # cold, warm, cold, warm (~4 min on 2 cores)
    python benchmarks/compile_warm_start.py --rounds 1

Each run is a new 2-rank job (``Trainer(accelerator="cpu", devices=2, strategy=SGDTPStrategy(compile_cache=C))``)
with its own, empty, Inductor cache folder (``TORCHINDUCTOR_CACHE_DIR``), as a job on a fresh node has:

- cold: ``C`` is an empty folder: rank 0 compiles while rank 1 waits, then rank 1 compiles from the node's cache;
  after the first step rank 0 writes the bundle to ``C``;
- warm: ``C`` holds the bundle of the previous cold run: every rank verifies it and loads it before compiling.

Rank 0 measures from ``on_fit_start`` (processes up, process group made) to the end of the first
``on_train_batch_end`` ("first step"), and from the start of its interpreter ("from launch"). The driver prints
a table and, LAST, one JSON line. Target: warm at most 25% of cold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
START = time.time()

from harness import QUIET_TRAINER


def job(args: argparse.Namespace) -> None:
    """One training job (Lightning re-runs this command line for rank 1)."""
    sys.path.insert(0, str(REPO / "examples"))
    import lightning.pytorch as L
    import torch
    from data import PydocDataModule
    from gpt import GPTLightningModule

    from lightning_sgdtp import SGDTPStrategy

    torch.set_num_threads(1)

    class FirstStep(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.t0 = time.time()

        def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
            if trainer.global_step == 1 and trainer.is_global_zero:
                now = time.time()
                result = {"first_step_s": now - self.t0, "from_launch_s": now - START}
                if os.environ.get("SGDTP_BENCH_PROFILE"):
                    from torch._dynamo.utils import compile_times, counters

                    print(compile_times(repr="str", aggregate=True), flush=True)
                    print("inductor counters:", dict(counters["inductor"]), flush=True)
                Path(args.out).write_text(json.dumps(result))

    L.seed_everything(0, verbose=False)
    data = PydocDataModule(block_size=128, batch_size=16)
    model = GPTLightningModule(vocab_size=data.vocab_size, block_size=128, n_layer=4, n_head=4, n_embd=128)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SGDTPStrategy(compile_cache=args.cache),
        max_steps=2,
        **QUIET_TRAINER,
        callbacks=[FirstStep()],
        default_root_dir=args.root,
    )
    trainer.fit(model, datamodule=data)


def run(kind: str, cache: Path, work: Path) -> dict[str, float]:
    inductor = Path(tempfile.mkdtemp(prefix=f"inductor-{kind}-", dir=work))
    out = work / f"{kind}-{time.monotonic_ns()}.json"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(SCRIPT), "--job", "--cache", str(cache), "--out", str(out), "--root", str(work / kind)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{kind} run failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    shutil.rmtree(inductor, ignore_errors=True)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "compile cache:" in line]
    return {**json.loads(out.read_text()), "log": lines}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="cold/warm pairs, each with a new compile_cache folder")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        return job(args)
    work = Path(tempfile.mkdtemp(prefix="sgdtp-warm-start-"))
    results: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    try:
        for _ in range(args.rounds):
            cache = Path(tempfile.mkdtemp(prefix="cache-", dir=work))
            results["cold"].append(run("cold", cache, work))
            bundle_mib = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 2**20
            results["warm"].append(run("warm", cache, work))
            results["warm"][-1]["bundle_mib"] = bundle_mib
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {
        k: {m: statistics.median(r[m] for r in v) for m in ("first_step_s", "from_launch_s")}
        for k, v in results.items()
    }
    ratio = med["warm"]["first_step_s"] / med["cold"]["first_step_s"]
    ratio_launch = med["warm"]["from_launch_s"] / med["cold"]["from_launch_s"]
    print(f"{'run':6} {'first step (s)':>15} {'from launch (s)':>16}   compile cache")
    for kind, runs in results.items():
        for r in runs:
            print(f"{kind:6} {r['first_step_s']:15.1f} {r['from_launch_s']:16.1f}   {' | '.join(r['log'])[:150]}")
    print(
        f"median  cold {med['cold']['first_step_s']:.1f} s, warm {med['warm']['first_step_s']:.1f} s:"
        f" warm/cold = {ratio:.2f} (from launch {ratio_launch:.2f}); target <= 0.25"
    )
    summary = {
        "benchmark": "compile_warm_start",
        "median_first_step_s": med,
        "warm_over_cold": round(ratio, 3),
        "warm_over_cold_from_launch": round(ratio_launch, 3),
        "target": 0.25,
        "target_met": ratio <= 0.25,
        "bundle_mib": round(results["warm"][0]["bundle_mib"], 1),
        "runs": {
            k: [{m: round(r[m], 2) for m in ("first_step_s", "from_launch_s")} for r in v] for k, v in results.items()
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
