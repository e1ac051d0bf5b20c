"""One wait per collective (lightning_sgdtp/compiler/waits.py), on a graph built by hand: no process group."""

from __future__ import annotations

import torch
from torch import fx

from lightning_sgdtp.compiler.waits import one_wait_per_collective

c10d = torch.ops._c10d_functional


def _graph_with_two_waits() -> fx.Graph:
    """What AOTAutograd gave for Phi's shared LayerNorm under sharding: one reduce-scatter, two waits, each read."""
    graph = fx.Graph()
    grad = graph.placeholder("grad")
    scattered = graph.call_function(c10d.reduce_scatter_tensor.default, (grad, "avg", 2, "0"))
    first = graph.call_function(c10d.wait_tensor.default, (scattered,))
    second = graph.call_function(c10d.wait_tensor.default, (scattered,))
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (first, 2.0)), second))
    return graph


def test_the_second_wait_of_a_collective_reads_the_first() -> None:
    graph = _graph_with_two_waits()
    assert one_wait_per_collective(graph) == 1
    graph.lint()
    (scattered,) = [n for n in graph.nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert len(scattered.users) == 1, "what Inductor's bucket_reduce_scatters_fx asserts"
    (wait,) = scattered.users
    out = graph.output_node().args[0]
    assert out[1] is wait and out[0].args[0] is wait, "every reader of either wait reads the one left"
    assert one_wait_per_collective(graph) == 0, "nothing left to merge"


def test_a_graph_with_one_wait_each_is_left_as_it_is() -> None:
    graph = _graph_with_two_waits()
    one_wait_per_collective(graph)
    before = str(graph)
    assert one_wait_per_collective(graph) == 0 and str(graph) == before
