"""ParallelDims (every dimension present, the product checked once, meshes built once) and the one plan / apply
step: plan_part is pure data over the options, the dimensions and the module; parallelize applies it in one fixed
order. No processes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_sgdtp import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.engine import parallelize as apply
from lightning_sgdtp.engine.parallelize import DEBUG_OPTIONS_ENV, PartPlan, ShardSettings, parallelize, plan_part
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.mesh.topology import detect
from lightning_sgdtp.parallel.tensor.plan import TensorPlan


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.up(x).relu())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).logsumexp(-1).mean()


def dims(config: SGDTPConfig, world: int = 2, per_node: int = 2, nodes: int = 1) -> ParallelDims:
    """The dimensions on a CPU cluster of ``nodes`` x ``per_node`` (the grid from its topology)."""
    return ParallelDims.resolve(config, world, per_node, nodes, detect("cpu", per_node, nodes))


# ---------------------------------------------------------------------------------------------- dims
def test_every_dimension_is_present_and_data_parallel_is_replicate_times_shard() -> None:
    replicated = dims(SGDTPConfig(), 4, 4)
    assert (replicated.pp, replicated.dp_replicate, replicated.dp_shard, replicated.cp, replicated.tp) == (
        1,
        4,
        1,
        1,
        1,
    )
    assert replicated.dp == 4 and replicated.dp_enabled and not replicated.tp_enabled and replicated.shard is None
    sharded = dims(SGDTPConfig(sharding="full"), 4, 4)
    assert (sharded.dp_replicate, sharded.dp_shard, sharded.shard, sharded.hybrid_shard_enabled) == (1, 4, None, False)
    hybrid = dims(SGDTPConfig(sharding="full", shard_size="node"), 8, 4, 2)
    assert (hybrid.dp_replicate, hybrid.dp_shard, hybrid.shard, hybrid.hybrid_shard_enabled) == (2, 4, 4, True)
    tp = dims(SGDTPConfig(parallelism="hybrid", tensor_parallel_size=2), 8, 4, 2)
    assert (tp.dp, tp.tp, tp.tp_enabled, tp.pp_enabled) == (4, 2, True, False)


def test_stage_and_micro_batch_counts_are_stored_once() -> None:
    pipe = dims(SGDTPConfig(pipeline_stages=2, pipeline_schedule="interleaved_1f1b", pipeline_stages_per_rank=3), 4, 4)
    assert (pipe.pp, pipe.dp, pipe.stages, pipe.micro_batches) == (2, 2, 6, 12)
    assert dims(SGDTPConfig(pipeline_stages=2, pipeline_chunks=5), 2, 2).micro_batches == 5
    assert (dims(SGDTPConfig(), 2, 2).stages, dims(SGDTPConfig(), 2, 2).micro_batches) == (0, 0)


def test_the_product_is_checked_once_and_unbuilt_dimensions_are_refused() -> None:
    with pytest.raises(SGDTPConfigError, match="must equal the world size 4"):
        ParallelDims(world_size=4, devices_per_node=4, dp_replicate=3)
    with pytest.raises(SGDTPConfigError, match="context parallel"):
        ParallelDims(world_size=4, devices_per_node=4, dp_replicate=2, cp=2)
    with pytest.raises(RuntimeError, match="build_meshes"):
        _ = dims(SGDTPConfig()).dp_group  # the meshes are built at setup, once, by every rank


# ---------------------------------------------------------------------------------------------- plan
def test_the_plan_is_pure_data_and_leaves_the_module_alone() -> None:
    model = Net()
    before = copy.deepcopy(model.state_dict())
    config = SGDTPConfig(parallelism="hybrid", tensor_parallel_size=2, sharding="full")
    plan = plan_part(config, dims(config, 4, 2, 2), model)
    assert isinstance(plan, PartPlan) and isinstance(plan.tensor_plan, TensorPlan)
    assert plan.sharding == ShardSettings("full", None, None)
    assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing split
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    # with sharding, embeddings stay whole (sharded over dp, not split by vocabulary)
    assert "embed" not in plan.tensor_plan.styles and "embed" in plan.tensor_plan.replicated
    assert plan.tensor_plan.styles["blocks.0.up"] == "colwise" and plan.clip == "mesh" and plan.implicit_replication
    assert plan.to_dict()["sharding"] == "full" and plan.lock_compiles is None  # each rank its own row of groups
    # DTensor parameters: regional compile is off (torch 2.13 has no rule for them in a region), and says why
    assert plan.regions == () and any("off with tensor parallel or sharding" in n for n in plan.notes)
    for mesh in (SGDTPConfig(parallelism="tensor"), SGDTPConfig(sharding="full")):
        assert plan_part(mesh, dims(mesh), Net()).regions == ()


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_sequence_parallel_is_off_by_default_on_every_device_and_the_plan_says_why(device_type: str) -> None:
    from gpt import GPT, GPTConfig

    def gpt() -> GPT:
        return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=48))

    default = SGDTPConfig(parallelism="tensor", tensor_parallel_size=2)
    plan = plan_part(default, dims(default), gpt(), device_type=device_type).tensor_plan
    assert plan is not None and not plan.sequence_blocks and "sequence" not in plan.styles.values()
    assert plan.sequence_reason.startswith("off (sequence_parallel=None: off; on ")
    assert plan.sequence_reason.endswith("; pass sequence_parallel=True to turn it on)")
    why = {"cpu": "gloo runs a reduce-scatter as a full all-reduce", "cuda": "until a GPU run of benchmarks/gpu_check"}
    assert why[device_type] in plan.sequence_reason
    assert f"  sequence parallel: {plan.sequence_reason}" in plan.describe()  # the rank-0 log line
    # Explicitly asked for: on, on either device (the CUDA run of it is what benchmarks/gpu_check.py checks).
    asked = SGDTPConfig(parallelism="tensor", tensor_parallel_size=2, sequence_parallel=True)
    on = plan_part(asked, dims(asked), gpt(), device_type=device_type).tensor_plan
    assert on is not None and on.sequence_blocks == ["blocks.0", "blocks.1"] and on.sequence_reason.startswith("on: ")


def test_data_parallel_plans_the_compile_and_the_sync_only() -> None:
    config = SGDTPConfig(activation_checkpointing=True)
    plan = plan_part(config, dims(config), Net())
    assert (plan.tensor_plan, plan.sharding, plan.compile, plan.clip) == (None, None, "training_step", None)
    assert plan.checkpoint == tuple(f"blocks.{i}" for i in range(4))
    assert plan.in_graph_sync and plan.dp_sync and plan.measure_link and plan.lock_compiles == "node"
    cached = SGDTPConfig(compile_cache="/tmp/x", bucket_cap_mb=25)
    with_cache = plan_part(cached, dims(cached), Net())
    assert (with_cache.lock_compiles, with_cache.compile_cache) == ("node", "/tmp/x")  # one rank compiles, into it
    assert not with_cache.measure_link  # a fixed cap: nothing to measure
    measured = SGDTPConfig(compile_cache="/tmp/x")  # the measured cost model is recorded in the cache: kept
    assert plan_part(measured, dims(measured), Net()).measure_link
    assert plan.regions == () and "activation_checkpointing" in plan.notes[0]  # compiles whole (compiler/regions.py)
    plain = SGDTPConfig()
    assert plan_part(plain, dims(plain), Net()).regions == tuple(f"blocks.{i}" for i in range(4))  # the default
    whole = SGDTPConfig(regional_compile=False)
    assert plan_part(whole, dims(whole), Net()).regions == () and "off" in plan_part(whole, dims(whole), Net()).notes[0]
    evaluation = plan_part(config, dims(config), Net(), fitting=False)
    assert (evaluation.checkpoint, evaluation.compile) == ((), None)  # validate/test: Lightning's own step


def test_a_pipeline_shards_the_whole_module_and_parallelizes_each_stage() -> None:
    config = SGDTPConfig(pipeline_stages=2, sharding="optimizer", activation_checkpointing=True)
    d = dims(config, 4, 4)
    whole = plan_part(config, d, Net(), part="pipelined model")
    assert whole.sharding == ShardSettings("optimizer", None, None) and (whole.checkpoint, whole.compile) == ((), None)
    assert whole.clip == "pipeline" and whole.in_graph_sync  # dp=2 replicas of each stage
    stage = plan_part(config, d, Net(), part="stage", stage_blocks=["blocks.0", "blocks.1"])
    assert stage.sharding is not None and stage.sharding.from_whole
    assert (stage.checkpoint, stage.compile) == (("blocks.0", "blocks.1"), "forward")
    one_pipeline = SGDTPConfig(pipeline_stages=2)
    assert not plan_part(one_pipeline, dims(one_pipeline), Net(), part="stage").in_graph_sync  # no replicas
    assert stage.regions == () and any("not for pipeline stages" in n for n in whole.notes)  # a traced stage


def test_what_is_applied_already_is_not_planned_again() -> None:
    from lightning_sgdtp.parallel.checkpointing import checkpoint_blocks

    model = Net()
    checkpoint_blocks(model, [["blocks.0"]])
    config = SGDTPConfig(activation_checkpointing=True)
    assert plan_part(config, dims(config), model).checkpoint == ()


def test_debug_skip_sync_acts_only_under_the_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEBUG_OPTIONS_ENV, raising=False)
    config = SGDTPConfig(sharding="full", debug_skip_sync="reduce-scatter")
    with pytest.warns(UserWarning, match="refused"):
        refused = plan_part(config, dims(config), Net())
    assert refused.skipped is None and refused.sharding.reduce and not any("NOT" in n for n in refused.notes)
    monkeypatch.setenv(DEBUG_OPTIONS_ENV, "1")
    control = plan_part(config, dims(config), Net())
    assert control.skipped == "reduce-scatter" and not control.sharding.reduce
    assert control.prove_shards and control.dp_sync  # the proof stays on: the first compile must fail
    assert "NOT reduce-scattered" in control.notes[-1] and control.to_dict()["debug_skip_sync"] == "reduce-scatter"
    no_sync = SGDTPConfig(debug_skip_sync="dp-sync")
    plan = plan_part(no_sync, dims(no_sync), Net())
    assert not (plan.dp_sync or plan.in_graph_sync or plan.prove_shards or plan.measure_link)


# --------------------------------------------------------------------------------------------- apply
def test_parallelize_applies_in_one_fixed_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor parallel, then sharding, then activation checkpointing, then compile with backends made for the
    part as it is then."""
    order: list[str] = []
    monkeypatch.setattr(apply, "apply_tensor_parallel", lambda part, plan, mesh: order.append("tensor parallel"))
    monkeypatch.setattr(apply, "shard_parameters", lambda part, *args: order.append("sharding"))
    monkeypatch.setattr(apply, "checkpoint_blocks", lambda part, blocks: order.append("checkpointing") or ["b"])
    monkeypatch.setattr(apply, "compile_step", lambda fn, backend: order.append(f"compile with {backend}") or fn)
    built = ParallelDims(world_size=2, devices_per_node=2, dp_replicate=2).build_meshes("cpu")  # no mesh: plain dp

    def backends(part: nn.Module) -> list[str]:
        order.append("backends made")
        return ["a", "b"]

    plan = PartPlan(TensorPlan(tp=2), ShardSettings("full"), ("blocks.0",), "training_step")
    done = parallelize(Net(), plan, built, backends)
    assert order == [
        "tensor parallel", "sharding", "checkpointing", "backends made", "compile with a", "compile with b",
    ]  # fmt: skip
    assert done.checkpointed == ["b"] and len(done.steps) == 2
    order.clear()
    parallelize(Net(), PartPlan(), built, backends)  # nothing asked, nothing applied
    assert order == []


def test_sharding_over_one_data_parallel_rank_proves_nothing() -> None:
    """``sharding="full"`` on one process: a gradient over one rank is already reduced (the backend inserts no
    collective for a group of one), so the shard proof has nothing to ask; it ran and failed the first backward."""
    config = SGDTPConfig(sharding="full")
    one, two = plan_part(config, dims(config, 1, 1), Net()), plan_part(config, dims(config, 2, 2), Net())
    assert one.sharding is not None and not one.prove_shards
    assert two.sharding is not None and two.prove_shards
