"""ParallelLayout (sizes, grid, coordinates, sampler arguments), the one flatten-average helper, and GradSync's
sequence on one process: no processes started (a 1-rank gloo group in this process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_sgdtp import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.compiler.backend import CompileSettings, SGDTPCompiler
from lightning_sgdtp.engine.parallelize import DEBUG_OPTIONS_ENV, plan_part
from lightning_sgdtp.mesh.dims import ParallelLayout
from lightning_sgdtp.mesh.topology import detect
from lightning_sgdtp.sync.comm import all_reduce_flat
from lightning_sgdtp.sync.grad_sync import GradSync


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- layout
def test_data_parallel_has_no_grid() -> None:
    layout = ParallelLayout.resolve(SGDTPConfig(), 4, 2, 2)
    assert (layout.pp, layout.dp, layout.tp, layout.grid, layout.mesh_dims) == (1, 4, 1, None, None)
    assert layout.sampler_kwargs(3) == {"num_replicas": 4, "rank": 3}


def test_pipeline_grid_rows_are_stages() -> None:
    layout = ParallelLayout.resolve(SGDTPConfig(pipeline_stages=2), 4, 2, 2)
    assert (layout.pp, layout.dp, layout.grid, layout.mesh_dims) == (2, 2, [[0, 1], [2, 3]], ("pp", "dp"))
    assert layout.coordinates(3) == {"pp": 1, "dp": 1, "tp": 0}
    # The two ranks of one pipeline read the same batches; the two pipelines different ones.
    assert layout.sampler_kwargs(0) == layout.sampler_kwargs(2) == {"num_replicas": 2, "rank": 0}
    # pipeline_chunks alone: one stage per node when there are several nodes, else every rank.
    assert ParallelLayout.resolve(SGDTPConfig(pipeline_chunks=8), 8, 2, 4).pp == 4
    assert ParallelLayout.resolve(SGDTPConfig(pipeline_chunks=8), 4, 4, 1).pp == 4


def test_pipeline_with_tensor_parallel_has_a_3d_grid_tensor_parallel_innermost() -> None:
    config = SGDTPConfig(parallelism="hybrid", tensor_parallel_size=2, pipeline_stages=2, sharding="full")
    layout = ParallelLayout.resolve(config, 8, 4, 2)  # 2 nodes of 4: a stage's tensor-parallel group in one node
    assert (layout.pp, layout.dp, layout.tp, layout.mesh_dims) == (2, 2, 2, ("pp", "dp", "tp"))
    assert layout.grid == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert layout.coordinates(6) == {"pp": 1, "dp": 1, "tp": 0}
    # the ranks of a tensor-parallel group and the stages of one pipeline read the same batches
    assert (
        layout.sampler_kwargs(2)
        == layout.sampler_kwargs(3)
        == layout.sampler_kwargs(7)
        == {"num_replicas": 2, "rank": 1}
    )
    tensor = ParallelLayout.resolve(SGDTPConfig(parallelism="tensor", pipeline_stages=2), 4, 4, 1)
    assert (tensor.pp, tensor.dp, tensor.tp, tensor.grid) == (2, 1, 2, [[[0, 1]], [[2, 3]]])
    with pytest.raises(SGDTPConfigError, match="leaves one rank per stage: no tensor-parallel group"):
        ParallelLayout.resolve(SGDTPConfig(parallelism="tensor", pipeline_stages=4), 4, 4, 1)


def test_hybrid_grid_rows_are_tensor_parallel_groups() -> None:
    topo = detect("cpu", devices_per_node=2, num_nodes=2)
    layout = ParallelLayout.resolve(SGDTPConfig(parallelism="hybrid", tensor_parallel_size=2), 4, 2, 2, topo)
    assert (layout.dp, layout.tp, layout.grid, layout.mesh_dims) == (2, 2, [[0, 1], [2, 3]], ("dp", "tp"))
    assert layout.coordinates(3) == {"pp": 0, "dp": 1, "tp": 1}
    assert layout.sampler_kwargs(1) == {"num_replicas": 2, "rank": 0}


@pytest.mark.parametrize(
    ("config", "world", "per_node", "nodes", "message"),
    [
        (SGDTPConfig(pipeline_stages=3), 4, 4, 1, "pipeline_stages=3 must divide the 4 ranks"),
        (SGDTPConfig(parallelism="hybrid", tensor_parallel_size=3), 4, 4, 1, "does not divide the world size 4"),
        (SGDTPConfig(parallelism="tensor"), 4, 2, 2, "spans nodes"),
    ],
)
def test_sizes_that_cannot_work_are_named(config, world, per_node, nodes, message) -> None:
    with pytest.raises(SGDTPConfigError, match=message):
        ParallelLayout.resolve(config, world, per_node, nodes)


# ------------------------------------------------------------------------------------------------- comm
def test_all_reduce_flat_buckets_by_the_one_rule(one_rank: None) -> None:
    tensors = [torch.full((3,), 2.0), torch.full((2, 2), 4.0), torch.full((5,), 6.0, dtype=torch.float64)]
    sent = all_reduce_flat(tensors, divide_by=2, cap_bytes=16)  # 12 B, then 16 B, then a new dtype
    assert [t.tolist() for t in tensors[::2]] == [[1.0] * 3, [3.0] * 5]
    assert tensors[1].tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert sent == 3 * 4 + 4 * 4 + 5 * 8
    wire = [torch.full((4,), 1.0 / 3)]
    assert all_reduce_flat(wire, wire_dtype=torch.bfloat16) == 4 * 2  # bytes on the wire in bf16
    assert wire[0].dtype == torch.float32 and wire[0][0].item() != 1.0 / 3  # rounded through bf16


# -------------------------------------------------------------------------------------------- grad sync
def _sync(model: nn.Module, lines: list[str], config: SGDTPConfig | None = None) -> GradSync:
    """The gradient sync of ``model`` on one process, set up as the compiled engine sets it up from its plan."""
    config = config or SGDTPConfig()
    plan = plan_part(config, ParallelLayout.resolve(config, 1, 1), model)
    settings = CompileSettings(in_graph_sync=plan.in_graph_sync, prove_shards=plan.prove_shards)
    compiler = SGDTPCompiler(config, settings=settings)
    return GradSync(model.named_parameters(), compiler, None, config, lines.append, enabled=plan.dp_sync)


def test_eager_gradients_go_through_the_fallback_and_are_covered(one_rank: None) -> None:
    model, lines = nn.Linear(3, 2), []
    sync = _sync(model, lines)
    loss = model(torch.ones(4, 3)).sum()
    sync.before_backward(loss)
    loss.backward()
    sync.after_backward()
    sync.at_optimizer_step(torch.optim.SGD(model.parameters(), lr=0.1))
    assert sync.ledger.last_step == {"bias": ["fallback"], "weight": ["fallback"]}
    assert sync.fallback_params == ["weight", "bias"] and "outside the compiled graphs" in lines[0]


def test_a_gradient_the_sync_never_saw_fails_the_step(one_rank: None) -> None:
    model = nn.Linear(3, 2)
    sync = _sync(model, [])
    model(torch.ones(4, 3)).sum().backward()  # a backward the strategy did not see
    with pytest.raises(RuntimeError, match="were not averaged across ranks this step"):
        sync.at_optimizer_step(torch.optim.SGD(model.parameters(), lr=0.1))


def test_stepping_after_unsynced_micro_batches_alone_names_the_fix(one_rank: None) -> None:
    """An optimizer step whose every micro-batch ran in no_sync (Fabric's no_backward_sync) is named as such."""
    model = nn.Linear(3, 2)
    sync = _sync(model, [])
    with sync.no_sync():
        loss = model(torch.ones(4, 3)).sum()
        sync.before_backward(loss)
        loss.backward()
        sync.after_backward()
    with pytest.raises(RuntimeError, match="every backward since the last step ran without gradient sync"):
        sync.at_optimizer_step(torch.optim.SGD(model.parameters(), lr=0.1))


def test_negative_control_switch_turns_every_average_off(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_OPTIONS_ENV, "1")
    model, lines = nn.Linear(3, 2), []
    sync = _sync(model, lines, SGDTPConfig(debug_skip_sync="dp-sync"))
    assert not sync.enabled and not sync.compiler.in_graph_sync and "NEGATIVE CONTROL" in lines[0]
    loss = model(torch.ones(4, 3)).sum()
    sync.before_backward(loss)
    loss.backward()
    sync.after_backward()
    sync.at_optimizer_step(torch.optim.SGD(model.parameters(), lr=0.1))  # no coverage proof
    assert sync.ledger.last_step == {}
