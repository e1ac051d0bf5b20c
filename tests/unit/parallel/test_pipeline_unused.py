"""Parameters no pipeline stage calls (MBartForCausalLM's decoder layers keep a cross-attention that only an encoder
would feed): each stays on the stage of its module, by the split's rule, rather than on none. Before, every rank
released them after the first step (no traced stage holds them), so they were meta tensors everywhere: in the
optimizer's way, in every rank's checkpoint part, in the merged state dict (the zoo's "mbart", pipeline 1f1b).

One process on a fake 2-rank group (its collectives and sends do nothing): the stages are traced and built for
rank 0 (stage 0), which releases what rank 1's stage holds."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_sgdtp.parallel.pipeline.runner import PipelineRunner
from lightning_sgdtp.parallel.pipeline.split import plan_pipeline_split
from lightning_sgdtp.parallel.pipeline.unused import unused_line, unused_parameters

WIDTH = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.cross = nn.Linear(WIDTH, WIDTH)  # never called: as a decoder layer's cross-attention without encoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.spare = nn.Linear(WIDTH, WIDTH)  # never called, registered after the stack: the last stage's
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


UNUSED = {
    "blocks.0.cross.weight": 0,
    "blocks.0.cross.bias": 0,
    "blocks.1.cross.weight": 1,
    "blocks.1.cross.bias": 1,
    "spare.weight": 1,
    "spare.bias": 1,
}


@pytest.fixture
def fake_pair():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_unused_parameters_get_the_stage_of_their_module_and_are_named_in_one_line() -> None:
    torch.manual_seed(0)
    net = Net()
    split = plan_pipeline_split(net, 2)
    assert split.blocks_per_stage == [["blocks.0"], ["blocks.1"]]
    used = {id(p) for name, p in net.named_parameters() if ".cross." not in name and not name.startswith("spare.")}
    assert unused_parameters(net, split, used) == UNUSED
    line = unused_line(net, UNUSED)
    assert line.startswith("pipeline: 6 parameter(s) no stage's traced forward uses (blocks.0.cross (stage 0),"), line
    assert "blocks.1.cross (stage 1), spare (stage 1))" in line and "(2 on stage 0, 4 on stage 1)" in line, line


def test_a_parameter_no_stage_calls_is_kept_by_the_stage_of_its_module(fake_pair: dist.ProcessGroup) -> None:
    torch.manual_seed(0)
    net = Net()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    split = plan_pipeline_split(net, 2)
    runner = PipelineRunner(net, split, "1f1b", 2, fake_pair, torch.device("cpu"))
    assert runner.stage_ids == [0]
    runner._build((torch.randn(4, WIDTH),), {}, 2)
    # the traced stages' names, each unused parameter with the stage of its module
    assert {"blocks.0.cross.weight", "blocks.0.cross.bias"} <= runner.names_per_stage[0]
    assert {"blocks.1.cross.weight", "spare.bias"} <= runner.names_per_stage[1]
    assert not {"blocks.1.cross.weight", "spare.weight"} & runner.names_per_stage[0]
    local = {id(p) for p in runner.local_parameters}
    assert id(net.blocks[0].cross.weight) in local and id(net.blocks[1].cross.weight) not in local

    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    runner.release_other_stages([optimizer])  # after the first step: rank 0 keeps stage 0's parameters only
    assert not net.blocks[0].cross.weight.is_meta and not net.blocks[0].cross.bias.is_meta
    assert net.blocks[1].cross.weight.is_meta and net.spare.weight.is_meta  # stage 1's, held by rank 1
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(net.blocks[0].cross.weight) in stepped and id(net.blocks[1].cross.weight) not in stepped

    # this rank's checkpoint part: its stage's tensors, the unused ones of its modules included, none meta
    part = runner.stage_state_dict(net.state_dict())
    assert not [k for k, v in part.items() if v.is_meta]
    assert {"blocks.0.cross.weight", "blocks.0.cross.bias", "emb.weight", "blocks.0.fc.weight"} <= set(part)
    assert not {"blocks.1.cross.weight", "spare.weight", "head.weight"} & set(part)
    torch.testing.assert_close(part["blocks.0.cross.weight"], before["blocks.0.cross.weight"])
    assert runner.unused == UNUSED  # what rank 0's line names
