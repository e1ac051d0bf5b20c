"""Pipeline parallel against single-process training of the same model on the same global batch.

``tests/jobs/pp_parity.py``: the launching process trains the reference on one device (global batch = dp x
per-rank batch, Lightning's shuffled order), then every rank trains with ``pipeline_stages=2,
pipeline_chunks=4``; AdamW lr=1e-2, 6 steps, a 4-block GPT with a tied embedding / head (on stages 0 and 1).
Measured (fp32):
- first-step gradients (before clipping), merged from the stages: relative error 4e-7 .. 6e-7. A missing
  micro-batch, a wrong loss scale (x4) or an unsummed tied gradient is off by 30-300%;
- ``rel`` = ||delta_sgdtp - delta_ref|| / ||delta_ref|| after 6 steps: 1.3e-5 .. 3e-5. The negative control
  (pp=2 x dp=2 with the data-parallel all-reduce off) measures 0.97. Tolerance 1e-3;
- the logged ``train_loss`` (every rank) and ``val_loss`` / ``val_ppl`` (validated through the pipeline) equal
  the reference's to 1e-5.
- bf16-mixed (autocast around the schedule): first-step gradients 2.6e-3, ``rel`` 0.037 (bf16 rounding turned
  into lr-sized AdamW steps, as in ``test_tensor_parallel.py``); tolerances 3e-2 / 0.15, loss 1e-2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from launch import JOBS, parity_result, rel_update_diff, run, run_job

GRAD_TOL = {"fp32": 1e-4, "bf16": 3e-2}
REL_TOL = {"fp32": 1e-3, "bf16": 0.15}
LOSS_TOL = {"fp32": 1e-5, "bf16": 1e-2}
CASES = {
    "gpipe_2x4": "GPipe, 2 stages x 4 micro-batches, clipping, validation",
    "1f1b_2x4": "1F1B, 2 stages x 4 micro-batches, validation",
    "interleaved_2x4": "interleaved 1F1B, 4 stages (2 per rank) x 4 micro-batches",
    "1f1b_accumulate_clip": "1F1B, accumulate_grad_batches=2 (8 micro-batches per optimizer step), clipping",
    "pp2_dp2_1f1b": "pp=2 x dp=2 on 4 ranks, 1F1B, clipping, validation",
    "options_dict_ckpt_measured": "the design documents' options dict, measured balance, activation checkpointing",
    "1f1b_bf16": "1F1B, bf16-mixed (autocast around the schedule)",
    "1f1b_short_last_batch": "1F1B, 49 samples: the 7th batch has 1 sample (runs as GPipe, 1 micro-batch)",
}
PRECISION = {case: "bf16" if case.endswith("bf16") else "fp32" for case in CASES}
_RESULTS: dict[str, dict] = {}


def result(case: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    if case not in _RESULTS:
        out = tmp_path_factory.mktemp(case)
        return parity_result(_RESULTS, "pp_parity.py", case, out, ("info", "ref_metrics"))
    return _RESULTS[case]


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_one_process(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    r = result(case, tmp_path_factory)
    assert r["ref"].keys() == r["sgdtp"].keys()
    assert r["grads"].keys() == r["ref_grads"].keys()  # every parameter got its gradient on some stage
    for name, ref in r["ref_grads"].items():
        err = float((r["grads"][name] - ref).norm() / ref.norm().clamp_min(1e-12))
        assert err < GRAD_TOL[PRECISION[case]], f"{case}: first-step gradient of {name} differs by {err:.3g} (relative)"
    rel = rel_update_diff(r["init"], r["ref"], r["sgdtp"])
    assert rel < REL_TOL[PRECISION[case]], f"{case}: relative update difference {rel:.3g}"
    assert torch.equal(r["sgdtp"]["model.tok_emb.weight"], r["sgdtp"]["model.lm_head.weight"])  # tie kept
    assert all(r["info"]["whole_on_every_rank"])  # after fit, model.state_dict() is the trained model on every rank
    if case in ("gpipe_2x4", "pp2_dp2_1f1b", "1f1b_accumulate_clip"):
        norm = sum(float(g.norm() ** 2) for g in r["ref_grads"].values()) ** 0.5
        assert norm > 0.3 * 2, norm  # clipping (gradient_clip_val=0.3) really acted, on the global norm


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_logs_what_the_reference_logs(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    r = result(case, tmp_path_factory)
    ref = r["ref_metrics"]
    final = [phases[-1] for phases in r["info"]["metrics"]]
    dp = r["info"]["plans"][0]["pipeline"]["dp_size"]
    # self.log("train_loss", prog_bar=True) in training_step: the mean over the micro-batches, shown on every rank
    # of the pipeline (the same value); without sync_dist each pipeline logs its own batch's (as with DDP), so
    # the pipelines' mean is the global batch's loss. Rank r is stage r // dp of pipeline r % dp.
    for rank, metrics in enumerate(final):
        assert metrics["train_loss"] == final[rank % dp]["train_loss"], (rank, final)
    mean = sum(final[p]["train_loss"] for p in range(dp)) / dp
    assert abs(mean - ref["train_loss"]) < LOSS_TOL[PRECISION[case]], (final, ref)
    if "val_loss" in ref:  # validation ran through the pipeline; sync_dist and a torchmetrics metric: all ranks
        for rank, metrics in enumerate(final):
            assert abs(metrics["val_loss"] - ref["val_loss"]) < 1e-5, (rank, metrics, ref)
            assert abs(metrics["val_ppl"] - ref["val_ppl"]) < 1e-3, (rank, metrics, ref)


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_says_what_was_decided(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    r = result(case, tmp_path_factory)
    plan = r["info"]["plans"][0]
    pipeline = plan["pipeline"]
    written = json.loads((r["out"] / "sgdtp0" / "sgdtp_plan.json").read_text())  # saved with the run plan
    assert written["pipeline"]["split"] == pipeline["split"]
    split = pipeline["split"]
    assert pipeline["chunks"] == 4
    assert split["stack"] == "model.blocks"
    assert split["before"] == ["model.tok_emb", "model.pos_emb", "model.drop"]
    assert split["after"][:2] == ["model.ln_f", "model.lm_head"]
    assert split["tied"] == [["model.tok_emb.weight", "model.lm_head.weight"]]
    if case == "interleaved_2x4":
        assert (pipeline["schedule"], split["stages"]) == ("interleaved_1f1b", 4)
        assert pipeline["stages_of_rank_0"] == [0, 2]
        assert split["blocks_per_stage"] == [[f"model.blocks.{i}"] for i in range(4)]
    else:
        assert split["blocks_per_stage"] == [["model.blocks.0", "model.blocks.1"], ["model.blocks.2", "model.blocks.3"]]
    if case == "options_dict_ckpt_measured":
        assert (split["balance"], pipeline["schedule"], pipeline["pp_size"]) == ("cost", "1f1b", 2)
        assert plan["activation_checkpointing"] == ["model.blocks.0", "model.blocks.1"]
        assert plan["graph_breaks"] == {}  # checkpointed blocks stay inside the one compiled stage graph
    if case == "1f1b_short_last_batch":  # the 1-sample batch: traced again, one micro-batch, GPipe's order
        assert any("(1, 16)" in t and "ScheduleGPipe" in t for t in pipeline["traced"]), pipeline["traced"]
    if case == "pp2_dp2_1f1b":
        assert (pipeline["pp_size"], pipeline["dp_size"], plan["mesh_layout"]) == (2, 2, [[0, 1], [2, 3]])
        assert plan["grad_sync"].startswith("in-graph")
        # the data-parallel all-reduce is inside the compiled stage backward, over the dp group of 2
        assert plan["graphs"] and all(g["in_graph_sync"] and g["world_size"] == 2 for g in plan["graphs"])
    else:
        assert pipeline["dp_size"] == 1


def test_negative_control_without_the_data_parallel_sync(tmp_path: Path) -> None:
    run_job("pp_parity.py", "pp2_dp2_no_dp_sync_control", str(tmp_path), timeout=600)
    load = lambda n: torch.load(tmp_path / f"{n}.pt")
    rel = rel_update_diff(load("init"), load("ref"), load("sgdtp"))
    assert rel > 0.1, f"the control must not match (rel {rel:.3g}): the parity tests could not fail"


@pytest.mark.parametrize("case", ["resume_pp_to_pp", "resume_pp_to_dp"])
def test_checkpoint_per_stage_resume_and_consolidate(case: str, tmp_path: Path) -> None:
    """3 steps, a sharded checkpoint (each rank its stage), resumed in a fresh module (another split, or no
    pipeline), 3 more steps: as 6 uninterrupted steps of one process. The folder consolidates to one file."""
    from lightning_sgdtp import sharded_checkpoint as sharded

    run_job("pp_parity.py", case, str(tmp_path), timeout=600)
    load = lambda n: torch.load(tmp_path / f"{n}.pt")
    rel = rel_update_diff(load("init"), load("ref"), load("sgdtp"))
    assert rel < REL_TOL["fp32"], f"{case}: relative update difference {rel:.3g}"
    ckpt = Path(json.loads((tmp_path / "info.json").read_text())["ckpt"])
    assert sharded.is_sharded(ckpt) and len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per stage
    merged = torch.load(sharded.consolidate(ckpt, tmp_path / "one.ckpt"), weights_only=False)
    saved = load("saved")
    assert merged["state_dict"].keys() >= saved.keys() - {"model.lm_head.weight"}
    for name, value in merged["state_dict"].items():
        assert torch.equal(value, saved[name]), name
    states = merged["optimizer_states"][0]["state"]
    assert all(isinstance(k, str) for k in states) and "model.blocks.3.mlp.fc.weight" in states


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("contract_no_self_call", "NoSelfCall.training_step never called self(...)"),
        ("contract_no_loss", "training_step returned no loss"),
        ("contract_untraceable", "torch.export could not trace Untraceable.forward"),
    ],
)
def test_a_broken_contract_is_named(case: str, message: str, tmp_path: Path) -> None:
    result = run([sys.executable, str(JOBS / "pp_parity.py"), case, str(tmp_path)], timeout=300)
    assert result.returncode != 0
    assert message in result.stdout, result.stdout[-4000:]
