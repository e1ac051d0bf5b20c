"""A traced stage graph never names a value ``self`` (lightning_sgdtp/parallel/pipeline/names.py): BERT keeps its
self-attention as ``attention.self``, and FX's generated code then rebinds ``self`` ("'Tensor' object has no
attribute 'output'", every BERT-family model's first compiled pipeline step before issue 24)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from lightning_sgdtp.parallel.pipeline.names import rename_self_nodes


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self = nn.Linear(8, 8)  # as BertAttention
        self.output = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x)) + x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.ModuleList([Attention(), Attention()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layer:
            x = block(x)
        return x


def _stage0(x: torch.Tensor, rename: bool) -> tuple[nn.Module, list[str]]:
    torch.manual_seed(0)
    net = Net()
    pipe = pipeline(net, mb_args=(x,), split_spec={"layer.1": SplitPoint.BEGINNING})
    renamed = rename_self_nodes(pipe.split_gm) if rename else []
    stage = next(m for n, m in pipe.split_gm.named_children() if n.startswith("submod_"))
    return stage, renamed


def test_a_submodule_named_self_compiles_after_the_rename_and_computes_the_same() -> None:
    x = torch.randn(2, 8)
    stage, _ = _stage0(x, rename=False)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="has no attribute 'output'"):  # what torch 2.13's generated code does
        torch.compile(stage, backend="eager")(x)
    stage, renamed = _stage0(x, rename=True)
    assert renamed and all(r.endswith("self_") for r in renamed), renamed
    torch._dynamo.reset()
    got = torch.compile(stage, backend="eager")(x)
    torch.manual_seed(0)
    torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, Net().layer[0](x))  # the same weights
