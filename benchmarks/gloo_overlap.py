"""Does compute proceed while a gloo all-reduce runs? 2 ranks, one compute thread each (~10 s).

    python benchmarks/gloo_overlap.py

Each rank times, with a barrier before each repetition: ``compute`` (matmuls shaped like the MLP benchmark's
backward, 2048x2048 weights, batch 32), ``all-reduce`` of N MiB alone, and ``both`` (the all-reduce issued
asynchronously, the same compute, then the wait), for N = 4, 16 and 52 MiB (52 MiB: all of the MLP's gradients).
Perfect overlap gives both = max(compute, all-reduce); none gives both = compute + all-reduce.
``hidden`` = (compute + all-reduce - both) / all-reduce. The last line is one JSON object.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_MIB = (4, 16, 52)
REPS = 15


def _rank(rank: int, port: int, queue: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    a, w = torch.randn(32, 2048), torch.randn(2048, 2048)

    def compute() -> None:
        for _ in range(4):  # ~ the two matmuls of 4 layers' backward
            torch.mm(a.t(), a @ w)

    rows = []
    for mib in SIZES_MIB:
        buf = torch.ones(mib * 2**20 // 4)

        def alone(buf: torch.Tensor = buf) -> None:
            dist.all_reduce(buf)

        def both(buf: torch.Tensor = buf) -> None:
            work = dist.all_reduce(buf, async_op=True)
            compute()
            work.wait()

        times: dict[str, list[float]] = {}
        for _ in range(REPS):
            for name, fn in (("compute", compute), ("allreduce", alone), ("both", both)):
                dist.barrier()
                t = time.perf_counter()
                fn()
                times.setdefault(name, []).append(1e3 * (time.perf_counter() - t))
        med = {k: statistics.median(v[2:]) for k, v in times.items()}
        hidden = (med["compute"] + med["allreduce"] - med["both"]) / med["allreduce"]
        rows.append({"mib": mib, **{f"{k}_ms": round(v, 2) for k, v in med.items()}, "hidden": round(hidden, 3)})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main() -> int:
    os.environ["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_rank, args=(port, queue), nprocs=2)
    rows = queue.get()
    print(f"{'MiB':>4s} {'compute':>9s} {'all-reduce':>11s} {'both':>8s} {'hidden':>7s}")
    for r in rows:
        print(
            f"{r['mib']:4d} {r['compute_ms']:8.1f}ms {r['allreduce_ms']:10.1f}ms {r['both_ms']:7.1f}ms"
            f" {100 * r['hidden']:6.0f}%"
        )
    print(json.dumps({"benchmark": "gloo_overlap", "cpu_count": os.cpu_count(), "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
