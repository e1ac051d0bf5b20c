"""The job side: what every job script in tests/distributed/jobs shares (they import this, never each other).

A job reads its scenario (``OUT/scenario.json``, written by the test), trains a reference and sgdtp, and writes
tensors and JSON into ``OUT`` for the test to compare.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler


def read_scenario(out: Path, inline: str | None = None) -> dict[str, Any]:
    """The job's scenario: ``inline`` (JSON given on the command line, for a run by hand) or the one the test wrote
    to ``OUT/scenario.json``. Lightning starts the other ranks with the same command line: all read the same."""
    return json.loads(inline) if inline is not None else json.loads((out / "scenario.json").read_text())


def quiet_trainer(strategy: Any, root: Path, **kwargs: Any) -> L.Trainer:
    """2 CPU devices, 6 steps, no logger, checkpoints, progress bar or validation, unless ``kwargs`` say otherwise."""
    defaults = {
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(root),
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, **defaults)


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of the whole tensor (a DTensor shard is gathered: a collective on every rank of its mesh)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict as full, detached tensors."""
    return {k: full(v) for k, v in model.state_dict().items()}


class FirstStepGrads(L.Callback):
    """The gradients the optimizer sees at the first optimizer step (before clipping: AdamW hides a gradient scale
    error, this does not), as full tensors by parameter name. ``local(trainer)`` gives the ids of the parameters
    this rank holds (a pipeline stage's); without it, every parameter that has a gradient."""

    def __init__(self, local: Callable[[L.Trainer], set[int]] | None = None) -> None:
        self.local = local
        self.grads: dict[str, torch.Tensor] | None = None

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if self.grads is None:
            keep = self.local(trainer) if self.local is not None else None
            self.grads = {
                n.replace("_checkpoint_wrapped_module.", ""): full(p.grad)
                for n, p in module.named_parameters()
                if p.grad is not None and (keep is None or id(p) in keep)
            }


class SaveAt(L.Callback):
    """Save a checkpoint where ModelCheckpoint does (end of a training batch, mid-epoch) at ``step``, and the full
    parameters saved (``whole(trainer, module)``, called on every rank; rank 0 writes them to ``OUT/saved.pt``)."""

    def __init__(
        self, step: int, path: Path, out: Path, whole: Callable[[L.Trainer, L.LightningModule], dict[str, Any]]
    ) -> None:
        self.step, self.path, self.out, self.whole = step, path, out, whole

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
            saved = self.whole(trainer, module)
            if trainer.global_rank == 0:
                torch.save(saved, self.out / "saved.pt")


def shuffled_like_lightning(data: DataLoader, batch_size: int) -> DataLoader:
    """One process reading what all data-parallel ranks read together: Lightning gives every rank a shuffling
    DistributedSampler (seed 0); rank r takes every dp-th index of one permutation, so step k's global batch is
    the k-th slice of ``batch_size`` of that permutation."""
    sampler = DistributedSampler(data.dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data.dataset, batch_size=batch_size, sampler=sampler)


def gather_full(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's tensors (a pipeline stage's), merged: what rank 0 returns is the whole model."""
    parts: list[Any] = [None] * dist.get_world_size()
    meta = [k for k, v in named.items() if v.is_meta]
    assert not meta, f"rank {dist.get_rank()} returns released (meta) tensors as its own: {meta}"
    dist.all_gather_object(parts, {k: v.detach().cpu() for k, v in named.items()})
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def held_bytes(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, int]:
    """The bytes this rank holds, counted from the tensors (what a user measures): its parameters (a DTensor's local
    shard; a pipeline's released one, meta, nothing; a tied parameter once) and its optimizers' state tensors."""
    from lightning_sgdtp.parallel.sharding import held_bytes as counted

    held = counted(module, optimizers)
    return {"parameters": held["parameters"], "optimizer": held["optimizer_state"]}


def metrics(trainer: L.Trainer) -> dict[str, float]:
    """What the run logged (``trainer.callback_metrics``), as floats."""
    return {k: float(v) for k, v in trainer.callback_metrics.items()}
