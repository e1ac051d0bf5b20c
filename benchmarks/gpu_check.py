"""The GPU check: what ``strategy="sgdtp"`` does on CUDA + NCCL, measured in one call, for docs/hardware.md.

    python benchmarks/gpu_check.py                  # on a CUDA machine: < 8 min on one GPU; writes the results file
    python benchmarks/gpu_check.py --dry-run        # anywhere, in seconds: every part listed as skipped, with why
    python benchmarks/gpu_check.py --only eager,sgdtp --budget 240 --out /tmp/gpu_check.json

No GPU has run this project yet (docs/hardware.md): every CUDA path below runs here for the first time. Each part is
one training run, in its own subprocess with a hard timeout, of ``examples/gpt.py``'s ``GPTLightningModule`` (the
module users write: ``self.log`` and a torchmetrics perplexity in ``training_step``, AdamW) on
``examples/data.py``'s corpus, the same windows in the same order in every part (the order Lightning's shuffling
sampler gives), the same seed and the same global batch (each rank loads ``batch_size / dp``):

- ``eager``: Lightning's own strategy (``"auto"``), no compile: the reference every parity check compares with.
- ``sgdtp``: ``SGDTPStrategy()`` data parallel on 1 GPU, the step compiled, CUDA graphs off (Inductor's default).
- ``auto+compile``: Lightning ``"auto"`` with the module's network compiled by ``torch.compile`` (default Inductor),
  the baseline of the tokens/s ratio.
- ``sgdtp-cudagraphs``: ``sgdtp`` with Inductor's CUDA graphs on. The strategy has no option for them (it never sets
  them); this part sets ``torch._inductor.config.triton.cudagraphs`` (``TORCHINDUCTOR_CUDAGRAPHS=1``) in the process,
  and counts the graphs Inductor declined to capture (``cudagraph_skips``).
- ``sgdtp-bf16`` / ``auto+compile-bf16``: the same two with ``precision="bf16-mixed"``.
- with 2 GPUs (else listed as skipped, "needs 2 GPUs"): ``sgdtp-dp2`` and its baseline ``ddp+compile-dp2``,
  ``sgdtp-tensor2``, ``sgdtp-sequence2`` (tensor parallel with ``sequence_parallel=True``: its CUDA default stays
  off until this part passes), ``sgdtp-sharded2`` (``sharding="full"``), ``sgdtp-pipeline2``; with 4: ``sgdtp-hybrid4``.
  Multi-GPU parts are launched by Lightning's own launcher (it re-runs the worker's command line for each rank).

Derived from the runs (no extra training): parity, each compiled run against ``eager`` (bf16: against
``auto+compile-bf16``): the relative difference of the parameter updates after ``--parity-steps`` optimizer steps,
``||(p_run - p_0) - (p_ref - p_0)|| / ||p_ref - p_0||`` over every parameter (gathered whole from shards and stages),
passed below ``--tolerance``; and tokens/s ratios, sgdtp over Lightning + ``torch.compile`` measured in this run.

Timing: rank 0, ``torch.cuda.synchronize()`` before and after each batch (``on_train_batch_start`` ->
``on_train_batch_end``); the first ``--warmup`` batches (compilation, CUDA graph recording) are dropped; tokens/s =
global tokens per step / the median of the rest. The whole script stays within ``--budget`` seconds: each part's
timeout is the smaller of ``--part-timeout`` and what is left, and a part that no longer fits is skipped, named.

Results: ``--out`` (default ``benchmarks/results/gpu_check.json``; a dry run writes ``gpu_check.dry-run.json`` so it
never replaces a real result), one entry per part and per check with its status (passed / failed / timed out /
skipped / measured) and reason; each part's log beside it (``<out>.logs/``). Exit code 0 when nothing failed, 1 when a
part or a check failed, 2 when there is no CUDA device and no ``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
RESULTS = REPO / "benchmarks" / "results"

from harness import QUIET_TRAINER, git_commit, run_reaped, version, worker_env

SEED = 1234
#: The options that shape the measurement, copied into the results file.
CONFIG_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "warmup", "steps", "parity_steps")
CONFIG_KEYS += ("tolerance", "bf16_tolerance", "budget", "part_timeout")
#: Below this many seconds of budget left, a part is not started (startup and compile alone take longer).
MIN_PART_S = 45.0


@dataclass(frozen=True)
class Part:
    """One training run: a strategy on ``devices`` GPUs (``dp`` of them split the batch)."""

    name: str
    what: str
    strategy: str  # "sgdtp", or a Lightning strategy name
    devices: int = 1
    dp: int = 1
    compile: bool = False  # torch.compile the module's network (Lightning strategies; sgdtp compiles itself)
    precision: str = "32-true"
    cudagraphs: bool = False
    sgdtp: dict[str, Any] = field(default_factory=dict)
    parity_with: str | None = "eager"  # the run whose parameters this one must match
    baseline: str | None = None  # the Lightning + torch.compile run of its tokens/s ratio


#: In order of priority: when the budget runs short, the last ones are skipped.
PARTS = (
    Part("eager", "Lightning strategy='auto', eager, fp32 (the parity reference)", "auto", parity_with=None),
    Part("sgdtp", "SGDTPStrategy() data parallel on 1 GPU, compiled, CUDA graphs off, fp32", "sgdtp",
         baseline="auto+compile"),
    Part("auto+compile", "Lightning strategy='auto' + torch.compile(network), fp32", "auto", compile=True),
    Part("sgdtp-cudagraphs", "SGDTPStrategy() on 1 GPU, Inductor CUDA graphs on, fp32", "sgdtp", cudagraphs=True,
         baseline="auto+compile"),
    Part("sgdtp-bf16", "SGDTPStrategy() on 1 GPU, precision='bf16-mixed'", "sgdtp", precision="bf16-mixed",
         parity_with="auto+compile-bf16", baseline="auto+compile-bf16"),
    Part("auto+compile-bf16", "Lightning strategy='auto' + torch.compile(network), bf16-mixed", "auto", compile=True,
         precision="bf16-mixed", parity_with=None),
    Part("sgdtp-dp2", "SGDTPStrategy() data parallel on 2 GPUs (NCCL)", "sgdtp", devices=2, dp=2,
         baseline="ddp+compile-dp2"),
    Part("ddp+compile-dp2", "Lightning strategy='ddp' + torch.compile(network) on 2 GPUs", "ddp", devices=2, dp=2,
         compile=True),
    Part("sgdtp-tensor2", "SGDTPStrategy(parallelism='tensor') on 2 GPUs", "sgdtp", devices=2,
         sgdtp={"parallelism": "tensor", "tensor_parallel_size": 2}),
    Part("sgdtp-sequence2", "SGDTPStrategy(parallelism='tensor', sequence_parallel=True) on 2 GPUs", "sgdtp",
         devices=2, sgdtp={"parallelism": "tensor", "tensor_parallel_size": 2, "sequence_parallel": True}),
    Part("sgdtp-sharded2", "SGDTPStrategy(sharding='full') on 2 GPUs", "sgdtp", devices=2, dp=2,
         sgdtp={"sharding": "full"}),
    Part("sgdtp-pipeline2", "SGDTPStrategy(pipeline_stages=2) on 2 GPUs, 1F1B", "sgdtp", devices=2,
         sgdtp={"pipeline_stages": 2}),
    Part("sgdtp-hybrid4", "SGDTPStrategy(parallelism='hybrid', tensor_parallel_size=2) on 4 GPUs (dp 2 x tp 2)",
         "sgdtp", devices=4, dp=2, sgdtp={"parallelism": "hybrid", "tensor_parallel_size": 2}),
)  # fmt: skip
BY_NAME = {p.name: p for p in PARTS}


# ------------------------------------------------------------------------------------------------ worker
def _plain_name(name: str) -> str:
    """A parameter's name without the wrappers' segments (torch.compile, activation checkpointing)."""
    return ".".join(s for s in name.split(".") if s not in ("_orig_mod", "_checkpoint_wrapped_module"))


def _full_params(module: Any) -> dict[str, Any]:
    """Every parameter as a whole fp32 CPU tensor, by plain name, merged over the ranks (shards gathered, each
    pipeline stage's own). A collective: every rank calls it at the same point."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    local = {}
    for name, p in module.named_parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if not t.is_meta:
            local[_plain_name(name)] = t.float().cpu().clone()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    merged: dict[str, Any] = {}
    for held in every:
        for name, t in held.items():
            merged.setdefault(name, t)
    return merged


def _worker(args: argparse.Namespace) -> None:
    """One part (Lightning's launcher re-runs this command line for ranks 1..N-1); rank 0 writes ``--out``."""
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader, DistributedSampler

    sys.path.insert(0, str(REPO / "examples"))
    from data import WindowDataset, load_corpus
    from gpt import GPTLightningModule

    part = BY_NAME[args.worker]
    cuda = args.accelerator != "cpu"
    if part.cudagraphs:
        import torch._inductor.config

        torch._inductor.config.triton.cudagraphs = True
    L.seed_everything(SEED, verbose=False)
    tokens = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
    train = WindowDataset(tokens[: int(0.9 * len(tokens))], args.block_size)
    # The same batches in every part: under a distributed strategy Lightning gives the training loader its own
    # DistributedSampler, shuffled with PL_GLOBAL_SEED (set by seed_everything), over the data-parallel ranks; a
    # one-device part gets that sampler's permutation here (Lightning keeps a DistributedSampler it is given).
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=SEED) if part.devices == 1 else None
    loader = DataLoader(train, batch_size=args.batch_size // part.dp, sampler=sampler, drop_last=True)
    model = GPTLightningModule(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, dropout=0.0
    )
    if part.compile:
        model.model = torch.compile(model.model)
    if part.strategy == "sgdtp":
        from lightning_sgdtp import SGDTPStrategy

        strategy: Any = SGDTPStrategy(**part.sgdtp)
    else:
        strategy = part.strategy

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    class Probe(Callback):
        """Per-batch times and losses (rank 0), and the parameters before training and after ``parity_steps``."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float | None] = []
            self.params: dict[str, Any] = {}
            self._t0 = 0.0

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.params["init"] = _full_params(pl_module)

        def on_train_batch_start(self, trainer: L.Trainer, *rest: Any) -> None:
            sync()
            self._t0 = time.perf_counter()

        def on_train_batch_end(
            self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *rest: Any
        ) -> None:
            sync()
            self.times.append(time.perf_counter() - self._t0)
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if loss is None:  # a pipeline's first stage: the loss is on the last one
                loss = trainer.callback_metrics.get("train_loss")
            self.losses.append(None if loss is None else float(loss))
            if trainer.global_step == args.parity_steps and "after" not in self.params:
                self.params["after"] = _full_params(pl_module)

    probe = Probe()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=part.devices,
        strategy=strategy,
        precision=part.precision,  # type: ignore[arg-type]
        max_steps=args.warmup + args.steps,
        callbacks=[probe],
        default_root_dir=str(Path(args.out).with_suffix("")),
        **QUIET_TRAINER,
    )
    t0 = time.perf_counter()
    trainer.fit(model, loader)
    fit_s = time.perf_counter() - t0
    if trainer.global_rank != 0:
        return
    timed = probe.times[args.warmup :]
    median_s = statistics.median(timed) if timed else None
    global_tokens = args.batch_size * args.block_size
    result: dict[str, Any] = {
        "part": part.name,
        "fit_s": round(fit_s, 2),
        "first_step_s": round(probe.times[0], 3) if probe.times else None,
        "step_ms": [round(1e3 * t, 3) for t in timed],
        "median_step_ms": round(1e3 * median_s, 3) if median_s else None,
        "tokens_per_step": global_tokens,
        "tokens_per_s": round(global_tokens / median_s, 1) if median_s else None,
        "losses": probe.losses,
        "losses_finite": all(x is None or math.isfinite(x) for x in probe.losses),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
        "graph_breaks": sum(counters["graph_break"].values()),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
        "gpu": torch.cuda.get_device_name() if cuda else None,
    }
    if part.strategy == "sgdtp":
        result["plan"] = json.loads(json.dumps(trainer.strategy.plan, default=str))
    params_file = Path(args.out).with_suffix(".params.pt")
    torch.save(probe.params, params_file)
    result["params_file"] = str(params_file)
    Path(args.out).write_text(json.dumps(result))


# ------------------------------------------------------------------------------------------------ driver
def _skip_reason(part: Part, args: argparse.Namespace, cuda: bool, gpus: int) -> str | None:
    need = f"needs {part.devices} GPUs (torch.cuda.device_count() is {gpus})"
    if not cuda:
        why = "no CUDA device (torch.cuda.is_available() is False)"
        return why + (f"; {need}" if part.devices > 1 else "")
    if gpus < part.devices:
        return need
    if args.only and part.name not in args.only:
        return "not in --only"
    if args.dry_run:
        return "--dry-run"
    if args.batch_size % part.dp:
        return f"--batch-size {args.batch_size} does not divide by its {part.dp} data-parallel ranks"
    return None


def _run_part(part: Part, args: argparse.Namespace, logs: Path, timeout: float) -> dict[str, Any]:
    out = logs / f"{part.name}.json"
    log = logs / f"{part.name}.log"
    env = worker_env()
    if part.cudagraphs:  # on, and Inductor's reasons for each graph it does not capture logged
        env.update(TORCHINDUCTOR_CUDAGRAPHS="1", TORCH_LOGS="cudagraphs")
    cmd = [sys.executable, str(SCRIPT), "--worker", part.name, "--out", str(out)]
    for flag in ("steps", "warmup", "parity_steps", "n_layer", "n_head", "n_embd", "block_size", "batch_size"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    t0 = time.monotonic()
    rc = run_reaped(cmd, REPO, env, log, timeout)
    entry: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1), "log": str(log)}
    text = log.read_text(errors="replace") if log.exists() else ""
    tail = text[-3000:]
    skips = sorted({line.strip() for line in text.splitlines() if "skipping cudagraphs" in line})
    if rc is None:
        return {**entry, "status": "timed out", "reason": f"no result within {timeout:.0f} s", "log_tail": tail}
    if rc != 0 or not out.exists():
        return {**entry, "status": "failed", "reason": f"exit code {rc}", "log_tail": tail}
    result = json.loads(out.read_text())
    if skips:
        result["cudagraph_skip_messages"] = skips
    if not result["losses_finite"]:
        return {**entry, **result, "status": "failed", "reason": "a loss is not finite"}
    return {**entry, **result, "status": "passed", "reason": "trained"}


def _not_passed(runs: dict[str, dict[str, Any]], *names: str) -> str | None:
    """Why a check cannot be made: e.g. ``needs sgdtp (skipped), eager (skipped)``; None when every run passed."""
    missing = [f"{n} ({runs[n]['status']})" for n in names if runs[n]["status"] != "passed"]
    return f"needs {', '.join(missing)}" if missing else None


def _rel_update_diff(init: dict[str, Any], ref: dict[str, Any], run: dict[str, Any]) -> float:
    """||(run - init) - (ref - init)|| / ||ref - init|| over every parameter."""
    num = sum(float((run[k] - ref[k]).norm() ** 2) for k in ref) ** 0.5
    den = sum(float((ref[k] - init[k]).norm() ** 2) for k in ref) ** 0.5
    return num / den if den else math.inf


def _parity(part: Part, runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    ref_name = part.parity_with
    assert ref_name is not None
    tol = args.bf16_tolerance if part.precision.startswith("bf16") else args.tolerance
    entry: dict[str, Any] = {"name": f"parity {part.name} vs {ref_name}", "kind": "parity", "tolerance": tol}
    missing = _not_passed(runs, part.name, ref_name)
    if missing:
        return {**entry, "status": "skipped", "reason": missing}
    ref = torch.load(runs[ref_name]["params_file"])
    run = torch.load(runs[part.name]["params_file"])
    if "after" not in ref or "after" not in run:
        return {**entry, "status": "failed", "reason": f"fewer than --parity-steps {args.parity_steps} steps ran"}
    if ref["after"].keys() != run["after"].keys():
        only = sorted(set(ref["after"]) ^ set(run["after"]))[:5]
        return {**entry, "status": "failed", "reason": f"the parameter names differ, e.g. {only}"}
    shapes = [k for k in ref["after"] if ref["after"][k].shape != run["after"][k].shape]
    if shapes:
        return {**entry, "status": "failed", "reason": f"shapes differ (a shard, not the whole tensor?): {shapes[:5]}"}
    same_init = max(float((run["init"][k] - ref["init"][k]).abs().max()) for k in ref["init"])
    rel = _rel_update_diff(ref["init"], ref["after"], run["after"])
    ok = rel < tol and same_init == 0.0
    why = f"relative update difference {rel:.3g} {'<' if rel < tol else '>='} {tol:g} after {args.parity_steps} steps"
    if same_init:
        why += f"; the initial parameters differ by {same_init:.3g} (seeding)"
    return {**entry, "status": "passed" if ok else "failed", "reason": why, "rel_update_diff": rel,
            "init_max_abs_diff": same_init}  # fmt: skip


def _ratio(part: Part, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base = part.baseline
    assert base is not None
    entry: dict[str, Any] = {"name": f"tokens/s {part.name} / {base}", "kind": "ratio"}
    missing = _not_passed(runs, part.name, base)
    if missing:
        return {**entry, "status": "skipped", "reason": missing}
    ratio = runs[part.name]["tokens_per_s"] / runs[base]["tokens_per_s"]
    return {**entry, "status": "measured", "reason": f"{ratio:.3f}x", "ratio": round(ratio, 3)}


def _environment(cuda: bool) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "lightning": version("lightning"),
        "lightning_sgdtp": version("lightning-sgdtp"),
        "commit": git_commit(),
        "cuda_available": cuda,
        "gpus": [],
    }
    if cuda:
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    return env


def main_driver(args: argparse.Namespace) -> int:
    import torch

    start = time.monotonic()
    deadline = start + args.budget
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    if not cuda and not args.dry_run:
        print(
            f"gpu_check: no CUDA device here (torch.cuda.is_available() is False; torch {torch.__version__}). This"
            " script checks the GPU paths: run it on a machine with a CUDA GPU, or pass --dry-run to list the parts"
            " it would run and write the results file with each one skipped.",
            file=sys.stderr,
        )
        return 2
    bad = sorted(set(args.only) - set(BY_NAME))
    if bad:
        raise SystemExit(f"--only: unknown part(s) {bad}; choose from {list(BY_NAME)}")
    out = Path(args.out) if args.out else RESULTS / ("gpu_check.dry-run.json" if args.dry_run else "gpu_check.json")
    logs = out.with_suffix(".logs")
    print(f"gpu_check: {'dry run, ' if args.dry_run else ''}{gpus} GPU(s), budget {args.budget:.0f} s, results {out}")
    runs: dict[str, dict[str, Any]] = {}
    for i, part in enumerate(PARTS, 1):
        entry: dict[str, Any] = {"name": part.name, "kind": "run", "what": part.what, "devices": part.devices}
        why = _skip_reason(part, args, cuda, gpus)
        left = deadline - time.monotonic()
        if why is None and left < MIN_PART_S:
            why = f"time budget: {left:.0f} s of --budget {args.budget:.0f} s left (a part needs {MIN_PART_S:.0f} s)"
        print(f"[{i:>2}/{len(PARTS)}] {part.name:<18} {part.what}")
        if why is not None:
            runs[part.name] = {**entry, "status": "skipped", "reason": why}
        else:
            logs.mkdir(parents=True, exist_ok=True)
            runs[part.name] = {**entry, **_run_part(part, args, logs, min(args.part_timeout, left))}
        r = runs[part.name]
        figures = ""
        if "tokens_per_s" in r:
            figures = f", {r['tokens_per_s']:,.0f} tokens/s, first step {r['first_step_s']:.1f} s"
        print(f"        {part.name:<18} {r['status']}: {r['reason']}{figures}", flush=True)
    checks = [_parity(p, runs, args) for p in PARTS if p.parity_with] + [_ratio(p, runs) for p in PARTS if p.baseline]
    print("checks:")
    for c in checks:
        print(f"        {c['name']:<40} {c['status']}: {c['reason']}")
    entries = list(runs.values()) + checks
    statuses = {e["status"] for e in entries}
    status = "failed" if statuses & {"failed", "timed out"} else "passed" if "passed" in statuses else "skipped"
    results = {
        "benchmark": "gpu_check",
        "status": status,
        "dry_run": args.dry_run,
        "environment": _environment(cuda),
        "config": {k: getattr(args, k) for k in CONFIG_KEYS},
        "parts": entries,
        "total_s": round(time.monotonic() - start, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"gpu_check: {status} in {results['total_s']:.0f} s; results in {out}")
    return 1 if status == "failed" else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="list every part as skipped, run nothing, write the file")
    p.add_argument("--out", default=None, help="results file (default benchmarks/results/gpu_check.json)")
    p.add_argument("--only", default="", help=f"comma-separated parts to run, of: {','.join(BY_NAME)}")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole script (450)")
    p.add_argument("--part-timeout", type=float, default=150.0, help="hard limit per part, seconds (150)")
    p.add_argument("--warmup", type=int, default=10, help="untimed first steps: compile, CUDA graph recording (10)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per part (30)")
    p.add_argument("--parity-steps", type=int, default=5, help="optimizer steps before the parity snapshot (5)")
    p.add_argument("--tolerance", type=float, default=1e-2, help="parity bound, fp32 (relative update difference)")
    p.add_argument("--bf16-tolerance", type=float, default=0.1, help="parity bound, bf16-mixed against bf16-mixed")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="global batch (each rank loads batch / dp)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--accelerator", default="gpu", help=argparse.SUPPRESS)  # worker only: "cpu" tests this script
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    if args.parity_steps > args.warmup + args.steps:
        p.error(f"--parity-steps {args.parity_steps} exceeds the steps run ({args.warmup + args.steps})")
    return args


if __name__ == "__main__":
    args = parse_args()
    if args.worker:
        _worker(args)
        sys.exit(0)
    sys.exit(main_driver(args))
