"""The Lightning features users combine with a strategy give what they give under ``ddp`` (issue 46: a true drop-in),
as Lightning's own ``test_common.py`` checks across strategies.

One launch of 2 ranks (``jobs/contract.py``) runs each feature with Lightning's DDP and with sgdtp, the same seed,
model (``BreaksModel``: a tied embedding and head, an unused layer, an eager region, graph breaks) and data; each test
here compares what a user observes of one feature. Weights are compared by their sum: DDP and the compiled step add
in another order, so equal training gives sums equal to fp32 noise (measured 3e-6 on ~23 after 4-6 steps; bf16
autocast 1e-3), and one missed or doubled step changes them by ~1e-1.

What differs from ``ddp`` on purpose is listed in docs/lightning-features.md (DDP's internals: ``_ddp_kwargs``, the
``DistributedDataParallel`` wrapper, the reducer's unused-parameter error).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers.launch import run_job

FP32, BF16 = 1e-4, 2e-2


@pytest.fixture(scope="module")
def contract(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("contract")
    run_job("contract.py", str(out), timeout=900)
    return json.loads((out / "contract.json").read_text())


def both(contract: dict[str, Any], feature: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return contract[feature]["ddp"], contract[feature]["sgdtp"]


@pytest.mark.covers("data", "validate")
@pytest.mark.covers("data", "test")
@pytest.mark.covers("data", "predict")
def test_validate_test_predict_and_sampler(contract: dict[str, Any]) -> None:
    ref, ours = both(contract, "evaluate")
    assert abs(ref["val"] - ours["val"]) < 1e-4 and abs(ref["test"] - ours["test"]) < 1e-4
    assert ref["pred"] == ours["pred"]
    # the training sampler is sized by the data-parallel group: 2 replicas, 32 samples / 2 / batch 4 = 4 batches
    assert ours["sampler"] == ["DistributedSampler", 2, 0] and ours["batches"] == 4
    assert ours["sampler_kwargs"] == {"num_replicas": 2, "rank": 0}


def test_checkpoint_folder_early_stopping_and_weight_averaging(contract: dict[str, Any]) -> None:
    """ModelCheckpoint's folder lists what ddp's lists (no file of the plugin's), so does ``default_root_dir`` with
    ``logger=False`` (no plan file), EarlyStopping stops at the same step, and the EMA of WeightAveraging ends with
    the same weights."""
    ref, ours = both(contract, "callbacks")
    assert ours["files"] == ref["files"] and ours["best"] == ref["best"], (ref, ours)
    assert ours["root"] == ref["root"] == ["ckpt"], (ref, ours)
    assert ours["stopped"] == ref["stopped"]
    assert abs(ours["weights"] - ref["weights"]) < FP32 and abs(ours["ema"] - ref["ema"]) < FP32, (ref, ours)


def test_resume_from_the_last_checkpoint(contract: dict[str, Any]) -> None:
    ref, ours = both(contract, "resume")
    assert ours["step"] == ref["step"] == 6 and ours["files"] == ref["files"], (ref, ours)
    assert abs(ours["weights"] - ref["weights"]) < FP32, (ref, ours)


def test_the_trainer_pickles_before_and_after_fit(contract: dict[str, Any]) -> None:
    """``copy.deepcopy(strategy)`` and ``torch.save(trainer)`` before fit on every rank, as with DDP; after fit
    sgdtp's trainer saves and loads back (DDP's rank 0 cannot when its launcher holds the other ranks' process
    handles, i.e. in a script's first Trainer: ``tests/unit/frontends/test_trainer_copies_and_files.py``)."""
    ref, ours = both(contract, "save_trainer")
    assert ours["before"] and ref["before"]
    assert ours["after"] == 2, ours


def test_a_torch_compiled_module_trains_as_under_ddp(contract: dict[str, Any]) -> None:
    """``trainer.fit(torch.compile(model))``: the strategy takes the module and compiles the step itself."""
    ref, ours = both(contract, "compiled")
    assert ours["step"] == ref["step"] == 4 and abs(ours["weights"] - ref["weights"]) < FP32, (ref, ours)


def test_a_precision_plugin_subclass_is_used(contract: dict[str, Any]) -> None:
    """A subclass of MixedPrecision (Lightning's ``test_amp_ddp``): accepted, its hooks run, bf16 autocast."""
    ref, ours = both(contract, "precision_plugin")
    assert ours["plugin_steps"] == ref["plugin_steps"] == 4, (ref, ours)
    assert abs(ours["weights"] - ref["weights"]) < BF16, (ref, ours)


def test_the_profilers_files(contract: dict[str, Any]) -> None:
    ref, ours = both(contract, "profiler")
    assert ours["files"] == ref["files"] == ["fit-perf-0.txt", "fit-perf-1.txt"], (ref, ours)


def test_the_learning_rate_finder(contract: dict[str, Any]) -> None:
    ref, ours = both(contract, "lr_find")
    assert ours["lrs"] == ref["lrs"] and ours["restored"] and ref["restored"], (ref, ours)
    assert all(abs(a - b) < 1e-3 * abs(a) for a, b in zip(ref["losses"], ours["losses"], strict=True)), (ref, ours)


def test_lightning_cli_with_the_strategy_by_name(contract: dict[str, Any]) -> None:
    ref, ours = both(contract, "cli")
    assert ours["step"] == ref["step"] == 3 and abs(ours["weights"] - ref["weights"]) < FP32, (ref, ours)
