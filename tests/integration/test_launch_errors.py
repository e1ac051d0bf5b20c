"""Errors the strategy raises in the launching process, before Lightning starts any rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.launch import job_env, run


def test_errors_before_any_process_is_spawned() -> None:
    """A precision plugin the strategy cannot run and sync_batchnorm fail in the launching process, naming why and
    the fix. (A torch.compile()d module is no longer refused: tests/unit/frontends/test_drop_in_compile.py.)"""
    code = r"""
import sys, lightning.pytorch as L, torch
from lightning.pytorch.plugins import FSDPPrecision
import lightning_sgdtp
from lightning_sgdtp import NotAvailableYetError, SGDTPConfigError
errors = []
try:
    L.Trainer(strategy="sgdtp", accelerator="cpu", devices=2, plugins=[FSDPPrecision("bf16-mixed")], logger=False)
except SGDTPConfigError as e:
    errors.append(str(e))
try:
    L.Trainer(strategy="sgdtp", accelerator="cpu", devices=2, sync_batchnorm=True, logger=False)
except NotAvailableYetError as e:
    errors.append(str(e))
import json
print("ERRORS" + json.dumps(errors))
"""
    result = run([sys.executable, "-c", code], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    errors = json.loads(result.stdout.split("ERRORS", 1)[1].strip().splitlines()[0])
    assert len(errors) == 2, errors
    assert "FSDPPrecision" in errors[0] and "FSDP's wrapper" in errors[0] and "bf16-mixed" in errors[0]
    assert "sync_batchnorm" in errors[1]
    # Lightning's launch line (logged by the strategy as it joins the process group): no rank was started
    assert "Initializing distributed" not in result.stdout


def test_a_cache_folder_that_cannot_be_written_stops_the_job_before_training(tmp_path: Path) -> None:
    """TORCHINDUCTOR_CACHE_DIR exists but is immutable (``chattr +i``: no one can write it, root included): the job
    ends at setup with the folder and the fix named, before any training step."""
    code = r"""
import sys, lightning.pytorch as L, torch
sys.path.insert(0, "tests")
from helpers.models import BreaksModel, token_data
from lightning_sgdtp.compiler.artifacts import CacheFolderError
class Counted(BreaksModel):
    steps = 0
    def training_step(self, *args):
        Counted.steps += 1
        return super().training_step(*args)
t = L.Trainer(strategy="sgdtp", accelerator="cpu", devices=1, logger=False, max_steps=1, enable_progress_bar=False)
try:
    t.fit(Counted(), token_data())
except CacheFolderError as e:
    print("REFUSED", Counted.steps, e)
"""
    folder = tmp_path / "inductor"
    folder.mkdir()
    subprocess.run(["chattr", "+i", str(folder)], check=True)
    try:
        result = run([sys.executable, "-c", code], timeout=180, env=job_env(TORCHINDUCTOR_CACHE_DIR=str(folder)))
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"REFUSED 0 the compile cache folder {folder} (TORCHINDUCTOR_CACHE_DIR) cannot be written" in result.stdout
    assert "export TORCHINDUCTOR_CACHE_DIR=" in result.stdout, result.stdout[-3000:]
