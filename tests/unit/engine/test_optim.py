"""The optimizer's update (option ``optimizer_update``): what is chosen, and that the result is the same update."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_sgdtp.engine.optim import OptimizerUpdateError, OptimizerUpdates, choose, compile_update, use_fused

CPU = torch.device("cpu")


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def train(m: nn.Module, opt: torch.optim.Optimizer, steps: int = 4, scheduler: bool = False) -> list[float]:
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler else None
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            opt.zero_grad()
            loss = m(x).pow(2).mean()
            loss.backward()
            return loss

        losses.append(float(opt.step(closure)))
        if sched is not None:
            sched.step()
    return losses


def test_choose_fused_where_torch_has_the_kernel_and_the_user_chose_nothing() -> None:
    params = list(model().parameters())
    assert choose(torch.optim.AdamW(params), "auto", CPU).how == "fused"
    assert choose(torch.optim.SGD(params, lr=0.1, momentum=0.9), "auto", CPU).how == "fused"
    assert choose(torch.optim.RMSprop(params), "auto", CPU).how == "compiled"  # no fused kernel in torch
    kept = choose(torch.optim.AdamW(params, foreach=True), "auto", CPU)
    assert kept.how == "eager" and "foreach=True" in kept.why
    assert choose(torch.optim.AdamW(params), "eager", CPU).how == "eager"

    class Lion(torch.optim.Optimizer):  # an optimizer from elsewhere: left alone
        def __init__(self, p: list) -> None:
            super().__init__(p, {"lr": 1e-3})

    assert choose(Lion(params), "auto", CPU).how == "eager"
    with pytest.raises(OptimizerUpdateError, match="no fused kernel for RMSprop.*'compiled'"):
        choose(torch.optim.RMSprop(params), "fused", CPU)


@pytest.mark.parametrize(
    "make", [lambda p: torch.optim.AdamW(p, lr=1e-2), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)]
)
def test_fused_update_matches_the_configured_one(make) -> None:
    ref, fused = model(), model()
    ref_opt, fused_opt = make(ref.parameters()), make(fused.parameters())
    undo = use_fused(fused_opt)
    assert train(ref, ref_opt, scheduler=True) == pytest.approx(train(fused, fused_opt, scheduler=True), rel=1e-5)
    for a, b in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not torch.equal(next(ref.parameters()), next(model().parameters()))  # it did train
    undo()
    assert fused_opt.param_groups[0]["fused"] is None and fused_opt.defaults["fused"] is None


def test_fused_checkpoints_keep_the_users_settings_and_loading_keeps_the_kernel() -> None:
    m = model()
    opt = torch.optim.AdamW(m.parameters())
    use_fused(opt)
    train(m, opt, steps=1)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["fused"] is None and saved["param_groups"][0]["foreach"] is None
    assert opt.param_groups[0]["fused"] is True  # still running fused
    opt.load_state_dict(copy.deepcopy(saved))  # the loaded groups say fused=None: the kernel stays
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
    train(m, opt, steps=1)


def test_compiled_update_matches_runs_the_closure_and_does_not_recompile_on_a_new_learning_rate() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    ref, comp = model(), model()
    ref_opt, comp_opt = torch.optim.RMSprop(ref.parameters(), lr=1e-2), torch.optim.RMSprop(comp.parameters(), lr=1e-2)
    undo = compile_update(comp_opt)
    before = counters["stats"]["unique_graphs"]
    ref_losses = train(ref, ref_opt, steps=5, scheduler=True)
    comp_losses = train(comp, comp_opt, steps=5, scheduler=True)
    assert ref_losses == pytest.approx(comp_losses, rel=1e-5)  # the closure ran: losses come back
    for a, b in zip(ref.parameters(), comp.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the learning rate halves every step (a 0-d tensor now, filled in place): the update compiled once
    assert counters["stats"]["unique_graphs"] - before == 1
    assert isinstance(comp_opt.state_dict()["param_groups"][0]["lr"], float)  # checkpoints keep a float
    undo()
    assert "step" not in comp_opt.__dict__ and comp_opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 32)


def test_installer_says_and_restores() -> None:
    m = model()
    opts = [torch.optim.AdamW(m.parameters()), torch.optim.RMSprop(m.parameters())]
    lines: list[str] = []
    updates = OptimizerUpdates()
    updates.install(opts, "auto", CPU, lines.append)
    assert [p["how"] for p in updates.describe()] == ["fused", "compiled"]
    assert lines[0].startswith("optimizer AdamW: update fused")
    updates.restore()
    assert opts[0].param_groups[0]["fused"] is None and "step" not in opts[1].__dict__
