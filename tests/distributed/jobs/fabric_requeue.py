"""A Fabric loop that SLURM's time-limit signal requeues: the loop of docs/fabric.md's SLURM section.

Each step ends with ``fabric.strategy.requeue_if_agreed(CKPT, state)``: once the ranks agreed on SLURM's signal it
saves ``state`` to ``DIR/preempted.ckpt``, requeues the job and exits 0; when SLURM starts the job again the loop
loads that file and goes on from its step. The batches are a function of the step and the rank, so a resumed run
reads what the uninterrupted one reads.

Usage, under SLURM (``SGDTP_EXAMPLE=<this file> sbatch examples/slurm/train_gpt.sbatch ...``, which passes the
first four) or launched by Fabric itself (the reference):
python tests/distributed/jobs/fabric_requeue.py --accelerator cpu --devices 2 --num_nodes 1 --default_root_dir DIR
    [--steps 100] [--step_seconds 0.05] [--save_weights W.pt]
Rank 0 writes the final parameters to W.pt.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--default_root_dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step_seconds", type=float, default=0.0, help="a slower step: time to signal the job")
    parser.add_argument("--save_weights", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)

    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy="sgdtp")
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    checkpoint = args.default_root_dir / "preempted.ckpt"
    if checkpoint.exists():  # SLURM started the job again
        fabric.load(checkpoint, state)
        fabric.print(f"resumed from {checkpoint} at step {state['step']}")

    g = torch.Generator().manual_seed(1)
    xs = torch.randn(args.steps, fabric.world_size, 8, 16, generator=g)
    ys = torch.randint(0, 4, (args.steps, fabric.world_size, 8), generator=g)
    while state["step"] < args.steps:
        x, y = xs[state["step"], fabric.global_rank], ys[state["step"], fabric.global_rank]
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        time.sleep(args.step_seconds)
        fabric.strategy.requeue_if_agreed(checkpoint, state)

    fabric.print(f"trained {state['step']} steps")
    if args.save_weights is not None and fabric.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.save_weights)


if __name__ == "__main__":
    main()
