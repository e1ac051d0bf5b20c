"""Fabric's ``state`` <-> the Trainer's checkpoint layout (``lightning_sgdtp.checkpoint.fabric_layout``), in one process:
what goes where, and that loading puts every object back (the files and the resume across front ends:
tests/distributed/test_fabric.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_sgdtp.checkpoint.fabric_layout import FABRIC_KEY, from_trainer_layout, to_trainer_layout
from lightning_sgdtp.config import SGDTPConfigError


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


class Counter:
    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_fabric_state_goes_to_the_trainer_layout_and_back() -> None:
    model, optimizer = _trained()
    state = {"model": model, "optimizer": optimizer, "step": 7, "counter": Counter(3)}
    checkpoint = to_trainer_layout(state, model, by_name=False)
    assert set(checkpoint["state_dict"]) == set(model.state_dict())
    assert len(checkpoint["optimizer_states"]) == 1 and checkpoint["optimizer_states"][0]["state"]
    assert checkpoint["step"] == 7 and checkpoint["counter"] == {"n": 3}
    assert checkpoint[FABRIC_KEY] == {"module": "model", "optimizers": ["optimizer"]}
    assert "pytorch-lightning_version" in checkpoint and checkpoint["lr_schedulers"] == []

    fresh, fresh_optimizer = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), None
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    target = {"model": fresh, "optimizer": fresh_optimizer, "step": 0, "counter": Counter(0)}
    load = lambda m, sd, strict: m.load_state_dict(sd, strict=strict)
    rest = from_trainer_layout(checkpoint, target, loaded=False, strict=True, load_module=load)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert fresh_optimizer.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    assert target["step"] == 7 and target["counter"].n == 3
    assert "state_dict" not in rest and FABRIC_KEY not in rest and "pytorch-lightning_version" in rest


def test_a_trainer_checkpoint_loads_into_fabric_state_and_strict_names_what_is_missing() -> None:
    model, optimizer = _trained()
    trainer_checkpoint = {
        "state_dict": model.state_dict(),
        "optimizer_states": [optimizer.state_dict()],
        "global_step": 5,
        "epoch": 0,
    }
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    load = lambda m, sd, strict: m.load_state_dict(sd, strict=strict)
    rest = from_trainer_layout(trainer_checkpoint, {"model": fresh}, loaded=False, strict=True, load_module=load)
    assert torch.equal(fresh[0].weight, model[0].weight) and rest["global_step"] == 5
    with pytest.raises(KeyError, match="iteration"):
        from_trainer_layout(trainer_checkpoint, {"model": fresh, "iteration": 0}, False, True, load)
    assert from_trainer_layout(trainer_checkpoint, {"model": fresh, "iteration": 0}, False, False, load)["epoch"] == 0


def test_two_models_in_one_state_are_refused_with_the_fix() -> None:
    with pytest.raises(SGDTPConfigError, match="one model per Fabric"):
        to_trainer_layout({"a": nn.Linear(1, 1), "b": nn.Linear(1, 1)}, None, by_name=False)
