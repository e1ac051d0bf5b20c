"""The planner's layouts and memory limits (lightning_sgdtp/planner/search.py) and `sgdtp plan` (in-process)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import REPO
from torch import nn

from lightning_sgdtp.cli import main
from lightning_sgdtp.planner.memory import Layout
from lightning_sgdtp.planner.search import (
    TP_NOT_WITH_PP,
    PlannerInputError,
    candidate_layouts,
    check_fits,
    parse_memory,
    plan_memory,
)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4))
        self.head = nn.Linear(16, 64)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("300MB", 300 * 10**6), ("80GB", 80 * 10**9), ("1.5GiB", 3 * 2**29), ("512 kib", 512 * 1024), (4096, 4096)],
)
def test_memory_figures_take_decimal_and_binary_units(text: str | int, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("bad", ["300", "80 GBs", "-1GB", "0MB", "", True])
def test_a_memory_figure_without_a_unit_is_refused_naming_it_and_the_fix(bad: object) -> None:
    with pytest.raises(PlannerInputError, match=r"give a positive number with a unit, e.g. '300MB'"):
        parse_memory(bad)  # type: ignore[arg-type]


def test_every_layout_of_the_world_size_is_listed_and_what_is_not_built_says_why() -> None:
    candidates = candidate_layouts(world_size=16, devices_per_node=8, blocks=4)
    layouts = {c.layout: c.skipped for c in candidates}
    assert all(layout.world_size == 16 for layout in layouts)
    assert layouts[Layout(dp=16, sharding="full")] is None
    assert layouts[Layout(dp=2, tp=8)] is None  # one node per tensor-parallel group
    assert "does not divide 8" in layouts[Layout(tp=16)]  # across nodes
    assert "every stage needs one" in layouts[Layout(dp=2, pp=8)]  # 8 stages, 4 blocks
    assert layouts[Layout(dp=2, tp=2, pp=4)] == TP_NOT_WITH_PP
    assert not [c for c in candidates if c.layout.dp == 1 and c.layout.sharding != "none"]  # nothing to shard over
    with pytest.raises(PlannerInputError, match="multiple of the devices per node"):
        candidate_layouts(world_size=12, devices_per_node=8, blocks=4)


def test_the_layouts_that_fit_come_first_least_memory_first() -> None:
    module = Blocks()
    whole = sum(p.numel() * 4 for p in module.parameters())
    plan = plan_memory(module, world_size=4, devices_per_node=4, max_memory_per_rank=2 * whole)
    built = [c for c in plan.candidates if c.memory is not None]
    assert plan.fitting and plan.fitting == built[: len(plan.fitting)]
    assert all(c.memory.total <= 2 * whole for c in plan.fitting)
    assert [c.memory.total for c in plan.fitting] == sorted(c.memory.total for c in plan.fitting)
    assert not next(c for c in built if c.layout == Layout(dp=4)).fits  # a whole replica with AdamW: 4x the weights
    assert plan.candidates[-1].skipped  # what cannot be built, last
    assert "step time is not predicted yet" in plan.describe()[0]
    check_fits(plan)


def test_no_layout_that_fits_is_an_error_naming_the_smallest_and_its_memory() -> None:
    plan = plan_memory(Blocks(), world_size=2, devices_per_node=2, max_memory_per_rank="1KB")
    assert not plan.fitting
    with pytest.raises(
        PlannerInputError, match=r"no layout fits .* the smallest, dp 2, sharding=\w+, needs [0-9.]+ KiB"
    ):
        check_fits(plan)


def test_sgdtp_plan_prints_the_table_from_a_model_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{REPO / 'examples' / 'gpt.py'}:GPTLightningModule"
    assert main(["plan", target, "--gpus-per-node", "4", "--gpu-memory", "8MB"]) == 0
    out = capsys.readouterr().out
    assert "10 of 12 layouts fit" in out and "dp 1 x tp 2 x pp 2" in out and TP_NOT_WITH_PP in out
    assert main(["plan", target, "--nodes", "2", "--gpus-per-node", "2", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["limit"] is None and all("skipped" in c or c["fits"] for c in table["candidates"])
    assert torch.empty(1).device.type == "cpu"  # the meta device was only the model's


def test_sgdtp_plan_names_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{REPO / 'examples' / 'gpt.py'}:GPT"  # needs a config: the factory must take no argument
    assert main(["plan", target]) == 2
    assert "GPT() failed: TypeError" in capsys.readouterr().err
    good = f"{REPO / 'examples' / 'gpt.py'}:GPTLightningModule"
    assert main(["plan", good, "--gpu-memory", "80"]) == 2
    assert "memory '80': give a positive number with a unit" in capsys.readouterr().err
