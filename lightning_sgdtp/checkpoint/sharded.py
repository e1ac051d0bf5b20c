"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): save, load on any mesh, consolidate.

A sharded checkpoint is a folder: DCP's ``.metadata`` and one ``*.distcp`` file per rank (each rank writes
only its shards; replicated tensors are written once), ``meta.pt`` with the rest of Lightning's checkpoint
(loops, callbacks, hyper-parameters), and ``SGDTP-MANIFEST.json`` (SHA256 of every file, signed with
``signing_key``). The folder is written under a temporary name and renamed by rank 0 once every rank is
done: a crash mid-save leaves the previous checkpoint whole.

Model and optimizer states are keyed by parameter name (``torch.distributed.checkpoint.state_dict``), so a
checkpoint written on one mesh loads on another: DCP reads, for each rank, the part of each tensor that
rank holds (trained ``tp=2``, resumed ``dp=2``, and the reverse). :func:`consolidate` turns the folder into
one ``torch.save`` file that plain PyTorch loads.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_sgdtp.trust.durable import fsync_path, write_atomically

META = "meta.pt"
MODEL_KEY = "state_dict"


def is_sharded(path: str | os.PathLike) -> bool:
    """A folder written by :func:`save` (or any DCP checkpoint)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def save(
    path: Path,
    checkpoint: dict[str, Any],
    rank: int,
    token: str,
    barrier: Callable[[], None],
    signing_key: str | None = None,
) -> None:
    """Write Lightning's ``checkpoint`` (``state_dict`` and ``optimizer_states`` keyed by name) as a sharded folder.

    Every rank calls it with the same ``path`` and ``token`` (a name for the temporary folder, from rank 0).
    """
    import torch.distributed.checkpoint as dcp

    from lightning_sgdtp.trust.signatures import sign_with

    rest = dict(checkpoint)
    state = {MODEL_KEY: rest.pop(MODEL_KEY)}
    for i, optimizer_state in enumerate(rest.pop("optimizer_states", [])):
        state[optimizer_key(i)] = optimizer_state
    tmp = path.with_name(f".{path.name}.tmp-{token}")
    dcp.save(state, checkpoint_id=tmp)
    if rank == 0:
        torch.save(rest, tmp / META)
        sign_with(tmp, signing_key)
    barrier()  # every rank's shards are on disk
    if rank == 0:
        publish(tmp, path)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by saves killed mid-write
            shutil.rmtree(stale, ignore_errors=True)
    barrier()


def publish(tmp: Path, path: Path) -> None:
    """Put the finished folder ``tmp`` at ``path``. With a previous one there, both names are swapped in one
    atomic ``renameat2(RENAME_EXCHANGE)`` (Linux), so ``path`` is never missing; elsewhere, two renames."""
    if path.exists() and _exchange(tmp, path):
        old = tmp  # now holds the previous checkpoint
    else:
        old = path.with_name(f"{tmp.name}.old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
    fsync_path(path.parent)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2`` with ``RENAME_EXCHANGE``). False where unavailable."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def load(
    path: Path,
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    weights_only: bool | None = None,
    partial_optimizer: bool = False,
) -> dict[str, Any]:
    """Load a sharded folder into ``model`` and ``optimizers`` as they are laid out now; return the rest.

    ``partial_optimizer``: an optimizer may hold state for some parameters only (a pipeline rank steps its
    stages' parameters): load what it holds, do not require the rest."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {MODEL_KEY: get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state[MODEL_KEY])
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    for i, optimizer in enumerate(optimizers):
        optim_state = {optimizer_key(i): get_optimizer_state_dict(model, optimizer)}
        # A parameter that had no optimizer state when the checkpoint was written (never got a gradient: AdamW keeps
        # nothing for it) has none after loading either; torch's state-dict helpers made one up for every parameter.
        per_param = optim_state[optimizer_key(i)].get("state", {})
        stateless = [n for n in per_param if not any(k.startswith(f"{optimizer_key(i)}.state.{n}.") for k in saved)]
        for name in stateless:
            del per_param[name]
        dcp.load(optim_state, checkpoint_id=path)
        options = StateDictOptions(strict=not (partial_optimizer or stateless))
        set_optimizer_state_dict(model, optimizer, optim_state[optimizer_key(i)], options=options)
    return torch.load(path / META, map_location="cpu", weights_only=weights_only)


def load_full(checkpoint: dict[str, Any], model: nn.Module, optimizers: Sequence[Optimizer]) -> dict[str, Any]:
    """Load a one-file checkpoint (full tensors) into a model and optimizers that may be split across ranks."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    rest = dict(checkpoint)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, rest.pop(MODEL_KEY), options=options)
    states = rest.pop("optimizer_states", [])
    for optimizer, optim_state in zip(optimizers, states):
        set_optimizer_state_dict(model, optimizer, by_name(optim_state, model, optimizer), options=options)
    return rest


def by_name(optim_state: dict[str, Any], model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` (keyed by position) re-keyed by parameter name, as DCP's state dicts are."""
    groups = optim_state.get("param_groups", [])
    if all(isinstance(i, str) for g in groups for i in g["params"]):
        return optim_state
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    positions = [i for g in groups for i in g["params"]]
    if len(positions) != len(ordered):
        raise ValueError(
            f"the checkpoint's optimizer has {len(positions)} parameters, this one {len(ordered)}: it was written"
            " for another model or optimizer configuration."
        )
    to_name = dict(zip(positions, ordered))
    state = {to_name[k]: v for k, v in optim_state.get("state", {}).items()}
    new_groups = [{**g, "params": [to_name[i] for i in g["params"]]} for g in groups]
    return {"state": state, "param_groups": new_groups}


def consolidate(path: str | os.PathLike, output: str | os.PathLike) -> Path:
    """Merge a sharded checkpoint folder into one file (Lightning's layout; ``torch.load(output)["state_dict"]``
    is the full model state dict, keyed by parameter name). Runs in one process, no process group needed."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path, output = Path(path), Path(output)
    if not is_sharded(path):
        raise FileNotFoundError(f"{path} is not a sharded checkpoint folder (no .metadata inside).")
    output.parent.mkdir(parents=True, exist_ok=True)
    staged = output.with_name(f".{output.name}.dcp-{os.getpid()}")  # DCP's own single-file form, read back at once
    try:
        dcp_to_torch_save(path, staged)
        full = torch.load(staged, map_location="cpu", weights_only=False)
    finally:
        staged.unlink(missing_ok=True)
    meta = torch.load(path / META, map_location="cpu", weights_only=False) if (path / META).exists() else {}
    keys = sorted((k for k in full if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    merged = {**meta, MODEL_KEY: full[MODEL_KEY], "optimizer_states": [full[k] for k in keys]}
    write_atomically(output, lambda f: torch.save(merged, f))
    return output
