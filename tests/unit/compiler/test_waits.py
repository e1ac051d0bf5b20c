"""The repairs of lightning_sgdtp/compiler/waits.py (one wait per collective, one tensor per gradient output), on
graphs built by hand: no process group."""

from __future__ import annotations

import torch
from torch import fx

from lightning_sgdtp.compiler.waits import one_tensor_per_output, one_wait_per_collective

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


def _graph_returning_one_gradient_twice() -> fx.GraphModule:
    """What AOTAutograd gave for Phi's ``dense.bias`` and ``fc2.bias`` (the same gradient, computed once), and an
    opaque value returned beside them (as a graph returns a process group)."""
    graph = fx.Graph()
    grad = graph.placeholder("grad")
    grad.meta["val"] = torch.empty(4, 3)
    summed = graph.call_function(torch.ops.aten.sum.dim_IntList, (grad, [0]))
    summed.meta["val"] = torch.empty(3)
    group = graph.call_function(torch.ops.aten.sym_size.int, (grad, 0))  # not a tensor: left as it is
    group.meta["val"] = 4
    graph.output((summed, summed, group, group))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_gradient_returned_twice_gets_its_own_tensor() -> None:
    gm = _graph_returning_one_gradient_twice()
    assert one_tensor_per_output(gm.graph) == 1
    gm.graph.lint()
    gm.recompile()
    first, second, *_ = gm(torch.ones(4, 3))
    assert first.equal(second) and first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    first += 1  # what the next micro-batch's accumulation does to one parameter's .grad
    assert second.equal(torch.full((3,), 4.0)), "the other parameter's gradient is not touched"
    assert one_tensor_per_output(gm.graph) == 0, "outputs already distinct"
