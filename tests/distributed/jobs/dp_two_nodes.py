"""Two simulated nodes: launched once per node (NODE_RANK=0/1, devices=1, num_nodes=2); sgdtp vs Lightning's DDP.

Usage: python tests/distributed/jobs/dp_two_nodes.py OUT_DIR. Rank 0 writes OUT_DIR/params.pt (both runs' final
parameters) and OUT_DIR/nodes.json (world size, ranks, and the strategy's plan).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import BreaksModel, token_data
from helpers.training import params, quiet_trainer

from lightning_sgdtp import SGDTPStrategy


def main(out: Path) -> dict[str, Any]:
    data = token_data(n=32)
    finals = {}
    for name, strategy in (("ref", "ddp_find_unused_parameters_true"), ("sgdtp", SGDTPStrategy())):
        L.seed_everything(0, verbose=False)
        model = BreaksModel()
        t = quiet_trainer(strategy, out / name, devices=1, num_nodes=2, max_steps=4)
        t.fit(model, data)
        finals[name] = params(model)
        info = {"world_size": t.world_size, "global_rank": t.global_rank, "node_rank": t.node_rank}
    if info["global_rank"] == 0:
        torch.save(finals, out / "params.pt")
    return {**info, "plan": t.strategy.plan}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    info = main(out)
    if torch.distributed.get_rank() == 0:
        (out / "nodes.json").write_text(json.dumps(info, default=str))
