"""The `sgdtp` command line in fresh interpreters: `sgdtp diagnose`, `sgdtp doctor`, `sgdtp plan`, `sgdtp sign` /
`sgdtp verify`. What a command prints is its feature here: these tests read its output. (The library functions behind
each command: tests/unit/diagnose/test_diagnose.py, test_doctor.py, test_trust.py; every input `sgdtp plan` refuses,
in-process: tests/unit/planner/test_planner_inputs.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import DATA as TEST_DATA
from helpers.launch import REPO, job_env
from helpers.signing import gpg_identities
from helpers.signing import make_artifact as _artifact

from lightning_sgdtp.diagnose import CACHE_MARKER
from lightning_sgdtp.observe import doctor

DATA = TEST_DATA / "doctor"


# ---------------------------------------------------------------------------------------------------- diagnose
TARGET = """
import torch
import torch.nn.functional as F
from torch import nn
from lightning_sgdtp import graph

SCALE = graph.register("scale_cuda", lambda x: 2 * x, lambda ctx, g: 2 * g, [("tensor", "cuda")], [("tensor", "cuda")])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum().item() > 0:  # a data-dependent branch: graph break
            h = h * 2
        return h.relu().sum()


class OpNet(Net):
    def forward(self, x):
        return SCALE(self.lin(x)).sum()


def make():
    return Net(), torch.randn(8, 4)


def make_op():
    return OpNet(), torch.randn(8, 4)
"""


def target_line(text: str) -> int:
    return next(i for i, line in enumerate(TARGET.splitlines(), 1) if text in line)


def sgdtp(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_sgdtp.cli", *args],
        check=False,
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_json_with_the_sgdtp_backend(tmp_path: Path) -> None:
    (tmp_path / "target.py").write_text(TARGET)
    cache = tmp_path / "cache"
    cache.mkdir()
    out = sgdtp("diagnose", f"{tmp_path / 'target.py'}:make", "--json", "--cache-dir", str(cache))
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert data["backend"] == "sgdtp" and data["target"] == "Net.forward"
    checks = {f["check"] for f in data["findings"]}
    assert {"graph_break", "recompile", "compile_cache"} <= checks, data["findings"]
    brk = next(f for f in data["findings"] if f["check"] == "graph_break")
    assert brk["where"] == f"{tmp_path / 'target.py'}:{target_line('.item()')}" and brk["source"].startswith(
        "if h.sum().item() > 0:"
    )
    assert "capture_scalar_outputs" in brk["fix"]
    assert (cache / CACHE_MARKER).exists()


def test_cli_text_custom_op_strict_and_errors(tmp_path: Path) -> None:
    (tmp_path / "target.py").write_text(TARGET)
    out = sgdtp("diagnose", f"{tmp_path / 'target.py'}:make_op", "--backend", "aot_eager", "--no-cache", "--strict")
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]  # --strict: an error was found
    assert "sgdtp diagnose: OpNet.forward" in out.stdout
    assert "[error] custom_op_device: sgdtp.scale_cuda is registered for cuda, but its input 0" in out.stdout
    assert (
        f"at {tmp_path / 'target.py'}:{target_line('SCALE(self')}" in out.stdout
        and "    fix: register the op" in out.stdout
    )

    missing = sgdtp("diagnose", f"{tmp_path / 'target.py'}:nope")
    assert missing.returncode == 2 and "has no callable 'nope'" in missing.stderr


def test_console_script_cache_only(tmp_path: Path) -> None:
    exe = shutil.which("sgdtp")
    assert exe, "the sgdtp console script is not on PATH: install the package (pip install -e '.[test]')"
    out = subprocess.run(
        [exe, "diagnose", "--cache-dir", str(tmp_path), "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert data["target"] == "compile cache" and data["findings"][0]["check"] == "compile_cache"


# ------------------------------------------------------------------------------------------------------ doctor
def test_this_machine_and_the_cli(tmp_path: Path) -> None:
    env = doctor.probe()
    assert env["torch"] and "gloo" in env["backends"] and env["python"].startswith(f"{sys.version_info[0]}.")
    cli = [sys.executable, "-m", "lightning_sgdtp.cli", "doctor"]
    table = subprocess.run(cli, capture_output=True, text=True, check=False, cwd=REPO)
    assert table.returncode == 0 and "sgdtp doctor" in table.stdout and "torch wheel for this machine" in table.stdout
    bad = subprocess.run([*cli, "--env", str(DATA / "old-stack.json")], capture_output=True, text=True, check=False)
    assert bad.returncode == 1 and "FAIL" in bad.stdout and "not ready" in bad.stdout
    # the H100 record with the versions CI runs: ready, its GPU stack untested (no GPU has run this project)
    h100 = {**json.loads((DATA / "h100-8x-nvlink.json").read_text()), "torch": "2.13.0+cu121", "lightning": "2.6.6"}
    (tmp_path / "h100.json").write_text(json.dumps(h100))
    as_json = subprocess.run(
        [*cli, "--json", "--env", str(tmp_path / "h100.json")], capture_output=True, text=True, check=False
    )
    result = json.loads(as_json.stdout)
    assert as_json.returncode == 0 and result["ok"] and result["wheel_tag"] == "cu121-cp311-linux_x86_64"
    assert {r["item"] for r in result["rows"] if r["verdict"] == "untested"} >= {"NCCL", "CUDA driver"}


# -------------------------------------------------------------------------------------------------------- plan
def test_cli_plan_refuses_an_impossible_topology_with_exit_code_2_and_plans_a_possible_one() -> None:
    target = "examples/gpt.py:GPTLightningModule"
    refused = sgdtp("plan", target, "--nodes", "2", "--gpus-per-node", "0")
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr[-3000:]
    assert refused.stderr == (
        "sgdtp plan: --gpus-per-node 0: a node has at least one GPU. Give --gpus-per-node 1 or more (default 8, or"
        " the topology file's).\n"
    )
    planned = sgdtp("plan", target, "--nodes", "2", "--gpus-per-node", "2", "--rows", "1")
    assert planned.returncode == 0 and "\nchosen: " in planned.stdout, planned.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ sign / verify
@pytest.fixture(scope="module")
def gpg_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path | str]]:
    """Two signing identities in one GNUPGHOME, and a keyring that trusts only the first."""
    with gpg_identities(tmp_path_factory.mktemp("gnupg")) as keys:
        yield keys


def test_cli_sign_and_verify(tmp_path: Path, gpg_keys: dict) -> None:
    root = _artifact(tmp_path / "run")
    cli = [sys.executable, "-m", "lightning_sgdtp.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    signed = subprocess.run(
        [*cli, "sign", str(root), "--gpg-key", gpg_keys["trusted"], "--gnupg-home", str(gpg_keys["home"])],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert signed.returncode == 0 and "and signed" in signed.stdout, signed.stderr
    verify = [*cli, "verify", str(root), "--keyring", str(gpg_keys["keyring"])]
    ok = subprocess.run(verify, capture_output=True, text=True, env=env, check=False)
    assert ok.returncode == 0 and "signature and every file verified" in ok.stdout, ok.stderr
    (root / "plan.json").write_text("{}")
    bad = subprocess.run(verify, capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 1 and "plan.json: size check failed" in bad.stderr, bad.stderr
