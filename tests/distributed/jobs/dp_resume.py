"""Resume under data parallel: one part of the scenario per job, as on a cluster.

Usage: python tests/distributed/jobs/dp_resume.py PART OUT_DIR [SHARDING], with PART one of
  straight   train 2 epochs;
  first      train 1 epoch and checkpoint (ModelCheckpoint, save_last);
  resumed    a new job: other weights, then ``fit(ckpt_path=OUT_DIR/ckpt/last.ckpt)`` to 2 epochs;
  ref        2 epochs with Lightning's DDP.
SHARDING (default "none") is SGDTPStrategy's ``sharding``. Rank 0 writes OUT_DIR/PART.pt (final parameters) and OUT_DIR/resume-PART.json (global step, checkpoint files).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import BreaksModel, token_data
from helpers.training import params, quiet_trainer

from lightning_sgdtp import SGDTPStrategy


def main(part: str, out: Path, sharding: str = "none") -> dict[str, Any]:
    data = token_data(n=32)
    # Same seed in every part, as a user relaunching the job has: Lightning seeds its DistributedSampler's
    # shuffle from PL_GLOBAL_SEED, so another seed would mean another data order (with ddp too).
    L.seed_everything(0, verbose=False)
    model = BreaksModel()
    kwargs: dict[str, Any] = {"max_steps": -1, "max_epochs": 2}
    ckpt_path = None
    if part == "first":
        kwargs.update(
            max_epochs=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=out / "ckpt", save_last=True)]
        )
    if part == "resumed":
        with torch.no_grad():  # the weights must come from the checkpoint, not from the seed
            for p in model.parameters():
                p.add_(1.0)
        ckpt_path = str(out / "ckpt" / "last.ckpt")
    strategy = "ddp_find_unused_parameters_true" if part == "ref" else SGDTPStrategy(sharding=sharding)
    run = quiet_trainer(strategy, out / part, **kwargs)
    run.fit(model, data, ckpt_path=ckpt_path)
    final = params(model)  # a collective with sharded parameters (DTensors gathered): every rank
    if run.global_rank == 0:
        torch.save(final, out / f"{part}.pt")
    files = sorted(p.name for p in (out / "ckpt").iterdir()) if (out / "ckpt").exists() else []
    return {"global_step": run.global_step, "ckpt_files": files}


if __name__ == "__main__":
    part, out = sys.argv[1], Path(sys.argv[2])
    info = main(part, out, *sys.argv[3:4])
    if torch.distributed.get_rank() == 0:
        (out / f"resume-{part}.json").write_text(json.dumps(info, default=str))
