"""Fabric's ``state`` dict <-> the Trainer strategy's checkpoint layout, so that a checkpoint of either front end
resumes under the other (the files themselves are written and read by :mod:`lightning_sgdtp.checkpoint.hooks`).

Fabric saves ``{"model": model, "optimizer": optimizer, "step": 3, ...}``; the Trainer's layout is the model's
weights under ``"state_dict"``, the optimizers' states in order under ``"optimizer_states"`` (keyed by parameter
name on a mesh, so that they load on any layout), and the rest beside them. ``"sgdtp_fabric"`` records which of
Fabric's keys went where.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_sgdtp.config import SGDTPConfigError

#: Where Fabric's keys went: {"module": key or None, "optimizers": [keys]}.
FABRIC_KEY = "sgdtp_fabric"


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _split(state: dict[str, Any]) -> tuple[str | None, list[str]]:
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if len(modules) > 1:
        raise SGDTPConfigError(
            f"fabric.save/load got {len(modules)} models ({modules}); the sgdtp strategy runs one model per Fabric."
            " Save one model in the state (put models trained together into one nn.Module)."
        )
    return (modules[0] if modules else None), [k for k, v in state.items() if isinstance(v, Optimizer)]


def to_trainer_layout(state: dict[str, Any], module: nn.Module | None, by_name: bool) -> dict[str, Any]:
    """The checkpoint of Fabric's ``state``: ``module`` is the set-up model (the inner one); ``by_name``: optimizer
    states keyed by parameter name (on a mesh: DTensor shards, loadable on any layout)."""
    module_key, optimizer_keys = _split(state)
    checkpoint: dict[str, Any] = {}
    for key, value in state.items():
        if key == module_key or key in optimizer_keys:
            continue
        checkpoint[key] = value.state_dict() if _stateful(value) else value
    if module_key is not None:
        assert module is not None
        checkpoint["state_dict"] = module.state_dict()
    if optimizer_keys:
        if by_name:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            assert module is not None
            checkpoint["optimizer_states"] = [get_optimizer_state_dict(module, state[k]) for k in optimizer_keys]
        else:
            checkpoint["optimizer_states"] = [state[k].state_dict() for k in optimizer_keys]
    checkpoint[FABRIC_KEY] = {"module": module_key, "optimizers": optimizer_keys}
    # What the Trainer reads on resume (it restores no loop state from a Fabric checkpoint: its counters start at 0).
    checkpoint.setdefault("pytorch-lightning_version", metadata.version("lightning"))
    checkpoint.setdefault("lr_schedulers", [])
    return checkpoint


def from_trainer_layout(
    checkpoint: dict[str, Any], state: Any, loaded: bool, strict: bool, load_module: Any
) -> dict[str, Any]:
    """Restore Fabric's ``state`` in place from a checkpoint in the Trainer's layout (ours or the Trainer's);
    ``loaded``: the model and optimizer states were loaded already (sharded folders, resharded files);
    ``load_module(module, state_dict, strict)`` loads the weights. Returns what ``state`` did not name."""
    checkpoint = dict(checkpoint)
    if not state:
        return checkpoint
    if isinstance(state, nn.Module):
        if not loaded:
            load_module(state, checkpoint.pop("state_dict", checkpoint), strict)
        return {}
    if isinstance(state, Optimizer):
        if not loaded:
            state.load_state_dict((checkpoint.get("optimizer_states") or [checkpoint])[0])
        return {}
    module_key, optimizer_keys = _split(state)
    weights, optimizer_states = checkpoint.pop("state_dict", None), checkpoint.pop("optimizer_states", [])
    checkpoint.pop(FABRIC_KEY, None)
    if module_key is not None and not loaded:
        if weights is None:
            raise KeyError(f"the checkpoint has no model weights ('state_dict') to load into state[{module_key!r}]")
        load_module(state[module_key], weights, strict)
    if optimizer_keys and not loaded:
        if len(optimizer_states) != len(optimizer_keys):
            raise KeyError(
                f"the checkpoint has {len(optimizer_states)} optimizer state(s) for {len(optimizer_keys)} optimizer(s)"
                f" in state ({optimizer_keys})"
            )
        for key, saved in zip(optimizer_keys, optimizer_states, strict=True):
            state[key].load_state_dict(saved)
    missing = [k for k in state if k not in (module_key, *optimizer_keys) and k not in checkpoint]
    if strict and missing:
        raise KeyError(f"the checkpoint has no {missing}: remove them from the state, or load with strict=False")
    for key in list(state):
        if key in (module_key, *optimizer_keys) or key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if _stateful(state[key]):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return checkpoint
