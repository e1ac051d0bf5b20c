"""Pipeline parallel against single-process training of the same model on the same global batch.

``jobs/pp_parity.py``: the launching process trains the reference on one device (global batch = dp x per-rank
batch, Lightning's shuffled order), then every rank trains with ``pipeline_stages=2, pipeline_chunks=4``; AdamW
lr=1e-2, 6 steps, a 4-block GPT with a tied embedding / head (on stages 0 and 1).
Measured (fp32):
- first-step gradients (before clipping), merged from the stages: relative error 4e-7 .. 6e-7. A missing
  micro-batch, a wrong loss scale (x4) or an unsummed tied gradient is off by 30-300%;
- ``rel`` = ||delta_sgdtp - delta_ref|| / ||delta_ref|| after 6 steps: 1.3e-5 .. 3e-5. The negative control
  (pp=2 x dp=2 with the data-parallel all-reduce off) measures 0.97. Tolerance 1e-3;
- the logged ``train_loss`` (every rank) and ``val_loss`` / ``val_ppl`` (validated through the pipeline) equal
  the reference's to 1e-5.
- bf16-mixed (autocast around the schedule): first-step gradients 2.6e-3, ``rel`` 0.037 (bf16 rounding turned
  into lr-sized AdamW steps, as in ``test_tensor_parallel.py``); tolerances 3e-2 / 0.15, loss 1e-2.

Checkpoints per stage and resume: test_checkpoints_and_resume.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.launch import JOBS, parity_result, rel_update_diff, run, tiered

GRAD_TOL = {"fp32": 1e-4, "bf16": 3e-2}
REL_TOL = {"fp32": 1e-3, "bf16": 0.15}
LOSS_TOL = {"fp32": 1e-5, "bf16": 1e-2}
PP2 = {"pipeline_stages": 2, "pipeline_chunks": 4}
VAL = {"limit_val_batches": 2, "val_check_interval": 3}
TWO_STAGES = [["model.blocks.0", "model.blocks.1"], ["model.blocks.2", "model.blocks.3"]]


@dataclass(frozen=True)
class Case:
    """A scenario: what it covers, the devices, SGDTPStrategy and Trainer options, the dataset size."""

    covers: str
    devices: int
    sgdtp: dict[str, Any]
    trainer: dict[str, Any] = field(default_factory=dict)
    samples: int = 64
    #: After ``fit``: ``save_checkpoint`` and ``validate(ckpt_path=...)``, as examples/train_gpt.py does.
    validate_after_fit: bool = False

    @property
    def precision(self) -> str:
        return "bf16" if self.trainer.get("precision") == "bf16-mixed" else "fp32"

    def scenario(self) -> dict[str, Any]:
        scenario = {"devices": self.devices, "phases": [self.sgdtp], "trainer": self.trainer, "samples": self.samples}
        return {**scenario, "validate_after_fit": True} if self.validate_after_fit else scenario


CASES = {
    "gpipe_2x4": Case(
        "GPipe, 2 stages x 4 micro-batches, clipping, validation",
        2,
        {**PP2, "pipeline_schedule": "gpipe"},
        {"gradient_clip_val": 0.3, **VAL},
    ),
    "1f1b_2x4": Case("1F1B, 2 stages x 4 micro-batches, validation", 2, {**PP2, "pipeline_schedule": "1f1b"}, VAL),
    "interleaved_2x4": Case(
        "interleaved 1F1B, 4 stages (2 per rank) x 4 micro-batches", 2, {**PP2, "pipeline_schedule": "interleaved_1f1b"}
    ),
    "1f1b_accumulate_clip": Case(
        "1F1B, accumulate_grad_batches=2 (8 micro-batches per optimizer step), clipping, validation",
        2,
        PP2,
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3, **VAL},
        validate_after_fit=True,
    ),
    "pp2_dp2_1f1b": Case(
        "pp=2 x dp=2 on 4 ranks, 1F1B, clipping, validation",
        4,
        {**PP2, "pipeline_schedule": "1f1b"},
        {"gradient_clip_val": 0.3, **VAL},
    ),
    "pp2_dp2_sharded_full": Case(
        "pp=2 x dp=2 on 4 ranks, each stage sharded over its 2 replicas (sharding='full'), tied embedding and head on"
        " two stages, clipping, validation",
        4,
        {**PP2, "pipeline_schedule": "1f1b", "sharding": "full"},
        {"gradient_clip_val": 0.3, **VAL},
    ),
    "pp2_tp2_1f1b": Case(
        "pp=2 x tp=2 on 4 ranks (parallelism='tensor'): each stage split over its tensor-parallel group, tied"
        " embedding and head split on two stages, clipping (validation: the 8-rank case, slow)",
        4,
        {**PP2, "pipeline_schedule": "1f1b", "parallelism": "tensor"},
        {"gradient_clip_val": 0.3},
    ),
    "pp2_dp2_tp2_sharded_full": Case(
        "pp=2 x dp=2 x tp=2 on 8 ranks (parallelism='hybrid', sharding='full': FSDP x TP x PP), clipping, validation",
        8,
        {**PP2, "pipeline_schedule": "1f1b", "parallelism": "hybrid", "tensor_parallel_size": 2, "sharding": "full"},
        {"gradient_clip_val": 0.3, **VAL},
    ),
    # the planner's schedules with the 3-D layouts: interleaved 1F1B (2 stages per rank) with tensor parallel and
    # with sharding (measured: benchmarks/results/pipeline_2026-12-05.txt)
    "interleaved_pp2_tp2": Case(
        "interleaved 1F1B (4 stages, 2 per rank) x tp=2 on 4 ranks, clipping",
        4,
        {**PP2, "pipeline_schedule": "interleaved_1f1b", "parallelism": "tensor"},
        {"gradient_clip_val": 0.3},
    ),
    "interleaved_pp2_dp2_sharded": Case(
        "interleaved 1F1B (4 stages, 2 per rank) x dp=2, sharding='full', on 4 ranks, clipping",
        4,
        {**PP2, "pipeline_schedule": "interleaved_1f1b", "sharding": "full"},
        {"gradient_clip_val": 0.3},
    ),
    "options_dict_ckpt_measured": Case(
        "the design documents' options dict, measured balance, activation checkpointing",
        2,
        {
            "options": {"distributed": {"plugin": "sgdtp", "strategy": "data", "pipeline_chunks": 4}},
            "pipeline_balance": "measured",
            "activation_checkpointing": True,
        },
        {"num_sanity_val_steps": 1, **VAL},  # traced for validation first, then split again by measured times
    ),
    "1f1b_bf16": Case("1F1B, bf16-mixed (autocast around the schedule)", 2, PP2, {"precision": "bf16-mixed"}),
    "1f1b_short_last_batch": Case(
        "1F1B, 49 samples: the 7th batch has 1 sample (one micro-batch: too few for 1F1B, it runs as GPipe)",
        2,
        PP2,
        {"max_steps": 7, "limit_val_batches": 7, "val_check_interval": 7},
        samples=49,
    ),
}
# The negative control: pp=2 x dp=2 with the data-parallel all-reduce switched off (the tied-weight sum still runs).
NO_DP_SYNC = Case("pp=2 x dp=2 on 4 ranks, debug_skip_sync='dp-sync'", 4, {**PP2, "debug_skip_sync": "dp-sync"})
#: The slow tier (tests/README.md): other schedules and options over the same stage split. The default run keeps
#: 1F1B with accumulation, clipping and validation on 2 ranks, pp x dp with each stage sharded over its replicas and
#: pp x tp (the two 4-rank pipeline jobs: pp x dp replicated, the same mesh and schedule with the all-reduce in place
#: of the reduce-scatter, is slow; so is FSDP x TP x PP on 8 ranks).
SLOW = {
    "1f1b_2x4",
    "gpipe_2x4",
    "interleaved_2x4",
    "options_dict_ckpt_measured",
    "1f1b_bf16",
    "1f1b_short_last_batch",
    "pp2_dp2_1f1b",
    "pp2_dp2_tp2_sharded_full",
    "interleaved_pp2_tp2",
    "interleaved_pp2_dp2_sharded",
}
#: The cases that validate from a saved checkpoint after ``fit`` (examples/train_gpt.py's ending).
AFTER_FIT = [name for name, case in CASES.items() if case.validate_after_fit]
_RESULTS: dict[str, dict] = {}


def _sizes(case: Case) -> tuple[int, int, int]:
    """(stages, data-parallel size, tensor-parallel size) of a case."""
    options = case.sgdtp
    stages = options.get("pipeline_stages", 2)
    per_stage = case.devices // stages
    tp = {"tensor": per_stage, "hybrid": options.get("tensor_parallel_size", 1)}.get(options.get("parallelism"), 1)
    return stages, per_stage // tp, tp


def _held_share(case: Case) -> float:
    """The share of the module's parameter bytes a rank holds when its layout divides them as asked."""
    stages, dp, tp = _sizes(case)
    return 1.0 / (stages * tp * (dp if case.sgdtp.get("sharding", "none") != "none" else 1))


def result(name: str, tmp_path_factory: pytest.TempPathFactory, case: Case | None = None, **env: str) -> dict:
    """Run a scenario (``CASES[name]`` unless ``case`` is given) once per test session: several tests read it."""
    scenario = (case or CASES[name]).scenario()
    out = tmp_path_factory.mktemp(name)
    return parity_result(_RESULTS, "pp_parity.py", name, scenario, out, ("info", "ref_metrics"), **env)


@pytest.mark.covers("pipeline", "gradient accumulation", param="1f1b_accumulate_clip")
@pytest.mark.covers("pipeline", "gradient clipping", param="1f1b_accumulate_clip")
@pytest.mark.covers("pipeline", "activation checkpointing", param="options_dict_ckpt_measured")
@pytest.mark.covers("pipeline", "bf16-mixed", param="1f1b_bf16")
@pytest.mark.covers("pipeline x data", "gradient clipping", param="pp2_dp2_sharded_full", note="sharding='full'")
@pytest.mark.covers("pipeline x data", "gradient clipping", param="pp2_dp2_1f1b")
@pytest.mark.covers("pipeline x tensor", "gradient clipping", param="pp2_tp2_1f1b")
@pytest.mark.covers(
    "pipeline x tensor", "gradient clipping", param="pp2_dp2_tp2_sharded_full", note="8 ranks, x data, sharding='full'"
)
@pytest.mark.parametrize("name", tiered(list(CASES), SLOW))
def test_parity_with_one_process(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    case = CASES[name]
    r = result(name, tmp_path_factory)
    assert r["ref"].keys() == r["sgdtp"].keys()
    assert r["grads"].keys() == r["ref_grads"].keys()  # every parameter got its gradient on some stage
    for param, ref in r["ref_grads"].items():
        err = float((r["grads"][param] - ref).norm() / ref.norm().clamp_min(1e-12))
        print(f"{name}: first-step gradient of {param} differs by {err:.2e} (relative)")
        assert err < GRAD_TOL[case.precision], f"{name}: first-step gradient of {param} differs by {err:.3g} (relative)"
    rel = rel_update_diff(r["init"], r["ref"], r["sgdtp"])
    print(f"{name}: relative update difference {rel:.2e}")
    assert rel < REL_TOL[case.precision], f"{name}: relative update difference {rel:.3g}"
    assert torch.equal(r["sgdtp"]["model.tok_emb.weight"], r["sgdtp"]["model.lm_head.weight"])  # tie kept
    # what a pipeline is for: after fit a rank holds its stages' parameters and AdamW state, not every stage's
    whole, stages = r["info"]["whole_parameter_bytes"], case.scenario()["phases"][-1].get("pipeline_stages", 1)
    if stages > 1:
        for held in r["info"]["held"]:
            assert held["parameters"] <= 0.6 * whole and held["optimizer"] <= 0.6 * 2 * whole, (held, whole)
    # with tensor parallel a stage's parameters are split over its group too (and sharded over its replicas):
    # 1 / (pp x tp [x dp]) of the module, plus what stays whole (positions, norms: 2% of it)
    share = _held_share(case)
    print(f"{name}: each rank holds {[h['parameters'] / whole for h in r['info']['held']]} of the parameter bytes")
    for held in r["info"]["held"]:
        assert held["parameters"] <= 1.25 * share * whole, (held, whole, share)
        assert held["optimizer"] <= 1.25 * share * 2 * whole, (held, whole, share)
    # gather_pipeline_stages() asked for: model.state_dict() is the trained model on every rank
    assert all(r["info"]["whole_on_every_rank"])
    if "gradient_clip_val" in case.trainer:
        norm = sum(float(g.norm() ** 2) for g in r["ref_grads"].values()) ** 0.5
        assert norm > 0.3 * 2, norm  # clipping (gradient_clip_val=0.3) really acted, on the global norm


@pytest.mark.covers("pipeline", "validate", param="1f1b_accumulate_clip", note="and accumulation")
@pytest.mark.covers("pipeline", "validate", param="1f1b_2x4")
@pytest.mark.covers("pipeline x data", "validate", param="pp2_dp2_sharded_full", note="sharding='full'")
@pytest.mark.covers("pipeline x data", "validate", param="pp2_dp2_1f1b")
@pytest.mark.covers("pipeline x tensor", "validate", param="pp2_dp2_tp2_sharded_full", note="8 ranks, x data")
@pytest.mark.parametrize("name", tiered(list(CASES), SLOW))
def test_every_rank_logs_what_the_reference_logs(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    case = CASES[name]
    r = result(name, tmp_path_factory)
    ref = r["ref_metrics"]
    final = [phases[-1] for phases in r["info"]["metrics"]]
    dp, tp = (r["info"]["plans"][0]["pipeline"][k] for k in ("dp_size", "tp_size"))
    # self.log("train_loss", prog_bar=True) in training_step: the mean over the micro-batches, shown on every rank
    # of the pipeline (the same value); without sync_dist each pipeline logs its own batch's (as with DDP), so
    # the pipelines' mean is the global batch's loss. Rank r is stage r // (dp * tp) of pipeline r // tp % dp
    # (tensor parallel innermost: docs/architecture.md's worked examples); pipeline p's first rank is p * tp.
    for rank, metrics in enumerate(final):
        assert metrics["train_loss"] == final[rank // tp % dp * tp]["train_loss"], (rank, final)
    mean = sum(final[p * tp]["train_loss"] for p in range(dp)) / dp
    assert abs(mean - ref["train_loss"]) < LOSS_TOL[case.precision], (final, ref)
    if "val_loss" in ref:  # validation ran through the pipeline; sync_dist and a torchmetrics metric: all ranks
        for rank, metrics in enumerate(final):
            assert abs(metrics["val_loss"] - ref["val_loss"]) < 1e-5, (rank, metrics, ref)
            assert abs(metrics["val_ppl"] - ref["val_ppl"]) < 1e-3, (rank, metrics, ref)


@pytest.mark.parametrize("name", tiered(AFTER_FIT, SLOW & set(AFTER_FIT)))
def test_validate_after_fit_keeps_each_ranks_stages(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``fit``, ``save_checkpoint``, ``validate(ckpt_path=...)`` (examples/train_gpt.py) while each rank holds only
    its stages (tied embedding and head on both): the second trainer function's setup must neither broadcast rank
    0's module (its tensors are not rank 1's: gloo aborted on a mismatched broadcast) nor replace the trained stages.
    The validation measures the final weights, as the reference's ``validate`` after its ``fit`` does (``fit``'s
    last one may precede the last step: here it differs by 0.03); the parity test checks the weights left after it."""
    r = result(name, tmp_path_factory)
    ref = r["ref_metrics"]
    after = [phases[-1] for phases in r["info"]["validated_after_fit"]]
    assert len(after) == CASES[name].devices, after
    for rank, metrics in enumerate(after):
        assert abs(metrics["val_loss"] - ref["after_fit_val_loss"]) < 1e-5, (rank, metrics, ref)
        assert abs(metrics["val_ppl"] - ref["after_fit_val_ppl"]) < 1e-3, (rank, metrics, ref)


@pytest.mark.parametrize("name", tiered(list(CASES), SLOW))
def test_the_plan_says_what_was_decided(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    case = CASES[name]
    r = result(name, tmp_path_factory)
    pipeline = r["info"]["plans"][0]["pipeline"]
    written = json.loads((r["out"] / "sgdtp0" / "sgdtp_plan.json").read_text())  # saved with the run plan
    assert written["pipeline"]["split"] == pipeline["split"]
    split = pipeline["split"]
    assert pipeline["chunks"] == 4
    assert split["stack"] == "model.blocks"
    assert split["before"] == ["model.tok_emb", "model.pos_emb", "model.drop"]
    assert split["after"][:2] == ["model.ln_f", "model.lm_head"]
    assert split["tied"] == [["model.tok_emb.weight", "model.lm_head.weight"]]
    if case.sgdtp.get("pipeline_schedule") != "interleaved_1f1b":  # one stage per rank: two blocks each
        assert split["blocks_per_stage"] == TWO_STAGES
    assert pipeline["dp_size"] == _sizes(case)[1]  # pipelines of 2 stages, data parallel over the rest


@pytest.mark.slow
def test_interleaved_schedule_places_two_stages_on_each_rank(tmp_path_factory: pytest.TempPathFactory) -> None:
    pipeline = result("interleaved_2x4", tmp_path_factory)["info"]["plans"][0]["pipeline"]
    split = pipeline["split"]
    assert (pipeline["schedule"], split["stages"]) == ("interleaved_1f1b", 4)
    assert pipeline["stages_of_rank_0"] == [0, 2]
    assert split["blocks_per_stage"] == [[f"model.blocks.{i}"] for i in range(4)]


@pytest.mark.slow
@pytest.mark.covers("pipeline", "activation checkpointing")
def test_the_options_dict_with_measured_balance_and_checkpointing(tmp_path_factory: pytest.TempPathFactory) -> None:
    plan = result("options_dict_ckpt_measured", tmp_path_factory)["info"]["plans"][0]
    pipeline, split = plan["pipeline"], plan["pipeline"]["split"]
    assert (split["balance"], pipeline["schedule"], pipeline["pp_size"]) == ("cost", "1f1b", 2)
    assert plan["activation_checkpointing"] == ["model.blocks.0", "model.blocks.1"]
    assert plan["graph_breaks"] == {}  # checkpointed blocks stay inside the one compiled stage graph


@pytest.mark.slow
def test_a_short_last_batch_is_traced_again_as_gpipe(tmp_path_factory: pytest.TempPathFactory) -> None:
    pipeline = result("1f1b_short_last_batch", tmp_path_factory)["info"]["plans"][0]["pipeline"]
    # the 1-sample batch: traced again, one micro-batch, GPipe's order
    assert any("(1, 16)" in t and "ScheduleGPipe" in t for t in pipeline["traced"]), pipeline["traced"]


@pytest.mark.slow  # default: the same mesh, sharded (the next test)
def test_pipelines_with_data_parallel_sync_inside_each_stage(tmp_path_factory: pytest.TempPathFactory) -> None:
    plan = result("pp2_dp2_1f1b", tmp_path_factory)["info"]["plans"][0]
    pipeline = plan["pipeline"]
    assert (pipeline["pp_size"], pipeline["dp_size"], plan["mesh_layout"]) == (2, 2, [[0, 1], [2, 3]])
    assert plan["grad_sync"].startswith("in-graph")
    # the data-parallel all-reduce is inside the compiled stage backward, over the dp group of 2
    assert plan["graphs"] and all(g["in_graph_sync"] and g["world_size"] == 2 for g in plan["graphs"])


def test_sharded_stages_gather_and_reduce_scatter_inside_their_graphs(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each stage split over its 2 replicas: every stage backward graph reduce-scatters (proved at compile time),
    and each rank holds a quarter of the parameters + AdamW state it would hold replicated (its stage, halved)."""
    r = result("pp2_dp2_sharded_full", tmp_path_factory)
    plan = r["info"]["plans"][0]
    pipeline = plan["pipeline"]  # 2 pipelines of 2 stages: stage s of pipeline p on rank s * dp + p
    assert (pipeline["pp_size"], pipeline["dp_size"], plan["mesh_layout"]) == (2, 2, [[0, 1], [2, 3]])
    sharding = plan["sharding"]
    (part,) = sharding["parts"]
    assert (part["mode"], part["dp"]) == ("full", 2) and part["split"], part
    backward = [g for g in sharding["collectives_per_graph"] if "proved_reduced" in g]
    assert backward and all(g["proved_reduced"] == g["sharded_gradients"] > 0 for g in backward), sharding
    assert all(g["collectives_in_backward"].get("reduce_scatter_tensor") for g in backward), sharding
    assert all(g["collectives_in_forward"].get("all_gather_into_tensor") for g in sharding["collectives_per_graph"])
    held = sharding["held_bytes"]  # a rank holds its 1/dp share of its own stage only: 1/4 of the module
    assert held["parameters"] <= part["param_bytes_before"] / 4 + part["largest_block_bytes"], (held, part)
    assert held["optimizer_state"] <= part["param_bytes_before"] / 2 + part["largest_block_bytes"], (held, part)


@pytest.mark.slow
def test_negative_control_without_the_data_parallel_sync(tmp_path_factory: pytest.TempPathFactory) -> None:
    r = result("pp2_dp2_no_dp_sync", tmp_path_factory, NO_DP_SYNC)
    assert "NEGATIVE CONTROL" in r["log"], "the switch was not honoured"  # the log line is the switch's feature
    rel = rel_update_diff(r["init"], r["ref"], r["sgdtp"])
    assert rel > 0.1, f"the control must not match (rel {rel:.3g}): the parity tests could not fail"


@pytest.mark.parametrize(
    ("module", "message"),
    [
        ("NoSelfCall", "NoSelfCall.training_step never called self(...)"),
        pytest.param("NoLoss", "training_step returned no loss", marks=pytest.mark.slow),  # the same contract check
        pytest.param("Untraceable", "torch.export could not trace Untraceable.forward", marks=pytest.mark.slow),
    ],
    ids=["contract_no_self_call", "contract_no_loss", "contract_untraceable"],
)
def test_a_broken_contract_is_named(module: str, message: str, tmp_path: Path) -> None:
    """The job must fail, and the error it prints is the feature: it names what is broken."""
    result = run([sys.executable, str(JOBS / "pp_contract.py"), module, str(tmp_path)], timeout=300)
    assert result.returncode != 0
    assert message in result.stdout, result.stdout[-4000:]
