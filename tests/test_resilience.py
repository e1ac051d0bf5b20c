"""Nothing is lost: runs killed mid-epoch, mid-save, or restarted by torchrun end exactly where an
uninterrupted run ends (bitwise: CPU, one thread per rank, dropout included).

The jobs are in tests/jobs/resilience.py; every kill is a SIGKILL of the whole job (no handler runs).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from launch import JOBS, job_env, run

JOB = str(JOBS / "resilience.py")


def _params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path)


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not different, f"max |diff| per parameter: {different}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("straight")
    result = run([sys.executable, JOB, "straight", str(out)])
    assert result.returncode == 0, result.stdout[-4000:]
    return _params(out / "straight.pt")


@pytest.mark.parametrize(
    ("part", "resumes_at"),
    [
        ("killed", "resuming epoch 1 after batch 2"),  # killed at step 9; last complete checkpoint: step 8
        ("save_killed", "resuming epoch 0 after batch 2"),  # killed writing last.ckpt at step 4: resumes at 2
    ],
)
def test_killed_run_resumes_to_the_uninterrupted_parameters(
    straight: dict[str, torch.Tensor], tmp_path: Path, part: str, resumes_at: str
) -> None:
    killed = run([sys.executable, JOB, part, str(tmp_path)])
    assert killed.returncode == -9, f"the job was not killed (rc={killed.returncode}):\n{killed.stdout[-3000:]}"
    assert not (tmp_path / f"{part}.pt").exists()
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    if part == "save_killed":  # the half-written file is there, under a name that Lightning never loads
        assert any(name.startswith(".last.ckpt.tmp-") for name in ckpts), ckpts
    resumed = run([sys.executable, JOB, "resumed", str(tmp_path)])
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert f"sgdtp: {resumes_at}" in resumed.stdout, resumed.stdout[-3000:]
    _assert_bitwise(straight, _params(tmp_path / "resumed.pt"))
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".tmp-" in p.name], "stale temporary files remain"


def test_torchrun_restart_resumes_on_its_own(straight: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """torchrun --max-restarts=1: rank 1 dies at step 9 of the first attempt; the restart resumes from last."""
    env = job_env()
    port = env.pop("MASTER_PORT")
    env.pop("MASTER_ADDR")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", JOB, "torchrun", str(tmp_path)]
    result = run(cmd, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "sgdtp: resuming epoch 1 after batch 2" in result.stdout, result.stdout[-3000:]
    _assert_bitwise(straight, _params(tmp_path / "torchrun.pt"))
