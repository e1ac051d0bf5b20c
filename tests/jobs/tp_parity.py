"""Tensor / hybrid parallel against single-process training of the same model on the same global batch.

Usage: python tests/jobs/tp_parity.py CASE OUT_DIR. The launching process first trains the reference on one
device (global batch = dp x per-rank batch); Lightning's launcher then starts the other ranks by running
this script again, and every rank trains with sgdtp. Rank 0 writes OUT_DIR/{init,ref,sgdtp,grads}.pt and
OUT_DIR/info.json (the strategy's plan). Checkpoint cases train in two phases, saving after the first and
resuming (possibly on another mesh) in a second ``fit`` in the same processes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import parity
from models import LlamaLike, MHALanguageModel, small_gpt, token_data

from lightning_sgdtp import SGDTPStrategy

STEPS, BATCH = 6, 4
# name -> (model factory, devices, per-phase sgdtp kwargs (one dict: no checkpoint; two: resume), trainer kwargs)
CASES: dict[str, tuple[Any, int, list[dict[str, Any]], dict[str, Any]]] = {
    "tensor_gpt_clip": (small_gpt, 2, [{"parallelism": "tensor"}], {"gradient_clip_val": 0.3}),
    "tensor_mha": (MHALanguageModel, 2, [{"parallelism": "tensor"}], {}),
    "tensor_llama_bf16": (
        LlamaLike,
        2,
        [{"parallelism": "tensor", "sequence_parallel": True}],
        {"precision": "bf16-mixed"},
    ),
    # validation through the split model, twice during training; sequence parallel
    "hybrid_gpt": (
        small_gpt,
        4,
        [{"parallelism": "hybrid", "tensor_parallel_size": 2, "sequence_parallel": True}],
        {"limit_val_batches": 2, "val_check_interval": 3},
    ),
    # negative control: the data-parallel all-reduce switched off (must NOT match)
    "hybrid_no_dp_sync_control": (small_gpt, 4, [{"parallelism": "hybrid", "tensor_parallel_size": 2}], {}),
    "hybrid_mha_clip": (
        MHALanguageModel,
        4,
        [{"parallelism": "hybrid", "tensor_parallel_size": 2}],
        {"gradient_clip_val": 0.3},
    ),
    # the second phase splits differently (a tp_plan: only the MLPs): the checkpoint is resharded between plans
    "resume_tp_to_tp": (
        small_gpt,
        2,
        [
            {"parallelism": "tensor"},
            {
                "parallelism": "tensor",
                "tp_plan": {"model.blocks.*.mlp.fc": "colwise", "model.blocks.*.mlp.proj": "rowwise"},
            },
        ],
        {},
    ),
    "resume_tp_to_dp": (small_gpt, 2, [{"parallelism": "tensor"}, {"parallelism": "data"}], {}),
    "resume_dp_to_tp": (small_gpt, 2, [{"parallelism": "data"}, {"parallelism": "tensor"}], {}),
}


def dp_size(kwargs: dict[str, Any], devices: int) -> int:
    if kwargs.get("parallelism") == "tensor":
        return 1
    if kwargs.get("parallelism") == "hybrid":
        return devices // kwargs["tensor_parallel_size"]
    return devices


def trainer(strategy: Any, devices: int, root: Path, **kwargs: Any) -> L.Trainer:
    """The parity jobs' quiet Trainer (``parity.trainer``: 6 steps, no logging, checkpoints or validation)."""
    return parity.trainer(strategy, root, devices=devices, **kwargs)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def params(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in model.state_dict().items()}


class FirstStepGrads(L.Callback):
    """The gradients the optimizer sees at the first step (full tensors; a collective on every rank)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if not self.grads:
            self.grads = {n: full(p.grad) for n, p in module.named_parameters() if p.grad is not None}


class SaveAt(L.Callback):
    """Save a checkpoint where ModelCheckpoint does (end of a training batch, mid-epoch) and keep the full
    parameters saved (rank 0 writes them to ``saved.pt``)."""

    def __init__(self, step: int, path: Path, out: Path) -> None:
        self.step, self.path, self.out = step, path, out

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            saved = params(module)
            if trainer.global_rank == 0:
                torch.save(saved, self.out / "saved.pt")


def switch_off_dp_sync(strategy: SGDTPStrategy) -> None:
    """After setup: no in-graph data-parallel all-reduce, no fallback (the control must then fail to match)."""
    setup = strategy._setup_training

    def setup_then_switch_off(trainer: L.Trainer) -> None:
        setup(trainer)
        strategy._compiler.in_graph_sync = False
        strategy._ledger.sync = lambda record, everything=False: []
        strategy._ledger.uncovered = lambda params=None: []

    strategy._setup_training = setup_then_switch_off


def shuffled_like_lightning(data: DataLoader, batch_size: int) -> DataLoader:
    """One process reading what all data-parallel ranks read together: Lightning gives every rank a shuffling
    DistributedSampler (seed 0); rank r takes every dp-th index of one permutation, so step k's global batch is
    the k-th slice of ``batch_size`` of that permutation."""
    sampler = DistributedSampler(data.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data.dataset, batch_size=batch_size, sampler=sampler)


def main(case: str, out: Path) -> None:
    factory, devices, phases, trainer_kwargs = CASES[case]
    global_batch = BATCH * dp_size(phases[0], devices)  # kept across phases: per-rank batch = global / dp
    if "LOCAL_RANK" not in os.environ:  # the launching process, before any rank starts: the reference
        L.seed_everything(0, verbose=False)
        ref_model = factory()
        torch.save(params(ref_model), out / "init.pt")
        ref_grads = FirstStepGrads()
        ref = trainer("auto", 1, out / "ref", callbacks=[ref_grads], **trainer_kwargs)
        ref.fit(ref_model, shuffled_like_lightning(token_data(), global_batch), token_data(batch_size=global_batch))
        (out / "ref_metrics.json").write_text(json.dumps({k: float(v) for k, v in ref.callback_metrics.items()}))
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
        callbacks = [grads] + ([SaveAt(steps, ckpt, out)] if i + 1 < len(phases) else [])
        run = trainer(strategy, devices, out / f"sgdtp{i}", callbacks=callbacks, max_steps=steps, **trainer_kwargs)
        per_rank = global_batch // dp_size(kwargs, devices)
        if case.endswith("_control"):
            switch_off_dp_sync(strategy)
        val = token_data(batch_size=per_rank)
        run.fit(model, token_data(batch_size=per_rank), val, ckpt_path=str(ckpt) if i else None)
        plans.append(strategy.plan)
        metrics = {k: float(v) for k, v in run.callback_metrics.items()}
        final = params(model)
        if i + 1 < len(phases):  # the next phase starts from a fresh module (other weights), as a new job would
            torch.manual_seed(1)  # (not seed_everything: PL_GLOBAL_SEED seeds the distributed sampler's shuffle)
            model = factory()

    if run.global_rank == 0:
        torch.save(final, out / "sgdtp.pt")
        torch.save(grads.grads, out / "grads.pt")
        (out / "info.json").write_text(json.dumps({"plans": plans, "ckpt": str(ckpt), "metrics": metrics}, default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    os._exit(0) if os.environ.get("SGDTP_FAST_EXIT") else None
