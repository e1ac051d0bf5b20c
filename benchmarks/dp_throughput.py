"""Data-parallel step time: Lightning's ``ddp`` (eager), ``ddp`` + ``torch.compile`` and ``sgdtp``, interleaved.

    python benchmarks/dp_throughput.py                        # default: user,mlp,gpt,fabric; 3 rounds (~35 min)
    python benchmarks/dp_throughput.py --workloads fabric     # Fabric(strategy="sgdtp") vs Fabric("ddp")
    python benchmarks/dp_throughput.py --quick                # smoke (1 round, few steps)
    python benchmarks/dp_throughput.py --workloads user --rounds 5 --steps 40
    python benchmarks/dp_throughput.py --workloads mlp --sweep-buckets   # + bucket_cap_mb 4/25/100, overlap, bf16
    python benchmarks/dp_throughput.py --workloads user --rounds 1 --profile /tmp/prof   # + per-step breakdown

Workloads: ``user`` (the module users write: ``self.log`` of the loss every step, a torchmetrics accuracy, AdamW;
also run with ``ddp`` + a compiled or fused optimizer, and sgdtp with its update as configured), ``mlp`` (the
same network, SGD, no logging), ``gpt`` (the example GPT) and ``fabric`` (the ``user`` workload as a Fabric loop:
``fabric.setup``, ``fabric.backward``, ``fabric.log_dict`` of the loss and a torchmetrics accuracy every step, AdamW;
``x ddp`` is then against ``Fabric(strategy="ddp")``, DDP's floor every step inside ``fabric.no_backward_sync``, and
each of its two fits runs in its own processes, one Fabric each; ``--profile`` does not cover it).

Every run is what a user gets: ``Trainer(accelerator="cpu", devices=2, strategy=...)``, 2 gloo ranks, one
thread each (``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``). Each (workload, variant) of each round
is one subprocess (``--worker``); Lightning's launcher re-runs that same command line for rank 1. A worker
fits the model twice in the same processes: once as configured ("step") and once with gradient
communication switched off ("floor": the same variant's compute, see ``benchmarks/README.md``); the order of
the two alternates between rounds. Rank 0 times every batch with a Callback (``on_train_batch_start`` ->
``on_train_batch_end``, ``time.perf_counter``, no barriers), drops the warm-up (compile) steps and writes
the per-step times to ``--out``. The driver shuffles the variant order every round (seeded), aggregates medians over
rounds and prints a table followed, LAST, by one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()

from harness import (
    QUIET_TRAINER,
    cpu_busy,
    fmt,
    frames_compiled,
    git_commit,
    median_ms,
    run_reaped,
    version,
    worker_env,
)

# variant -> (strategy kind, torch.compile the LightningModule's inner network (default Inductor), SGDTPStrategy kwargs).
# sgdtp gets the plain module: the strategy compiles the training step itself (and refuses a compiled module).
VARIANTS: dict[str, tuple[str, bool, dict[str, Any]]] = {
    "ddp": ("ddp", False, {}),
    "ddp+compile": ("ddp", True, {}),
    "sgdtp": ("sgdtp", False, {}),
    # --sweep-buckets extras (MLP): bucket size and overlap scheduling
    "sgdtp(bucket=4MiB)": ("sgdtp", False, {"bucket_cap_mb": 4}),
    "sgdtp(bucket=25MiB)": ("sgdtp", False, {"bucket_cap_mb": 25}),
    "sgdtp(bucket=100MiB)": ("sgdtp", False, {"bucket_cap_mb": 100}),
    "sgdtp(overlap=False)": ("sgdtp", False, {"overlap": False}),
    "sgdtp(bf16 wire)": ("sgdtp", False, {"grad_comm_dtype": "bf16"}),
    # the optimizer's share (user workload): what a user can do by hand with ddp, and sgdtp without its update
    "ddp+compiled-opt": ("ddp", False, {}),
    "ddp+fused-opt": ("ddp", False, {}),
    "sgdtp(update=eager)": ("sgdtp", False, {"optimizer_update": "eager"}),
}
#: ddp variants whose optimizer the worker changes at on_train_start, with sgdtp's own helpers (the same wrapper a
#: user would write: the closure outside, torch.compile of the step, the learning rate as a 0-d tensor).
DDP_OPTIMIZER = {"ddp+compiled-opt": "compiled", "ddp+fused-opt": "fused"}
MAIN_VARIANTS = ["ddp", "ddp+compile", "sgdtp"]
USER_VARIANTS = MAIN_VARIANTS + ["ddp+compiled-opt", "ddp+fused-opt", "sgdtp(update=eager)"]
#: Fabric: the main three, and ddp with torch's fused AdamW (how much of the gain is the optimizer's, as in user).
FABRIC_VARIANTS = MAIN_VARIANTS + ["ddp+fused-opt"]
SWEEP_VARIANTS = [
    "sgdtp(bucket=4MiB)",
    "sgdtp(bucket=25MiB)",
    "sgdtp(bucket=100MiB)",
    "sgdtp(overlap=False)",
    "sgdtp(bf16 wire)",
]
# With sync off, bucket size, overlap and wire dtype change nothing that is computed: the sweep variants share
# sgdtp's floor (measured in the same round).
FLOOR_OF = {v: "sgdtp" for v in SWEEP_VARIANTS}
WORKLOADS = ("user", "mlp", "gpt", "fabric")
QUIET = 0.10  # other processes using more than this fraction of the CPUs: the machine is busy
TARGET = {"workload": "user", "ratio_to_ddp": 0.85, "stretch_ratio_to_ddp": 0.65, "exposed_comm_fraction": 0.25}


# ------------------------------------------------------------------------------------------------ worker
def _worker(
    workload: str, variant: str, out: Path, steps: int, warmup: int, phases: list[str], profile_to: Path | None
) -> None:
    """One (workload, variant): fit once per phase ("sync" and/or "nosync") in these 2 processes."""
    import lightning.pytorch as L
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    kind, compiled, sgdtp_kwargs = VARIANTS[variant]
    batch = 32  # per rank, both workloads
    total = warmup + steps

    class MLPModule(L.LightningModule):
        """``_mlp()``, SGD with momentum, nothing logged."""

        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)

    class UserModule(MLPModule):
        """The MLP as users write it: the loss logged every step, a torchmetrics accuracy, AdamW."""

        def __init__(self) -> None:
            super().__init__()
            from torchmetrics.classification import MulticlassAccuracy

            self.acc = MulticlassAccuracy(num_classes=10)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            loss = F.cross_entropy(logits, y)
            self.acc(logits, y)
            self.log("loss", loss, prog_bar=True)
            self.log("acc", self.acc)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def make(seed: int) -> tuple[L.LightningModule, DataLoader]:
        L.seed_everything(seed, verbose=False)
        g = torch.Generator().manual_seed(seed)
        n = 2 * batch * total  # one epoch covers the run on both ranks (no epoch boundary inside)
        if workload in ("mlp", "user"):
            model: L.LightningModule = MLPModule() if workload == "mlp" else UserModule()
            data = TensorDataset(torch.randn(n, 512, generator=g), torch.randint(0, 10, (n,), generator=g))
        else:
            sys.path.insert(0, str(REPO / "examples"))
            from gpt import GPTLightningModule  # the example's defaults: train_gpt.py's GPT (4x128, block 128)

            model = GPTLightningModule(lr=2e-3)
            x = torch.randint(0, 256, (n, 128), generator=g)
            data = TensorDataset(x, torch.roll(x, -1, dims=1))
        return model, DataLoader(data, batch_size=batch, shuffle=False, drop_last=True)

    class StepTimer(Callback):
        """Wall time of each batch and of each loop iteration; no barriers. Only rank 0's times are written."""

        def __init__(self, sync: bool, profile_to: Path | None) -> None:
            self.sync = sync
            self.batch: list[float] = []
            self.period: list[float] = []
            self._t0: float | None = None
            self.profile_to = profile_to
            self._prof: Any = None
            self._label: Any = None
            self.breakdown: list[dict[str, Any]] = []
            self.ddp_buckets: list[int] = []
            self.faults: list[int] = []  # minor page faults of this process during each batch
            self._faults0 = 0

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if not self.sync:
                _switch_off_grad_sync(trainer.strategy)
            if variant in DDP_OPTIMIZER:
                from lightning_sgdtp.engine.optim import compile_update, use_fused

                for opt in trainer.optimizers:
                    (compile_update if DDP_OPTIMIZER[variant] == "compiled" else use_fused)(opt)

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            from lightning_sgdtp.observe.timeline import STEP_LABEL, label

            if self.profile_to is not None and len(self.batch) == warmup:
                self._prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
                )
                self._prof.__enter__()
            if self._prof is not None:  # the span the breakdown cuts steps by (sgdtp's timeline uses the same)
                self._label = label(f"{STEP_LABEL} {trainer.global_step}")
                self._label.__enter__()
            self._faults0 = _minor_faults()
            now = time.perf_counter()
            if self._t0 is not None:
                self.period.append(now - self._t0)
            self._t0 = now

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if self._label is not None:
                self._label.__exit__(None, None, None)
                self._label = None
            assert self._t0 is not None
            self.batch.append(time.perf_counter() - self._t0)
            self.faults.append(_minor_faults() - self._faults0)

        def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.ddp_buckets = _ddp_bucket_bytes(trainer.strategy.model)
            if self._prof is None or self.profile_to is None:
                return
            self._prof.__exit__(None, None, None)
            stem = f"{workload}-{variant}-{'step' if self.sync else 'floor'}-rank{trainer.global_rank}"
            self.profile_to.mkdir(parents=True, exist_ok=True)
            table = self._prof.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70)
            (self.profile_to / f"{stem}.txt").write_text(f"{len(self.batch) - warmup} steps\n{table}")
            self._prof.export_chrome_trace(str(self.profile_to / f"{stem}.trace.json"))
            from lightning_sgdtp.observe.timeline import breakdown

            trace = json.loads((self.profile_to / f"{stem}.trace.json").read_text())["traceEvents"]
            self.breakdown = [s["summary"] for s in breakdown(trace)]

    def _switch_off_grad_sync(strategy: Any) -> None:
        if kind == "ddp":
            # What DDP's no_sync() does, for the whole run: the reducer's hooks stay, no bucket is all-reduced.
            strategy.model.require_backward_grad_sync = False
        else:
            _sgdtp_without_sync(strategy)

    result: dict[str, Any] = {"workload": workload, "variant": variant, "steps": steps, "warmup": warmup}
    for phase in phases:
        sync = phase == "sync"
        model, loader = make(seed=1234)
        result.setdefault("params", sum(p.numel() for p in model.parameters()))
        if kind == "ddp":
            from lightning.pytorch.strategies import DDPStrategy

            from lightning_sgdtp.observe.timeline import CLOSURE_LABEL, OPTIMIZER_LABEL, label, labelled

            class LabelledDDP(DDPStrategy):
                """Lightning's DDP with the spans sgdtp's timeline reads (no other change): the breakdown of a
                profiled run is computed the same way for both."""

                def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
                    with label(OPTIMIZER_LABEL):
                        return super().optimizer_step(optimizer, labelled(closure, CLOSURE_LABEL), model, **kwargs)

            strategy: Any = LabelledDDP() if profile_to is not None else "ddp"
        else:
            from lightning_sgdtp import SGDTPStrategy

            strategy = SGDTPStrategy(**sgdtp_kwargs)
        timer = StepTimer(sync, profile_to)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=total,
            callbacks=[timer],
            **QUIET_TRAINER,
            default_root_dir=str(out.parent / f"{out.stem}-{phase}"),
        )
        t0 = time.perf_counter()
        if compiled:
            # torch.compile the inner network (default Inductor). Two ways that look equivalent do not work here:
            # trainer.fit(torch.compile(lightning_module)) also compiles training_step, and Dynamo then fails in
            # the GPT's self.log(...); nn.Sequential(...).compile() (in place) compiles nothing in torch 2.13
            # (its forward lives in torch.nn, which Dynamo skips as a top-level frame). See README.
            if workload in ("mlp", "user"):
                model.net = torch.compile(model.net)
            else:
                model.model = torch.compile(model.model)
        frames_before = frames_compiled()
        trainer.fit(model, loader)
        fit_s = time.perf_counter() - t0
        frames = frames_compiled() - frames_before
        entry: dict[str, Any] = {
            "batch_s": timer.batch[warmup:],
            "period_s": timer.period[warmup:],
            "warmup_s": timer.batch[:warmup],
            "fit_s": fit_s,
            "replicas_equal": _replicas_equal(model),
            "frames_compiled": frames,
            "page_faults": timer.faults[warmup:],
            "breakdown": timer.breakdown,
        }
        if profile_to is not None:  # both ranks' breakdowns (rank 0 writes the result)
            by_rank: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(by_rank, timer.breakdown)
            entry["breakdown_by_rank"] = by_rank
        _record_buckets(entry, sync, strategy.plan if kind == "sgdtp" else None, timer.ddp_buckets)
        result[phase] = entry
    if dist.get_rank() == 0:
        out.write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _sgdtp_without_sync(strategy: Any) -> None:
    """sgdtp's floor: the compiler's switch for gradient accumulation (graphs compiled without collectives; call
    before the first step compiles) and the ledger (sgdtp's after-backward fallback, and its per-step agreement
    all-reduce) made a no-op: the same compiled step, and its graph walk, without communication."""
    import dataclasses

    from lightning_sgdtp.sync.ledger import Agreement, BackwardRecord

    # The compiler's settings are fixed when the engine makes it: a benchmark-only replacement of the frozen value.
    compiler = strategy.engine.compiler
    compiler.settings = dataclasses.replace(compiler.settings, in_graph_sync=False)
    ledger = strategy.grad_sync.ledger
    ledger.start_agreement = lambda *args, **kwargs: Agreement(ledger, None, set(), None, BackwardRecord())
    ledger.sync = lambda *args, **kwargs: []
    ledger.uncovered = lambda *args, **kwargs: []


def _fabric_worker(variant: str, out: Path, steps: int, warmup: int, phase: str) -> None:
    """The ``fabric`` workload: the ``user`` workload as a Fabric loop (``fabric.setup``, ``fabric.backward``,
    ``fabric.log_dict`` of the loss and a torchmetrics accuracy every step, AdamW) under ``Fabric(strategy="ddp")``
    or ``Fabric(strategy="sgdtp")``. The floor, the same compute without gradient communication: DDP's every step
    inside ``fabric.no_backward_sync(model)`` (its ``no_sync``), sgdtp's as in the Trainer workloads. One ``phase``
    ("sync" or "nosync") per pair of processes: one model per Fabric."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader, TensorDataset
    from torchmetrics.classification import MulticlassAccuracy

    torch.set_num_threads(1)
    kind, compiled, sgdtp_kwargs = VARIANTS[variant]
    batch, total = 32, warmup + steps
    if kind == "sgdtp":
        from lightning_sgdtp import SGDTPFabricStrategy

        strategy: Any = SGDTPFabricStrategy(**sgdtp_kwargs)
    else:
        strategy = "ddp"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()  # re-runs this command line for rank 1
    sync = phase == "sync"
    fabric.seed_everything(1234, verbose=False)
    g = torch.Generator().manual_seed(1234)
    n = 2 * batch * total
    data = TensorDataset(torch.randn(n, 512, generator=g), torch.randint(0, 10, (n,), generator=g))
    net = _mlp()
    params = sum(p.numel() for p in net.parameters())
    if compiled:
        net = torch.compile(net)  # Fabric moves the compile outside its DDP wrapper
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    if DDP_OPTIMIZER.get(variant) == "fused":
        from lightning_sgdtp.engine.optim import use_fused

        use_fused(optimizer.optimizer)
    if not sync and kind == "sgdtp":
        _sgdtp_without_sync(fabric.strategy)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=batch, shuffle=False, drop_last=True))
    acc = MulticlassAccuracy(num_classes=10).to(fabric.device)
    times: list[float] = []
    periods: list[float] = []
    faults: list[int] = []
    frames_before = frames_compiled()
    t_fit = t_prev = time.perf_counter()
    for i, (x, y) in enumerate(loader):
        if i == total:
            break
        t0 = time.perf_counter()
        if i:
            periods.append(t0 - t_prev)
        t_prev, faults0 = t0, _minor_faults()
        with fabric.no_backward_sync(model, enabled=not sync and kind == "ddp"):  # DDP's no_sync
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.log_dict({"loss": loss, "acc": acc(logits, y)})
        times.append(time.perf_counter() - t0)
        faults.append(_minor_faults() - faults0)
    entry: dict[str, Any] = {
        "batch_s": times[warmup:],
        "period_s": periods[warmup:],
        "warmup_s": times[:warmup],
        "fit_s": time.perf_counter() - t_fit,
        "replicas_equal": _replicas_equal(net),
        "frames_compiled": frames_compiled() - frames_before,
        "page_faults": faults[warmup:],
        "breakdown": [],
    }
    ddp_buckets = [] if kind == "sgdtp" else _ddp_bucket_bytes(model._forward_module)
    _record_buckets(entry, sync, fabric.strategy.plan if kind == "sgdtp" else None, ddp_buckets)
    if fabric.global_rank == 0:
        result = {"workload": "fabric", "variant": variant, "steps": steps, "warmup": warmup, "params": params}
        out.write_text(json.dumps({**result, phase: entry}))
    dist.barrier()
    dist.destroy_process_group()


def _record_buckets(entry: dict[str, Any], sync: bool, plan: dict[str, Any] | None, ddp_buckets: list[int]) -> None:
    """What a run keeps of its gradient buckets: sgdtp's from its ``plan``, DDP's sizes otherwise; after a synced
    run, the time to all-reduce them alone."""
    import torch

    if plan is not None:
        entry["plan"], buckets = _plan_entry(plan)
    else:
        entry["ddp_bucket_bytes"] = ddp_buckets
        buckets = [(n, torch.float32) for n in ddp_buckets]
    if sync:
        entry["comm_alone_ms"] = _comm_alone_ms(buckets)


def _ddp_bucket_bytes(ddp: Any) -> list[int]:
    """DDP's own record of its (rebuilt) buckets, in bytes."""
    import torch

    while not isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and hasattr(ddp, "_orig_mod"):
        ddp = ddp._orig_mod
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        return []
    info = ddp._get_ddp_logging_data()
    sizes = info.get("rebuilt_bucket_sizes") or info.get("bucket_sizes") or ""
    return [int(x) for x in str(sizes).split(",") if x.strip()]


def _mlp() -> Any:
    """512 -> 4x2048 -> 10 with ReLU: 13.7M parameters, ~0.1 GFLOP of compute per MB of gradient."""
    from torch import nn

    dims = [512, 2048, 2048, 2048, 2048, 10]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(dims) - 2 else [])
    return nn.Sequential(*layers)


def _replicas_equal(model: Any) -> bool:
    """Proof of what was measured: replicas agree after a synced run and diverge after a floor run."""
    import torch.distributed as dist

    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    sums: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sums, checksum)
    return max(sums) - min(sums) <= 1e-9 * max(1.0, abs(max(sums)))


def _plan_entry(plan: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[int, Any]]]:
    """What a result keeps of sgdtp's plan, and its buckets as (wire bytes, dtype)."""
    import torch

    entry = {
        "graphs": [
            {
                "graph_id": g["graph_id"],
                "buckets": len(g["buckets"]),
                "bucket_bytes": [b["wire_bytes"] for b in g["buckets"]],
                "wire_bytes": g["wire_bytes"],
            }
            for g in plan["graphs"]
        ],
        "bytes_per_step": plan["bytes_per_step"],
        "graph_breaks": plan["graph_breaks"],
        "config": {k: plan["config"][k] for k in ("bucket_cap_mb", "overlap", "grad_comm_dtype")},
    }
    buckets = [(b["wire_bytes"], getattr(torch, b["wire_dtype"])) for g in plan["graphs"] for b in g["buckets"]]
    return entry, buckets


def _comm_alone_ms(buckets: list[tuple[int, Any]], reps: int = 10) -> float | None:
    """All-reduce this step's buckets (bytes, dtype) back to back, both ranks otherwise idle."""
    import torch
    import torch.distributed as dist

    if not buckets:
        return None
    bufs = [torch.ones(nbytes // dtype.itemsize, dtype=dtype) for nbytes, dtype in buckets]
    times = []
    for _ in range(reps + 2):
        dist.barrier()
        t = time.perf_counter()
        for work in [dist.all_reduce(b, async_op=True) for b in bufs]:
            work.wait()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times[2:])


def _minor_faults() -> int:
    """Minor page faults of this process so far (first touches of freshly mapped memory)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ------------------------------------------------------------------------------------------------ driver
def _run_worker(
    workload: str,
    variant: str,
    phases: list[str],
    steps: int,
    warmup: int,
    tmp: Path,
    tag: str,
    timeout: float,
    profile_to: Path | None = None,
    wait_quiet: float = 0.0,
) -> dict[str, Any]:
    if workload == "fabric" and len(phases) > 1:
        # One Fabric per process (sgdtp sets up one model per Fabric, and a second Fabric in the same ranks is not
        # something users do): each phase in its own pair of processes, in the order given.
        parts = [
            _run_worker(workload, variant, [ph], steps, warmup, tmp, f"{tag}-{ph}", timeout, profile_to, wait_quiet)
            for ph in phases
        ]
        return {**parts[1], **parts[0], "load_before": max(part["load_before"] for part in parts)}
    out = tmp / f"{tag}.json"
    log = tmp / f"{tag}.log"
    env = worker_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(SCRIPT), "--worker", workload, variant, "--out", str(out)]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--phases", ",".join(phases)]
    if profile_to is not None:
        cmd += ["--profile", str(profile_to.resolve())]
    load_before = cpu_busy()  # before our ranks start: what else runs on this machine
    deadline = time.monotonic() + wait_quiet
    while load_before > QUIET and time.monotonic() < deadline:
        load_before = cpu_busy(2.0)
    rc = run_reaped(cmd, REPO, env, log, timeout)
    if rc != 0 or not out.exists():
        why = f"timed out after {timeout:.0f}s" if rc is None else f"exit code {rc}"
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"worker {workload} {variant} ({','.join(phases)}) failed: {why}\n{tail}")
    result = json.loads(out.read_text())
    result["load_before"] = load_before
    return result


def main_driver(args: argparse.Namespace) -> int:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise SystemExit(f"unknown workload(s) {bad}; choose from {list(WORKLOADS)}")
    if args.quick:
        args.rounds = args.rounds or 1
        args.warmup = args.warmup or 3
    rounds = args.rounds or 3
    warmup = args.warmup or 5

    def steps_for(w: str) -> int:  # timed steps per run; GPT steps are ~10x longer than MLP steps
        if args.steps:
            return args.steps
        quick, full = {"mlp": 12, "user": 12, "gpt": 4, "fabric": 12}, {"mlp": 40, "user": 40, "gpt": 10, "fabric": 40}
        return (quick if args.quick else full)[w]

    plan_list: list[tuple[str, str, bool]] = []  # (workload, variant, with floor)
    for w in workloads:
        variants = {"user": USER_VARIANTS, "fabric": FABRIC_VARIANTS}.get(w, MAIN_VARIANTS)
        plan_list += [(w, v, True) for v in variants]
        if args.sweep_buckets and w == "mlp":
            plan_list += [(w, v, False) for v in SWEEP_VARIANTS]

    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    loads: list[float] = []
    failures: list[str] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dp_throughput-") as tmpdir:
        tmp = Path(tmpdir)
        for r in range(rounds):
            for w in workloads:
                todo = [(v, floor) for (ww, v, floor) in plan_list if ww == w]
                # A new (seeded) order every round: who goes first, and who runs right after whom (a run can
                # leave the machine in a state that slows the next one), are spread over all variants.
                order = todo if r == 0 else random.Random(r).sample(todo, len(todo))
                for v, floor in order:
                    phases = ["sync", "nosync"] if floor else ["sync"]
                    if r % 2:
                        phases.reverse()
                    t0 = time.perf_counter()
                    tag = f"r{r}-{w}-{len(loads)}"
                    try:
                        res = _run_worker(
                            w, v, phases, steps_for(w), warmup, tmp, tag, args.timeout, args.profile, args.wait_quiet
                        )
                    except RuntimeError as err:  # report, keep going: the other runs still mean something
                        failures.append(f"round {r + 1} {w} {v}: {str(err).splitlines()[0]}")
                        print(f"[round {r + 1}/{rounds}] FAILED: {err}", file=sys.stderr, flush=True)
                        continue
                    runs.setdefault((w, v), []).append(res)
                    loads.append(res["load_before"])
                    step = median_ms(res["sync"]["batch_s"])
                    floor_ms = median_ms(res["nosync"]["batch_s"]) if floor else None
                    print(
                        f"[round {r + 1}/{rounds}] {w:4s} {v:21s} step {fmt(step, '8.1f')} ms  floor"
                        f" {fmt(floor_ms, '8.1f')} ms  ({time.perf_counter() - t0:5.1f}s)",
                        file=sys.stderr,
                        flush=True,
                    )

    rows = []
    for w in workloads:
        base = None
        for ww, v, _ in plan_list:
            if ww != w:
                continue
            rs = runs.get((w, v), [])
            floor_rs = runs.get((w, FLOOR_OF.get(v, v)), [])
            if not rs or not floor_rs:
                continue  # every run of it (or of its floor) failed: listed under "failures"
            step_rounds = [median_ms(r["sync"]["batch_s"]) for r in rs]
            floor_rounds = [median_ms(r["nosync"]["batch_s"]) for r in floor_rs]
            comm_rounds = [r["sync"]["comm_alone_ms"] for r in rs if r["sync"].get("comm_alone_ms") is not None]
            step = statistics.median(step_rounds)
            floor = statistics.median(floor_rounds)
            comm = statistics.median(comm_rounds) if comm_rounds else None
            if v == "ddp":
                base = step
            row: dict[str, Any] = {
                "workload": w,
                "variant": v,
                "params": rs[0]["params"],
                "ms_per_step": round(step, 2),
                "floor_ms": round(floor, 2),
                "floor_of": FLOOR_OF.get(v, v),
                "ratio_to_ddp": round(step / base, 3) if base else None,
                "exposed_comm_fraction": round((step - floor) / step, 3),
                "comm_alone_ms": round(comm, 2) if comm is not None else None,
                "comm_hidden_fraction": round((floor + comm - step) / comm, 3) if comm else None,
                "period_ms": round(statistics.median([median_ms(r["sync"]["period_s"]) for r in rs]), 2),
                "floor_period_ms": round(statistics.median([median_ms(r["nosync"]["period_s"]) for r in floor_rs]), 2),
                "page_faults_per_step": statistics.median([statistics.median(r["sync"]["page_faults"]) for r in rs]),
                "floor_page_faults_per_step": statistics.median(
                    [statistics.median(r["nosync"]["page_faults"]) for r in floor_rs]
                ),
                "round_ms": [round(x, 2) for x in step_rounds],
                "floor_round_ms": [round(x, 2) for x in floor_rounds],
                "replicas_equal": [r["sync"]["replicas_equal"] for r in rs],
                "floor_replicas_equal": [r["nosync"]["replicas_equal"] for r in floor_rs],
                "frames_compiled": max(
                    r[ph].get("frames_compiled", 0) for r in rs for ph in ("sync", "nosync") if ph in r
                ),
                # the first step (compile included; Inductor's cache may be warm after round 1): per round, seconds
                "first_step_s": [round(r["sync"]["warmup_s"][0], 2) for r in rs if r["sync"]["warmup_s"]],
            }
            keys = ("step_ms", "forward_backward_ms", "optimizer_update_ms", "exposed_comm_ms", "strategy_ms")
            for rank in (0, 1):  # --profile: the per-step breakdown of the profiled steps (median of each term)
                profiled = [b for r in rs for b in (r["sync"].get("breakdown_by_rank") or [[], []])[rank] or []]
                if profiled:
                    row.setdefault("breakdown_ms", {})[f"rank{rank}"] = {
                        k: round(statistics.median(b[k] for b in profiled), 2) for k in keys
                    }
            if VARIANTS[v][0] == "sgdtp":
                plan = rs[0]["sync"]["plan"]
                row["graphs"] = len(plan["graphs"])
                row["buckets"] = sum(g["buckets"] for g in plan["graphs"])
                row["bucket_bytes"] = [n for g in plan["graphs"] for n in g["bucket_bytes"]]
                row["bytes_per_step"] = plan["bytes_per_step"]
                row["graph_breaks"] = sum(plan["graph_breaks"].values())
            else:
                row["bucket_bytes"] = rs[0]["sync"]["ddp_bucket_bytes"]
            rows.append(row)

    header = (
        f"{'workload':8s} {'variant':21s} {'ms/step':>8s} {'floor':>7s} {'comm':>6s} {'x ddp':>6s} {'exposed':>8s}"
        f" {'hidden':>7s} {'1st step':>8s}  {'rounds ms/step':16s} buckets (MiB)"
    )
    print(header)
    print("-" * (len(header) + 12))
    for row in rows:
        spread = "/".join(f"{x:.0f}" for x in row["round_ms"])
        buckets = "+".join(f"{n / 2**20:.3g}" for n in row["bucket_bytes"])
        if "graphs" in row:
            buckets += f" in {row['graphs']} graph(s), {row['bytes_per_step']['total'] / 2**20:.1f} MiB/step"
        hidden = row["comm_hidden_fraction"]
        print(
            f"{row['workload']:8s} {row['variant']:21s} {row['ms_per_step']:8.1f} {row['floor_ms']:7.1f}"
            f" {fmt(row['comm_alone_ms'], '6.1f')} {fmt(row['ratio_to_ddp'], '6.2f')}"
            f" {100 * row['exposed_comm_fraction']:7.1f}% {fmt(None if hidden is None else 100 * hidden, '6.0f')}%"
            f" {fmt(statistics.median(row['first_step_s']) if row['first_step_s'] else None, '7.1f')}s"
            f"  {spread:16s} {buckets}"
        )
    profiled_rows = [r for r in rows if "breakdown_ms" in r]
    if profiled_rows:
        print("\nBreakdown of the profiled steps (torch.profiler, rank 0, median per term, ms; profiling slows steps):")
        print(
            f"{'workload':8s} {'variant':21s} {'step':>7s} {'fwd+bwd':>8s} {'update':>7s} {'waits':>7s} {'strategy':>8s}"
        )
        for r in profiled_rows:
            for rank, b in r["breakdown_ms"].items():
                print(
                    f"{r['workload']:8s} {r['variant'] + ' ' + rank:21s} {b['step_ms']:7.1f} {b['forward_backward_ms']:8.1f}"
                    f" {b['optimizer_update_ms']:7.1f} {b['exposed_comm_ms']:7.1f} {b['strategy_ms']:8.2f}"
                )
    sync_ok = all(all(r["replicas_equal"]) for r in rows) if rows else None
    floor_off = all(not any(r["floor_replicas_equal"]) for r in rows) if rows else None
    uncompiled = ("ddp", "ddp+fused-opt")  # the variants that compile nothing
    compiled_ok = all((r["frames_compiled"] > 0) == (r["variant"] not in uncompiled) for r in rows) if rows else None
    busy = statistics.median(loads) if loads else 0.0
    print(
        "\nms/step: median over rounds of the per-run median batch time (rank 0, warm-up dropped). floor: the same"
        " variant, gradient communication off. comm: this variant's buckets all-reduced alone (ranks idle)."
        "\nx ddp = ms/step / ddp's; exposed = (ms/step - floor) / ms/step; hidden = (floor + comm - ms/step) / comm"
        " (100%: communication fully overlapped, 0%: fully serialized)."
        f"\nChecks: replicas identical after every synced run: {sync_ok}; replicas diverged after every floor run:"
        f" {floor_off}; Dynamo compiled frames in every compiled variant and none in ddp / ddp+fused-opt: {compiled_ok}. Other processes used {100 * busy:.0f}% (median; max {100 * max(loads, default=0.0):.0f}%) of the CPUs"
        f" just before each run{' -- BUSY MACHINE: times are inflated and noisy' if busy > QUIET else ''}."
        f" Total {time.perf_counter() - started:.0f}s."
    )
    target_rows = {r["variant"]: r for r in rows if r["workload"] == TARGET["workload"]}
    verdict = None
    if "sgdtp" in target_rows and target_rows["sgdtp"]["ratio_to_ddp"] is not None:
        s = target_rows["sgdtp"]
        verdict = {
            "ratio_met": s["ratio_to_ddp"] <= TARGET["ratio_to_ddp"],
            "stretch_met": s["ratio_to_ddp"] <= TARGET["stretch_ratio_to_ddp"],
            "exposed_met": s["exposed_comm_fraction"] <= TARGET["exposed_comm_fraction"],
        }
    sgdtp_rows = [r for r in rows if r["variant"] == "sgdtp" and r["ratio_to_ddp"] is not None]
    if sgdtp_rows:
        verdict = (verdict or {}) | {
            "no_workload_above_ddp": all(r["ratio_to_ddp"] <= 1.0 for r in sgdtp_rows),
            "gpt_met": all(r["ratio_to_ddp"] <= 0.95 for r in sgdtp_rows if r["workload"] == "gpt") or None,
        }
    summary = {
        "benchmark": "dp_throughput",
        "config": {
            "ranks": 2,
            "backend": "gloo",
            "threads_per_rank": 1,
            "batch_per_rank": 32,
            "rounds": rounds,
            "warmup_steps": warmup,
            "timed_steps": {w: steps_for(w) for w in workloads},
            "cpu_count": os.cpu_count(),
            "torch": version("torch"),
            "lightning": version("lightning"),
            "lightning_sgdtp": version("lightning-sgdtp"),
            "plugin_commit": git_commit(),
        },
        "other_cpu_busy": {"median": round(busy, 3), "max": round(max(loads, default=0.0), 3)},
        "results": rows,
        "target": TARGET,
        "target_met": verdict,
        "checks": {
            "replicas_equal_after_sync": sync_ok,
            "replicas_diverged_without_sync": floor_off,
            "compiled_variants_compiled": compiled_ok,
        },
        "failures": failures,
    }
    for failure in failures:
        print(f"FAILED: {failure}")
    print(json.dumps(summary, separators=(",", ":")))
    return 1 if failures else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="user,mlp,gpt,fabric", help="comma-separated subset of: user,mlp,gpt,fabric")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; --quick: 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default user/mlp 40, gpt 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps per run, compile included (5)")
    p.add_argument("--quick", action="store_true", help="~2-minute smoke: 1 round, few steps")
    p.add_argument(
        "--sweep-buckets",
        action="store_true",
        help="MLP extras: sgdtp with bucket_cap_mb 4 and 100, overlap=False, bf16 wire",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write torch.profiler tables and traces of the timed steps (each rank) to this folder; slows steps",
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="before each run, wait up to this long for other processes to leave the CPUs idle (shared machines)",
    )
    p.add_argument("--timeout", type=float, default=600, help="hard limit per worker, seconds")
    # internal: one (workload, variant) run, started by the driver (and re-run by Lightning for rank 1)
    p.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--phases", default="sync,nosync", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    if args.worker:
        workload, variant = args.worker
        if workload == "fabric":
            if "," in args.phases:
                raise SystemExit("the fabric workload runs one phase per worker (one model per Fabric)")
            _fabric_worker(variant, args.out, args.steps, args.warmup, args.phases)
            sys.exit(0)
        _worker(workload, variant, args.out, args.steps, args.warmup, args.phases.split(","), args.profile)
        sys.exit(0)
    sys.exit(main_driver(args))
