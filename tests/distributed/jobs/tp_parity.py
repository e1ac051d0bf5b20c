"""Tensor / hybrid parallel against single-process training of the same model on the same global batch.

Usage: python tests/distributed/jobs/tp_parity.py OUT_DIR [SCENARIO], with the scenario (JSON; else
OUT_DIR/scenario.json) = {"model": a name in helpers.models.MODELS, "devices": N, "phases": [SGDTPStrategy
kwargs, ...], "trainer": Trainer kwargs}. The
launching process first trains the reference on one device (global batch = dp x per-rank batch); Lightning's
launcher then starts the other ranks by running this script again, and every rank trains with sgdtp. Rank 0
writes OUT_DIR/{init,ref,sgdtp,ref_grads,grads}.pt, OUT_DIR/ref_metrics.json and OUT_DIR/info.json (the plan of
each phase, the checkpoint, the logged metrics). With two phases the job saves after the first (3 steps) and
resumes, in a fresh module and possibly on another mesh, in a second ``fit`` in the same processes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import MODELS, token_data
from helpers.training import (
    FirstStepGrads,
    SaveAt,
    metrics,
    params,
    quiet_trainer,
    read_scenario,
    shuffled_like_lightning,
)

from lightning_sgdtp import SGDTPStrategy

STEPS, BATCH = 6, 4


def dp_size(kwargs: dict[str, Any], devices: int) -> int:
    if kwargs.get("parallelism") == "tensor":
        return 1
    if kwargs.get("parallelism") == "hybrid":
        return devices // kwargs["tensor_parallel_size"]
    return devices


def main(out: Path) -> None:
    scenario = read_scenario(out, sys.argv[2] if len(sys.argv) > 2 else None)
    factory, devices, phases, trainer_kwargs = (
        MODELS[scenario["model"]],
        scenario["devices"],
        scenario["phases"],
        scenario.get("trainer", {}),
    )
    global_batch = BATCH * dp_size(phases[0], devices)  # kept across phases: per-rank batch = global / dp
    if "LOCAL_RANK" not in os.environ:  # the launching process, before any rank starts: the reference
        L.seed_everything(0, verbose=False)
        ref_model = factory()
        torch.save(params(ref_model), out / "init.pt")
        ref_grads = FirstStepGrads()
        ref = quiet_trainer("auto", out / "ref", devices=1, callbacks=[ref_grads], **trainer_kwargs)
        ref.fit(ref_model, shuffled_like_lightning(token_data(), global_batch), token_data(batch_size=global_batch))
        (out / "ref_metrics.json").write_text(json.dumps(metrics(ref)))
        torch.save(params(ref_model), out / "ref.pt")
        torch.save(ref_grads.grads, out / "ref_grads.pt")

    L.seed_everything(0, verbose=False)
    model = factory()
    grads = FirstStepGrads()
    plans = []
    ckpt = out / "ckpt" / "phase0.ckpt"
    for i, kwargs in enumerate(phases):
        strategy = SGDTPStrategy(**kwargs)
        steps = STEPS if len(phases) == 1 else STEPS // 2 * (i + 1)
        save = SaveAt(steps, ckpt, out, lambda trainer, module: params(module))
        callbacks = [grads] + ([save] if i + 1 < len(phases) else [])
        run = quiet_trainer(
            strategy, out / f"sgdtp{i}", devices=devices, callbacks=callbacks, max_steps=steps, **trainer_kwargs
        )
        per_rank = global_batch // dp_size(kwargs, devices)
        val = token_data(batch_size=per_rank)
        run.fit(model, token_data(batch_size=per_rank), val, ckpt_path=str(ckpt) if i else None)
        plans.append(strategy.plan)
        logged = metrics(run)
        final = params(model)
        if i + 1 < len(phases):  # the next phase starts from a fresh module (other weights), as a new job would
            torch.manual_seed(1)  # (not seed_everything: PL_GLOBAL_SEED seeds the distributed sampler's shuffle)
            model = factory()

    if run.global_rank == 0:
        torch.save(final, out / "sgdtp.pt")
        torch.save(grads.grads, out / "grads.pt")
        (out / "info.json").write_text(json.dumps({"plans": plans, "ckpt": str(ckpt), "metrics": logged}, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    os._exit(0) if os.environ.get("SGDTP_FAST_EXIT") else None
