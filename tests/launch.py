"""Run a multi-process job script with a hard timeout; always reap every process it started."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "tests" / "jobs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
    )
    env.update(extra)
    return env


def start(cmd: list[str], env: dict[str, str] | None = None, merge_stderr: bool = True) -> subprocess.Popen:
    """Start ``cmd`` in its own session, so that it and every process it starts can be killed together."""
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env or job_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str, bool]:
    """Wait for ``proc``; on timeout kill its whole process group. Always reap what it left behind.

    Returns (stdout, stderr, timed_out)."""
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return out, err or "", timed_out


def run(cmd: list[str], timeout: float = 420, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion (stderr merged into stdout); a timeout fails the test with the output tail."""
    proc = start(cmd, env)
    out, _, timed_out = finish(proc, timeout)
    if timed_out:
        raise AssertionError(f"{cmd} timed out after {timeout}s; output tail:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def run_job(script: str, *args: str, timeout: float = 420, **env: str) -> subprocess.CompletedProcess:
    result = run([sys.executable, str(JOBS / script), *args], timeout=timeout, env=job_env(**env))
    assert result.returncode == 0, f"{script} {args} failed (rc={result.returncode}):\n{result.stdout[-6000:]}"
    return result


def load_result(out: Path) -> dict[str, Any]:
    info = json.loads((out / "info.json").read_text())
    info["init"] = torch.load(out / "init.pt")
    if (out / "grads.pt").exists():  # the parity jobs' first-step gradients
        info["grads"] = torch.load(out / "grads.pt")
    info["ref"] = torch.load(out / "ref.pt")
    info["sgdtp"] = torch.load(out / "sgdtp.pt")
    return info


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a if a[k].is_floating_point())


def rel_update_diff(init: dict[str, torch.Tensor], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||(b - init) - (a - init)|| / ||a - init|| over all floating-point parameters."""
    keys = [k for k in a if a[k].is_floating_point()]
    num = sum(float((a[k].float() - b[k].float()).norm() ** 2) for k in keys) ** 0.5
    den = sum(float((a[k].float() - init[k].float()).norm() ** 2) for k in keys) ** 0.5
    return num / den


PARITY_TENSORS = ("init", "ref", "sgdtp", "ref_grads", "grads")


def parity_result(
    cache: dict[str, dict], script: str, case: str, out: Path, json_files: tuple[str, ...] = ("info",)
) -> dict:
    """Run a parity job once per case (``cache`` keeps what it wrote): its JSON files and tensors, by name."""
    if case not in cache:
        run_job(script, case, str(out), timeout=600)
        cache[case] = {
            "out": out,
            **{name: json.loads((out / f"{name}.json").read_text()) for name in json_files},
            **{name: torch.load(out / f"{name}.pt") for name in PARITY_TENSORS},
        }
    return cache[case]
