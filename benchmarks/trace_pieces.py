"""Per-step cost of each named piece in torch.profiler traces (what ``dp_throughput.py --profile DIR`` writes).

    python benchmarks/trace_pieces.py /tmp/prof/user-sgdtp-step-rank0.trace.json /tmp/prof/user-ddp-step-rank0.trace.json

For each trace: the steps (``sgdtp: step N`` spans), and per step the mean inclusive time and count of the spans that
make up the work around compute on the main thread: the strategy's own labels (``sgdtp: ...``), Dynamo's guard checks
(``TorchDynamo Cache Lookup``) and compiled frames (``Torch-Compiled Region``: one per graph-break segment),
collectives the main thread runs or waits on, Lightning's ``zero_grad``, and the eager ops of logging and metrics.
Spans nest (a wait inside ``sgdtp: after backward`` counts in both); read each row on its own.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

STEP = "sgdtp: step"
PIECES = (
    ("sgdtp: ", "the strategy's labelled work"),
    ("TorchDynamo Cache Lookup", "Dynamo guard checks (one per compiled frame entered)"),
    ("Torch-Compiled Region", "compiled frames (graph-break segments) run"),
    ("_c10d_functional::wait_tensor", "waits for in-graph buckets"),
    ("c10d::allreduce_", "eager all-reduce launches (the agreement; DDP's buckets)"),
    ("c10d::broadcast_", "broadcasts (Lightning's per-step SIGTERM flag; buffers)"),
    ("Optimizer.zero_grad", "zero_grad"),
    ("Optimizer.step", "the optimizer's step (with the closure inside)"),
    ("aten::item", ".item() (logging, metrics)"),
    ("DistributedDataParallel.forward", "DDP's forward (with its own bookkeeping)"),
)


def pieces(path: Path) -> tuple[int, dict[str, tuple[float, float]]]:
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith(STEP)]
    if not steps:
        raise SystemExit(f"{path}: no '{STEP} N' spans (record with dp_throughput.py --profile or profile_steps)")
    main = {(e["pid"], e["tid"]) for e in steps}
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in events:
        if (e["pid"], e["tid"]) not in main or not any(a <= e["ts"] < b for a, b in windows):
            continue
        name = e["name"]
        if name.startswith(STEP):
            key = "step"
        elif name.startswith("sgdtp: "):
            key = name
        else:
            key = next((p for p, _ in PIECES if name.startswith(p)), None)
            if key is None:
                continue
        totals[key][0] += e["dur"] / 1e3
        totals[key][1] += 1
    n = len(steps)
    return n, {k: (v[0] / n, v[1] / n) for k, v in totals.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    args = p.parse_args()
    for path in args.traces:
        n, table = pieces(path)
        print(f"\n{path.name}: {n} steps, per step (inclusive ms, count)")
        for key, (ms, count) in sorted(table.items(), key=lambda kv: -kv[1][0]):
            print(f"  {ms:9.3f} ms  x{count:5.1f}  {key}")


if __name__ == "__main__":
    main()
