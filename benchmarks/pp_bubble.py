"""Pipeline bubble and activation memory per schedule: GPipe, 1F1B, interleaved 1F1B, measured in one run.

Every schedule trains the same GPT with ``lightning_sgdtp``'s pipeline runner (the code behind
``SGDTPStrategy(pipeline_stages=..., pipeline_chunks=...)``: stages traced by torch's pipeline frontend, run by
``torch.distributed.pipelining``'s schedules, each stage compiled through the ``"sgdtp"`` backend), on
``--stages`` CPU ranks (gloo, one thread each). Per schedule and rank:

- **bubble** = 1 - busy / step: ``busy`` is the time this rank spent computing (its stages' forward and
  backward of every micro-batch, and the loss), timed around torch's own ``forward_one_chunk`` /
  ``backward_one_chunk``; ``step`` the wall time of the whole schedule. Theory, balanced stages:
  (p-1)/(m+p-1), and (p-1)/(v*m+p-1) with v stages per rank (interleaved);
- **peak activation memory**: the most bytes of tensors saved for backward alive at once on the rank
  (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded, shared storage counted once), one
  extra step, eager. GPipe keeps the activations of all m micro-batches, 1F1B of at most p - stage.

Targets: 1F1B's measured bubble within 10% of the theory (relative: |measured - theory| <= 0.1 x theory,
averaged over ranks and steps), 1F1B's peak activation memory below GPipe's on every stage.

    python benchmarks/pp_bubble.py            # 2 stages x 8 micro-batches, 3 schedules (~4 min on 2 cores)
    python benchmarks/pp_bubble.py --quick    # smaller model, fewer steps (~40 s)

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, fmt, free_port, git_commit, version

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

THEORY = "(p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1)"


def build_module(args: argparse.Namespace) -> Any:
    from gpt import GPTLightningModule

    class LossOnly(GPTLightningModule):
        """The example GPT, its training_step without metrics: the benchmark times the pipeline, not logging."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self(x)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    torch.manual_seed(0)
    return LossOnly(vocab_size=64, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0)


class Busy:
    """Wall time spent inside the wrapped compute calls (forward/backward of a chunk, the loss)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(obj, name, timed)


class SavedBytes:
    """Bytes of activations saved for backward alive now, and the peak (storage counted once)."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.live, self.peak = params, {}, 0
        self.now = 0

    def pack(self, t: torch.Tensor) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if id(t) in self.params or key in self.params or storage.nbytes() == 0:
            return t
        count, nbytes = self.live.get(key, (0, storage.nbytes()))
        if count == 0:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        self.live[key] = (count + 1, nbytes)
        return _Release(t, key, self)

    def unpack(self, packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Release) else packed

    def release(self, key: int) -> None:
        count, nbytes = self.live[key]
        if count == 1:
            del self.live[key]
            self.now -= nbytes
        else:
            self.live[key] = (count - 1, nbytes)


class _Release:
    def __init__(self, tensor: torch.Tensor, key: int, owner: SavedBytes) -> None:
        self.tensor, self.key, self.owner = tensor, key, owner

    def __del__(self) -> None:
        self.owner.release(self.key)


def worker(rank: int, world: int, port: int, schedule: str, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from lightning_sgdtp.compiler.backend import CompileSettings, SGDTPCompiler
    from lightning_sgdtp.parallel.pipeline.runner import PipelineRunner
    from lightning_sgdtp.parallel.pipeline.schedules import stages_per_rank
    from lightning_sgdtp.parallel.pipeline.split import plan_pipeline_split

    module = build_module(args)
    stages = world * stages_per_rank(schedule, None)
    split = plan_pipeline_split(module, stages)
    # One pipeline, no data parallel: nothing to average (as the strategy's plan decides).
    compiler = SGDTPCompiler(settings=CompileSettings(in_graph_sync=False))
    prepare = (lambda stage: stage.compile(backend=compiler)) if args.compile else None
    runner = PipelineRunner(module, split, schedule, args.chunks, dist.group.WORLD, torch.device("cpu"), prepare)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batch_size = args.chunks * args.micro_batch
    x = torch.randint(0, 64, (batch_size, args.seq), generator=g)
    batch = (x, torch.roll(x, -1, dims=1))

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        runner.run("training_step", batch, i)
        runner.sum_tied_gradients()
        opt.step()

    step(0)  # traces and compiles the stages
    busy, schedule_time = Busy(), Busy()
    for built in runner._built.values():
        for stage in built.stages:
            busy.wrap(stage, "forward_one_chunk")
            busy.wrap(stage, "backward_one_chunk")
        busy.wrap(built.schedule, "_compute_loss")
        # The pipeline alone (not the optimizer, not the loss broadcast), until the last rank is done: the last
        # stage's own step ends before stage 0's final backward, which is still part of the pipeline's time.
        run_schedule = built.schedule.step

        def step_to_the_end(*a: Any, _run: Any = run_schedule, **k: Any) -> Any:
            out = _run(*a, **k)
            dist.barrier()
            return out

        built.schedule.step = step_to_the_end
        schedule_time.wrap(built.schedule, "step")
    for i in range(args.warmup):
        step(i + 1)
    steps, busys = [], []
    for i in range(args.steps):
        dist.barrier()
        busy.seconds = schedule_time.seconds = 0.0
        step(i)
        steps.append(schedule_time.seconds)
        busys.append(busy.seconds)
    # peak activation memory: one more step, eager stages (a fresh runner) with the saved-tensor hooks
    eager = PipelineRunner(module, split, schedule, args.chunks, dist.group.WORLD, torch.device("cpu"))
    saved = SavedBytes(
        {id(p) for p in module.parameters()} | {p.untyped_storage().data_ptr() for p in module.parameters()}
    )
    opt.zero_grad(set_to_none=True)
    eager.run("training_step", batch, 0)  # traces (outside the hooks: export runs on fake tensors)
    dist.barrier()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        opt.zero_grad(set_to_none=True)
        eager.run("training_step", batch, 0)
    result = {
        "rank": rank,
        "stages": runner.stage_ids,
        "step_s": steps,
        "busy_s": busys,
        "bubble": [1 - b / s for b, s in zip(busys, steps)],
        "peak_activation_bytes": saved.peak,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def theory(schedule: str, p: int, m: int) -> float:
    v = 2 if schedule == "interleaved_1f1b" else 1
    return (p - 1) / (v * m + p - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=2, help="ranks (pipeline stages; interleaved: 2 per rank)")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per step (m)")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="eager stages")
    parser.add_argument("--quick", action="store_true", help="width 128, seq 64, 3 steps (a smoke test: comm-bound)")
    args = parser.parse_args()
    if args.quick:
        args.width, args.seq, args.steps, args.warmup = 128, 64, 3, 1
    schedules = args.schedules.split(",")
    p, m = args.stages, args.chunks
    print(
        f"pipeline bubble: {p} ranks, m={m} micro-batches of {args.micro_batch} x {args.seq} tokens, GPT {args.layers}"
        f" layers x {args.width} (vocab 64), stages {'compiled (sgdtp backend)' if args.compile else 'eager'},"
        f" gloo, 1 thread per rank; {args.warmup} warm-up + {args.steps} timed steps per schedule",
        flush=True,
    )
    results: dict[str, Any] = {}
    retried: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in schedules:
            out = str(Path(tmp) / f"{schedule}.json")
            for attempt in (1, 2):
                try:
                    mp.spawn(worker, args=(p, free_port(), schedule, args, out), nprocs=p, join=True)
                    break
                except mp.ProcessExitedException as exc:  # reported, retried once (see the JSON's "retried")
                    print(f"{schedule}: attempt {attempt} failed: {exc}", flush=True)
                    retried.append(f"{schedule}: {exc}")
                    if attempt == 2:
                        raise
            ranks = json.loads(Path(out).read_text())
            bubble = statistics.fmean(statistics.fmean(r["bubble"]) for r in ranks)
            results[schedule] = {
                "step_ms": statistics.median(s for r in ranks for s in r["step_s"]) * 1e3,
                "bubble": bubble,
                "bubble_per_rank": [statistics.fmean(r["bubble"]) for r in ranks],
                "busy_ms_per_rank": [statistics.median(r["busy_s"]) * 1e3 for r in ranks],
                "theory": theory(schedule, p, m),
                "peak_activation_mib_per_rank": [r["peak_activation_bytes"] / 2**20 for r in ranks],
                "stages_per_rank": [r["stages"] for r in ranks],
            }
    header = f"{'schedule':<17} {'pipe ms':>8} {'busy ms/rank':>16} {'bubble':>7} {'theory':>7} {'rel. gap':>8}  peak activations MiB/rank"
    print(header)
    print("-" * len(header))
    for schedule, r in results.items():
        gap = (r["bubble"] - r["theory"]) / r["theory"]
        r["relative_gap"] = gap
        print(
            f"{schedule:<17} {r['step_ms']:>8.1f} {' / '.join(fmt(b, '.1f') for b in r['busy_ms_per_rank']):>16}"
            f" {r['bubble']:>7.1%} {r['theory']:>7.1%} {gap:>+8.1%}  "
            + " / ".join(fmt(x, ".2f") for x in r["peak_activation_mib_per_rank"])
        )
    targets = {}
    if "1f1b" in results:
        targets["1f1b_bubble_within_10pct_of_theory"] = abs(results["1f1b"]["relative_gap"]) <= 0.10
    if "1f1b" in results and "gpipe" in results:
        targets["1f1b_peak_activation_below_gpipe_every_rank"] = all(
            a < b
            for a, b in zip(
                results["1f1b"]["peak_activation_mib_per_rank"], results["gpipe"]["peak_activation_mib_per_rank"]
            )
        )
    print(f"theory: {THEORY}; bubble = 1 - busy / step per rank (mean over ranks and steps)")
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'NOT met'}")
    summary = {
        "benchmark": "pp_bubble",
        "commit": git_commit(),
        "torch": torch.__version__,
        "lightning": version("lightning"),
        "pipeline_ranks": p,
        "chunks": m,
        "model": {"layers": args.layers, "width": args.width, "seq": args.seq, "micro_batch": args.micro_batch},
        "compiled": args.compile,
        "results": results,
        "targets": targets,
        "retried": retried,
    }
    print(json.dumps(summary, separators=(",", ":")))


if __name__ == "__main__":
    main()
