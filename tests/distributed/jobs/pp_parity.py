"""Pipeline parallel against single-process training of the same model (a 4-block GPT) on the same global batch.

Usage: python tests/distributed/jobs/pp_parity.py OUT_DIR [SCENARIO], with the scenario (JSON; else
OUT_DIR/scenario.json) = {"devices": N, "phases": [SGDTPStrategy kwargs, ...], "trainer": Trainer kwargs,
"samples": dataset size, "validate_after_fit": bool}. As ``tp_parity.py``: the
launching process trains the reference on one device (global batch = dp x per-rank batch, Lightning's shuffled
order), then Lightning's launcher starts the ranks. Every rank sends the tensors its stages hold; rank 0 merges
them into full ``sgdtp.pt`` / ``grads.pt`` (first step) and writes ``info.json`` (plans, every rank's logged
metrics). With two phases the job saves after the first and resumes in a second ``fit``. With ``validate_after_fit``
each ``fit`` is followed by ``save_checkpoint`` and ``validate(ckpt_path=...)`` (as ``examples/train_gpt.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import pp_gpt, token_data
from helpers.training import (
    FirstStepGrads,
    SaveAt,
    full,
    gather_full,
    held_bytes,
    metrics,
    params,
    quiet_trainer,
    read_scenario,
    shuffled_like_lightning,
)

from lightning_sgdtp import SGDTPStrategy

STEPS, BATCH = 6, 8


def dp_size(kwargs: dict[str, Any], devices: int) -> int:
    pipelined = "pipeline_stages" in kwargs or "options" in kwargs
    per_stage = devices // kwargs.get("pipeline_stages", devices) if pipelined else devices
    tp = {"tensor": per_stage, "hybrid": kwargs.get("tensor_parallel_size", 1)}.get(kwargs.get("parallelism"), 1)
    return per_stage // tp


def runner(strategy: SGDTPStrategy) -> Any:
    """The pipelined engine's PipelineRunner (stage_state_dict, local_parameters); None without a pipeline."""
    return getattr(strategy.engine, "runner", None)


def local_state(strategy: SGDTPStrategy, module: L.LightningModule) -> dict[str, torch.Tensor]:
    """What this rank's stages hold of the module's state (all of it without a pipeline)."""
    state = {k: full(v) for k, v in module.state_dict().items()}  # sharded stages: gathered over dp
    pipeline = runner(strategy)
    return pipeline.stage_state_dict(state) if pipeline is not None else state


def main(out: Path) -> None:
    scenario = read_scenario(out, sys.argv[2] if len(sys.argv) > 2 else None)
    devices, phases, trainer_kwargs = scenario["devices"], scenario["phases"], dict(scenario.get("trainer", {}))
    samples = scenario.get("samples", 64)
    global_batch = BATCH * dp_size(phases[0], devices)
    if "LOCAL_RANK" not in os.environ:  # the launching process, before any rank starts: the reference
        L.seed_everything(0, verbose=False)
        ref_model = pp_gpt()
        torch.save(params(ref_model), out / "init.pt")
        ref_grads = FirstStepGrads()
        ref = quiet_trainer("auto", out / "ref", devices=1, callbacks=[ref_grads], **trainer_kwargs)
        train, val = token_data(samples), token_data(samples, batch_size=global_batch)
        ref.fit(ref_model, shuffled_like_lightning(train, global_batch), val)
        ref_metrics = metrics(ref)
        if scenario.get("validate_after_fit"):  # the final weights' validation, for the ranks' after their fit
            (after,) = ref.validate(ref_model, val, verbose=False)
            ref_metrics.update({f"after_fit_{k}": float(v) for k, v in after.items()})
        (out / "ref_metrics.json").write_text(json.dumps(ref_metrics))
        torch.save(params(ref_model), out / "ref.pt")
        torch.save(ref_grads.grads, out / "ref_grads.pt")

    L.seed_everything(0, verbose=False)
    model = pp_gpt()
    first = FirstStepGrads(local=lambda trainer: {id(p) for p in runner(trainer.strategy).local_parameters})
    plans, logged, validated = [], [], []
    ckpt = out / "ckpt" / "phase0.ckpt"
    for i, kwargs in enumerate(phases):
        strategy = SGDTPStrategy(**kwargs, plan_file=str(out / f"sgdtp{i}" / "sgdtp_plan.json"))  # no logger: asked for
        steps = trainer_kwargs.pop("max_steps", STEPS) if len(phases) == 1 else STEPS // 2 * (i + 1)
        save = SaveAt(steps, ckpt, out, lambda trainer, module: gather_full(local_state(trainer.strategy, module)))
        callbacks = ([first] if i == 0 else []) + ([save] if i + 1 < len(phases) else [])
        run = quiet_trainer(
            strategy, out / f"sgdtp{i}", devices=devices, callbacks=callbacks, max_steps=steps, **trainer_kwargs
        )
        per_rank = global_batch // dp_size(kwargs, devices)
        run.fit(
            model,
            token_data(samples, batch_size=per_rank),
            token_data(samples, batch_size=per_rank),
            ckpt_path=str(ckpt) if i else None,
        )
        plans.append(strategy.plan)
        logged.append(metrics(run))
        held = held_bytes(model, run.optimizers)  # after fit a rank holds its stages only (issue 24)
        if scenario.get("validate_after_fit"):
            # as examples/train_gpt.py: save, then validate from that checkpoint while each rank holds its stages
            # only (a second trainer function on the module: its weights must stay the ranks' trained stages)
            saved = out / "ckpt" / f"final{i}.ckpt"
            run.save_checkpoint(saved)
            val_data = token_data(samples, batch_size=per_rank)
            (after,) = run.validate(model, val_data, ckpt_path=str(saved), verbose=False)
            validated.append({k: float(v) for k, v in after.items()})
        final = gather_full(local_state(strategy, model))  # after validate_after_fit: the weights it left
        # asked for, the module is whole on every rank (each stage sent by its holder)
        strategy.gather_pipeline_stages()
        whole = all(torch.equal(full(v), final[k]) for k, v in model.state_dict().items())
        if i == 0:
            step_grads = gather_full(first.grads or {})
        if i + 1 < len(phases):
            torch.manual_seed(1)  # the next phase starts from other weights, as a new job would
            model = pp_gpt()

    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, logged)
    wholes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(wholes, whole)
    helds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(helds, held)
    after_fit: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(after_fit, validated)
    if run.global_rank == 0:
        torch.save(final, out / "sgdtp.pt")
        torch.save(step_grads, out / "grads.pt")
        info = {"plans": plans, "ckpt": str(ckpt), "metrics": every_rank, "whole_on_every_rank": wholes, "held": helds,
                "validated_after_fit": after_fit,
                "whole_parameter_bytes": held_bytes(pp_gpt(), [])["parameters"]}  # fmt: skip
        (out / "info.json").write_text(json.dumps(info, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    os._exit(0) if os.environ.get("SGDTP_FAST_EXIT") else None
