"""The strategy as users copy it, and the files it leaves (issue 46, items 4 and 5), 1-process runs in this process.

- ``pickle.dumps`` / ``copy.deepcopy`` of the strategy and ``torch.save(trainer)`` before fit, and
  ``torch.save(trainer)`` after a fit, loaded back and fit again: as with ``ddp`` (each such test runs both). What
  belongs to the run (threads, process groups, the engine) stays behind and is rebuilt by the next setup; a
  process-bound object copied on its own refuses, naming it.
- ``sgdtp_plan.json`` goes into the logger's folder; with ``logger=False`` no file at all (as ``ddp``) unless
  ``plan_file`` names one.

The multi-process side (every rank saves the trainer) is ``tests/distributed/test_lightning_contract.py``.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sgdtp import SGDTPStrategy
from lightning_sgdtp.observe.report import PLAN_FILENAME, PlanReport
from lightning_sgdtp.runtime.faults import FaultGuard, Liveness
from lightning_sgdtp.runtime.shutdown import ShutdownWatchdog


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)


def trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    defaults: dict[str, Any] = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
    defaults.update(enable_model_summary=False, max_steps=2, accelerator="cpu", devices=1)
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The working directory is an empty folder; the run's process group and environment do not outlive the test."""
    monkeypatch.chdir(tmp_path)
    environ, initialized = dict(os.environ), dist.is_initialized()
    yield tmp_path
    if dist.is_initialized() and not initialized:
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


STRATEGIES = [pytest.param("ddp", id="ddp"), pytest.param("sgdtp", id="sgdtp")]


# ---------------------------------------------------------------------------------------------------- copies
@pytest.mark.parametrize("name", STRATEGIES)
def test_the_strategy_pickles_and_deep_copies_before_fit(name: str, in_tmp: Path) -> None:
    """Lightning's own ``test_trainer_pickle``, with the strategy's copies."""
    strategy = SGDTPStrategy(bucket_cap_mb=5) if name == "sgdtp" else name
    t = trainer(strategy)
    for copied in (pickle.loads(pickle.dumps(t.strategy)), copy.deepcopy(t.strategy)):
        assert type(copied) is type(t.strategy)
        assert getattr(copied, "config", None) == getattr(t.strategy, "config", None)
    torch.save(t, in_tmp / "trainer.pt")
    loaded = torch.load(in_tmp / "trainer.pt", weights_only=False)
    assert type(loaded.strategy) is type(t.strategy)


@pytest.mark.parametrize("name", STRATEGIES)
def test_torch_save_of_the_trainer_after_a_fit_and_the_copy_fits_again(name: str, in_tmp: Path) -> None:
    """After fit, the trainer saves and loads back (as with ``ddp``); the copy's strategy holds the options, not the
    run (no engine, meshes or watchdog), and a second fit rebuilds them."""
    t = trainer(name)
    t.fit(Tiny(), data())
    copy.deepcopy(t.strategy)
    torch.save(t, in_tmp / "trainer.pt")
    loaded = torch.load(in_tmp / "trainer.pt", weights_only=False)
    assert loaded.global_step == 2
    if name == "sgdtp":
        job = loaded.strategy._job
        assert (job.engine, job.dims, job.watchdog, job.guard.liveness) == (None, None, None, None)
        assert loaded.strategy.config == t.strategy.config
    loaded.fit_loop.epoch_loop.max_steps = 4
    loaded.fit(loaded.lightning_module, data())
    assert loaded.global_step == 4


def test_what_belongs_to_a_process_is_left_out_or_refused() -> None:
    """The fault guard's copy leaves its heartbeat behind; a heartbeat or a watchdog copied on its own refuses."""
    guard = FaultGuard(60.0)
    guard.liveness = Liveness("localhost", 1, 0, 2, "key", 60.0)
    assert copy.deepcopy(guard).liveness is None and guard.liveness is not None
    for bound in (guard.liveness, ShutdownWatchdog(0)):
        with pytest.raises(TypeError, match=f"a {type(bound).__name__} belongs to the process that started it"):
            pickle.dumps(bound)


# ----------------------------------------------------------------------------------------------------- files
@pytest.mark.parametrize("name", STRATEGIES)
def test_no_file_is_written_without_a_logger(name: str, in_tmp: Path) -> None:
    """``logger=False``, ``default_root_dir`` the working directory: ``ddp`` writes nothing, nor does sgdtp."""
    t = trainer(name)
    t.fit(Tiny(), data())
    assert sorted(in_tmp.rglob("*")) == []
    if name == "sgdtp":
        assert t.strategy.plan["graphs"]  # the plan is still there, in strategy.plan


def test_the_plan_file_goes_into_the_loggers_folder(in_tmp: Path) -> None:
    t = trainer("sgdtp", logger=CSVLogger(in_tmp / "logs"), default_root_dir=in_tmp / "root")
    t.fit(Tiny(), data())
    written = Path(t.log_dir) / PLAN_FILENAME
    assert written.parent == in_tmp / "logs" / "lightning_logs" / "version_0"
    assert sorted(in_tmp.rglob(PLAN_FILENAME)) == [written]  # not in default_root_dir
    assert json.loads(written.read_text())["graphs"] == t.strategy.plan["graphs"]


def test_plan_file_writes_the_plan_where_it_says_without_a_logger(in_tmp: Path) -> None:
    t = trainer(SGDTPStrategy(plan_file="runs/plan.json"))  # relative: to the working directory at setup
    t.fit(Tiny(), data())
    assert sorted(in_tmp.rglob("*.json")) == [in_tmp / "runs/plan.json"]
    assert json.loads((in_tmp / "runs/plan.json").read_text())["config"]["plan_file"] == "runs/plan.json"


@pytest.mark.parametrize(
    ("plan_file", "logger", "where"),
    [
        ("auto", True, "logs/sgdtp_plan.json"),
        ("auto", False, None),
        (False, True, None),
        ("out/plan.json", False, "out/plan.json"),
        ("logs", False, "logs/sgdtp_plan.json"),  # a folder that exists: the file inside it
    ],
)
def test_where_the_plan_file_goes(
    plan_file: str | bool, logger: bool, where: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    report = PlanReport()
    report.place(tmp_path / "logs", plan_file, logger=logger)
    assert report.folder == tmp_path / "logs"  # the timeline's folder, whatever the plan file
    assert report.plan_path == (tmp_path / where if where else None)


def test_storage_options_are_refused_as_lightning_refuses_them(in_tmp: Path) -> None:
    """Lightning's TorchCheckpointIO refuses ``storage_options`` (it has no use for them); the strategy's one-file
    CheckpointIO did not, and silently wrote the file without them."""
    from lightning_sgdtp.frontends.trainer import AtomicCheckpointIO

    with pytest.raises(TypeError, match="storage_options.*not supported for `AtomicCheckpointIO`"):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, in_tmp / "last.ckpt", storage_options={"x": 1})
    assert not (in_tmp / "last.ckpt").exists()
    AtomicCheckpointIO().save_checkpoint({"state_dict": {}}, in_tmp / "last.ckpt")
    assert (in_tmp / "last.ckpt").exists()
