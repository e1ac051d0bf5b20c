"""Fabric on SLURM, and the end of a Fabric script (issue 43, item 4), in this process.

Under SLURM with ``auto_requeue`` the strategy installs the ranks' agreement on SLURM's signal; the loop's
``fabric.strategy.requeue_if_agreed(path, state)`` at a step's end saves ``state`` atomically, requeues the job and
exits 0 once the ranks agreed, and the restarted loop loads ``path``. Here with the real signal, strategy, save and
``requeue_slurm_job``, ``scontrol`` a script on ``PATH`` and the agreement's all-reduce done by hand (what the next
backward's does); the whole job on the local SLURM cluster: ``tests/distributed/test_slurm.py``.

At exit, a script that never called teardown (Fabric calls none) stops its heartbeat and watchdog and destroys its
process group while Python is alive (``Job.leave``): left to the interpreter's finalization, a thread still in a
c10d call aborted the process (exit -6) about once in ten runs (docs/fabric.md).
"""

from __future__ import annotations

import logging
import os
import signal
import weakref
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from torch import nn

from lightning_sgdtp.frontends import job as jobs
from lightning_sgdtp.frontends.fabric import SGDTPFabricStrategy
from lightning_sgdtp.runtime.preemption import Preempted, PreemptionCoordinator
from lightning_sgdtp.trust.manifest import MANIFEST


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``scontrol`` on PATH: records its arguments, exits with ``$SCONTROL_RC`` (0); this is SLURM job 4242."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit ${{SCONTROL_RC:-0}}\n')
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    return calls


@pytest.fixture
def strategy(monkeypatch: pytest.MonkeyPatch) -> Iterator[SGDTPFabricStrategy]:
    """A one-rank strategy whose job watches SIGUSR1 (what ``Job.start`` installs under SLURM), with ``model`` set
    up: its collectives are this rank's own values."""
    strategy = SGDTPFabricStrategy()
    job = strategy._job
    monkeypatch.setattr(job, "broadcast", lambda obj, src=0: obj)
    job.engine = SimpleNamespace(module=nn.Linear(4, 2))
    job.steps = 7
    job.preemption = PreemptionCoordinator(signal.SIGUSR1)
    yield strategy
    job.preemption.close()  # the previous SIGUSR1 handler back


def _state(strategy: SGDTPFabricStrategy, step: int = 7) -> dict:
    model = strategy._job.engine.module
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": step}


def _signal_and_agree(strategy: SGDTPFabricStrategy) -> None:
    preemption = strategy._job.preemption
    os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's --signal: the handler only sets a flag
    assert preemption.requested and not preemption.agreed
    preemption.agree(preemption.requested)  # the next backward's agreement (GradSync._agreed): every rank learns it


def test_the_agreed_step_saves_the_state_atomically_requeues_and_exits_0(
    strategy: SGDTPFabricStrategy, scontrol: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, state = tmp_path / "run" / "preempted.ckpt", _state(strategy)
    caplog.set_level(logging.INFO)
    strategy.requeue_if_agreed(path, state)  # no signal: the loop goes on
    os.kill(os.getpid(), signal.SIGUSR1)
    strategy.requeue_if_agreed(path, state)  # asked on this rank, not agreed yet: the loop goes on
    assert not path.exists() and not scontrol.exists()
    strategy._job.preemption.agree(True)
    with pytest.raises(Preempted) as stopped:
        strategy.requeue_if_agreed(path, state)
    assert stopped.value.code == 0  # SystemExit(0): the loop ends, the process exits cleanly
    assert scontrol.read_text().split() == ["requeue", "4242"]
    # written through the strategy's save (fabric.save's): atomically, sealed (its manifest inside: the folder lists
    # the checkpoint alone), verified by the load below
    assert sorted(p.name for p in path.parent.iterdir()) == ["preempted.ckpt"]
    assert any(n.endswith(f"/.sgdtp/{MANIFEST}") for n in zipfile.ZipFile(path).namelist())
    said = caplog.text
    assert "SLURM: on signal 10 the ranks agree on a step" in said  # once, at the first call
    assert f"preempted at step 7: checkpoint saved to {path}; requeueing job 4242; stopping" in said
    assert "job 4242 requeued" in said

    # SLURM starts the job again: the loop loads the file (fabric.load) and goes on from its step
    saved = {k: v.clone() for k, v in state["model"].state_dict().items()}
    restarted = _state(strategy, step=0)
    with torch.no_grad():
        restarted["model"].weight.add_(1.0)
    remainder = strategy.load_checkpoint(path, restarted)  # what the state did not name: Lightning's version keys
    assert restarted["step"] == 7 and "step" not in remainder
    assert all(torch.equal(v, saved[k]) for k, v in restarted["model"].state_dict().items())


def test_a_failed_requeue_keeps_the_checkpoint_and_training_goes_on(
    strategy: SGDTPFabricStrategy, scontrol: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SCONTROL_RC", "1")
    path = tmp_path / "preempted.ckpt"
    _signal_and_agree(strategy)
    strategy.requeue_if_agreed(path, _state(strategy))  # no Preempted: the loop goes on
    preemption = strategy._job.preemption
    assert path.exists() and scontrol.read_text().split() == ["requeue", "4242"]
    assert not preemption.requested and not preemption.agreed  # a later signal asks again


def test_only_slurm_with_auto_requeue_installs_the_agreement() -> None:
    assert jobs.requeue_signal(SLURMEnvironment()) == signal.SIGUSR1
    assert jobs.requeue_signal(SLURMEnvironment(requeue_signal=signal.SIGHUP)) == signal.SIGHUP
    assert jobs.requeue_signal(SLURMEnvironment(auto_requeue=False)) is None
    assert jobs.requeue_signal(LightningEnvironment()) is None


def test_without_slurm_the_call_does_nothing(tmp_path: Path) -> None:
    strategy = SGDTPFabricStrategy()
    assert strategy._job.preemption is None
    strategy.requeue_if_agreed(tmp_path / "preempted.ckpt", {"step": 1})
    assert list(tmp_path.iterdir()) == []


def test_fabric_num_nodes_reaches_the_strategy() -> None:
    """``Fabric(num_nodes=2)``: Fabric's connector sets ``strategy._num_nodes``; the launcher and the job's world
    size read it (SLURM checks it against ``--nodes``)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, num_nodes=2, strategy="sgdtp")
    assert (fabric.strategy.num_nodes, fabric.strategy._launcher.num_nodes) == (2, 2)


# ------------------------------------------------------------------------------------------------ the exit
def test_at_exit_every_job_stops_its_threads_then_the_process_group_goes_while_python_is_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two Fabrics in one script (two jobs): both heartbeats and watchdogs stop before the process group (and the
    store they write to) is destroyed."""
    monkeypatch.setattr(jobs, "_AT_EXIT", weakref.WeakSet())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        done: list[str] = []
        made = [SGDTPFabricStrategy()._job for _ in range(2)]
        for n, job in enumerate(made):
            job.guard = SimpleNamespace(failed=False, close=lambda n=n: done.append(f"heartbeat {n}"))
            job.watchdog = SimpleNamespace(close=lambda n=n: done.append(f"watchdog {n}"))
            jobs._AT_EXIT.add(job)
        jobs.leave_at_exit()
        assert sorted(done) == ["heartbeat 0", "heartbeat 1", "watchdog 0", "watchdog 1"]
        assert not dist.is_initialized()
        jobs.leave_at_exit()  # nothing left to do
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_at_exit_a_failed_rank_neither_waits_for_its_peers_nor_stops_its_watchdog(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meets: list[object] = []
    monkeypatch.setattr(jobs, "_AT_EXIT", weakref.WeakSet())
    monkeypatch.setattr(jobs.shutdown, "leave_process_group", lambda meet=True: meets.append(meet))
    jobs.leave_at_exit()  # no job left (gone, or none made): the process group still goes
    job = SGDTPFabricStrategy()._job
    job.guard = SimpleNamespace(failed=True, close=lambda: None)  # this rank reported a failure
    job.watchdog = SimpleNamespace(close=lambda: meets.append("watchdog closed"))  # its countdown bounds the exit
    jobs._AT_EXIT.add(job)
    jobs.leave_at_exit()
    assert meets == [True, False]
