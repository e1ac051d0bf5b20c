"""The planner's layouts and memory limits (lightning_sgdtp/planner/search.py) and `sgdtp plan` (in-process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import REPO
from torch import nn

from lightning_sgdtp.cli import main
from lightning_sgdtp.planner.cost import HARDWARE, profile
from lightning_sgdtp.planner.memory import Layout
from lightning_sgdtp.planner.search import (
    CKPT_NOT_WITH_TP,
    SETUP_DOC,
    Plan,
    PlannerInputError,
    candidate_layouts,
    check_a_layout_is_left,
    check_fits,
    parse_memory,
    plan,
    size_text,
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
    assert layouts[Layout(dp=2, tp=2, pp=4)] is None  # pipeline x data x tensor: built
    assert not [c for c in candidates if c.layout.dp == 1 and c.layout.sharding != "none"]  # nothing to shard over
    with pytest.raises(PlannerInputError, match="runs on whole nodes, and 12 is not a multiple of 8"):
        candidate_layouts(world_size=12, devices_per_node=8, blocks=4)


def _plan(module: nn.Module, world: int, per_node: int, limit: object = None, **kwargs: object) -> Plan:
    model = profile(module, tokens=8, batch=4)
    return plan(module, model, HARDWARE["h100"], world, per_node, limit, **kwargs)  # type: ignore[arg-type]


def test_the_layouts_that_fit_come_first_fastest_per_sample_first() -> None:
    module = Blocks()
    result = _plan(module, world=4, per_node=4, limit="400KB")
    fitting = result.fitting
    assert fitting and fitting == result.candidates[: len(fitting)]
    assert all(c.memory.total <= 400_000 and c.built for c in fitting)
    per_sample = [c.time.seconds_per_sample for c in fitting]
    assert per_sample == sorted(per_sample) and result.best is fitting[0]
    replicated = next(c for c in result.candidates if c.layout == Layout(dp=4) and not c.schedule.checkpointing)
    assert not replicated.fits  # a whole replica with AdamW: 4x the weights
    assert all(c.layout.world_size == 4 for c in result.candidates if c.memory is not None)
    assert result.why().endswith(
        tuple(
            f"mostly {p}"
            for p in ("compute", "bubble", "pipeline sends", "tensor parallel", "data parallel", "optimizer")
        )
    )
    lines = result.describe(rows=5)
    assert lines[1].startswith(f"chosen: {result.best.describe()}: ") and len(lines) == 9
    assert lines[2].startswith("setup peak per rank: ") and lines[3].startswith("built on the meta device instead: ")
    check_fits(result)


def test_what_is_not_built_is_predicted_and_never_chosen() -> None:
    result = _plan(Blocks(), world=16, per_node=4)  # 4 nodes: hybrid sharding inside each
    three_d = [c for c in result.candidates if c.layout.tp > 1 and c.layout.pp > 1 and not c.layout.shard_size]
    assert three_d and all(c.built != c.schedule.checkpointing for c in three_d)  # pp x dp x tp: built
    ckpt_tp = [c for c in result.candidates if c.layout.tp > 1 and c.schedule.checkpointing]
    assert ckpt_tp and all(not c.built and c.time and c.memory for c in ckpt_tp)
    assert {c.skipped for c in ckpt_tp} == {CKPT_NOT_WITH_TP}
    hsdp_pp = [c for c in result.candidates if c.layout.shard_size and c.layout.pp > 1 and c.layout.tp == 1]
    assert hsdp_pp and all(c.built and not c.skipped for c in hsdp_pp)  # pp x dp_replicate x dp_shard: built
    hsdp_tp = [
        c
        for c in result.candidates
        if c.layout.shard_size and c.layout.tp > 1 and c.layout.pp == 1 and not c.schedule.checkpointing
    ]
    assert hsdp_tp and all(c.built and not c.skipped for c in hsdp_tp)  # 3-D: dp_replicate x dp_shard x tp
    assert all(c.built for c in result.fitting) and result.best.built


def test_options_the_user_set_stay_fixed() -> None:
    result = _plan(Blocks(), world=4, per_node=4, fixed={"tp": 2, "checkpointing": False})
    assert result.candidates and all(c.layout.tp == 2 for c in result.candidates if c.memory is not None)
    assert result.best.layout == Layout(dp=2, tp=2) or result.best.layout.tp == 2
    with pytest.raises(PlannerInputError, match=r"cannot fix pipeline='interleaved': the schedules are"):
        _plan(Blocks(), world=4, per_node=4, fixed={"pipeline": "interleaved"})
    left = _plan(Blocks(), world=4, per_node=4, fixed={"pp": 2, "stages_per_rank": 5})
    with pytest.raises(PlannerInputError, match=r"no layout of 4 ranks keeps your options \{'pp': 2"):
        check_a_layout_is_left(left, 4, {"pp": 2, "stages_per_rank": 5})
    check_a_layout_is_left(result, 4, {"tp": 2})  # the tp=2 layouts are left: no error
    with pytest.raises(PlannerInputError, match=r"cannot fix \['colour'\]"):
        _plan(Blocks(), world=4, per_node=4, fixed={"colour": 1})


def test_a_global_batch_is_split_over_the_replicas() -> None:
    result = _plan(Blocks(), world=4, per_node=4, global_batch=8)
    by_layout = {c.layout: c for c in result.candidates if c.time is not None and not c.schedule.checkpointing}
    assert by_layout[Layout(dp=4)].time.samples == 8 and by_layout[Layout(dp=2, tp=2)].time.samples == 8
    odd = _plan(Blocks(), world=4, per_node=4, global_batch=2)  # 2 samples over dp 4: no whole sample each
    assert any("does not divide over dp=4" in (c.skipped or "") for c in odd.candidates)
    # 2 samples for 4 stages: no schedule 1F1B can run (the strategy refuses pipeline_chunks < stages)
    assert any(c.skipped == "2 sample(s) per replica for 4 stages: 1F1B needs one per stage" for c in odd.candidates)
    piped = [c for c in result.candidates + odd.candidates if c.time is not None and c.layout.pp > 1]
    assert piped and all(c.schedule.micro_batches >= c.layout.pp for c in piped)


def test_no_layout_that_fits_is_an_error_naming_the_smallest_and_its_memory() -> None:
    result = _plan(Blocks(), world=2, per_node=2, limit="1KB", materialized=False)  # whole: the next test
    assert not result.fitting
    with pytest.raises(PlannerInputError, match=r"no layout fits .* the smallest, dp .*, needs [0-9.]+ KiB"):
        check_fits(result)


class Wide(nn.Module):
    """Weights large next to the activations of one sample of 8 tokens: the setup peak can decide."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4))
        self.head = nn.Linear(64, 512)


def _plan_wide(module: nn.Module, limit: str, **kwargs: object) -> Plan:
    return plan(module, profile(module, tokens=8, batch=1), HARDWARE["h100"], 8, 8, limit, **kwargs)  # type: ignore[arg-type]


def test_a_model_built_whole_that_does_not_fit_is_refused_and_built_on_meta_it_fits() -> None:
    whole = sum(p.numel() * 4 for p in Wide().parameters())  # 775 KiB on every rank when built whole
    with torch.device("meta"):
        on_meta = _plan_wide(Wide(), "700KB")  # the module says: on meta
    built = _plan_wide(Wide(), "700KB")  # real weights: built whole
    assert (on_meta.materialized, built.materialized) == (False, True) and on_meta.whole == built.whole == whole
    best = on_meta.best
    assert best is not None and best.memory.setup == best.memory.parameters < 700_000 < whole
    assert not built.fitting and built.best is None  # the same layout, built whole: its setup peak is too large
    same = next(c for c in built.candidates if c.layout == best.layout and c.schedule == best.schedule)
    assert same.memory.total == best.memory.total <= 700_000 < same.memory.setup == whole and not same.fits
    assert "too large at setup" in built.line(same)

    lines = on_meta.describe(rows=1)
    assert lines[2] == f"setup peak per rank: {size_text(best.memory.parameters)} (model built on the meta device:" + (
        " each rank materializes its part)"
    )
    assert lines[3] == f"built whole instead: 775.00 KiB on every rank, does not fit 683.59 KiB ({SETUP_DOC})"
    check_fits(on_meta)
    assert on_meta.to_dict()["chosen"]["memory"]["setup"] == best.memory.parameters

    lines = built.describe(rows=1)
    assert lines[1].startswith("none chosen: no built layout fits")
    assert lines[2] == (
        "setup peak per rank: 775.00 KiB (model built whole: all of it on every rank before the split, does not fit"
        f" 683.59 KiB): build it on the meta device ({SETUP_DOC})"
    )
    with pytest.raises(PlannerInputError) as err:
        check_fits(built)
    assert str(err.value) == (
        "no layout fits max_memory_per_rank=683.59 KiB: the model is built whole, so every rank holds all of it"
        f" (775.00 KiB) at setup, before it is split. Build it on the meta device, so that each rank materializes"
        f" only its part ({SETUP_DOC}); the smallest layout, {best.describe()}, then needs"
        f" {size_text(best.memory.total)} per rank."
    )
    # told instead of detected: a meta module planned as if built whole, and the other way round
    with torch.device("meta"):
        assert not _plan_wide(Wide(), "700KB", materialized=True).fitting
    assert _plan_wide(Wide(), "700KB", materialized=False).best.layout == best.layout


def test_sgdtp_plan_prints_the_table_from_a_model_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    target = f"{REPO / 'examples' / 'gpt.py'}:GPTLightningModule"
    assert main(["plan", target, "--gpus-per-node", "4", "--gpu-memory", "8MB", "--batch", "8", "--rows", "400"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit and are built (limit 7.63 MiB per rank; h100;" in out and "\nchosen: " in out
    assert "dp 1 x tp 2 x pp 2" in out and CKPT_NOT_WITH_TP in out
    assert main(["plan", target, "--nodes", "2", "--gpus-per-node", "2", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["limit"] == 80 * 10**9 and table["chosen"]["built"] and table["why"]
    assert torch.empty(1).device.type == "cpu"  # the meta device was only the model's


def test_sgdtp_plan_plans_a_named_llama_shape_in_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "llama3-8b", "--global-batch", "16", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    model = table["model"]
    assert (model["blocks"], model["width"], model["heads"], model["vocab"], model["tokens"]) == (
        32,
        4096,
        32,
        128256,
        8192,
    )
    assert 6.9e9 < model["matmul_params"] < 7.6e9  # 8.03e9 parameters, the 0.53e9 of the input embedding excluded
    chosen = table["chosen"]
    assert chosen["built"] and chosen["fits"] and chosen["memory"]["total"] <= 80 * 10**9


def test_sgdtp_plan_prints_the_setup_peak_of_llama3_70b_on_4_nodes_of_8_h100(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", "llama3-70b", "--nodes", "4", "--gpus-per-node", "8", "--hardware", "h100", "--rows", "1"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    # 70.6e9 float32 parameters: 262.83 GiB whole; dp 32 sharded, each rank materializes 1/32 of them
    assert lines[1] == "chosen: dp 32, sharding=full, checkpointing: the only layout that fits"
    assert lines[2] == "setup peak per rank: 8.21 GiB (model built on the meta device: each rank materializes its part)"
    assert lines[3] == f"built whole instead: 262.83 GiB on every rank, does not fit 74.51 GiB ({SETUP_DOC})"
    assert main([*args, "--materialized"]) == 0  # built whole: nothing fits, and the line says what to do
    out = capsys.readouterr().out
    assert out.startswith("0 of 75 layouts fit") and "\nnone chosen: no built layout fits" in out
    assert (
        "setup peak per rank: 262.83 GiB (model built whole: all of it on every rank before the split, does not" in out
    )
    assert f"build it on the meta device ({SETUP_DOC})\nbuilt on the meta device instead: 8.21 GiB per rank" in out


def test_sgdtp_plan_names_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = f"{REPO / 'examples' / 'gpt.py'}:GPT"  # needs a config: the factory must take no argument
    assert main(["plan", target]) == 2
    assert "GPT() failed: TypeError" in capsys.readouterr().err
    good = f"{REPO / 'examples' / 'gpt.py'}:GPTLightningModule"
    assert main(["plan", good, "--gpu-memory", "80"]) == 2
    assert "memory '80': give a positive number with a unit" in capsys.readouterr().err
    bad = tmp_path / "topo.txt"
    bad.write_text("GPU0 GPU1\nnot a table\n")
    assert main(["plan", good, "--topology", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--topology {bad}: no GPU table found" in err and "nvidia-smi topo -m" in err
    topo = REPO / "tests" / "data" / "topology" / "pcie-4x.txt"
    assert main(["plan", good, "--topology", str(topo), "--gpus-per-node", "8"]) == 2
    assert "--gpus-per-node 8 but the topology file has 4 GPUs" in capsys.readouterr().err
    assert main(["plan", good, "--fix", "tp"]) == 2
    assert "--fix 'tp': give NAME=VALUE" in capsys.readouterr().err


def test_a_tensor_parallel_size_that_divides_no_query_heads_is_never_chosen() -> None:
    """Qwen2.5-1.5B's 12 query heads on a node of 8: tp 8 is listed with the reason (the strategy refuses it at
    setup); tp 4 and 2 stay candidates, so is the fewer key/value heads (2) than tp 4."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=4, num_attention_heads=12,
        num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):
        module = transformers.Qwen2ForCausalLM(config)
    result = plan(module, profile(module, tokens=8, batch=8), HARDWARE["h100"], 8, 8, None)
    tp8 = [c for c in result.candidates if c.layout.tp == 8]
    assert tp8 and all(c.skipped == "tp=8 does not divide the query heads (12)" and not c.choosable for c in tp8)
    assert any(c.choosable for c in result.candidates if c.layout.tp == 4)
