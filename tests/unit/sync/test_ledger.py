"""The ledger's autograd-graph walk: which parameter gradients leave a compiled graph, which are eager."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_sgdtp import SGDTPCompiler
from lightning_sgdtp.sync.ledger import GradLedger, Sync, walk_autograd_graph


@pytest.fixture(scope="module", autouse=True)
def fake_world() -> None:
    """A fake 2-rank process group: graphs get their in-graph collectives (no-ops here), as on 2 ranks."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


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
    compiler = SGDTPCompiler()
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
    agreed = ledger.agree(record)
    loss.backward()
    synced = ledger.sync(agreed)
    assert sorted(synced) == ["both.bias", "both.weight", "outside.bias", "outside.weight"]
    summary = ledger.end_step()
    assert summary["inside.weight"] == [Sync.GRAPH.value]
    assert summary["outside.weight"] == [Sync.FALLBACK.value]
    assert summary["both.weight"] == [Sync.FALLBACK.value, Sync.GRAPH.value]
    assert "unused.weight" not in summary and ledger.uncovered() == []
    ledger.remove_hooks()


def test_uncovered_reports_a_gradient_the_ledger_never_saw() -> None:
    model = Mixed()
    ledger = GradLedger(model.named_parameters())
    model.inside(torch.randn(2, 8)).sum().backward()  # a backward the strategy did not see
    ledger.end_step()
    assert ledger.uncovered(model.inside.parameters()) == ["inside.weight", "inside.bias"]
    assert ledger.uncovered() == []  # each step is checked once
    ledger.remove_hooks()


def test_collective_errors_are_told_from_the_ranks_own() -> None:
    """The fault guard turns a failed collective into a diagnosis of the peers (RankLostError); the rank's own errors
    pass through. gloo's timeout inside a compiled backward's wait_tensor has no "gloo" in its text."""
    from lightning_sgdtp.runtime.faults import is_distributed_error

    assert is_distributed_error(RuntimeError("Application timeout caused pair closure"))
    assert is_distributed_error(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 5000ms"))
    assert not is_distributed_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_distributed_error(ValueError("pair closure"))
