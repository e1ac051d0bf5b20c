"""`benchmarks/gpu_check.py` in a fresh interpreter, without running anything heavy: the dry run lists every part and
check as skipped with its reason and writes them to the results file; without CUDA and without --dry-run it refuses at
once, naming the fix. (What the check measures on a GPU: docs/hardware.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.launch import REPO

SCRIPT = REPO / "benchmarks" / "gpu_check.py"
#: Parts the docs name (docs/hardware.md); the dry run lists these at least.
NAMED = ("eager", "sgdtp", "auto+compile", "sgdtp-cudagraphs", "sgdtp-bf16", "sgdtp-dp2", "sgdtp-sequence2")
NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_the_dry_run_lists_every_part_as_skipped_with_its_reason(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = _run("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["benchmark"] == "gpu_check" and results["status"] == "skipped" and results["dry_run"]
    entries = results["parts"]
    runs = [e["name"] for e in entries if e["kind"] == "run"]
    assert set(NAMED) <= set(runs)
    assert {e["kind"] for e in entries} == {"run", "parity", "ratio"}
    lines = proc.stdout.splitlines()
    for e in entries:
        assert e["status"] == "skipped" and e["reason"], e
        if e["kind"] == "run" and not torch.cuda.is_available():
            assert e["reason"].startswith(NO_CUDA), e
        assert any(e["name"] in line and f"skipped: {e['reason']}" in line for line in lines), e["name"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal without CUDA")
def test_without_cuda_it_refuses_at_once_and_names_the_fix(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    proc = _run("--out", str(out))
    assert proc.returncode == 2
    assert "torch.cuda.is_available() is False" in proc.stderr and "--dry-run" in proc.stderr
    assert not out.exists()
