"""Sharding's pure parts: which dimension is split, the compile-time proof over a backward graph, the options."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from lightning_sgdtp import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.compiler.shard_proof import (
    UnreducedGradientError,
    check_sharded_gradients,
    gradient_positions,
    reduced,
)
from lightning_sgdtp.parallel.sharding import shard_dim

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


@pytest.mark.parametrize(
    ("shape", "dp", "dim"),
    [((64, 32), 2, 0), ((3, 32), 2, 1), ((3, 5), 2, None), ((), 2, None), ((8,), 8, 0), ((4, 6), 8, None)],
)
def test_the_first_dimension_the_data_parallel_size_divides_is_split(shape, dp, dim) -> None:
    assert shard_dim(torch.Size(shape), dp) == dim


def _backward_graph(reduce: bool) -> tuple[fx.Graph, dict[int, str]]:
    """A backward graph of two gradient outputs, as AOTAutograd makes them: the sharded weight's gradient (an mm,
    then, when ``reduce``, reduce-scatter -> wait -> the average's division -> view) and a plain one."""
    g = fx.Graph()
    a, b = g.placeholder("tangent"), g.placeholder("saved")
    for n in (a, b):
        n.meta["val"] = torch.empty(8, 8)
    mm = g.call_function(aten.mm.default, (a, b))
    mm.meta["val"] = torch.empty(8, 8)
    out = mm
    if reduce:
        rs = g.call_function(c10d.reduce_scatter_tensor.default, (mm, "sum", 2, "0"))
        wait = g.call_function(c10d.wait_tensor.default, (rs,))
        div = g.call_function(aten.div.Tensor, (wait, 2))
        out = g.call_function(aten.view.default, (div, [4, 8]))
        for n in (rs, wait, div):
            n.meta["val"] = torch.empty(4, 8)
        out.meta["val"] = torch.empty(4, 8)
    other = g.call_function(operator.mul, (b, 2))
    other.meta["val"] = torch.empty(8, 8)
    g.output((out, other))
    return g, {0: "blocks.0.fc.weight"}


def test_a_reduce_scattered_gradient_is_proved_and_a_local_one_is_refused() -> None:
    good, outputs = _backward_graph(reduce=True)
    record = check_sharded_gradients(good, outputs, graph_id=3)
    assert record["proved_reduced"] == 1 and record["collectives_in_backward"] == {"reduce_scatter_tensor": 1}
    bad, outputs = _backward_graph(reduce=False)
    assert not reduced(bad.output_node().args[0][0])
    with pytest.raises(UnreducedGradientError, match=r"graph 3 the gradient of sharded parameter\(s\) \['blocks.0.fc"):
        check_sharded_gradients(bad, outputs, graph_id=3)


def test_each_input_gradient_is_found_where_aotautograd_put_it() -> None:
    """Issue 43: a pipeline stage of a 3-D layout (pp x dp x tp, sharded) on transformers Llama. Its rotary tables
    are plain inputs whose gradients are DTensors (two outputs each: local tensor, mesh), so counting the inputs'
    leaves put the o_proj weight's gradient on a mesh placeholder and the proof refused a reduced gradient. The
    positions come from the outputs: a non-tensor output (a mesh) belongs to the gradient before it."""
    g = fx.Graph()
    mesh = g.placeholder("mesh")
    mesh.meta["val"] = object()  # an opaque DeviceMesh, as AOTAutograd passes it
    plain = g.placeholder("tangent")
    plain.meta["val"] = torch.empty(4)
    # inputs: a sharded weight (DTensor: local + mesh), a mesh, a plain table with a DTensor gradient, a mask (no
    # gradient), a second sharded weight
    outputs = (plain, mesh, None, plain, mesh, None, plain, mesh)
    g.output(outputs)
    assert gradient_positions(g, 5) == [0, 2, 3, 5, 6]
    assert gradient_positions(g, 4) is None  # not one gradient per input: the caller keeps the leaf count


def test_sharding_options_fail_at_construction_with_the_fix() -> None:
    assert SGDTPConfig(sharding="full").sharded and not SGDTPConfig().sharded
    assert (
        SGDTPConfig.from_options({"distributed": {"strategy": "data", "sharding": "optimizer"}}).sharding == "optimizer"
    )
    with pytest.raises(SGDTPConfigError, match="sharding='zero3' is not known"):
        SGDTPConfig(sharding="zero3")
    with pytest.raises(SGDTPConfigError, match="parallelism='tensor' has none"):
        SGDTPConfig(sharding="full", parallelism="tensor")
    assert SGDTPConfig(sharding="full", pipeline_stages=2).sharded  # each stage sharded over its replicas
    with pytest.raises(SGDTPConfigError, match="applies to sharded parameters"):
        SGDTPConfig(param_gather_dtype="bf16")
    assert SGDTPConfig(sharding="full", param_gather_dtype="bf16").gather_dtype is torch.bfloat16
    assert SGDTPConfig(sharding="full", parallelism="hybrid").sharded  # 2-D: dp x tp


def test_data_parallel_with_sharding_has_a_mesh_of_the_data_parallel_ranks() -> None:
    from lightning_sgdtp.mesh.dims import ParallelLayout

    layout = ParallelLayout.resolve(SGDTPConfig(sharding="full"), world_size=4, devices_per_node=4)
    assert layout.grid == [[0], [1], [2], [3]] and layout.mesh_dims == ("dp", "tp") and (layout.dp, layout.tp) == (4, 1)
    assert ParallelLayout.resolve(SGDTPConfig(), world_size=4, devices_per_node=4).grid is None  # replicated: no mesh


def test_hybrid_sharding_splits_inside_a_node_and_replicates_across_nodes() -> None:
    from lightning_sgdtp.mesh.dims import ParallelLayout

    node = SGDTPConfig(sharding="full", shard_size="node")
    layout = ParallelLayout.resolve(node, world_size=8, devices_per_node=4, num_nodes=2)
    assert (layout.dp, layout.shard) == (8, 4)
    line = layout.describe(node)
    assert "2 x 4" in line and "[[0, 1, 2, 3], [4, 5, 6, 7]]" in line and "one node each" in line, line
    # one node: splitting inside it is splitting over every rank (no replicas, the 1-D layout)
    assert ParallelLayout.resolve(node, world_size=4, devices_per_node=4).shard is None
    assert ParallelLayout.resolve(SGDTPConfig(sharding="full", shard_size=2), 8, 8).shard == 2
    with pytest.raises(SGDTPConfigError, match=r"shard_size=3 \(3 ranks\) does not divide the 8"):
        ParallelLayout.resolve(SGDTPConfig(sharding="full", shard_size=3), 8, 8)
    with pytest.raises(SGDTPConfigError, match="applies to sharded parameters"):
        SGDTPConfig(shard_size="node")
    with pytest.raises(SGDTPConfigError, match="positive int"):
        SGDTPConfig(sharding="full", shard_size=0)
    # with pipeline stages: over each stage's data-parallel ranks; "node" = a stage's ranks inside one node
    staged = SGDTPConfig(sharding="full", shard_size=2, pipeline_stages=2)
    layout = ParallelLayout.resolve(staged, world_size=8, devices_per_node=8)
    assert (layout.pp, layout.dp, layout.dp_replicate, layout.dp_shard) == (2, 4, 2, 2)
    line = layout.describe(staged)
    assert "groups of 2 of its 4 data-parallel ranks" in line and "replicated 2 times" in line, line
    across = SGDTPConfig(sharding="full", shard_size="node", pipeline_stages=2)
    layout = ParallelLayout.resolve(across, world_size=16, devices_per_node=4, num_nodes=4)
    assert (layout.dp, layout.dp_replicate, layout.dp_shard) == (8, 2, 4)  # a stage spans 2 nodes of 4
    assert ParallelLayout.resolve(across, world_size=8, devices_per_node=4, num_nodes=2).shard is None  # one node each
    with pytest.raises(SGDTPConfigError, match=r"shard_size=3 \(3 ranks\) does not divide the 4"):
        ParallelLayout.resolve(SGDTPConfig(sharding="full", shard_size=3, pipeline_stages=2), 8, 8)
    # with tensor parallel (issue 26): 3-D, groups of 2 rows of tp=2, "node" = the rows of one node
    hsdp_tp = SGDTPConfig(sharding="full", shard_size="node", parallelism="hybrid", tensor_parallel_size=2)
    layout = ParallelLayout.resolve(hsdp_tp, world_size=16, devices_per_node=8, num_nodes=2)
    assert (layout.dp, layout.tp, layout.dp_replicate, layout.dp_shard) == (8, 2, 2, 4)
