"""How much of the main job's step any strategy can change: the example GPT's step, eager against compiled.

    python benchmarks/step_floor.py            # one process, one thread, the main job's shapes (~1 min)
    python benchmarks/step_floor.py --steps 20

The README's main job (``examples/train_gpt.py``) spends ~91 % of its wall time in 360 optimizer steps. This script
runs the same model and batch (32 x 128 tokens, 4 layers, n_embd 128) in one process with one thread, as each of the
job's two ranks has one core, and reports:

- the step's time eager and compiled with ``torch.compile`` (Inductor), medians of ``--steps`` steps;
- the share of the eager step spent in the dense kernels that no compiler rewrites on CPU: matrix products
  (``aten::mm``, ``aten::addmm``, MKL) and attention (``aten::_scaled_dot_product_flash_attention_for_cpu`` and its
  backward), from ``torch.profiler``.

What is left outside those kernels bounds what a strategy can save per step: the issue-42 targets (main job warm
<= 0.95x ``ddp``) needed a step at least 5 % faster than ``ddp``'s. Results go to
``benchmarks/results/step_floor_DATE.json`` and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import REPO, git_commit

sys.path.insert(0, str(REPO / "examples"))
from gpt import GPT, GPTConfig

DENSE = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu")


def step_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    logits = model(x)
    F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).backward()


def timed(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def dense_share(fn, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    dense = sum(e.self_cpu_time_total for e in events if e.key.startswith(DENSE))
    return {"dense_ms_per_step": round(dense / 1e3 / steps, 1), "dense_share": round(dense / total, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # each rank of the main job has one of the machine's two cores
    model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128))
    x, y = torch.randint(0, 256, (32, 128)), torch.randint(0, 256, (32, 128))
    compiled = torch.compile(step_fn)
    result: dict[str, object] = {"mode": "step_floor", "threads": 1}
    for name, fn in (("eager", step_fn), ("compiled", compiled)):
        for _ in range(3):  # warm-up (and the compile)
            fn(model, x, y)
        result[f"{name}_ms"] = round(timed(lambda fn=fn: fn(model, x, y), args.steps), 1)
    result |= dense_share(lambda: step_fn(model, x, y), 3)
    result["outside_dense_ms"] = round(result["eager_ms"] - result["dense_ms_per_step"], 1)
    result |= {"commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    out = args.out or REPO / "benchmarks" / "results" / f"step_floor_{result['date']}.json"
    out.write_text(json.dumps(result, indent=1))
    print(
        f"eager {result['eager_ms']} ms/step, compiled {result['compiled_ms']} ms/step;"
        f" dense kernels (GEMM, attention) {result['dense_ms_per_step']} ms = {result['dense_share']:.0%} of the"
        f" eager step; outside them {result['outside_dense_ms']} ms"
    )
    print(f"saved {out}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
