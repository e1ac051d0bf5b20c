"""Tensor parallel inside pipeline stages (lightning_sgdtp/parallel/pipeline/stage_tensor.py), without a process group: the
hooks a split put on the whole module are recorded, set aside while torch.export traces it, and run by the traced
stage's layer of the same name."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import pipelining

from lightning_sgdtp.parallel.pipeline.stage_tensor import (
    has_tensor_hooks,
    hook_stage,
    hooks_set_aside,
    recording_hooks,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _split(net: Net) -> list[nn.Module]:
    x = torch.randn(2, 8)
    with hooks_set_aside(net):
        pipe = pipelining.pipeline(net, mb_args=(x,), split_spec={"blocks.1": pipelining.SplitPoint.BEGINNING})
    return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]


def test_the_hooks_added_in_the_block_are_recorded_and_only_those() -> None:
    net = Net()
    net.blocks[0].fc.register_forward_hook(lambda m, i, o: None)  # the user's own: not tensor parallel's
    with recording_hooks(net):
        net.blocks[0].fc.register_forward_pre_hook(lambda m, i: None)
        net.blocks[1].proj.register_forward_hook(lambda m, i, o: None, always_call=True)
    hooks = net.__dict__["_sgdtp_tensor_hooks"]
    assert [(h.module, h.pre, h.always_call) for h in hooks] == [
        ("blocks.0.fc", True, False),
        ("blocks.1.proj", False, True),
    ]
    assert has_tensor_hooks(net) and not has_tensor_hooks(Net())


def test_a_traced_stage_runs_the_hooks_of_the_whole_modules_layer_of_the_same_name() -> None:
    torch.manual_seed(0)
    net = Net()
    calls: list[str] = []
    with recording_hooks(net):  # as tensor parallel's: doubles fc's input, counts proj's output
        net.blocks[1].fc.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        net.blocks[1].proj.register_forward_hook(lambda m, args, out: calls.append("proj") or out)
    x = torch.randn(2, 8)
    expected = net(x)
    calls.clear()
    stages = _split(net)
    assert calls == []  # the trace ran without them
    assert len(net.blocks[1].fc._forward_pre_hooks) == 1  # and they are back on the whole module
    assert hook_stage(stages[0], net) == [] and hook_stage(stages[1], net) == ["blocks.1.fc", "blocks.1.proj"]
    out = stages[1](stages[0](x))
    torch.testing.assert_close(out, expected)  # the doubled input reached the traced fc
    assert calls == ["proj"]


def test_without_the_hooks_the_stage_computes_the_plain_model() -> None:
    torch.manual_seed(0)
    net = Net()
    with recording_hooks(net):
        net.blocks[1].fc.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    x = torch.randn(2, 8)
    hooked = net(x)
    stages = _split(net)
    with hooks_set_aside(net):
        plain = net(x)
    torch.testing.assert_close(stages[1](stages[0](x)), plain)  # not hooked: the plain model
    assert not torch.allclose(plain, hooked)
