"""Sharded data parallel: step time and memory of sgdtp's ``sharding`` against Lightning's FSDP2, interleaved.

    python benchmarks/fsdp_throughput.py                 # 3 rounds x 5 variants, example GPT, 2 ranks (~15 min)
    python benchmarks/fsdp_throughput.py --rounds 1 --steps 4 --warmup 2    # smoke

Variants (the same ``GPTLightningModule`` of ``examples/gpt.py``: ``self.log`` every step, torchmetrics perplexity,
AdamW; 2 gloo ranks, one thread each):

- ``fsdp2``: Lightning's ``ModelParallelStrategy(data_parallel_size=2)``, ``fully_shard`` on each transformer block
  and the root in ``configure_model`` (what its docs ask the user to write), eager;
- ``fsdp2+compile``: the same with ``torch.compile`` of each block (the per-block compile FSDP2 recommends);
- ``sgdtp(full)`` / ``sgdtp(optimizer)``: ``SGDTPStrategy(sharding=...)``, the module unchanged;
- ``sgdtp(replicated)``: ``SGDTPStrategy()`` (no sharding), the baseline of what sharding costs.

Each (variant, round) is one subprocess; rank 0 times every batch (``time.perf_counter`` around the batch, no
barrier) and drops the warm-up steps; every rank reports its peak resident memory (``ru_maxrss``: the process, the
compiler included), the bytes of parameters, gradients and optimizer state it holds (counted from the tensors), and
its peak tensor memory in one more, untimed step: the bytes held when the step starts plus the highest point that the
step's allocations minus frees reach (``torch.profiler`` with ``profile_memory``, op by op: on CPU what
``torch.cuda.max_memory_allocated`` measures on a GPU). The driver shuffles the variant order
per round (seeded), prints medians over rounds with ratios to ``fsdp2`` and, LAST, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import QUIET_TRAINER, git_commit, run_reaped, version, worker_env

VARIANTS = ("fsdp2", "fsdp2+compile", "sgdtp(full)", "sgdtp(optimizer)", "sgdtp(replicated)")
BATCH = 8


# ------------------------------------------------------------------------------------------------ worker
def _worker(variant: str, steps: int, warmup: int, out: Path) -> None:
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPTLightningModule

    from lightning_sgdtp import SGDTPStrategy
    from lightning_sgdtp.parallel.sharding import held_bytes

    torch.set_num_threads(1)

    class FSDP2GPT(GPTLightningModule):
        """What Lightning's ModelParallelStrategy asks the user to add: ``fully_shard`` in ``configure_model``."""

        compile_blocks = False

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for i, block in enumerate(self.model.blocks):
                if self.compile_blocks:
                    block.compile()
                fully_shard(block, mesh=mesh, reshard_after_forward=i < len(self.model.blocks) - 1)
            fully_shard(self.model, mesh=mesh)

    L.seed_everything(0, verbose=False)
    if variant.startswith("fsdp2"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        model: L.LightningModule = FSDP2GPT(lr=2e-3)
        model.compile_blocks = variant == "fsdp2+compile"
        strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        model = GPTLightningModule(lr=2e-3)
        sharding = variant[len("sgdtp(") : -1]
        strategy = SGDTPStrategy(sharding="none" if sharding == "replicated" else sharding)
    g = torch.Generator().manual_seed(0)
    n = 2 * BATCH * (steps + warmup + 1)  # + 1: the step profiled for its memory
    x = torch.randint(0, 256, (n, 128), generator=g)
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=BATCH, drop_last=True)
    times: list[float] = []
    memory: dict[str, int] = {}

    class Timer(Callback):
        profiler: Any = None

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == steps + warmup:  # the last step: its memory, not its time
                from torch.profiler import ProfilerActivity, profile

                memory["at_start"] = held_bytes(module, list(trainer.optimizers))["total"]
                self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
                self.profiler.__enter__()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            if self.profiler is None:
                times.append(time.perf_counter() - self.t0)
                return
            self.profiler.__exit__(None, None, None)
            live = peak = 0
            for event in sorted(self.profiler.events(), key=lambda e: e.time_range.start):
                live += event.self_cpu_memory_usage
                peak = max(peak, live)
            memory["step_peak"] = peak
            self.profiler = None

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=steps + warmup + 1,
        callbacks=[Timer()],
        **QUIET_TRAINER,
    )
    trainer.fit(model, data)
    held = held_bytes(model, [o for o in trainer.optimizers])
    result = {
        "rank": trainer.global_rank,
        "step_ms": [1000 * t for t in times[warmup:]],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "held_bytes": held,
        "peak_tensor_bytes": memory["at_start"] + memory["step_peak"],
    }
    (out.parent / f"{out.stem}-rank{trainer.global_rank}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------ driver
def _run(variant: str, steps: int, warmup: int, tmp: Path, tag: str, timeout: float) -> list[dict[str, Any]]:
    out = tmp / f"{tag}.json"
    env = worker_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(SCRIPT), "--worker", variant, "--steps", str(steps), "--warmup", str(warmup)]
    cmd += ["--out", str(out)]
    log = tmp / f"{tag}.log"
    rc = run_reaped(cmd, REPO, env, log, timeout)
    files = sorted(tmp.glob(f"{tag}-rank*.json"))
    if rc != 0 or len(files) != 2:
        raise RuntimeError(f"{variant} failed (rc={rc}):\n{log.read_text(errors='replace')[-4000:]}")
    return [json.loads(p.read_text()) for p in files]


def main(args: argparse.Namespace) -> int:
    rng = random.Random(0)
    runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = list(VARIANTS)
            rng.shuffle(order)
            for v in order:
                print(f"round {r + 1}/{args.rounds}: {v}", file=sys.stderr, flush=True)
                runs[v].append(_run(v, args.steps, args.warmup, Path(tmp), f"r{r}-{len(runs[v])}-{abs(hash(v))}", 900))
    rows = []
    for v in VARIANTS:
        step = statistics.median(statistics.median(run[0]["step_ms"] if run[0]["rank"] == 0 else run[1]["step_ms"])
                                 for run in runs[v])  # fmt: skip
        rss = max(rank["peak_rss_mib"] for run in runs[v] for rank in run)
        held = max(rank["held_bytes"]["total"] for run in runs[v] for rank in run)
        tensors = max(rank["peak_tensor_bytes"] for run in runs[v] for rank in run)
        rows.append(
            {
                "variant": v,
                "step_ms": step,
                "peak_rss_mib": rss,
                "held_mib": held / 2**20,
                "peak_tensor_mib": tensors / 2**20,
            }
        )
    base = next(r for r in rows if r["variant"] == "fsdp2")
    print(
        f"{'variant':<20} {'step ms':>9} {'x fsdp2':>8} {'peak RSS MiB':>13} {'x fsdp2':>8} {'held MiB':>9}"
        f" {'peak tensors MiB':>17} {'x fsdp2':>8}"
    )
    for r in rows:
        r["step_ratio"] = r["step_ms"] / base["step_ms"]
        r["rss_ratio"] = r["peak_rss_mib"] / base["peak_rss_mib"]
        r["tensor_ratio"] = r["peak_tensor_mib"] / base["peak_tensor_mib"]
        print(
            f"{r['variant']:<20} {r['step_ms']:>9.1f} {r['step_ratio']:>8.2f} {r['peak_rss_mib']:>13.0f}"
            f" {r['rss_ratio']:>8.2f} {r['held_mib']:>9.2f} {r['peak_tensor_mib']:>17.2f} {r['tensor_ratio']:>8.2f}"
        )
    meta = {"torch": version("torch"), "lightning": version("lightning"), "commit": git_commit(), "rounds": args.rounds}
    print(json.dumps({"benchmark": "fsdp_throughput", **meta, "rows": rows}))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped (compile)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    if a.worker:
        _worker(a.worker, a.steps, a.warmup, a.out)
        sys.exit(0)
    sys.exit(main(a))
