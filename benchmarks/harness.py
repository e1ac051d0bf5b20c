"""What the benchmarks share: ports, versions, the checkout's commit, CPU load, formatting.

Imported by the benchmark scripts (``python benchmarks/NAME.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Trainer arguments every benchmark run shares: no logging, checkpoints, progress bar, summary or validation.
QUIET_TRAINER = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "limit_val_batches": 0,
}


def run_reaped(cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float) -> int | None:
    """Run a worker in its own session with its output in ``log``; on exit or timeout kill the whole session (rank
    1, Lightning's child, and any compile workers). Returns the exit code, None on timeout."""
    import os
    import signal

    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return rc


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark's worker job: this one without another job's rank variables, a fresh
    127.0.0.1 rendezvous, the checkout on ``PYTHONPATH``, then ``extra``."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
    )
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def version(dist_name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist_name)
    except PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit of this checkout (``+dirty`` when lightning_sgdtp/ has uncommitted changes)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, check=False)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "lightning_sgdtp"], cwd=REPO, capture_output=True, check=False
        )
    except OSError:
        return None
    return (head.stdout.decode().strip() + ("+dirty" if dirty.stdout.strip() else "")) or None


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy over the next ``seconds`` (Linux /proc/stat; 0.0 elsewhere)."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields[:8]), fields[3] + fields[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, 1.0 - (i1 - i0) / max(1, t1 - t0))


def frames_compiled() -> int:
    """How many frames Dynamo has compiled in this process so far (proof that a compiled variant compiled)."""
    from torch._dynamo.utils import compilation_time_metrics

    return len(compilation_time_metrics.get("_compile.compile_inner", []))


def median_ms(values: list[float]) -> float | None:
    return 1e3 * statistics.median(values) if values else None
