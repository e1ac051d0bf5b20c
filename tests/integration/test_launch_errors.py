"""Errors the strategy raises in the launching process, before Lightning starts any rank."""

from __future__ import annotations

import json
import sys

from helpers.launch import run


def test_errors_before_any_process_is_spawned() -> None:
    """A compiled module and an unsupported precision fail in the launching process, naming the fix."""
    code = r"""
import sys, lightning.pytorch as L, torch
sys.path.insert(0, "tests")
from helpers.models import BreaksModel, token_data
import lightning_sgdtp
from lightning_sgdtp import SGDTPConfigError
errors = []
try:
    L.Trainer(strategy="sgdtp", accelerator="cpu", devices=2, precision="64-true", logger=False)
except SGDTPConfigError as e:
    errors.append(str(e))
t = L.Trainer(strategy="sgdtp", accelerator="cpu", devices=2, logger=False, max_steps=1)
try:
    t.fit(torch.compile(BreaksModel()), token_data())
except SGDTPConfigError as e:
    errors.append(str(e))
m = BreaksModel(); m.body = torch.compile(m.body)
try:
    t.fit(m, token_data())
except SGDTPConfigError as e:
    errors.append(str(e))
import multiprocessing, json
print("ERRORS" + json.dumps(errors))
"""
    result = run([sys.executable, "-c", code], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    errors = json.loads(result.stdout.split("ERRORS", 1)[1].strip().splitlines()[0])
    assert len(errors) == 3, errors
    assert "precision" in errors[0] and "bf16-mixed" in errors[0]
    assert "torch.compile" in errors[1] and "plain LightningModule" in errors[1]
    assert "body" in errors[2] and "remove the torch.compile" in errors[2]
    # Lightning's launch line (logged by the strategy as it joins the process group): no rank was started
    assert "Initializing distributed" not in result.stdout
