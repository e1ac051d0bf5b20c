"""Stage boundaries are made contiguous (lightning_sgdtp/parallel/pipeline/boundaries.py): torch's pipeline frontend
keeps the traced strides, and send/recv refuse non-contiguous tensors ("input tensor has to be contiguous", the
failure of an unchanged transformers Llama under pipeline parallelism before issue 14)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from lightning_sgdtp.parallel.pipeline.boundaries import _dense_sends, make_boundaries_contiguous


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).mT.contiguous().mT  # same shape, transposed strides: what a head merge leaves


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _boundary_vals(split_gm: torch.fx.GraphModule) -> tuple[torch.Tensor, torch.Tensor]:
    stages = [m for n, m in split_gm.named_children() if n.startswith("submod_")]
    output = next(n for n in reversed(stages[0].graph.nodes) if n.op == "output")
    sent = output.args[0] if isinstance(output.args[0], torch.fx.Node) else output.args[0][0]
    received = next(n for n in stages[1].graph.nodes if n.op == "placeholder")
    return sent.meta["val"], received.meta["val"]


def test_views_at_a_stage_boundary_become_contiguous_and_results_stay_equal() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 4, 8)
    pipe = pipeline(net, mb_args=(x,), split_spec={"blocks.1": SplitPoint.BEGINNING})
    sent, received = _boundary_vals(pipe.split_gm)
    assert not sent.is_contiguous() and not received.is_contiguous()  # what torch 2.13 would send / allocate
    changed = make_boundaries_contiguous(pipe.split_gm)
    assert changed and any("output" in c for c in changed) and any("input" in c for c in changed), changed
    sent, received = _boundary_vals(pipe.split_gm)
    assert sent.is_contiguous() and received.is_contiguous()
    stage0 = next(m for n, m in pipe.split_gm.named_children() if n.startswith("submod_"))
    out0 = stage0(x)
    assert (out0 if isinstance(out0, torch.Tensor) else out0[0]).is_contiguous()  # what is really sent
    torch.testing.assert_close(pipe(x)[0] if isinstance(pipe(x), tuple) else pipe(x), net(x))


def test_a_gradient_sent_backward_is_made_contiguous() -> None:
    strided = torch.randn(4, 6).mT
    dense = torch.randn(6, 4)
    created = not dist.is_initialized()
    if created:  # P2POp needs a process group to name its peer; one of one rank, gone after the test
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ops = [dist.P2POp(dist.isend, strided, 0), dist.P2POp(dist.isend, dense, 0)]
        sent = _dense_sends(lambda chunk: ops)(0)
        assert all(op.tensor.is_contiguous() for op in sent)
        assert torch.equal(sent[0].tensor, strided) and sent[1] is ops[1]  # copied only where needed
    finally:
        if created:
            dist.destroy_process_group()
