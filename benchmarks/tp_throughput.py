"""Hybrid tensor + data parallel: sgdtp's automatic plan against Lightning's ``ModelParallelStrategy``, same run.

    python benchmarks/tp_throughput.py                       # sgdtp, mp, ddp; 3 rounds: ~4 min on 2 quiet cores
    python benchmarks/tp_throughput.py --contenders sgdtp,mp --rounds 1
    python benchmarks/tp_throughput.py --contenders "mp,mp(eager)" --rounds 1   # what compile gives the hand plan
    python benchmarks/tp_throughput.py --n-layer 2 --n-embd 256 --batch-size 8 --seq 128

The model is ``examples/gpt.py``'s ``GPTLightningModule``, random tokens (fixed seed), the same global batch for
every contender, ``Trainer(accelerator="cpu", devices=4, ...)``: 4 gloo ranks, one thread each
(``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``).

- ``sgdtp``: ``SGDTPStrategy(parallelism="hybrid", tensor_parallel_size=2)`` (dp=2 x tp=2) on the plain,
  unmodified module. The strategy plans the tensor-parallel split, applies it and compiles the training step.
- ``mp``: Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)`` with a subclass
  of the same module whose ``configure_model`` holds what a Lightning user writes by hand: a
  ``parallelize_module`` plan, ``torch.compile`` per block, FSDP2 ``fully_shard`` over the data-parallel mesh.
  If the compiled run fails, the driver runs it again eager (``mp(eager)``, also selectable) and says so.
- ``ddp``: plain ``strategy="ddp"`` on 4 ranks, eager (a familiar baseline; no tensor parallelism).

Each contender is one subprocess (``--worker``) started by the driver in its own session with a hard
timeout; Lightning's launcher re-runs the same command line for ranks 1-3, and the driver kills the whole
process group when the run ends. Each round runs every contender once (the order alternates between
rounds). Rank 0 times every batch with a Callback (``on_train_batch_start`` -> ``on_train_batch_end``, no
barriers); the first ``--warmup`` batches (compilation) are dropped and the first one is reported separately.
Every rank reports its losses, peak RSS and CPU time; from the CPU times the worker tells how much of the machine
other processes took during the timed steps. The driver prints a table and, LAST, one JSON line with every figure
(``target_met``: sgdtp's tokens/s at least ``mp``'s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()

from harness import QUIET_TRAINER, cpu_busy, fmt, frames_compiled, git_commit, median_ms, version, worker_env

DEVICES = 4
DP, TP = 2, 2
SEED = 1234
# contender -> (label, strategy, what the user writes)
CONTENDERS: dict[str, tuple[str, str]] = {
    "sgdtp": ("SGDTPStrategy(hybrid, tp=2), automatic plan", "none"),
    "mp": ("ModelParallelStrategy(dp=2, tp=2), hand plan", "configure_model"),
    "mp(eager)": ("ModelParallelStrategy(dp=2, tp=2), hand plan, no torch.compile", "configure_model"),
    "ddp": ("DDP, 4 ranks, eager", "none"),
}
DEFAULT_CONTENDERS = "sgdtp,mp,ddp"
QUIET = 0.10  # other processes using more than this fraction of the CPUs: the machine is busy
BASELINE = "mp"  # the ratio is sgdtp / this (or mp(eager) when compiling failed)


# ------------------------------------------------------------------------------------------------ worker
def _worker(args: argparse.Namespace) -> None:
    """One contender: fit ``--warmup + --steps`` batches on these 4 processes; rank 0 writes ``--out``."""
    sys.path.insert(0, str(REPO / "examples"))
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist
    from gpt import GPTLightningModule
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    contender = args.worker
    total = args.warmup + args.steps
    replicas = DEVICES if contender == "ddp" else DP
    if args.batch_size % replicas:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {replicas} data-parallel replicas")
    hparams = {
        "vocab_size": 256,
        "block_size": args.seq,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "n_embd": args.n_embd,
        "lr": 2e-3,
    }

    class HandPlannedGPT(GPTLightningModule):
        """What a ``ModelParallelStrategy`` user adds to the module: the plan, compile, FSDP2."""

        compile_blocks = contender == "mp"

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            # Borrowed from lightning_sgdtp: torch 2.13 has no DTensor sharding rule for CPU flash attention.
            from lightning_sgdtp.parallel.tensor import dtensor_ops

            dtensor_ops.register()
            if getattr(self, "_parallelized", False):
                return
            tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
            model = self.model
            plan: dict[str, Any] = {
                "tok_emb": RowwiseParallel(input_layouts=Replicate()),  # split by vocabulary, output all-reduced
                "lm_head": ColwiseParallel(output_layouts=Replicate()),  # split by vocabulary, logits gathered
            }
            for i in range(len(model.blocks)):
                # qkv / fc keep DTensor outputs: the model's view/chunk/attention/GELU run on global shapes.
                # The fused qkv is head-major, so splitting its output features splits by head. The projections
                # get DTensors sharded on the last dim: RowwiseParallel's default input_layouts (Shard(-1)).
                plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel(use_local_output=False)
                plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
                plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel(use_local_output=False)
                plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
            parallelize_module(model, tp_mesh, plan)
            model.lm_head.weight = model.tok_emb.weight  # re-tie: both were split by vocabulary (Shard(0))
            for i, block in enumerate(model.blocks):
                if self.compile_blocks:
                    block = torch.compile(block)
                    model.blocks[i] = block
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
            self._parallelized = True

    class Meter(Callback):
        """Rank 0's batch times; every rank's losses, peak RSS and CPU time in the timed steps, gathered at the end."""

        def __init__(self) -> None:
            self.batch: list[float] = []
            self.losses: list[float] = []
            self._t0 = 0.0
            self.window: list[tuple[float, float, tuple[int, int]]] = []  # (wall, own CPU s, /proc/stat) at both ends
            self.gathered: list[Any] = []

        def _mark(self) -> None:
            self.window.append((time.perf_counter(), time.process_time(), _proc_stat()))

        def on_train_batch_start(self, *a: Any) -> None:
            if len(self.batch) == args.warmup:
                self._mark()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *a: Any) -> None:
            self.batch.append(time.perf_counter() - self._t0)
            if len(self.batch) == total:
                self._mark()
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss.detach()))  # this replica's loss (a plain tensor in every contender)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            import resource

            rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
            self.gathered = [None] * dist.get_world_size()
            mine = {"rss_mib": rss_mib, "losses": self.losses, "window": self.window}
            dist.all_gather_object(self.gathered, mine)

    L.seed_everything(SEED, verbose=False)  # every rank builds the same initial weights (mp broadcasts nothing)
    model = (HandPlannedGPT if contender.startswith("mp") else GPTLightningModule)(**hparams)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(SEED)
    x = torch.randint(0, 256, (args.batch_size * total, args.seq + 1), generator=g)
    # Lightning's DistributedSampler splits the samples by data-parallel replica (the tp ranks of one replica
    # read the same ones): batch i of every contender is the same global batch of --batch-size sequences.
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=args.batch_size // replicas, shuffle=False)
    if contender == "sgdtp":
        from lightning_sgdtp import SGDTPStrategy

        strategy: Any = SGDTPStrategy(parallelism="hybrid", tensor_parallel_size=TP)
    elif contender.startswith("mp"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=DP, tensor_parallel_size=TP)
    else:
        strategy = "ddp"
    meter = Meter()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        strategy=strategy,
        max_steps=total,
        callbacks=[meter],
        **QUIET_TRAINER,
        default_root_dir=str(args.out.parent / f"{args.out.stem}-root"),
    )
    t0 = time.perf_counter()
    trainer.fit(model, loader)
    fit_s = time.perf_counter() - t0
    if trainer.global_rank == 0:
        from torch._dynamo.utils import counters

        ranks = meter.gathered
        result: dict[str, Any] = {
            "contender": contender,
            "params": params,
            "batch_s": meter.batch[args.warmup :],
            "warmup_s": meter.batch[: args.warmup],
            "fit_s": fit_s,
            "rss_mib": [r["rss_mib"] for r in ranks],
            # the global batch's loss per step: the mean over ranks (tp ranks of one replica hold the same loss)
            "loss": [statistics.fmean(r["losses"][i] for r in ranks) for i in range(len(ranks[0]["losses"]))],
            "frames_compiled": frames_compiled(),
            "others_busy": _others_busy([r["window"] for r in ranks]),
            "graphs_compiled": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
        }
        if contender == "sgdtp":
            plan = strategy.plan
            result["plan"] = {
                "dp_size": plan["dp_size"],
                "tp_size": plan["tp_size"],
                "mesh_layout": plan["mesh_layout"],
                "tensor_parallel_plan": plan["tensor_parallel_plan"],
                "graphs": len(plan["graphs"]),
                "graph_breaks": plan["graph_breaks"],
                "bytes_per_step": plan["bytes_per_step"],
            }
        args.out.write_text(json.dumps(result))


def _proc_stat() -> tuple[int, int]:
    """All CPUs' (total, idle + iowait) jiffies so far (Linux; zeros elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return sum(fields[:8]), fields[3] + fields[4]


def _others_busy(windows: list[list[tuple[float, float, tuple[int, int]]]]) -> float | None:
    """The share of all CPUs that processes other than our ranks used during the timed steps.

    The machine's busy share over rank 0's window (``/proc/stat``) minus our ranks' own CPU time (each rank's
    ``process_time``: all its threads, gloo's included) over the same wall time.
    """
    if not windows or any(len(w) != 2 for w in windows):
        return None
    (wall0, _, (tot0, idle0)), (wall1, _, (tot1, idle1)) = windows[0]
    if tot1 <= tot0 or wall1 <= wall0:
        return None
    busy = 1.0 - (idle1 - idle0) / (tot1 - tot0)
    ours = sum(w[1][1] - w[0][1] for w in windows) / ((os.cpu_count() or 1) * (wall1 - wall0))
    return round(max(0.0, busy - ours), 3)


# ------------------------------------------------------------------------------------------------ driver
def _run_worker(contender: str, args: argparse.Namespace, tmp: Path, round_tag: str) -> dict[str, Any]:
    tag = round_tag + "-" + contender.replace("(", "-").replace(")", "")
    out, log = tmp / f"{tag}.json", tmp / f"{tag}.log"
    env = worker_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(SCRIPT), "--worker", contender, "--out", str(out)]
    for flag in ("steps", "warmup", "n_layer", "n_head", "n_embd", "batch_size", "seq"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    load_before = cpu_busy()  # before our ranks start: what else runs on this machine
    deadline = time.monotonic() + args.wait_quiet
    while load_before > QUIET and time.monotonic() < deadline:
        load_before = cpu_busy(2.0)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:  # reap the whole session: ranks 1-3 (Lightning's children) and any compile workers
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    text = log.read_text(errors="replace")
    if rc != 0 or not out.exists():
        why = f"timed out after {args.timeout:.0f}s" if rc is None else f"exit code {rc}"
        raise RuntimeError(f"worker {contender} failed: {why}\n{text[-4000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    result["load_before"] = load_before
    result["load_after"] = cpu_busy()  # our processes are gone: anything busy now is someone else's
    result["sgdtp_log"] = [line.rstrip() for line in text.splitlines() if "sgdtp:" in line]
    return result


def _first_error(err: Exception) -> str:
    """The last exception line of a failed worker's log (what went wrong), else the first line."""
    lines = str(err).splitlines()
    errors = [ln.strip() for ln in lines if "Error" in ln or "Exception" in ln]
    return errors[-1][:300] if errors else lines[0]


def main_driver(args: argparse.Namespace) -> int:
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in contenders if c not in CONTENDERS]
    if bad:
        raise SystemExit(f"unknown contender(s) {bad}; choose from {list(CONTENDERS)}")
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {}
    failures: list[str] = []
    notes: list[str] = []
    instead: dict[str, str] = {}  # "mp" -> "mp(eager)" once compiling it has failed
    with tempfile.TemporaryDirectory(prefix="tp_throughput-") as tmpdir:
        tmp = Path(tmpdir)
        for r in range(args.rounds):
            order = contenders if r % 2 == 0 else contenders[::-1]  # who runs first (and after whom) alternates
            for c in order:
                todo = [instead.get(c, c)]
                while todo:
                    name = todo.pop(0)
                    try:
                        res = _run_worker(name, args, tmp, f"r{r}")
                    except RuntimeError as err:  # report, keep going: the other contenders still mean something
                        failures.append(f"round {r + 1} {name}: {_first_error(err)}")
                        print(f"[round {r + 1}/{args.rounds}] FAILED: {err}", file=sys.stderr, flush=True)
                        if name == "mp":  # compiling under DTensor + FSDP2 failed: measure the same plan eager
                            notes.append(f"mp with torch.compile per block failed ({_first_error(err)}); ran eager.")
                            instead["mp"] = "mp(eager)"
                            todo.append("mp(eager)")
                        continue
                    runs.setdefault(name, []).append(res)
                    print(
                        f"[round {r + 1}/{args.rounds}] {name:9s} {median_ms(res['batch_s']):7.1f} ms/step, first"
                        f" step {res['warmup_s'][0]:5.1f}s, run {res['wall_s']:4.0f}s; other processes' CPU share:"
                        f" before {_pct(res['load_before'])}, timed steps {_pct(res['others_busy'])},"
                        f" after {_pct(res['load_after'])}",
                        file=sys.stderr,
                        flush=True,
                    )
                    if r == 0:
                        for line in res["sgdtp_log"]:
                            print(f"  [{name}] {line}", file=sys.stderr)

    tokens = args.batch_size * args.seq
    ms_of = {name: statistics.median(median_ms(res["batch_s"]) for res in rs) for name, rs in runs.items()}
    base_name = BASELINE if BASELINE in runs else ("mp(eager)" if "mp(eager)" in runs else None)
    ref_loss = next(iter(runs.values()))[0]["loss"] if runs else []
    rows = []
    for name, rs in runs.items():
        ms = ms_of[name]
        tps = tokens / (ms / 1e3)
        res = rs[0]
        row: dict[str, Any] = {
            "contender": name,
            "setup": CONTENDERS[name][0],
            "user_code": CONTENDERS[name][1],
            "compiled": res["frames_compiled"] > 0,
            "frames_compiled": res["frames_compiled"],
            "graphs_compiled": res["graphs_compiled"],
            "graph_breaks": res["graph_breaks"],
            "params": res["params"],
            "ms_per_step": round(ms, 2),
            "tokens_per_s": round(tps, 1),
            "round_ms": [round(median_ms(x["batch_s"]), 2) for x in rs],
            "first_step_s": round(statistics.median(x["warmup_s"][0] for x in rs), 2),
            "warmup_s": [[round(t, 3) for t in x["warmup_s"]] for x in rs],
            "step_ms": [[round(1e3 * t, 2) for t in x["batch_s"]] for x in rs],
            "peak_rss_mib": [round(max(rank), 1) for rank in zip(*(x["rss_mib"] for x in rs), strict=True)],
            "fit_s": [round(x["fit_s"], 1) for x in rs],
            "others_busy": [x["others_busy"] for x in rs],
            "others_busy_before_after": [[round(x["load_before"], 3), round(x["load_after"], 3)] for x in rs],
            "final_loss": round(res["loss"][-1], 5),
            "max_loss_diff_vs_first": round(
                max(abs(a - b) for x in rs for a, b in zip(x["loss"], ref_loss, strict=True)), 6
            ),
        }
        if base_name is not None:
            row["throughput_vs_mp"] = round(ms_of[base_name] / ms, 3)
        if "plan" in res:
            row["plan"] = res["plan"]
        rows.append(row)

    header = (
        f"{'contender':10s} {'user code':15s} {'compiled':17s} {'ms/step':>8s} {'tokens/s':>9s} {'x mp':>5s}"
        f" {'1st step':>8s} {'peak RSS':>9s} {'loss':>7s} {'others':>6s}  rounds ms/step"
    )
    print(header)
    print("-" * (len(header) + 6))
    for r in rows:
        marks = ["*" if (b or 0) > QUIET else "" for b in r["others_busy"]]
        spread = "/".join(f"{x:.0f}{m}" for x, m in zip(r["round_ms"], marks, strict=True))
        compiled = f"yes ({r['graphs_compiled']}g, {r['graph_breaks']} brk)" if r["compiled"] else "no (eager)"
        print(
            f"{r['contender']:10s} {r['user_code']:15s} {compiled:17s} {r['ms_per_step']:8.1f}"
            f" {r['tokens_per_s']:9.0f} {fmt(r.get('throughput_vs_mp'), '5.2f')} {r['first_step_s']:7.1f}s"
            f" {max(r['peak_rss_mib']):5.0f} MiB {r['final_loss']:7.4f} {_pct(_max(r['others_busy'])):>6s}"
            f"  {spread}"
        )
    by_name = {r["contender"]: r for r in rows}
    ratio = by_name["sgdtp"].get("throughput_vs_mp") if "sgdtp" in by_name else None
    loss_ok = all(r["max_loss_diff_vs_first"] <= 1e-3 for r in rows) if rows else None
    loads = [x["others_busy"] for rs in runs.values() for x in rs if x["others_busy"] is not None]
    busy = max(loads, default=0.0)
    n_busy = sum(b > QUIET for b in loads)
    print(
        "\n"
        + "\n".join(f"{name}: {CONTENDERS[name][0]}" for name in runs)
        + f"\nGPT {args.n_layer} layers x {args.n_embd} ({args.n_head} heads),"
        f" {rows[0]['params'] if rows else '?'} parameters; global batch {args.batch_size} x {args.seq} tokens,"
        f" {DEVICES} gloo ranks on {os.cpu_count()} CPU cores, 1 thread each; {args.warmup} warm-up +"
        f" {args.steps} timed steps, {args.rounds} round(s)."
        "\nms/step: median over rounds of the median of rank 0's timed batches (warm-up dropped); tokens/s: global"
        f" tokens per step / that; x mp: tokens/s over {base_name or 'mp'}'s; compiled: Dynamo graphs (g) and graph"
        " breaks (brk) on rank 0; 1st step: the first batch (compilation included); peak RSS: max over ranks of"
        " ru_maxrss; loss: the global batch's loss at the last step."
        f"\nSame loss curve in every contender (max |diff| <= 1e-3 against the first): {loss_ok}. others: the share"
        f" of the CPUs other processes used during a run's timed steps (max over rounds; * in rounds: above"
        f" {_pct(QUIET)}). {n_busy} of {len(loads)} runs on a busy machine"
        + (
            f" (up to {_pct(busy)}): their times are inflated; the median over rounds discounts a minority of them."
            if n_busy
            else "."
        )
        + "".join(f"\nNote: {n}" for n in notes)
        + f" Total {time.perf_counter() - started:.0f}s."
    )
    summary = {
        "benchmark": "tp_throughput",
        "config": {
            "devices": DEVICES,
            "dp": DP,
            "tp": TP,
            "backend": "gloo",
            "threads_per_rank": 1,
            "cpu_count": os.cpu_count(),
            "n_layer": args.n_layer,
            "n_head": args.n_head,
            "n_embd": args.n_embd,
            "seq": args.seq,
            "global_batch": args.batch_size,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "rounds": args.rounds,
            "seed": SEED,
            "torch": version("torch"),
            "lightning": version("lightning"),
            "lightning_sgdtp": version("lightning-sgdtp"),
            "plugin_commit": git_commit(),
        },
        "other_cpu_busy_max": round(busy, 3),
        "busy_runs": n_busy,
        "results": rows,
        "baseline": base_name,
        "ratio_sgdtp_over_mp": ratio,
        "target": {"ratio_sgdtp_over_mp": 1.0, "user_code": "none"},
        "target_met": ratio is not None and ratio >= 1.0,
        "checks": {"same_loss_curve": loss_ok},
        "notes": notes,
        "failures": failures,
    }
    for failure in failures:
        print(f"FAILED: {failure}")
    print(json.dumps(summary, separators=(",", ":")))
    return 1 if failures else 0


def _max(xs: list[float | None]) -> float | None:
    known = [x for x in xs if x is not None]
    return max(known) if known else None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contenders", default=DEFAULT_CONTENDERS, help="comma-separated subset of: sgdtp,mp,mp(eager),ddp")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender run (20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps, compilation included (5)")
    p.add_argument("--n-layer", type=int, default=4, help="GPT layers (4)")
    p.add_argument("--n-head", type=int, default=4, help="attention heads, divisible by the tp size 2 (4)")
    p.add_argument("--n-embd", type=int, default=128, help="GPT width (128)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch in sequences, same for all (16)")
    p.add_argument("--seq", type=int, default=128, help="sequence length = the GPT's block_size (128)")
    p.add_argument("--rounds", type=int, default=3, help="runs per contender, order alternating; medians (3)")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to this long for other processes to leave the CPUs idle (shared machines)",
    )
    p.add_argument("--timeout", type=float, default=300, help="hard limit per contender run, seconds (300)")
    # internal: one contender's run, started by the driver (and re-run by Lightning for ranks 1-3)
    p.add_argument("--worker", metavar="CONTENDER", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.worker:
        _worker(args)
        sys.exit(0)
    sys.exit(main_driver(args))
