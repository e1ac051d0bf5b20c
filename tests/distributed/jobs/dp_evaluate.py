"""fit, then validate / test / predict with the same Trainer, under sgdtp and under Lightning's DDP.

Usage: python tests/distributed/jobs/dp_evaluate.py OUT_DIR. Rank 0 writes OUT_DIR/eval.json: per strategy the
validation and test losses, the predictions, the training sampler (type, replicas, rank) and the batch count.
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
from helpers.training import quiet_trainer

from lightning_sgdtp import SGDTPStrategy


def main(out: Path) -> dict[str, Any]:
    data = token_data(n=32)
    results: dict[str, Any] = {}
    for name, strategy in (("ref", "ddp_find_unused_parameters_true"), ("sgdtp", SGDTPStrategy())):
        L.seed_everything(0, verbose=False)
        model = BreaksModel()
        t = quiet_trainer(strategy, out / name, max_steps=4, limit_val_batches=None)
        t.fit(model, train_dataloaders=data, val_dataloaders=token_data(n=16, seed=7))
        sampler = t.train_dataloader.sampler
        val = t.validate(model, token_data(n=16, seed=7), verbose=False)
        test = t.test(model, token_data(n=16, seed=8), verbose=False)
        pred = t.predict(model, token_data(n=8, seed=9))
        results[name] = {
            "val": val[0]["val_loss"],
            "test": test[0]["val_loss"],
            "pred": torch.cat(pred).tolist(),
            "sampler": [type(sampler).__name__, getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)],
            "batches": t.num_training_batches,
        }
        if name == "sgdtp":
            results["sampler_kwargs"] = t.strategy.distributed_sampler_kwargs
    return results


if __name__ == "__main__":
    out = Path(sys.argv[1])
    info = main(out)
    if torch.distributed.get_rank() == 0:
        (out / "eval.json").write_text(json.dumps(info, default=str))
