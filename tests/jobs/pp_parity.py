"""Pipeline parallel against single-process training of the same model on the same global batch.

Usage: python tests/jobs/pp_parity.py CASE OUT_DIR. As ``tp_parity.py``: the launching process trains the
reference on one device (global batch = dp x per-rank batch, Lightning's shuffled order), then Lightning's
launcher starts the ranks. Every rank sends the tensors its stages hold; rank 0 merges them into full
``sgdtp.pt`` / ``grads.pt`` (first step) and writes ``info.json`` (plan, every rank's logged metrics).
Checkpoint cases train in two phases, saving after the first and resuming in a second ``fit``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import parity
from gpt import GPTLightningModule
from models import pp_gpt, token_data
from tp_parity import shuffled_like_lightning

from lightning_sgdtp import SGDTPStrategy

STEPS, BATCH = 6, 8
PP2 = {"pipeline_stages": 2, "pipeline_chunks": 4}
VAL = {"limit_val_batches": 2, "val_check_interval": 3}
# name -> (devices, per-phase sgdtp kwargs (two dicts: save, then resume), trainer kwargs)
CASES: dict[str, tuple[int, list[dict[str, Any]], dict[str, Any]]] = {
    "gpipe_2x4": (2, [{**PP2, "pipeline_schedule": "gpipe"}], {"gradient_clip_val": 0.3, **VAL}),
    "1f1b_2x4": (2, [{**PP2, "pipeline_schedule": "1f1b"}], VAL),
    "interleaved_2x4": (2, [{**PP2, "pipeline_schedule": "interleaved_1f1b"}], {}),
    "1f1b_accumulate_clip": (2, [PP2], {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3}),
    "1f1b_bf16": (2, [PP2], {"precision": "bf16-mixed"}),
    # 49 samples: 6 batches of 8, then one of 1 (one micro-batch: too few for 1F1B, that batch runs as GPipe)
    "1f1b_short_last_batch": (2, [PP2], {"max_steps": 7, "limit_val_batches": 7, "val_check_interval": 7}),
    "pp2_dp2_1f1b": (4, [{**PP2, "pipeline_schedule": "1f1b"}], {"gradient_clip_val": 0.3, **VAL}),
    "options_dict_ckpt_measured": (
        2,
        [
            {
                "options": {"distributed": {"plugin": "sgdtp", "strategy": "data", "pipeline_chunks": 4}},
                "pipeline_balance": "measured",
                "activation_checkpointing": True,
            }
        ],
        {"num_sanity_val_steps": 1, **VAL},  # traced for validation first, then split again by measured times
    ),
    "resume_pp_to_pp": (2, [PP2, {**PP2, "pipeline_split": ["model.blocks.1"]}], {}),
    "resume_pp_to_dp": (2, [PP2, {}], {}),
    "pp2_dp2_no_dp_sync_control": (4, [PP2], {}),
}


class NoSelfCall(GPTLightningModule):
    """Breaks the contract: runs its model without calling self(...)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


class NoLoss(GPTLightningModule):
    """Breaks the contract on the last stage only: training_step returns nothing (the other stage waits)."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


class Untraceable(GPTLightningModule):
    """Breaks the contract: data-dependent Python control flow in forward."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.sum() > 0:
            return self.model(idx)
        return self.model(idx + 1)


ERRORS = {"contract_no_self_call": NoSelfCall, "contract_no_loss": NoLoss, "contract_untraceable": Untraceable}


def dp_size(kwargs: dict[str, Any], devices: int) -> int:
    pipelined = "pipeline_stages" in kwargs or "options" in kwargs
    return devices // kwargs.get("pipeline_stages", devices) if pipelined else devices


def gather_full(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's tensors (its stages'), merged: what rank 0 returns is the whole model."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in named.items()})
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def local_state(strategy: SGDTPStrategy, module: L.LightningModule) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return strategy._pipeline.stage_state_dict(state) if strategy._pipeline is not None else state


class FirstStepGrads(L.Callback):
    """The gradients the optimizer sees at the first step (before clipping), this rank's stages only."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if self.grads is None:
            local = {id(p) for p in trainer.strategy._pipeline.local_parameters}
            self.grads = {
                n: p.grad.detach().clone()
                for n, p in module.named_parameters()
                if id(p) in local and p.grad is not None
            }


class SaveAt(L.Callback):
    """Save a checkpoint mid-epoch (where ModelCheckpoint does) and the full parameters saved (``saved.pt``)."""

    def __init__(self, step: int, path: Path, out: Path) -> None:
        self.step, self.path, self.out = step, path, out

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            saved = gather_full(local_state(trainer.strategy, module))
            if trainer.global_rank == 0:
                torch.save(saved, self.out / "saved.pt")


def switch_off_dp_sync(strategy: SGDTPStrategy) -> None:
    setup = strategy._setup_pipeline

    def setup_then_switch_off() -> None:
        setup()
        strategy._compiler.in_graph_sync = False
        strategy._pipeline_after_backward = lambda: strategy._pipeline.sum_tied_gradients()

    strategy._setup_pipeline = setup_then_switch_off


def contract_error(case: str, out: Path) -> None:
    """The broken module trains with the pipeline; the job must fail with the contract's message."""
    L.seed_everything(0, verbose=False)
    model = ERRORS[case].from_config(pp_gpt().config)
    strategy = SGDTPStrategy(**PP2, collective_timeout=20)
    run = parity.trainer(strategy, out / "sgdtp", devices=2)
    run.fit(model, token_data(batch_size=BATCH))


SAMPLES = {"1f1b_short_last_batch": 49}


def main(case: str, out: Path) -> None:
    if case in ERRORS:
        return contract_error(case, out)
    devices, phases, trainer_kwargs = CASES[case]
    samples = SAMPLES.get(case, 64)
    global_batch = BATCH * dp_size(phases[0], devices)
    if "LOCAL_RANK" not in os.environ:  # the launching process, before any rank starts: the reference
        L.seed_everything(0, verbose=False)
        ref_model = pp_gpt()
        torch.save({k: v.detach().clone() for k, v in ref_model.state_dict().items()}, out / "init.pt")
        grads: dict[str, torch.Tensor] = {}

        class RefGrads(L.Callback):
            def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, opt: Any) -> None:
                if not grads:
                    grads.update({n: p.grad.detach().clone() for n, p in module.named_parameters()})

        ref = parity.trainer("auto", out / "ref", devices=1, callbacks=[RefGrads()], **trainer_kwargs)
        train, val = token_data(samples), token_data(samples, batch_size=global_batch)
        ref.fit(ref_model, shuffled_like_lightning(train, global_batch), val)
        (out / "ref_metrics.json").write_text(json.dumps({k: float(v) for k, v in ref.callback_metrics.items()}))
        torch.save({k: v.detach().clone() for k, v in ref_model.state_dict().items()}, out / "ref.pt")
        torch.save(grads, out / "ref_grads.pt")

    L.seed_everything(0, verbose=False)
    model = pp_gpt()
    first = FirstStepGrads()
    plans, metrics = [], []
    ckpt = out / "ckpt" / "phase0.ckpt"
    for i, kwargs in enumerate(phases):
        strategy = SGDTPStrategy(**kwargs)
        if case.endswith("_control"):
            switch_off_dp_sync(strategy)
        steps = trainer_kwargs.pop("max_steps", STEPS) if len(phases) == 1 else STEPS // 2 * (i + 1)
        callbacks = ([first] if i == 0 else []) + ([SaveAt(steps, ckpt, out)] if i + 1 < len(phases) else [])
        run = parity.trainer(
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
        metrics.append({k: float(v) for k, v in run.callback_metrics.items()})
        final = gather_full(local_state(strategy, model))
        # after fit the module is whole on every rank (the stages shared), as with data parallel
        whole = all(torch.equal(v, final[k]) for k, v in model.state_dict().items())
        first_grads = gather_full(first.grads or {}) if i == 0 else None
        if i == 0:
            step_grads = first_grads
        if i + 1 < len(phases):
            torch.manual_seed(1)  # the next phase starts from other weights, as a new job would
            model = pp_gpt()

    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, metrics)
    wholes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(wholes, whole)
    if run.global_rank == 0:
        torch.save(final, out / "sgdtp.pt")
        torch.save(step_grads, out / "grads.pt")
        info = {"plans": plans, "ckpt": str(ckpt), "metrics": every_rank, "whole_on_every_rank": wholes}
        (out / "info.json").write_text(json.dumps(info, default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    os._exit(0) if os.environ.get("SGDTP_FAST_EXIT") else None
