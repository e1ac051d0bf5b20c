"""Lightning features under sgdtp, each against a reference run in the same processes.

Usage: python tests/jobs/features.py {resume|eval|nodes} OUT_DIR. Rank 0 writes OUT_DIR/info.json and tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models import BreaksModel, token_data
from parity import params, trainer

from lightning_sgdtp import SGDTPStrategy


def resume(out: Path, part: str) -> dict[str, Any]:
    """Each part is its own job, as on a cluster: ``straight`` trains 2 epochs; ``first`` trains 1 epoch and
    checkpoints; ``resumed`` starts a new job from that checkpoint and trains to 2 epochs; ``ref`` is ddp."""
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
    strategy = "ddp_find_unused_parameters_true" if part == "ref" else SGDTPStrategy()
    run = trainer(strategy, out / part, **kwargs)
    run.fit(model, data, ckpt_path=ckpt_path)
    if run.global_rank == 0:
        torch.save(params(model), out / f"{part}.pt")
    files = sorted(p.name for p in (out / "ckpt").iterdir()) if (out / "ckpt").exists() else []
    return {"global_step": run.global_step, "ckpt_files": files}


def evaluate(out: Path) -> dict[str, Any]:
    """fit, then validate / test / predict with the same trainer, against ddp doing the same."""
    data = token_data(n=32)
    results: dict[str, Any] = {}
    for name, strategy in (("ref", "ddp_find_unused_parameters_true"), ("sgdtp", SGDTPStrategy())):
        L.seed_everything(0, verbose=False)
        model = BreaksModel()
        t = trainer(strategy, out / name, max_steps=4, limit_val_batches=None)
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


def nodes(out: Path) -> dict[str, Any]:
    """Launched once per simulated node (NODE_RANK=0/1, devices=1, num_nodes=2); sgdtp vs ddp."""
    data = token_data(n=32)
    finals = {}
    for name, strategy in (("ref", "ddp_find_unused_parameters_true"), ("sgdtp", SGDTPStrategy())):
        L.seed_everything(0, verbose=False)
        model = BreaksModel()
        t = trainer(strategy, out / name, devices=1, num_nodes=2, max_steps=4)
        t.fit(model, data)
        finals[name] = params(model)
        info = {"world_size": t.world_size, "global_rank": t.global_rank, "node_rank": t.node_rank}
    if info["global_rank"] == 0:
        torch.save(finals, out / "params.pt")
    return {**info, "plan_world": t.strategy.plan["world_size"], "num_nodes": t.strategy.plan["num_nodes"]}


if __name__ == "__main__":
    what, out = sys.argv[1], Path(sys.argv[2])
    if what == "resume":
        info = resume(out, sys.argv[3])
        what = f"resume-{sys.argv[3]}"
    else:
        info = {"eval": evaluate, "nodes": nodes}[what](out)
    if torch.distributed.get_rank() == 0:
        (out / f"{what}.json").write_text(json.dumps(info, default=str))
