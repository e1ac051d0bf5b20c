"""The test side of a job: run a job script with a hard timeout (always reaping every process it started), hand it
its scenario, read back what it wrote, compare parameters."""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers import JOBS, REPO
from helpers.zygote import Zygote


def tiered(names: list[str], slow: set[str]) -> list[Any]:
    """Parameters of a table-driven test: the names in ``slow`` carry the ``slow`` mark (left out of the default
    run; ``pytest -m slow`` runs them). ``slow`` must name cases of the table."""
    unknown = slow - set(names)
    assert not unknown, f"slow cases not in the table: {sorted(unknown)}"
    return [pytest.param(n, marks=[pytest.mark.slow] if n in slow else [], id=n) for n in names]


def read_plans(root: Path) -> list[dict[str, Any]]:
    """Every ``sgdtp_plan.json`` written under ``root`` (next to each run's logs), oldest log version first."""
    return [json.loads(p.read_text()) for p in sorted(root.rglob("sgdtp_plan.json"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    # Never inherited: rank variables (each job sets its own). SGDTP_DEBUG_OPTIONS=1: a job may be a negative
    # control (SGDTPStrategy(debug_skip_sync=...)), when its test says so in its options.
    dropped = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(
        SGDTP_DEBUG_OPTIONS="1",
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


def group_alive(pgid: int) -> bool:
    """Is any process of process group ``pgid`` still running (a job started by :func:`start`: its launcher, its
    ranks, their compile workers)? Zombies (dead, not yet reaped) do not count."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


#: Variables a job may set differently from the zygote's start: read when a job runs, never when torch, Lightning
#: or lightning_sgdtp are imported. Any other difference (an Inductor setting, ``CXX``, a cache folder: read at
#: import) runs the job in a fresh interpreter.
RUNTIME_ONLY = re.compile(r"MASTER_ADDR|MASTER_PORT|NODE_RANK|SGDTP_\w+")
_ZYGOTE: list[Zygote] = []
_ZYGOTE_START = threading.Lock()  # the docs blocks run two at a time: one zygote for both


def zygote_for(env: dict[str, str]) -> Zygote | None:
    """This test process's zygote (``helpers.zygote``), started on first use from ``job_env()``, if a job with
    ``env`` can run in a process forked from it; else None. ``SGDTP_TEST_NO_ZYGOTE=1`` turns it off."""
    if os.environ.get("SGDTP_TEST_NO_ZYGOTE") == "1":
        return None
    with _ZYGOTE_START:
        if not _ZYGOTE or not _ZYGOTE[0].alive():
            _ZYGOTE[:] = [Zygote(job_env())]
            atexit.register(_ZYGOTE[0].close)
    base = _ZYGOTE[0].env
    differ = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}
    return _ZYGOTE[0] if all(RUNTIME_ONLY.fullmatch(k) for k in differ) else None


def run_python(
    args: list[str], env: dict[str, str], timeout: float, merge_stderr: bool = True
) -> tuple[int, str, str, bool]:
    """Run ``python ARGS`` to its end or ``timeout`` s, then kill its whole process group: forked from the zygote when
    ``env`` allows (``zygote_for``: the same script, arguments and environment, without paying the import again),
    else in a fresh interpreter. Returns (exit status, stdout, stderr: "" when merged, timed_out)."""
    zygote = zygote_for(env)
    if zygote is not None:
        return zygote.run(args, env, timeout, merge_stderr)
    proc = start([sys.executable, *args], env, merge_stderr)
    out, err, timed_out = finish(proc, timeout)
    return proc.returncode, out, err, timed_out


def run(cmd: list[str], timeout: float = 420, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` to completion (stderr merged into stdout); a timeout fails the test with the output tail.
    ``python ...`` goes through :func:`run_python`."""
    env = env or job_env()
    if cmd[0] == sys.executable:
        returncode, out, _, timed_out = run_python(cmd[1:], env, timeout)
    else:
        proc = start(cmd, env)
        out, _, timed_out = finish(proc, timeout)
        returncode = proc.returncode
    if timed_out:
        raise AssertionError(f"{cmd} timed out after {timeout}s; output tail:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, returncode, out, None)


def run_job(script: str, *args: str, timeout: float = 420, **env: str) -> subprocess.CompletedProcess:
    """Run ``tests/distributed/jobs/SCRIPT ARGS`` (extra environment variables in ``env``); it must succeed."""
    result = run([sys.executable, str(JOBS / script), *args], timeout=timeout, env=job_env(**env))
    assert result.returncode == 0, f"{script} {args} failed (rc={result.returncode}):\n{result.stdout[-6000:]}"
    return result


def run_scenario(
    script: str, scenario: dict[str, Any], out: Path, timeout: float = 600, **env: str
) -> subprocess.CompletedProcess:
    """Write ``scenario`` (plain data: model name, devices, options) to ``OUT/scenario.json`` and run the job script
    on it: ``SCRIPT OUT``. The scenario is defined by the test; the script is the harness that trains it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "scenario.json").write_text(json.dumps(scenario, indent=1))
    return run_job(script, str(out), timeout=timeout, **env)


def load_result(out: Path) -> dict[str, Any]:
    """A job's ``info.json`` with its initial, reference and sgdtp parameters (``init``, ``ref``, ``sgdtp``)."""
    info = json.loads((out / "info.json").read_text())
    info["init"] = torch.load(out / "init.pt")
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


def grad_error(r: dict) -> float:
    """A parity result's first-step gradients against the reference's: ||got - ref|| / ||ref|| over every parameter
    (each must have its gradient somewhere: a pipeline's stages, a tensor-parallel rank's shards, merged)."""
    ref, got = r["ref_grads"], r["grads"]
    assert got.keys() == ref.keys(), sorted(set(ref) ^ set(got))
    num = sum(float((got[k].float() - ref[k].float()).norm() ** 2) for k in ref) ** 0.5
    return num / sum(float(ref[k].float().norm() ** 2) for k in ref) ** 0.5


def assert_parity(name: str, r: dict, grad_tol: float = 1e-4, rel_tol: float = 1e-3) -> tuple[float, float]:
    """The project's parity check of a result against its reference: first-step gradients (:func:`grad_error`) and
    the update of the steps run (:func:`rel_update_diff`) within their tolerances. Returns both."""
    grads = grad_error(r)
    assert grads < grad_tol, f"{name}: first-step gradients differ by {grads:.3g}"
    rel = rel_update_diff(r["init"], r["ref"], r["sgdtp"])
    assert rel < rel_tol, f"{name}: relative update difference {rel:.3g}"
    return grads, rel


PARITY_TENSORS = ("init", "ref", "sgdtp", "ref_grads", "grads")


def negative_control(scenario: dict[str, Any], skip: str) -> dict[str, Any]:
    """``scenario`` with ``SGDTPStrategy(debug_skip_sync=skip)`` in each of its strategy options (a job's
    ``"sgdtp"`` dict or its ``"phases"``): the same run with the sync switched off, which must not match."""
    out = dict(scenario)
    if "sgdtp" in out:
        out["sgdtp"] = {**out["sgdtp"], "debug_skip_sync": skip}
    if "phases" in out:
        out["phases"] = [{**phase, "debug_skip_sync": skip} for phase in out["phases"]]
    return out


def parity_result(
    cache: dict[str, dict],
    script: str,
    name: str,
    scenario: dict[str, Any],
    out: Path,
    json_files: tuple[str, ...] = ("info",),
    **env: str,
) -> dict:
    """Run a parity scenario once per test session (``cache``, by scenario name, keeps what the job wrote: its
    JSON files and tensors, by name, and its output as ``log``): several tests read the same run."""
    if name not in cache:
        result = run_scenario(script, scenario, out, **env)
        cache[name] = {
            "out": out,
            "log": result.stdout,
            **{f: json.loads((out / f"{f}.json").read_text()) for f in json_files},
            **{t: torch.load(out / f"{t}.pt") for t in PARITY_TENSORS},
        }
    return cache[name]
