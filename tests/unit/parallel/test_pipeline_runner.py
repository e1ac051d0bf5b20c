"""The pipeline runner's pure parts, one process: micro-batching, the contract probe, log recording, sizes."""

from __future__ import annotations

import pytest
import torch
from gpt import GPTLightningModule

from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.mesh.dims import ParallelLayout
from lightning_sgdtp.parallel.pipeline.contract import (
    LogRecorder,
    PipelineContractError,
    batch_size_of,
    capture_forward_inputs,
)
from lightning_sgdtp.parallel.pipeline.runner import check_chunks, micro_batch_count, split_batch


def small() -> GPTLightningModule:
    return GPTLightningModule(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=8)


@pytest.mark.parametrize(("batch", "chunks", "expected"), [(8, 4, 4), (6, 4, 3), (7, 4, 1), (2, 4, 2), (12, 8, 6)])
def test_a_batch_runs_with_the_largest_count_of_equal_micro_batches(batch: int, chunks: int, expected: int) -> None:
    assert micro_batch_count(batch, chunks) == expected


def test_split_batch_cuts_every_batch_sized_tensor_and_repeats_the_rest() -> None:
    x, y = torch.arange(8).view(8, 1), torch.arange(8) * 10
    parts = split_batch({"x": x, "y": y, "scale": torch.tensor(2.0), "name": "a"}, 8, 4)
    assert len(parts) == 4
    assert [p["x"].view(-1).tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert parts[3]["y"].tolist() == [60, 70] and parts[2]["name"] == "a" and float(parts[1]["scale"]) == 2.0
    # the same cut as the schedules make of the inputs (torch.tensor_split along dim 0)
    assert all(torch.equal(p["x"], c) for p, c in zip(parts, torch.tensor_split(x, 4)))


def test_the_probe_finds_what_training_step_passes_to_self_and_stops_there() -> None:
    module = small()
    x, y = torch.randint(0, 16, (4, 8)), torch.randint(0, 16, (4, 8))
    args, kwargs = capture_forward_inputs(module, "training_step", (x, y), 0)
    assert len(args) == 1 and args[0] is x and kwargs == {}
    assert batch_size_of(args, kwargs, "training_step") == 4
    assert "forward" not in module.__dict__ and "log" not in module.__dict__  # restored


def test_a_step_that_never_calls_self_is_named() -> None:
    module = small()
    module.training_step = lambda batch, batch_idx: module.model(batch[0]).sum()  # bypasses self(...)
    with pytest.raises(PipelineContractError, match=r"training_step never called self\(\.\.\.\)"):
        capture_forward_inputs(module, "training_step", (torch.zeros(2, 8, dtype=torch.long),) * 2, 0)


def test_logs_are_averaged_over_micro_batches_and_metrics_kept_by_name() -> None:
    module = small()
    recorder = LogRecorder(module)
    for value in (1.0, 2.0, 4.5):
        recorder.log("train_loss", torch.tensor(value), prog_bar=True)
        recorder.log("train_ppl", module.train_ppl, on_step=True, on_epoch=False)
    summary = recorder.summary()
    assert summary[0] == ("train_loss", "value", 2.5, (), {"prog_bar": True})
    assert summary[1] == ("train_ppl", "metric", "train_ppl", (), {"on_step": True, "on_epoch": False})


@pytest.mark.parametrize(
    ("schedule", "chunks", "pp", "stages", "problem"),
    [
        ("1f1b", 2, 2, 2, None),
        ("1f1b", 1, 2, 2, "at least as many micro-batches as stages"),
        ("gpipe", 1, 4, 4, None),
        ("interleaved_1f1b", 5, 2, 4, "multiple of max(1, chunks // 2) = 2"),
        ("interleaved_1f1b", 6, 2, 4, None),
        ("interleaved_1f1b", 8, 2, 4, None),
        ("interleaved_1f1b", 3, 2, 4, None),
    ],
)
def test_schedule_rules_are_torchs(schedule: str, chunks: int, pp: int, stages: int, problem: str | None) -> None:
    found = check_chunks(schedule, chunks, pp, stages)
    assert (found is None) if problem is None else (problem in found)


def test_pipeline_dims_place_stages_across_nodes_and_replicas_inside() -> None:
    dims = ParallelLayout.resolve(SGDTPConfig(pipeline_stages=2), 4, 2, num_nodes=2)  # 2 nodes x 2 devices
    assert (dims.pp, dims.dp, dims.grid) == (2, 2, [[0, 1], [2, 3]])  # stage 0 on node 0, stage 1 on node 1
    # (pipeline index = data-parallel rank, stage index = pipeline rank) of each rank
    assert [(dims.coordinates(r)["dp"], dims.coordinates(r)["pp"]) for r in range(4)] == [
        (0, 0),
        (1, 0),
        (0, 1),
        (1, 1),
    ]
    chunks_alone = SGDTPConfig(pipeline_chunks=8)
    assert ParallelLayout.resolve(chunks_alone, 8, 2, num_nodes=4).pp == 4  # pipeline_chunks alone: one stage per node
    assert ParallelLayout.resolve(chunks_alone, 4, 4, num_nodes=1).pp == 4  # one node: all ranks
    with pytest.raises(SGDTPConfigError, match="pipeline_stages=3 must divide the 4 ranks"):
        ParallelLayout.resolve(SGDTPConfig(pipeline_stages=3, pipeline_chunks=4), 4, 4, num_nodes=1)


def test_a_stage_that_uses_a_matrix_this_rank_never_allocated_is_refused_by_name() -> None:
    """On the meta device a rank allocates a matrix outside the block stack on the stage the split's rule gives it
    (registered after the stack: the last). A model that runs such a matrix earlier (an embedding registered after its
    layers) would reach stage 0 on meta: refused after the trace, naming it, not a device error at the first step."""
    from types import SimpleNamespace

    from torch import nn

    from lightning_sgdtp.parallel.pipeline.contract import PipelineContractError
    from lightning_sgdtp.parallel.pipeline.runner import PipelineRunner

    whole = nn.Module()
    whole.layers = nn.ModuleList([nn.Linear(4, 4)])
    with torch.device("meta"):
        whole.late_embedding = nn.Embedding(8, 4)
    stage = SimpleNamespace(submod=nn.ModuleDict({"late_embedding": whole.late_embedding, "block": whole.layers[0]}))
    runner = SimpleNamespace(module=whole, stage_ids=[0])
    with pytest.raises(PipelineContractError, match=r"late_embedding.weight run on stage\(s\) \[0\] of this rank"):
        PipelineRunner._check_stages_held(runner, [stage])  # type: ignore[arg-type]
    whole.late_embedding = nn.Embedding(8, 4)  # allocated: nothing to refuse
    stage.submod["late_embedding"] = whole.late_embedding
    PipelineRunner._check_stages_held(runner, [stage])  # type: ignore[arg-type]
