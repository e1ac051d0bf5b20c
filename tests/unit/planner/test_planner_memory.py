"""The planner's memory model (lightning_sgdtp/planner/memory.py) against what the ranks really held.

The support matrix (``python tools/model_support.py``, docs/model-support.json) records, for every zoo model in every
mode that divides the model, the most parameter bytes any rank held after ``fit``, counted from every rank's
tensors. The prediction, from the module alone (no process), must agree with each of those measurements.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import REPO
from torch import nn

from lightning_sgdtp.planner.memory import (
    Layout,
    LayoutError,
    is_materialized,
    model_bytes,
    parameter_fraction,
    predict_memory,
    setup_bytes,
    table,
)

#: The matrix's columns that divide the model, as layouts (2 CPU ranks, or 4 for the 2 x 2 ones).
MODES = {
    "tensor": Layout(tp=2),
    "pipeline 1f1b": Layout(pp=2),
    "pipeline x data (2 x 2)": Layout(dp=2, pp=2),
    "hybrid (dp 2 x tp 2)": Layout(dp=2, tp=2),
    "sharding full": Layout(dp=2, sharding="full"),
    "sharding optimizer": Layout(dp=2, sharding="optimizer"),
    "hybrid + full": Layout(dp=2, tp=2, sharding="full"),
    "pipeline + full (2 x 2)": Layout(dp=2, pp=2, sharding="full"),
}
MEASURED = json.loads((REPO / "docs" / "model-support.json").read_text())
#: Relative error allowed against a measurement (the issue's bound is 15%; the worst measured here: 4.2%, T5 tensor).
TOLERANCE = 0.05


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_predicted_parameter_bytes_match_what_each_rank_held(name: str) -> None:
    from helpers.zoo import zoo_module

    module = zoo_module(name, layers=2)  # the matrix's size for these columns
    compared = 0
    for mode, layout in MODES.items():
        cell = MEASURED[name].get(mode, {})
        if cell.get("status") != "works" or "held" not in cell:
            continue  # refused (ResNet's BatchNorm in a pipeline), not compared, or not measured
        predicted = parameter_fraction(module, layout)
        assert predicted == pytest.approx(cell["held"], rel=TOLERANCE), (mode, predicted, cell["held"])
        compared += 1
    assert compared >= 3, f"{name}: too few measured cells ({compared})"


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4))
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight  # tied: counted once in the whole, on both stages of a pipeline


def test_gradients_optimizer_state_and_the_gathered_block_are_counted() -> None:
    module = Blocks()
    whole = sum(p.numel() * 4 for p in module.parameters())
    replicated = predict_memory(module, Layout())
    assert replicated.parameters == replicated.gradients == whole
    assert replicated.optimizer == 2 * whole and replicated.gathered == 0
    assert predict_memory(module, Layout(), optimizer_states=0).total == 2 * whole  # plain SGD
    full = predict_memory(module, Layout(dp=4, sharding="full"))
    block = sum(p.numel() * 4 for p in module.blocks[0].parameters())
    assert full.parameters == whole // 4 and full.gathered == block
    zero2 = predict_memory(module, Layout(dp=4, sharding="optimizer"))  # whole parameters during the step
    assert zero2.parameters == whole // 4 and zero2.parameters + zero2.gathered == whole
    piped = predict_memory(module, Layout(pp=2))
    assert whole / 2 < piped.parameters < whole  # the tied embedding on both stages


class BlocksWithBuffer(Blocks):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(32))  # held whole by a model built whole, at setup


#: (layout, the share of the whole model's parameter bytes the fullest rank materializes when built on meta)
SETUP_ON_META = [
    pytest.param(Layout(dp=4), 1.0, id="dp 4: every rank its own replica"),
    pytest.param(Layout(dp=4, sharding="full"), 0.25, id="dp 4 sharded: a quarter (every dimension divides)"),
    pytest.param(Layout(dp=4, sharding="optimizer"), 0.25, id="dp 4 sharding=optimizer: split at setup too"),
    pytest.param(Layout(tp=2), 0.5, id="tp 2: a half (every module split, the embedding too)"),
    pytest.param(Layout(pp=2), None, id="pp 2: the fullest stage (the tied embedding on both)"),
]


@pytest.mark.parametrize(("layout", "share"), SETUP_ON_META)
def test_setup_on_meta_is_what_the_rank_holds_after_the_split(layout: Layout, share: float | None) -> None:
    module = BlocksWithBuffer()
    params = sum(p.numel() * 4 for p in module.parameters())
    predicted = predict_memory(module, layout)
    assert setup_bytes(module, layout) == predicted.setup == predicted.parameters  # no gradient, no optimizer state
    if share is not None:
        assert setup_bytes(module, layout) == params * share
    else:  # more than half: the tied embedding sits on both stages
        assert params / 2 < setup_bytes(module, layout) < params
    assert predicted.peak == predicted.total  # on meta the training peak is the larger: setup changes nothing


@pytest.mark.parametrize("layout", [p.values[0] for p in SETUP_ON_META])
def test_setup_built_whole_is_the_whole_model_on_every_rank(layout: Layout) -> None:
    module = BlocksWithBuffer()
    whole = sum(p.numel() * 4 for p in module.parameters()) + 32 * 4  # the tied weight once, and the buffer
    assert model_bytes(module) == whole
    assert setup_bytes(module, layout, materialized=True) == whole
    memory = predict_memory(module, layout, optimizer_states=0, materialized=True)
    assert memory.setup == whole and memory.peak == max(memory.total, whole)
    assert memory.to_dict()["setup"] == whole and memory.to_dict()["peak"] == memory.peak


def test_a_model_is_materialized_unless_its_parameters_are_on_meta() -> None:
    with torch.device("meta"):
        on_meta = Blocks()
    assert is_materialized(Blocks()) and not is_materialized(on_meta)
    assert setup_bytes(on_meta, Layout(dp=2, sharding="full")) == setup_bytes(Blocks(), Layout(dp=2, sharding="full"))


def test_the_table_is_smallest_first() -> None:
    rows = table(Blocks(), [Layout(), Layout(dp=2, sharding="full"), Layout(pp=2)])
    assert sorted(r["layout"] for r in rows) == ["dp 1", "dp 1 x pp 2", "dp 2, sharding=full"]
    assert [r["total"] for r in rows] == sorted(r["total"] for r in rows) and rows[-1]["layout"] == "dp 1"
    assert all(
        r["total"] == r["parameters"] + r["gradients"] + r["optimizer"] + r["gathered"] + r["activations"] for r in rows
    )


def test_a_module_on_the_meta_device_is_planned_without_memory() -> None:
    with torch.device("meta"):
        module = Blocks()
    assert predict_memory(module, Layout(pp=2)) == predict_memory(Blocks(), Layout(pp=2))


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"dp": 0}, ["dp=0", ">= 1"]),
        ({"tp": 1.5}, ["tp=1.5"]),
        ({"sharding": "zero3"}, ["zero3", "'full'"]),
    ],
)
def test_a_layout_that_cannot_exist_is_refused_naming_the_value(kwargs: dict, names: list[str]) -> None:
    with pytest.raises(LayoutError) as err:
        Layout(**kwargs)
    assert all(n in str(err.value) for n in names), err.value


def test_sharding_without_data_parallel_ranks_is_refused() -> None:
    with pytest.raises(LayoutError, match="dp=1 has none"):
        predict_memory(Blocks(), Layout(sharding="full"))
