"""The planner's predictions against measured steps: several layouts of one model on 4 CPU ranks (gloo), alternated.

    python benchmarks/planner_check.py                 # 8 layouts x 2 rounds (~30 min on 2 cores)
    python benchmarks/planner_check.py --quick         # 1 round, fewer steps (~15 min on 2 cores)
    python benchmarks/planner_check.py --layouts dp4,dp2xtp2,dp2xpp2 --rounds 1 --out /tmp/planner.json

The model is ``examples/gpt.py``'s ``GPTLightningModule`` (the module users write: ``self.log`` of the loss and a
torchmetrics perplexity every step, AdamW), 4 layers x 128, 4 heads, sequence 128, vocabulary 256, random tokens.
Layouts are compared at a FIXED GLOBAL BATCH (``--global-batch``, 16 sequences): each data-parallel replica's
DataLoader loads ``global / dp`` sequences (tensor and pipeline ranks of a replica share them), so every layout
trains the same samples per step, and the planner is called with the same ``global_batch``. Time per sample is
step time / global batch (the planner's ``StepTime.seconds_per_sample``).

Each (layout, round) is one subprocess (``--worker``), ``Trainer(accelerator="cpu", devices=4, strategy=
SGDTPStrategy(**options))`` with the options ``planner.auto.configure`` makes of the layout (what
``parallelism="auto"`` would build), started in its own session with a hard timeout (``harness.run_reaped``: every
rank and compile worker is killed when it ends); Lightning's launcher re-runs the same command line for ranks 1-3.
The rounds run the layouts in the same order (A B C ... A B C ...), so drift of the machine's load hits all alike.
In every job:

- at ``on_train_start`` all ranks measure the ``CostModel`` (``compiler/bucket_cost.measure``: all-reduce latency
  and bandwidth, matmul flop/s, memory bytes/s; the slowest rank's), the figures ``parallelism="auto"`` plans with;
- rank 0 times every batch (``on_train_batch_start`` -> ``on_train_batch_end``, ``time.perf_counter``, no
  barrier); the first ``--warmup`` (compilation) are dropped, the job's figure is the median of the rest;
- after the last step every rank counts the bytes of parameters, gradients and optimizer state it holds, from the
  tensors (``parallel.sharding.held_bytes``: a DTensor's local shard, a released pipeline parameter as nothing,
  shared storage once), gathered to rank 0;
- one more, untimed step runs under ``torch.profiler`` on rank 0: its ``gloo:*`` calls by kind (how many
  collectives the layout really issues per step, against the few the planner's formulas count);
- rank 0 asks the planner for this layout (``plan(..., fixed=<the layout>, global_batch=...)``) with the CostModel
  of this job.

The driver prints one row per layout: predicted and measured ms per sample, predicted and measured bytes of model
state (parameters + gradients + optimizer state) on the fullest rank and their ratio; then the criteria of
issue 26 (Spearman rank correlation of the times >= 0.8; memory within 15 %; the planner's choice, its best over the
same layouts, within 10 % of the fastest measured layout), PASS or FAIL each. The time criteria use one CostModel for
every layout, the median of the jobs' measurements (``parallelism="auto"`` plans every layout from the one
measurement it makes at setup; each job's own figures, printed too, move with the machine's load).
It exits 0 either way (a benchmark: figures, not assertions); the last line is one JSON object with every figure
(also written to ``--out``). A layout that fails to run is left out with its error printed (``LEFT OUT``); on
SIGTERM (``timeout``) the running worker is killed and the layouts that finished are reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import QUIET_TRAINER, cpu_busy, fmt, git_commit, median_ms, run_reaped, version, worker_env

DEVICES = 4
SEED = 1234
QUIET = 0.10  # other processes using more than this fraction of the CPUs: the machine is busy
#: The example GPT's shape (train_gpt.py's defaults): a step of tens to hundreds of ms per layout on 2 cores.
MODEL = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128, "lr": 2e-3}
#: layout name -> (dp, tp, pp, sharding, micro-batches per step): each one a row of the planner's own table.
LAYOUTS: dict[str, tuple[int, int, int, str, int]] = {
    "dp4": (4, 1, 1, "none", 1),
    "dp4-full": (4, 1, 1, "full", 1),
    "dp4-optimizer": (4, 1, 1, "optimizer", 1),
    "dp2xtp2": (2, 2, 1, "none", 1),
    "dp2xpp2": (2, 1, 2, "none", 4),
    "dp2xpp2-full": (2, 1, 2, "full", 4),
    "tp4": (1, 4, 1, "none", 1),
    "pp4": (1, 1, 4, "none", 8),
    "pp2xtp2": (1, 2, 2, "none", 4),
    # not in the default set (--layouts): tensor parallel with sharding
    "dp2xtp2-full": (2, 2, 1, "full", 1),
}
DEFAULT_LAYOUTS = "dp4,dp4-full,dp4-optimizer,dp2xtp2,dp2xpp2,dp2xpp2-full,tp4,pp4,pp2xtp2"
TARGET = {"spearman_min": 0.8, "memory_error_max": 0.15, "choice_gap_max": 0.10}


# ------------------------------------------------------------------------------------------------ the planner side
def layout_of(name: str) -> tuple[Any, Any]:
    """The planner's ``Layout`` and ``Schedule`` of a layout name (no checkpointing, no hybrid sharding)."""
    from lightning_sgdtp.planner.cost import Schedule
    from lightning_sgdtp.planner.memory import Layout

    dp, tp, pp, sharding, chunks = LAYOUTS[name]
    return Layout(dp=dp, tp=tp, pp=pp, sharding=sharding), Schedule(micro_batches=chunks)


def strategy_options(name: str) -> dict[str, Any]:
    """The SGDTPStrategy options the planner's ``configure`` makes of the layout (what ``parallelism="auto"``
    would build had it chosen it); the ones left at their defaults dropped."""
    from lightning_sgdtp.config import SGDTPConfig
    from lightning_sgdtp.planner.auto import configure
    from lightning_sgdtp.planner.search import Candidate

    layout, schedule = layout_of(name)
    config = configure(SGDTPConfig(), Candidate(layout, schedule))
    defaults = SGDTPConfig()
    keys = ("parallelism", "tensor_parallel_size", "sharding", "shard_size", "activation_checkpointing")
    keys += ("pipeline_stages", "pipeline_chunks")
    return {k: getattr(config, k) for k in keys if getattr(config, k) != getattr(defaults, k)}


def build_module() -> Any:
    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPTLightningModule

    return GPTLightningModule(**MODEL)


def planner_table(cost: dict[str, float], global_batch: int, fixed: dict[str, Any] | None = None) -> Any:
    """The planner's ``Plan`` for the example GPT on 4 ranks of one node, with this CostModel (as ``_plan_layout``
    builds it on CPU: ``measured_hardware``, no memory limit, fp32 activations)."""
    from lightning_sgdtp.compiler.bucket_cost import CostModel
    from lightning_sgdtp.planner.cost import measured_hardware, profile
    from lightning_sgdtp.planner.search import plan

    module = build_module()
    hardware = measured_hardware(CostModel(**cost), None, devices="cpu")
    model = profile(module, tokens=MODEL["block_size"], batch=global_batch // DEVICES, activation_bytes=4)
    return plan(module, model, hardware, DEVICES, DEVICES, fixed=fixed, global_batch=global_batch)


def row_of(result: Any, name: str) -> Any:
    """The planner's candidate for this layout (its layout and schedule exactly), or None."""
    layout, schedule = layout_of(name)
    for c in result.candidates:
        if c.layout == layout and c.schedule == schedule and c.time is not None:
            return c
    return None


def prediction(c: Any) -> dict[str, Any]:
    """What the planner predicts for one candidate: step time by part, per sample, memory by part."""
    assert c.time is not None and c.memory is not None
    mem = c.memory.to_dict()
    return {
        "layout": c.describe(),
        "step_s": c.time.to_dict(),
        "seconds_per_sample": c.time.seconds_per_sample,
        "memory": mem,
        "model_state_bytes": mem["parameters"] + mem["gradients"] + mem["optimizer"],
        "built": c.built,
        "skipped": c.skipped,
    }


def predict(name: str, cost: dict[str, float], global_batch: int) -> dict[str, Any]:
    """The planner's prediction for layout ``name``: ``plan`` with every field of the layout fixed."""
    layout, schedule = layout_of(name)
    fixed = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "sharding": layout.sharding}
    fixed |= {"checkpointing": schedule.checkpointing, "micro_batches": schedule.micro_batches}
    c = row_of(planner_table(cost, global_batch, fixed), name)
    if c is None:
        raise RuntimeError(f"the planner has no row for {name} ({layout.describe()}) with global batch {global_batch}")
    return prediction(c)


# ------------------------------------------------------------------------------------------------ worker
def _worker(args: argparse.Namespace) -> None:
    """One layout: fit ``--warmup + --steps`` batches on these 4 processes; rank 0 writes ``--result``."""
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sgdtp import SGDTPStrategy
    from lightning_sgdtp.compiler.bucket_cost import measure
    from lightning_sgdtp.parallel.sharding import held_bytes

    torch.set_num_threads(1)
    name = args.worker
    layout, _ = layout_of(name)
    total = args.warmup + args.steps
    if args.global_batch % layout.dp:
        raise SystemExit(f"--global-batch {args.global_batch} does not divide over dp={layout.dp}")

    class Meter(Callback):
        """The CostModel (all ranks, once), rank 0's batch times, every rank's held bytes after the last step."""

        def __init__(self) -> None:
            self.batch: list[float] = []
            self.period: list[float] = []
            self.cost: dict[str, float] = {}
            self.held: dict[str, int] = {}
            self.gathered: list[Any] = []
            self.collectives: dict[str, int] = {}  # gloo collectives of one step on rank 0, by kind
            self._t0: float | None = None
            self._start: float | None = None
            self._prof: Any = None

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.cost = asdict(measure(None, torch.device("cpu")))  # a collective: every rank, same place

        def on_train_batch_start(self, trainer: L.Trainer, *a: Any) -> None:
            if len(self.batch) == total and trainer.global_rank == 0:  # the extra step: its collectives, untimed
                self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self._prof.__enter__()
            now = time.perf_counter()
            if self._start is not None:
                self.period.append(now - self._start)
            self._start = self._t0 = now

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *a: Any) -> None:
            assert self._t0 is not None
            self.batch.append(time.perf_counter() - self._t0)
            if len(self.batch) == total:  # after the last optimizer step: what the rank holds while training
                self.held = held_bytes(pl_module, list(trainer.optimizers))
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
                self.collectives = dict(Counter(e.name for e in self._prof.events() if e.name.startswith("gloo:")))
                self._prof = None

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            import resource

            mine = {"held": self.held, "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
            self.gathered = [None] * dist.get_world_size()
            dist.all_gather_object(self.gathered, mine)

    L.seed_everything(SEED, verbose=False)
    module = build_module()
    g = torch.Generator().manual_seed(SEED)
    steps = total + 1  # + 1: the step whose collectives are counted (torch.profiler on rank 0)
    x = torch.randint(0, MODEL["vocab_size"], (args.global_batch * steps, MODEL["block_size"] + 1), generator=g)
    # Lightning's DistributedSampler splits the samples over the data-parallel replicas (the tensor and pipeline
    # ranks of one replica read the same ones): every layout trains on the same global batch per step.
    loader = DataLoader(
        TensorDataset(x[:, :-1], x[:, 1:]), batch_size=args.global_batch // layout.dp, shuffle=False, drop_last=True
    )
    options = strategy_options(name)
    meter = Meter()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        strategy=SGDTPStrategy(**options),
        max_steps=steps,
        callbacks=[meter],
        **QUIET_TRAINER,
        default_root_dir=str(args.result.parent / f"{args.result.stem}-root"),
    )
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    fit_s = time.perf_counter() - t0
    if trainer.global_rank != 0:
        return
    result: dict[str, Any] = {
        "layout": name,
        "options": options,
        "batch_s": meter.batch[args.warmup : total],
        "warmup_s": meter.batch[: args.warmup],
        "period_s": meter.period[args.warmup : total - 1],  # start to start: the periods of the timed steps
        "profiled_step_s": meter.batch[total],
        "collectives": meter.collectives,
        "fit_s": fit_s,
        "cost": meter.cost,
        "held": [r["held"] for r in meter.gathered],
        "rss_mib": [r["rss_mib"] for r in meter.gathered],
        "prediction": predict(name, meter.cost, args.global_batch),
        "built": _built(trainer.strategy.plan),
    }
    args.result.write_text(json.dumps(result, default=str))


def _built(plan: dict[str, Any]) -> dict[str, Any]:
    """What the strategy built, in a few numbers: its compiled graphs, gradient buckets and bytes per step, and
    the collectives each sharded graph holds before Inductor buckets them."""
    graphs = plan.get("graphs") or []
    sharding = plan.get("sharding") or {}
    return {
        "graphs": len(graphs),
        "buckets": sum(len(b) if isinstance(b := g.get("buckets", 0), list) else b for g in graphs),
        "grad_bytes_per_step": (plan.get("bytes_per_step") or {}).get("total"),
        "sharded_collectives_per_graph": [
            {k: v for k, v in g.items() if k.startswith("collectives")}
            for g in sharding.get("collectives_per_graph", [])
        ],
        "graph_breaks": sum((plan.get("graph_breaks") or {}).values()),
    }


# ------------------------------------------------------------------------------------------------ driver
def _run_worker(name: str, args: argparse.Namespace, tmp: Path, tag: str) -> dict[str, Any]:
    result, log = tmp / f"{tag}.json", tmp / f"{tag}.log"
    env = worker_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(SCRIPT), "--worker", name, "--result", str(result)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--global-batch", str(args.global_batch)]
    load_before = cpu_busy()  # before our ranks start: what else runs on this machine
    t0 = time.perf_counter()
    rc = run_reaped(cmd, REPO, env, log, args.timeout)
    if rc != 0 or not result.exists():
        why = f"timed out after {args.timeout:.0f}s" if rc is None else f"exit code {rc}"
        raise RuntimeError(f"worker {name} failed: {why}\n{log.read_text(errors='replace')[-6000:]}")
    out = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - t0
    out["load_before"] = load_before
    return out


class _Interrupted(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Interrupted  # unwinds run_reaped, whose `finally` kills the worker's whole session


def _first_error(err: Exception) -> str:
    """The last exception line of a failed worker's log (what went wrong), else the first line."""
    lines = str(err).splitlines()
    errors = [ln.strip() for ln in lines if "Error" in ln or "Exception" in ln]
    return errors[-1][:400] if errors else lines[0]


def _ranks(xs: list[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(xs)), key=xs.__getitem__)
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation: Pearson's correlation of the ranks (None below 3 points or without spread)."""
    if len(a) != len(b) or len(a) < 3:
        return None
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else None


def _mib(n: float | None) -> str:
    return fmt(None if n is None else n / 2**20, "7.2f")


def with_one_cost(rows: list[dict[str, Any]], gb: int) -> tuple[dict[str, float] | None, str | None, str | None]:
    """Predict every measured layout with one CostModel, as ``parallelism="auto"`` plans every layout from the one
    measurement it makes at setup: the median, field by field, of what the jobs measured (each job's own figures
    move with the machine's load as much as the layouts differ); also with the first job's. Adds both predictions to
    the rows; returns that CostModel, the planner's choice among the measured layouts and over every layout."""
    costs = [c for r in rows for c in r["cost_models"]]
    if not costs:
        return None, None, None
    one_cost = {k: statistics.median(c[k] for c in costs) for k in costs[0]}
    names = [r["layout"] for r in rows]
    table, first_table = planner_table(one_cost, gb), planner_table(costs[0], gb)
    for row in rows:
        row["predicted_ms_per_step_one_cost"] = round(1e3 * row_of(table, row["layout"]).time.total, 2)
        row["predicted_ms_per_step_first_cost"] = round(1e3 * row_of(first_table, row["layout"]).time.total, 2)
    same_set = [c for c in table.fitting if any(row_of(table, n) is c for n in names)]
    choice = next((n for n in names if same_set and row_of(table, n) is same_set[0]), None)
    return one_cost, choice, table.best.describe() if table.best else None


def reread(path: Path) -> int:
    """The time criteria of a saved run (``--out`` / the last line), judged again with this planner."""
    summary = json.loads(path.read_text().strip().splitlines()[-1])
    rows, gb = summary["results"], summary["config"]["global_batch"]
    one_cost, choice, unrestricted = with_one_cost(rows, gb)
    meas = [r["measured_ms_per_step"] for r in rows]
    for row in rows:
        print(
            f"{row['layout']:14s} predicted {row['predicted_ms_per_step_one_cost']:8.1f} ms/step (one CostModel),"
            f" {row['predicted_ms_per_step_first_cost']:8.1f} (the first job's); measured {row['measured_ms_per_step']:8.1f}"
        )
    fastest = min(rows, key=lambda r: r["measured_ms_per_step"])
    chosen = next(r for r in rows if r["layout"] == choice)
    gap = chosen["measured_ms_per_step"] / fastest["measured_ms_per_step"] - 1
    rho = spearman([r["predicted_ms_per_step_one_cost"] for r in rows], meas)
    print(
        f"{path.name} ({summary['config'].get('plugin_commit')}), re-read with this planner: Spearman"
        f" {fmt(rho, '.3f')} with one CostModel (target >= {TARGET['spearman_min']}),"
        f" {fmt(spearman([r['predicted_ms_per_step_first_cost'] for r in rows], meas), '.3f')} with the first job's,"
        f" {fmt(spearman([r['predicted_ms_per_sample'] for r in rows], meas), '.3f')} with each job's own (as run);"
        f" choice {choice} ({unrestricted} over every layout), fastest measured {fastest['layout']}: the choice"
        f" {100 * gap:+.1f}% (target <= {TARGET['choice_gap_max']:.0%}); one CostModel {one_cost}"
    )
    return 0


def main_driver(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        raise SystemExit(f"unknown layout(s) {bad}; choose from {list(LAYOUTS)}")
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    failed: dict[str, str] = {}  # layout -> the error (a layout that failed is left out of the later rounds)
    print(
        f"planner check: {len(names)} layouts x {args.rounds} round(s), example GPT {MODEL['n_layer']}x"
        f"{MODEL['n_embd']} ({MODEL['n_head']} heads, seq {MODEL['block_size']}, vocab {MODEL['vocab_size']}),"
        f" global batch {args.global_batch} (fixed: every layout trains the same samples per step), {DEVICES} gloo"
        f" ranks on {os.cpu_count()} CPU cores, 1 thread each; {args.warmup} warm-up + {args.steps} timed steps",
        file=sys.stderr,
        flush=True,
    )
    interrupted = None  # SIGTERM (e.g. from `timeout`): the current worker is killed, what finished is reported
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with tempfile.TemporaryDirectory(prefix="planner_check-") as tmpdir:
            tmp = Path(tmpdir)
            for r in range(args.rounds):
                for name in names:  # the same order every round: A B C ... A B C ...
                    if name in failed:
                        continue
                    try:
                        res = _run_worker(name, args, tmp, f"r{r}-{name}")
                    except RuntimeError as err:  # report, keep going: the other layouts still mean something
                        failed[name] = _first_error(err)
                        print(f"[round {r + 1}/{args.rounds}] {name} FAILED: {err}", file=sys.stderr, flush=True)
                        continue
                    runs.setdefault(name, []).append(res)
                    held = max(h["total"] for h in res["held"])
                    print(
                        f"[round {r + 1}/{args.rounds}] {name:14s} {median_ms(res['batch_s']):7.1f} ms/step (predicted"
                        f" {1e3 * res['prediction']['step_s']['total']:7.1f}), held {held / 2**20:.2f} MiB (predicted"
                        f" {res['prediction']['model_state_bytes'] / 2**20:.2f}), first step"
                        f" {res['warmup_s'][0]:5.1f}s, run {res['wall_s']:4.0f}s, others busy before"
                        f" {100 * res['load_before']:.0f}%",
                        file=sys.stderr,
                        flush=True,
                    )
    except _Interrupted:
        interrupted = (
            f"stopped by SIGTERM after {time.perf_counter() - started:.0f}s; the runs that finished are reported"
        )
        print(f"INTERRUPTED: {interrupted}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)

    gb = args.global_batch
    rows: list[dict[str, Any]] = []
    for name in names:
        rs = runs.get(name)
        if not rs:
            continue
        step_ms = statistics.median(median_ms(x["batch_s"]) for x in rs)
        pred_ms = statistics.median(1e3 * x["prediction"]["step_s"]["total"] for x in rs)
        held = [max(x["held"][k]["total"] for x in rs) for k in range(DEVICES)]
        pred_held = rs[0]["prediction"]["model_state_bytes"]
        rows.append(
            {
                "layout": name,
                "planner_layout": rs[0]["prediction"]["layout"],
                "options": rs[0]["options"],
                "measured_ms_per_step": round(step_ms, 2),
                "measured_ms_per_sample": round(step_ms / gb, 3),
                "predicted_ms_per_step": round(pred_ms, 2),
                "predicted_ms_per_sample": round(pred_ms / gb, 3),
                "predicted_over_measured_time": round(pred_ms / step_ms, 3),
                "round_ms": [round(median_ms(x["batch_s"]), 2) for x in rs],
                "period_ms": round(statistics.median(median_ms(x["period_s"]) for x in rs), 2),
                "first_step_s": [round(x["warmup_s"][0], 2) for x in rs],
                "predicted_step_ms_by_part": {
                    k: round(1e3 * statistics.median(x["prediction"]["step_s"][k] for x in rs), 3)
                    for k in rs[0]["prediction"]["step_s"]
                    if k != "samples"
                },
                "held_bytes_per_rank": held,
                "held_by_part_fullest_rank": max((h for x in rs for h in x["held"]), key=lambda h: h["total"]),
                "predicted_memory": rs[0]["prediction"]["memory"],
                "predicted_model_state_bytes": pred_held,
                "memory_ratio": round(pred_held / max(held), 4) if max(held) else None,
                "cost_models": [x["cost"] for x in rs],
                "gloo_calls_one_step_rank0": rs[0]["collectives"],
                "built": rs[0]["built"],
                "rss_mib_max": round(max(max(x["rss_mib"]) for x in rs), 1),
                "load_before": [round(x["load_before"], 3) for x in rs],
            }
        )

    one_cost, choice, unrestricted = with_one_cost(rows, gb)

    header = (
        f"{'layout':14s} {'planner layout':42s} {'pred ms/smp':>11s} {'(one cost)':>10s} {'meas ms/smp':>11s}"
        f" {'pred/meas':>9s} {'pred MiB':>8s} {'meas MiB':>8s} {'pred/meas':>9s}  held MiB per rank"
    )
    print(header)
    print("-" * (len(header) + 20))
    for row in rows:
        print(
            f"{row['layout']:14s} {row['planner_layout']:42s} {row['predicted_ms_per_sample']:11.2f}"
            f" {row['predicted_ms_per_step_one_cost'] / gb:10.2f} {row['measured_ms_per_sample']:11.2f}"
            f" {row['predicted_over_measured_time']:9.2f} {_mib(row['predicted_model_state_bytes'])} "
            f"{_mib(max(row['held_bytes_per_rank']))} {fmt(row['memory_ratio'], '9.3f')}  "
            + "/".join(f"{h / 2**20:.2f}" for h in row["held_bytes_per_rank"])
        )
    for name, why in failed.items():
        print(f"{name:14s} LEFT OUT: it failed to run ({why})")
    missing = [n for n in names if n not in runs and n not in failed]
    if interrupted:
        print(f"INTERRUPTED ({interrupted}); never ran: {', '.join(missing) or 'none'}")

    print("\nPredicted step by part (ms, median over rounds, each job's own CostModel) vs measured ms/step:")
    parts = ("compute", "bubble", "pipeline_sends", "tensor_parallel", "data_parallel", "optimizer", "total")
    print(f"{'layout':14s} " + " ".join(f"{p[:10]:>10s}" for p in parts) + f" {'measured':>10s}")
    for row in rows:
        by = row["predicted_step_ms_by_part"]
        print(
            f"{row['layout']:14s} "
            + " ".join(f"{by[p]:10.2f}" for p in parts)
            + f" {row['measured_ms_per_step']:10.2f}"
        )
    print("\nWhat ran: gloo calls in one (extra, profiled) step on rank 0, by kind; what the strategy compiled:")
    for row in rows:
        calls = ", ".join(f"{k[5:]} {v}" for k, v in sorted(row["gloo_calls_one_step_rank0"].items()))
        b = row["built"]
        if b["sharded_collectives_per_graph"]:  # sharded: the per-parameter collectives Inductor then buckets
            what = "; ".join(
                ", ".join(f"{part[len('collectives_in_') :]} {n} {op}" for op, n in ops.items())
                for g in b["sharded_collectives_per_graph"]
                for part, ops in g.items()
            )
            what = f"sharded graph, before Inductor's bucketing: {what}"
        else:
            what = (
                f"{b['graphs']} graph(s) with {b['buckets']} gradient bucket(s),"
                f" {_mib(b['grad_bytes_per_step']).strip()} MiB/step"
            )
        print(
            f"{row['layout']:14s} {sum(row['gloo_calls_one_step_rank0'].values()):4d} calls ({calls or 'none'}); {what}"
        )
    print("\nCostModel per job (all-reduce latency us, bandwidth GB/s, matmul GFLOP/s, memory GB/s):")
    for row in rows:
        print(
            f"{row['layout']:14s} "
            + "  ".join(
                f"{c['latency_s'] * 1e6:.0f}us {1 / c['seconds_per_byte'] / 1e9 if c['seconds_per_byte'] else 0:.2f}"
                f"GB/s {c['flops_per_s'] / 1e9:.1f}GF {c['bytes_per_s'] / 1e9:.1f}GB/s"
                for c in row["cost_models"]
            )
        )

    meas = [r["measured_ms_per_sample"] for r in rows]
    rho_each = spearman([r["predicted_ms_per_sample"] for r in rows], meas)
    rho_first = spearman([r["predicted_ms_per_step_first_cost"] for r in rows], meas) if rows else None
    rho = spearman([r["predicted_ms_per_step_one_cost"] for r in rows], meas) if rows else None
    mem_errors = {r["layout"]: abs(r["memory_ratio"] - 1) for r in rows if r["memory_ratio"] is not None}
    worst_mem = max(mem_errors.items(), key=lambda kv: kv[1], default=(None, None))
    fastest = min(rows, key=lambda r: r["measured_ms_per_step"], default=None)
    gap = None
    if choice is not None and fastest is not None:
        chosen_ms = next(r["measured_ms_per_step"] for r in rows if r["layout"] == choice)
        gap = chosen_ms / fastest["measured_ms_per_step"] - 1
    criteria = {  # (figure, met); met None: too few layouts ran to tell
        "spearman_times": (rho, None if rho is None else rho >= TARGET["spearman_min"]),
        "worst_memory_error": (
            worst_mem[1],
            None if worst_mem[1] is None else worst_mem[1] <= TARGET["memory_error_max"],
        ),
        "choice_gap_to_fastest": (gap, None if gap is None else gap <= TARGET["choice_gap_max"]),
    }

    def verdict(key: str) -> str:
        met = criteria[key][1]
        return "N/A" if met is None else "PASS" if met else "FAIL"

    loads = [x for r in rows for x in r["load_before"]]
    print(
        f"\nTimes per sample = ms/step / global batch {gb} (fixed for every layout). pred: the planner's"
        " StepTime.seconds_per_sample with the CostModel that job measured; (one cost): with the median of the jobs'"
        " CostModels, one for every layout (the criteria's)."
        " meas: median over rounds of rank 0's median batch time (warm-up dropped)."
        "\nMemory: parameters + gradients + optimizer state on the fullest rank (pred: RankMemory, without the"
        " gathered block and activations; meas: counted from the tensors after the last step, max over ranks and"
        " rounds)."
        f"\n[{verdict('spearman_times')}] Spearman rank correlation of predicted vs measured times, one CostModel for"
        f" every layout (the median of the jobs' measurements): {fmt(rho, '.3f')} (target >= {TARGET['spearman_min']};"
        f" {fmt(rho_first, '.3f')} with the first job's, {fmt(rho_each, '.3f')} with each job's own)"
        f"\n[{verdict('worst_memory_error')}] worst memory error: {fmt(worst_mem[1], '.1%')} ({worst_mem[0]};"
        f" target <= {TARGET['memory_error_max']:.0%})"
        f"\n[{verdict('choice_gap_to_fastest')}] the planner's choice among these layouts (the median CostModel):"
        f" {choice}; fastest measured: {fastest['layout'] if fastest else None}; the choice measured"
        f" {fmt(None if gap is None else 100 * gap, '+.1f')}% from the fastest (target <= {TARGET['choice_gap_max']:.0%})."
        f" Over every layout it would choose: {unrestricted}."
        f"\nOther processes used {fmt(100 * statistics.median(loads) if loads else None, '.0f')}% (median; max"
        f" {fmt(100 * max(loads) if loads else None, '.0f')}%) of the CPUs just before the runs"
        f"{' -- BUSY MACHINE: times are inflated and noisy' if loads and statistics.median(loads) > QUIET else ''}."
        f" Total {time.perf_counter() - started:.0f}s."
    )
    summary = {
        "benchmark": "planner_check",
        "config": {
            "devices": DEVICES,
            "backend": "gloo",
            "threads_per_rank": 1,
            "cpu_count": os.cpu_count(),
            "model": MODEL,
            "global_batch": gb,
            "compare": "fixed global batch; time per sample = step time / global batch",
            "layouts": names,
            "rounds": args.rounds,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "quick": args.quick,
            "torch": version("torch"),
            "lightning": version("lightning"),
            "plugin_commit": git_commit(),
        },
        "results": rows,
        "left_out": failed,
        "interrupted": interrupted,
        "spearman": rho,
        "spearman_first_cost": rho_first,
        "spearman_each_job": rho_each,
        "one_cost_model": one_cost,
        "worst_memory_error": {"layout": worst_mem[0], "error": worst_mem[1]},
        "planner_choice": choice,
        "planner_choice_unrestricted": unrestricted,
        "fastest_measured": fastest["layout"] if fastest else None,
        "choice_gap_to_fastest": gap,
        "target": TARGET,
        "target_met": {k: v[1] for k, v in criteria.items()},
    }
    line = json.dumps(summary, separators=(",", ":"))
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line)
    return 0  # figures, not assertions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default=DEFAULT_LAYOUTS, help=f"comma-separated subset of: {','.join(LAYOUTS)}")
    p.add_argument("--rounds", type=int, default=None, help="runs per layout, same order each round (2; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (12; --quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps, compilation included (4; --quick 3)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step over all replicas (16)")
    p.add_argument("--quick", action="store_true", help="1 round, fewer steps")
    p.add_argument("--timeout", type=float, default=420, help="hard limit per run, seconds (420)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON summary to this file")
    p.add_argument("--reread", type=Path, help="judge the time criteria of a saved summary (--out) again; runs nothing")
    # internal: one layout's run, started by the driver (and re-run by Lightning for ranks 1-3)
    p.add_argument("--worker", metavar="LAYOUT", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.steps = args.steps or (5 if args.quick else 12)
    args.warmup = args.warmup or (3 if args.quick else 4)
    return args


if __name__ == "__main__":
    args = parse_args()
    if args.worker:
        _worker(args)
        sys.exit(0)
    if args.reread:
        sys.exit(reread(args.reread))
    sys.exit(main_driver(args))
