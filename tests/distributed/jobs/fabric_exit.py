"""The end of a Fabric script, to run again and again and count the exits -6 (docs/fabric.md, "The end of a script").

docs/fabric.md's first example (2 CPU ranks, 8 steps), ending as the user's script ends: no teardown call.
``--destroy``: the script destroys the process group itself at its end (as ``benchmarks/dp_throughput.py``'s workers
do); ``--no_exit_hook``: without the exit hook the strategy registers (the code before the fix: threads left running
into the interpreter's finalization); ``--slow_finalize S``: the interpreter finalizes S seconds longer (an object
freed then sleeps), which widens the window of the race.

    for i in $(seq 30); do
        MASTER_ADDR=127.0.0.1 MASTER_PORT=$((30000 + RANDOM % 20000)) timeout 150 \\
            python tests/distributed/jobs/fabric_exit.py --destroy > run-$i.log 2>&1
        echo "run $i: exit $?, $(grep -c 'terminate called' run-$i.log) abort(s)"
    done

Both ranks write to the log: a rank that aborts prints ``terminate called without an active exception``. The exit
status is rank 0's (134 when it aborted under ``timeout``).
"""

from __future__ import annotations

import argparse
import atexit
import sys
import time
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class _SlowToFinalize:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __del__(self, sleep: Any = time.sleep) -> None:  # no global lookup: the module's names are gone by then
        sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--destroy", action="store_true")
    parser.add_argument("--no_exit_hook", action="store_true")
    parser.add_argument("--slow_finalize", type=float, default=0.0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="sgdtp")
    fabric.launch()
    if args.no_exit_hook:
        from lightning_sgdtp.frontends import job

        atexit.unregister(job.leave_at_exit)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    data = fabric.setup_dataloaders(DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))
    for step, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.print(f"trained {step + 1} steps, last loss {loss.item():.2f}")
    if args.destroy:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.modules["_slow_to_finalize"] = _SlowToFinalize(args.slow_finalize)  # freed once the interpreter finalizes


if __name__ == "__main__":
    main()
