"""Regional compile (compiler/regions.py) of blocks that receive views of one tensor as separate inputs (GPT-J's
sin and cos: two halves of one ``embed_positions`` row, passed to every layer). torch's ``invoke_subgraph`` takes no
aliased inputs (Dynamo: "Encountered aliasing during higher order op tracing"); the marked ``forward`` clones the
later views at the region's boundary. Small model, Dynamo with ``aot_eager`` (no Inductor): seconds."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import fx, nn

from lightning_sgdtp.compiler.regions import mark_regions, separate_aliased_inputs, unmark_regions

WIDTH, LAYERS = 8, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor) -> torch.Tensor:
        sin, cos = rotary
        return torch.tanh(self.proj(x)) * cos + x * sin + scale


class Stack(nn.Module):
    """Every layer gets ``sin`` and ``cos``, two views (``split``) of one tensor, and ``scale``, a third view of it."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Buffer(torch.randn(16, 3 * WIDTH), persistent=False)
        self.embed = nn.Linear(WIDTH, WIDTH)  # every layer's x requires grad, the first one's too (one region)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.table[: x.shape[0]] * 1.0  # an intermediate, as GPT-J's embed_positions[position_ids]
        sin, cos, scale = torch.split(rows, WIDTH, dim=-1)
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, (sin, cos), scale=scale)
        return x.sum()


def _grads(model: Stack, x: torch.Tensor, compiled: bool, graphs: list[fx.GraphModule]) -> dict[str, torch.Tensor]:
    model.zero_grad()

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return torch._dynamo.backends.common.aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    step = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
    step(x).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_views_of_one_tensor_as_separate_inputs_compile_as_one_region_with_eagers_gradients(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(4, WIDTH)
    eager = _grads(model, x, compiled=False, graphs=[])
    mark_regions(model, [f"layers.{i}" for i in range(LAYERS)])
    graphs: list[fx.GraphModule] = []
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch.sgdtp"):
            compiled = _grads(model, x, compiled=True, graphs=graphs)
    finally:
        unmark_regions(model)
        torch._dynamo.reset()
    target = torch.ops.higher_order.invoke_subgraph
    calls = [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and n.target is target]
    assert len(calls) == LAYERS and len({c.args[0].target for c in calls}) == 1, "one region, called per layer"
    assert compiled.keys() == eager.keys()
    for name in eager:  # each layer with its own weights (a region reusing the first layer's would be far off)
        assert torch.allclose(compiled[name], eager[name], rtol=1e-5, atol=1e-6), name
    said = [r.getMessage() for r in caplog.records if "cloned at the region's boundary" in r.getMessage()]
    line = (
        "sgdtp: regional compile: Block's input(s) rotary[1], scale view the same tensor as an earlier input: cloned"
        " at the region's boundary (torch's invoke_subgraph takes no aliased inputs)"
    )
    assert said == [line], "one line for the block class, not one per layer"


def test_separate_aliased_inputs_clones_only_the_later_views() -> None:
    base = torch.randn(4, 6)
    a, b = base[:, :3], base[:, 3:]
    other, plain = torch.randn(3), torch.randn(2)
    args, kwargs = separate_aliased_inputs("B", (a, [b, other], plain), {"again": base, "same": plain, "n": 3})
    assert args[0] is a and args[1][1] is other and args[2] is plain and kwargs["n"] == 3, "the first of each kept"
    for copy, of in ((args[1][0], b), (kwargs["again"], base), (kwargs["same"], plain)):
        assert torch.equal(copy, of) and copy.untyped_storage().data_ptr() != of.untyped_storage().data_ptr()
    assert type(args[1]) is list
    # nothing aliased: the very same objects back
    untouched = ((a, other), {"x": plain})
    assert separate_aliased_inputs("B", *untouched) == untouched
    assert separate_aliased_inputs("B", *untouched)[0] is untouched[0]
