"""What real models do to tensor-parallel activations, in one process on a fake 2-rank group (its collectives leave
each rank's tensor as it is, so a split layer's output is this rank's part: the masks and layouts are checked, the
sums across ranks are not; tests/distributed/test_model_zoo.py checks those against one process): in-place updates
of split layers' outputs (Falcon), the vocabulary-parallel embedding compiled with a graph break after it and as a
scaled subclass (BLOOM, Gemma), heads folded into the batch under the compiler (BLOOM's attention), writes into part
of a split dimension (refused: DTensor would lose them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_sgdtp.parallel.tensor.dtensor_ops import SplitWriteError
from lightning_sgdtp.parallel.tensor.plan import apply_tensor_parallel, auto_plan

VOCAB, WIDTH, HEADS = 32, 16, 4


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)


class ParallelBlock(nn.Module):
    """Falcon's parallel attention, reduced: two row-parallel outputs, one added into the other in place."""

    def __init__(self, in_place: bool = True) -> None:
        super().__init__()
        self.in_place = in_place
        self.attn, self.mlp = MLP(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp.proj(torch.relu(self.mlp.fc(x)))
        attn = self.attn.proj(torch.relu(self.attn.fc(x)))
        if not self.in_place:
            return x + out + attn
        out += attn  # into a row-parallel layer's output
        return x + out


def Plain() -> nn.Module:
    return ParallelBlock(in_place=False)


class FoldedAttention(nn.Module):
    """BLOOM's attention, reduced: the heads folded into the batch, a replicated bias added by ``baddbmm``."""

    def __init__(self, breaks: bool = False) -> None:
        super().__init__()
        self.num_heads, self.breaks = HEADS, breaks
        self.query_key_value, self.dense = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = WIDTH // HEADS
        q, k, v = self.query_key_value(x).view(b, t, HEADS, 3, d).unbind(-2)  # head-major: split by head
        q, k, v = (z.transpose(1, 2).reshape(b * HEADS, t, d) for z in (q, k, v))
        if self.breaks:
            torch._dynamo.graph_break()  # the folded tensors leave one graph and enter the next
        alibi = torch.arange(t, dtype=x.dtype).repeat(b * HEADS, 1, 1)  # a plain tensor: replicated
        probs = alibi.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=1.0, alpha=d**-0.5).softmax(-1)
        out = torch.bmm(probs, v).view(b, HEADS, t, d).transpose(1, 2).reshape(b, t, WIDTH)
        return x + self.dense(out)


class Scaled(nn.Embedding):
    """A token embedding that scales its lookup in its own forward (Gemma's, TrOCR's, MBart's)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 3.0


class LM(nn.Module):
    def __init__(
        self, block: type[nn.Module], embedding: type[nn.Embedding] = nn.Embedding, breaks: bool = False,
        in_place: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.breaks, self.in_place = breaks, in_place
        self.tok_emb = embedding(VOCAB, WIDTH)
        self.pos_emb = nn.Embedding(8, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.block = block()
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids)
        if self.in_place:
            x += self.pos_emb(torch.arange(ids.shape[1]))  # into the vocabulary-parallel embedding's output
        else:
            x = x + self.pos_emb(torch.arange(ids.shape[1]))
        if self.breaks:
            torch._dynamo.graph_break()  # the embedding's graph ends here (BLOOM's attention broke the graph)
        return self.lm_head(self.block(self.norm(x)))  # a norm right after the embedding (BLOOM)


def split(model: nn.Module, mesh) -> nn.Module:
    apply_tensor_parallel(model, auto_plan(model, 2), mesh)
    return model


def step(model: nn.Module, compiled: bool) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager") if compiled else model
    with implicit_replication():
        loss = run(ids).float().pow(2).mean()
        loss.backward()
    return loss


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_outputs_of_split_layers_can_be_updated_in_place(mesh, compiled: bool) -> None:
    # torch's to_local() is a view made in a custom autograd Function: `out += ...` failed in eager and at compile
    model = split(LM(ParallelBlock, in_place=True), mesh)
    assert torch.isfinite(step(model, compiled))
    assert all(p.grad is not None for p in model.parameters())


def test_the_vocabulary_parallel_embedding_compiles_as_a_graph_of_its_own(mesh) -> None:
    # torch's RowwiseParallel kept the mask of the other ranks' tokens in the output's placement until its output hook.
    # A graph break in the model (BLOOM's attention) made the compiler trace the embedding's forward alone, its hooks
    # outside the graph: the mask crossed graphs ("Mixing fake modes"). Here the layer reduces inside its forward
    model = split(LM(Plain), mesh)
    model.tok_emb.forward = torch.compile(model.tok_emb.forward, backend="aot_eager")
    assert torch.isfinite(step(model, compiled=False))
    assert model.tok_emb.weight.grad is not None


def test_a_scaled_embedding_subclass_keeps_its_forward_and_looks_up_this_ranks_rows(mesh) -> None:
    model = split(LM(Plain, embedding=Scaled), mesh)
    emb = model.tok_emb
    assert isinstance(emb, Scaled) and type(emb).__name__ == "VocabParallelScaled"
    assert isinstance(emb.weight, DTensor) and emb.weight.to_local().shape == (VOCAB // 2, WIDTH)
    ids = torch.tensor([[0, 5, 15, 16, 31]])
    with implicit_replication():
        out = emb(ids)
    # rank 0 of the fake group: its rows (ids 0..15) scaled by the subclass, the others' tokens zero (the fake
    # all-reduce adds nothing); a plain tensor of its own, modifiable in place
    local = emb.weight.to_local().detach()
    assert not isinstance(out, DTensor) and out.shape == (1, 5, WIDTH)
    assert torch.equal(out[0, :3], 3.0 * local[[0, 5, 15]]) and not out[0, 3:].any()
    out += 1


@pytest.mark.parametrize("breaks", [False, True], ids=["one-graph", "graph-break"])
def test_heads_folded_into_the_batch_compile(mesh, breaks: bool) -> None:
    # DTensor describes the folded head split as a _StridedShard. torch 2.13 gathered one with .tolist() on a fake
    # tensor (a graph break at the baddbmm: BLOOM) and could not rebuild one that crossed into the next graph
    from torch._dynamo.utils import counters

    model = split(LM(lambda: FoldedAttention(breaks)), mesh)
    assert model.block.query_key_value.weight.placements[0].is_shard()
    counters.clear()
    assert torch.isfinite(step(model, compiled=True))
    reasons = list(counters["graph_break"])  # only the model's own
    assert bool(reasons) == breaks and all("User-inserted graph break" in r for r in reasons), reasons


class Writer(nn.Module):
    def __init__(self, index: object) -> None:
        super().__init__()
        self.index = index
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mlp.fc(x)  # column-parallel: split on its last dimension until proj
        h[self.index] = 0.0
        return self.mlp.proj(h)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_write_into_part_of_the_split_dimension_is_refused_and_one_across_it_runs(mesh, compiled: bool) -> None:
    x = torch.randn(2, 8, WIDTH)
    torch._dynamo.reset()
    across = split(Writer((slice(None), 0)), mesh)  # one position, every feature: exact (fill_.Tensor)
    run = torch.compile(across, backend="aot_eager") if compiled else across
    with implicit_replication():
        assert run(x).shape == (2, 8, WIDTH)
    into = split(Writer((Ellipsis, slice(0, 3))), mesh)  # 3 features of 64, split 32 + 32: DTensor loses it
    run = torch.compile(into, backend="aot_eager") if compiled else into
    with implicit_replication(), pytest.raises(Exception, match=r"cuts dimension 2, the one the tensor is split on"):
        run(x)
    with pytest.raises(SplitWriteError, match=r"colwise_gather"), implicit_replication():
        into(x)


@pytest.mark.parametrize(
    ("index", "cut"),
    [
        ((Ellipsis, slice(0, 3)), 2),  # part of the split (last) dimension
        ((slice(None), 0), None),  # one position, every feature
        ((slice(None), slice(None), slice(None)), None),  # everything
        (0, None),  # one sample
        ((Ellipsis, 5), 2),  # one feature
        ((None, slice(None), slice(None), slice(2)), 2),  # a new axis takes no dimension
        (torch.ones(2, 8, dtype=torch.bool), None),  # a mask over batch and sequence
        (torch.ones(2, 8, 64, dtype=torch.bool), 2),  # a mask over every dimension
    ],
)
def test_which_writes_cut_the_split_dimension(index: object, cut: int | None) -> None:
    from types import SimpleNamespace

    from torch.distributed.tensor.placement_types import Shard

    from lightning_sgdtp.parallel.tensor.dtensor_ops import _cut_split_dim

    assert _cut_split_dim(SimpleNamespace(ndim=3, placements=(Shard(2),)), index) == cut
