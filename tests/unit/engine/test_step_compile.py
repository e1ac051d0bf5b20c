"""How a step is compiled: the frame Dynamo starts from (``engine/step_compile.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from lightning_sgdtp.engine.step_compile import compile_step


class OwnForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), id="torch_forward"),
        pytest.param(OwnForward, id="own_forward"),
    ],
)
def test_a_modules_call_compiles_whether_or_not_its_forward_is_torchs(build) -> None:
    """Fabric compiles the module's call (``_call_impl``): a ``nn.Sequential`` (forward in torch.nn, a file Dynamo
    never starts a frame in) must compile too, not run eagerly."""
    torch._dynamo.reset()
    module, counter = build(), CompileCounter()
    step = compile_step(module._call_impl, counter)
    x = torch.randn(3, 4)
    torch.testing.assert_close(step(x), module(x))
    assert counter.frame_count == 1 and counter.op_count >= 3


def test_a_training_step_is_compiled_as_it_is() -> None:
    torch._dynamo.reset()
    module, counter = OwnForward(), CompileCounter()
    step = compile_step(module.forward, counter)
    step(torch.randn(3, 4))
    assert counter.frame_count == 1
