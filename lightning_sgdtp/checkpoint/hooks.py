"""What the strategy's checkpoint hooks do, on any layout, without Lightning (the hooks delegate here).

- One file (data parallel): written atomically by rank 0 (``write_atomically``, then the folder fsynced) with its
  SHA256 manifest inside, signed with ``signing_key`` (a seal: :mod:`lightning_sgdtp.trust.sealed`; the folder
  holds the checkpoints and nothing else, as with ``ddp``), verified before ``torch.load`` unpickles anything
  (``verify_artifacts``, ``trusted_key``).
- A sharded folder (any mesh): every rank writes its shards, or its stages' tensors, through DCP
  (:mod:`lightning_sgdtp.checkpoint.sharded`); optimizer states are keyed by parameter name, so a checkpoint
  loads on any other layout.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_sgdtp.checkpoint import sharded
from lightning_sgdtp.config import SGDTPConfig
from lightning_sgdtp.runtime.faults import FaultGuard
from lightning_sgdtp.trust import verify_dir
from lightning_sgdtp.trust.durable import fsync_path, write_atomically
from lightning_sgdtp.trust.sealed import retire_manifest, seal
from lightning_sgdtp.trust.sealed import verify_file as verify_sealed
from lightning_sgdtp.trust.signatures import signing_keys


# ------------------------------------------------------------------------------------------- one file
def save_file(checkpoint: dict[str, Any], target: Path, signing_key: str | None) -> None:
    """``torch.save`` to a temporary file, seal it (signed with ``signing_key``), fsync, then rename: a crash mid-save
    leaves the previous file whole."""
    gpg_key, pem_key = signing_keys(signing_key)

    def write(f: Any) -> None:
        torch.save(checkpoint, f)
        seal(f, gpg_key=gpg_key, pem_key=pem_key)

    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, write)
    # What saves killed mid-write left behind (never a file Lightning would load: the name does not match).
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    fsync_path(target.parent)
    retire_manifest(target.parent)


def removed(target: Path) -> None:
    """``target`` was removed (by ``ModelCheckpoint``): the previous layout's manifest beside it goes once it vouches
    for no file there (a folder written before seals, then resumed into)."""
    retire_manifest(target.parent)


def verify_file(target: Path, trusted_key: str | None) -> None:
    """Refuse a file its seal (or the previous layout's manifest beside it; signed, with ``trusted_key``) does not
    vouch for."""
    verify_sealed(target, trusted=Path(trusted_key) if trusted_key else None)


# -------------------------------------------------------------------------------------------- layouts
class ShardedCheckpoints:
    """Save and load through DCP when the model is laid out on a mesh; load a one-file checkpoint onto it.

    Args:
        config: the options (signing and verification keys).
        rank: this process's global rank.
        broadcast: rank 0's value on every rank (a collective).
        barrier: all ranks meet (a collective).
        guard: names the phase of each collective (faults).
    """

    def __init__(
        self,
        config: SGDTPConfig,
        rank: int,
        broadcast: Callable[[Any], Any],
        barrier: Callable[[], None],
        guard: FaultGuard,
    ) -> None:
        self.config, self.rank, self.broadcast, self.barrier, self.guard = config, rank, broadcast, barrier, guard

    def save(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """Every rank writes its part of ``checkpoint`` (the model's state already reduced to what it holds)."""
        path = Path(self.broadcast(str(filepath)))
        token = self.broadcast(uuid.uuid4().hex[:12])
        with self.guard("save_checkpoint"):
            sharded.save(path, checkpoint, self.rank, token, self.barrier, self.config.signing_key)

    def load(
        self,
        path: Path,
        module: nn.Module,
        optimizers: list[Optimizer],
        weights_only: bool | None,
        load_file: Callable[[Path], dict[str, Any]],
        on_mesh: bool,
        partial_optimizer: bool,
    ) -> tuple[dict[str, Any], bool]:
        """Either format onto this layout. Returns (what is left for Lightning, whether the model and optimizer
        states were loaded here); a plain one-file checkpoint without a mesh is left to Lightning whole."""
        if sharded.is_sharded(path):
            if self.config.verify_artifacts:
                verify_dir(path, trusted=Path(self.config.trusted_key) if self.config.trusted_key else None)
            with self.guard("load_checkpoint"):
                rest = sharded.load(path, module, optimizers, weights_only, partial_optimizer=partial_optimizer)
            return rest, True
        checkpoint = load_file(path)
        states = checkpoint.get("optimizer_states") or [{}]
        by_name = any(isinstance(k, str) for k in states[0].get("state", {}))  # a consolidated sharded checkpoint
        if not on_mesh and not by_name:
            return checkpoint, False  # Lightning's own loading
        return sharded.load_full(checkpoint, module, optimizers if "optimizer_states" in checkpoint else []), True
