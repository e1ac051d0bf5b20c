"""Nothing hangs, in any mode: a failure on one rank, or a signal to the launching process, ends every process of the
job within seconds, with a non-zero exit code, the error and its rank shown, and no process left behind.

``jobs/zoo_fault.py`` trains a zoo model (transformers Llama in the pipeline, the MHA model elsewhere) with the *default*
``collective_timeout`` (1800 s), started the way users start it: ``python script.py`` with ``devices=N``
(Lightning's launcher starts ranks 1.. as children of rank 0). Measured on the 2-core machine (failure -> last
process gone): see ``BOUND`` and the closing note of issue 14. Before the fix a failure inside a pipeline stage
left both ranks in the teardown barrier for ``collective_timeout``, and SIGTERM did not end them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.launch import JOBS, finish, group_alive, job_env, start, tiered

BOUND = 60.0  # seconds from the failure (or the signal) to the last process of the job gone (issue 14)
STARTUP = 420.0  # compile and first steps, on 2 busy cores

# Data and the 4-rank modes run the zoo's nn.MultiheadAttention model: the same failure paths at a third of the
# compile time of Llama on 2 cores (the suite's budget); the pipeline (the reported hang) runs transformers Llama.
MODES: dict[str, dict[str, Any]] = {
    "data": {"devices": 2, "sgdtp": {}, "model": "mha"},
    "hybrid": {"devices": 4, "sgdtp": {"parallelism": "hybrid", "tensor_parallel_size": 2}, "model": "mha"},
    "pipeline": {"devices": 2, "sgdtp": {"pipeline_stages": 2, "pipeline_chunks": 4}, "batch": 8},
    # a Fabric loop (issue 27): Fabric has no on_exception hook; the strategy reports an uncaught error itself
    "fabric": {"devices": 2, "sgdtp": {}, "model": "mha", "front": "fabric"},
    "fabric_rank0": {"devices": 2, "sgdtp": {}, "model": "mha", "front": "fabric", "fail_rank": 0},
    "pipeline_x_data": {
        "devices": 4,
        "sgdtp": {"pipeline_stages": 2, "pipeline_chunks": 2},
        "batch": 4,
        "model": "mha",
    },
}


def _run_until(
    tmp_path: Path, scenario: dict[str, Any], strike: Any, limit: float = BOUND + 60, left: bool = False
) -> tuple[float, int, str]:
    """Start the job, wait until every rank trains step 1, call ``strike(proc)``: it returns the moment (``time.time``)
    of the failure or signal. Then wait (at most ``limit`` s) for the whole job to end. Returns (seconds to the end,
    exit code, output). ``left``: processes may still run then (a negative control); they are killed."""
    (tmp_path / "scenario.json").write_text(json.dumps({"model": "llama", **scenario}))
    cmd, env = [sys.executable, str(JOBS / "zoo_fault.py"), str(tmp_path)], job_env()
    if scenario.get("launcher") == "torchrun":  # torchrun's agent starts the ranks and hosts the store
        port, _ = env.pop("MASTER_PORT"), env.pop("MASTER_ADDR")
        run = ["-m", "torch.distributed.run", f"--nproc-per-node={scenario['devices']}", "--rdzv-backend=c10d"]
        cmd = [sys.executable, *run, f"--rdzv-endpoint=127.0.0.1:{port}", *cmd[1:]]
    proc = start(cmd, env=env)
    try:
        deadline = time.monotonic() + STARTUP
        while not all((tmp_path / f"step-{r}").exists() for r in range(scenario["devices"])):
            if proc.poll() is not None or time.monotonic() > deadline:
                out, _, _ = finish(proc, 10)
                pytest.fail(f"the job never reached step 1 (rc={proc.returncode}):\n{out[-5000:]}")
            time.sleep(0.2)
        struck = strike(proc)
        while group_alive(proc.pid) and time.time() - struck < limit:
            time.sleep(0.2)
        ended = time.time() - struck
        alive = group_alive(proc.pid)
    finally:
        if left:
            os.killpg(proc.pid, signal.SIGKILL)
        out, _, _ = finish(proc, 10)
    assert left or not alive, f"processes of the job were left behind {ended:.0f} s after the failure:\n{out[-5000:]}"
    return ended, proc.returncode, out


# The default run keeps pipeline; data (a raise in data mode: test_faults.py `raise`, 3 ranks), hybrid and pipeline x
# data (4 ranks, the same guard over a 2-D mesh) and Fabric (the same guard, reached through the strategy's
# excepthook: tests/unit/frontends/test_fabric_faults.py) are slow.
@pytest.mark.parametrize(
    "mode", tiered(list(MODES), slow={"data", "hybrid", "pipeline_x_data", "fabric", "fabric_rank0"})
)
def test_a_failure_on_one_rank_ends_the_job(tmp_path: Path, mode: str) -> None:
    """Rank 1 raises in its step-2 ``training_step`` (in a pipeline: inside the schedule, on the last stage, while
    rank 0 waits in a send/recv); the job writes the moment to ``OUT/struck``."""
    scenario = {"fail_rank": 1, "fail_step": 2, "where": "training_step", **MODES[mode]}

    def strike(proc: Any) -> float:
        marker = tmp_path / "struck"
        while not marker.exists() and proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), "the job ended before the injected failure"
        return float(marker.read_text())

    ended, code, out = _run_until(tmp_path, scenario, strike)
    print(f"{mode}: failure -> last process gone in {ended:.1f} s (rc={code})")
    assert code != 0, out[-4000:]
    assert ended <= BOUND, f"{mode}: the job took {ended:.0f} s to end after the failure:\n{out[-4000:]}"
    rank, where = scenario["fail_rank"], "the loop" if scenario.get("front") == "fabric" else "training_step"
    assert f"InjectedFailure: injected failure in {where} on rank {rank} at step 2" in out, out[-4000:]
    # The other rank names the failed one and its error (RankLostError, or the watchdog's message), unless
    # Lightning's own observer SIGKILLed it first (rc -9: it does so the moment a child exits non-zero).
    if code != -9:
        assert f"rank {rank}" in out and ("RankLostError" in out or "is ending itself" in out), out[-4000:]


#: A rank frozen (SIGSTOP: a hung driver call, a stalled node) never fails a collective; its peers wait in one. The
#: heartbeat's silence ends the job (issue 47): heartbeat_timeout=5 s here (default 15 s: the SLURM test's frozen
#: node); the default collective_timeout (1800 s) is kept. "data_off" is the negative control: detection off.
FROZEN: dict[str, dict[str, Any]] = {
    "data": MODES["data"],
    "sharded": {"devices": 2, "sgdtp": {"sharding": "full"}, "model": "mha"},
    "tensor": {"devices": 2, "sgdtp": {"parallelism": "tensor"}, "model": "mha"},
    "pipeline": MODES["pipeline"],
    "fabric": MODES["fabric"],
    "torchrun": {**MODES["data"], "launcher": "torchrun"},
    "data_off": {**MODES["data"], "sgdtp": {"heartbeat_timeout": False}},
}
FROZEN_BOUND = 30.0  # seconds from the freeze to the last process of the job gone


@pytest.mark.parametrize("mode", tiered(list(FROZEN), slow={"fabric", "torchrun", "data_off"}))
def test_a_frozen_rank_ends_the_job_naming_it(tmp_path: Path, mode: str) -> None:
    """Rank 1 stops itself (SIGSTOP) in its step-2 training step; rank 0 then waits in a collective for it."""
    scenario = {"fail_rank": 1, "fail_step": 2, "where": "freeze", **FROZEN[mode]}
    scenario["sgdtp"] = {"heartbeat_timeout": 5, **scenario["sgdtp"]}
    off = scenario["sgdtp"]["heartbeat_timeout"] is False

    def strike(proc: Any) -> float:
        marker = tmp_path / "struck"
        while not marker.exists() and proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), "the job ended before the freeze"
        time.sleep(0.1)
        return float(marker.read_text())

    ended, code, out = _run_until(tmp_path, scenario, strike, limit=FROZEN_BOUND + (0 if off else 30), left=off)
    print(f"{mode}: freeze -> last process gone in {ended:.1f} s (rc={code})")
    if os.environ.get("SGDTP_TEST_SHOW"):  # the saved runs the docs quote (benchmarks/results/faults_*.txt)
        print(out[-4000:])
    victim = int((tmp_path / "step-1").read_text())
    if off:  # without the heartbeat's verdict the job waits for collective_timeout (1800 s)
        assert ended >= FROZEN_BOUND and "is frozen or lost" not in out, out[-4000:]
        return
    assert code != 0 and ended <= FROZEN_BOUND, f"{mode}: ended after {ended:.0f} s (rc={code}):\n{out[-4000:]}"
    named = f"rank 1 (host {os.uname().nodename}, pid {victim}) is frozen or lost: no heartbeat for"
    # where its last heartbeat was: "in training_step at step 1", "after optimizer_step ..." when it froze within a
    # beat of entering its phase (a pipeline's last stage was once last seen at step 0: see issue 47's note)
    assert named in out and re.search(r"last seen (in|after) \w+ at step \d+", out), out[-4000:]


@pytest.mark.parametrize("signum", [signal.SIGTERM])
def test_a_signal_to_the_launcher_ends_the_job_while_a_rank_is_blocked(tmp_path: Path, signum: int) -> None:
    """Rank 1 sleeps in its step-2 training_step (outside any collective), so rank 0 blocks inside a pipeline
    collective waiting for it: Python cannot run rank 0's signal handler. The launcher (rank 0) is signalled."""
    scenario = {**MODES["pipeline"], "fail_rank": 1, "fail_step": 2, "where": "hang"}

    def strike(proc: Any) -> float:
        time.sleep(3.0)  # rank 1 is asleep in step 2 and rank 0 blocked in the schedule by now
        os.kill(proc.pid, signum)
        return time.time()

    ended, code, out = _run_until(tmp_path, scenario, strike)
    print(f"{signal.Signals(signum).name}: signal -> last process gone in {ended:.1f} s (rc={code})")
    assert code != 0, out[-4000:]
    assert ended <= BOUND, f"the job took {ended:.0f} s to end after {signal.Signals(signum).name}:\n{out[-4000:]}"
    assert f"received {signal.Signals(signum).name}" in out, out[-4000:]
