"""The sharded checkpoint folder in one process (DCP needs no process group for that): save over a previous
checkpoint atomically, verify, load back into a fresh model and optimizer, consolidate. Multi-rank saving and
resharding are in test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_sgdtp.checkpoint import sharded
from lightning_sgdtp.trust import verify_dir


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def lightning_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "state_dict": get_model_state_dict(model),
        "optimizer_states": [get_optimizer_state_dict(model, optimizer)],
        "global_step": step,
    }


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_save_over_a_previous_checkpoint_then_load_and_consolidate(
    tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:
        monkeypatch.setattr(sharded, "_exchange", lambda a, b: False)
    path = tmp_path / "last.ckpt"
    first, first_opt = trained(0)
    sharded.save(path, lightning_checkpoint(first, first_opt, 1), rank=0, token="a", barrier=lambda: None)
    model, optimizer = trained(1)
    sharded.save(path, lightning_checkpoint(model, optimizer, 2), rank=0, token="b", barrier=lambda: None)
    assert sharded.is_sharded(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"], "temporary or previous folders left behind"
    verify_dir(path)

    fresh, fresh_opt = trained(2)
    rest = sharded.load(path, fresh, [fresh_opt])
    assert rest["global_step"] == 2
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for state, loaded in zip(optimizer.state.values(), fresh_opt.state.values()):
        assert torch.equal(state["exp_avg"], loaded["exp_avg"])

    full = torch.load(sharded.consolidate(path, tmp_path / "full.pt"), weights_only=True)
    assert full["global_step"] == 2 and len(full["optimizer_states"]) == 1
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    plain.load_state_dict(full["state_dict"])
    assert torch.equal(plain[0].weight, model[0].weight)


def test_consolidate_refuses_a_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a sharded checkpoint folder"):
        sharded.consolidate(tmp_path, tmp_path / "out.pt")
