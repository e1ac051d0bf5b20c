"""The ledger's autograd-graph walk: which parameter gradients leave a compiled graph, which are eager."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sgdtp import SGDTPCompiler
from lightning_sgdtp.ledger import GradLedger, Sync, walk_autograd_graph


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inside = nn.Linear(8, 8)
        self.outside = nn.Linear(8, 8)
        self.both = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    @torch.compiler.disable
    def eager(self, h: torch.Tensor) -> torch.Tensor:
        return self.outside(h) + self.both(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.both(self.inside(x))
        return (h + self.eager(h)).sum()


def test_walk_classifies_graph_and_eager_edges() -> None:
    torch._dynamo.reset()
    model = Mixed()
    compiler = SGDTPCompiler()  # no process group: plain single-process compile, same graph structure
    loss = torch.compile(model, backend=compiler)(torch.randn(4, 8))
    record = walk_autograd_graph(loss, compiler.graph_param_ids)
    name = {id(p): n for n, p in model.named_parameters()}
    assert sorted(name[i] for i in record.graph) == ["both.bias", "both.weight", "inside.bias", "inside.weight"]
    assert sorted(name[i] for i in record.eager) == ["both.bias", "both.weight", "outside.bias", "outside.weight"]


def test_single_process_ledger_records_every_gradient_once() -> None:
    torch._dynamo.reset()
    model = Mixed()
    compiler = SGDTPCompiler()
    ledger = GradLedger(model.named_parameters())
    loss = torch.compile(model, backend=compiler)(torch.randn(4, 8))
    record = walk_autograd_graph(loss, compiler.graph_param_ids)
    loss.backward()
    synced = ledger.sync(record)
    assert sorted(synced) == ["both.bias", "both.weight", "outside.bias", "outside.weight"]
    summary = ledger.end_step()
    assert summary["inside.weight"] == [Sync.GRAPH.value]
    assert summary["outside.weight"] == [Sync.FALLBACK.value]
    assert summary["both.weight"] == [Sync.FALLBACK.value, Sync.GRAPH.value]
    assert "unused.weight" not in summary and ledger.uncovered() == []
