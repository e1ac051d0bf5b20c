"""Preemption on SLURM: checkpoint at a step boundary that every rank agrees on, requeue, stop.

SLURM warns a job before its time limit or preemption with a signal (``#SBATCH --signal=SIGUSR1@90``).
Lightning's own handler saves a checkpoint *inside* the signal handler, at whatever point each rank happens to
be: with collectives in flight, ranks that get the signal in different steps wait on each other, or save
different steps. Here the handler only raises a flag (:class:`PreemptionSignal`); the ranks OR their flags in
the all-reduce they already run before every backward (the ledger's agreement), so all of them learn it in the
same step; at the end of that step they save Lightning's ``hpc_ckpt_N.ckpt`` together, rank 0 requeues the job
(:func:`requeue_slurm_job`) and every rank stops. When SLURM starts the job again, Lightning resumes from that
checkpoint on its own (``trainer.fit(..., ckpt_path=None)`` under SLURM).

A Fabric loop has no step-end hook: it asks at the end of each step (``fabric.strategy.requeue_if_agreed(path,
state)``), and the same :meth:`PreemptionCoordinator.save_and_requeue` saves its ``state`` to ``path``, requeues and
stops; the loop loads ``path`` when the job starts again (``docs/fabric.md``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from lightning_sgdtp.runtime.process_bound import ProcessBound


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is saved and the job requeued: a clean exit (0)."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message

    def __str__(self) -> str:
        return self.message


class PreemptionSignal:
    """Remembers that ``signum`` arrived. The handler only sets a flag, which is safe at any point of a step."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def install(self) -> None:
        self._previous = signal.signal(self.signum, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed and signal.getsignal(self.signum) == self._handle:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
        self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def slurm_job_id() -> str | None:
    """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for array jobs, else ``SLURM_JOB_ID``."""
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and task:
        return f"{array_job}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job(timeout: float = 60.0) -> tuple[bool, str]:
    """Run ``scontrol requeue`` for this job. Returns (done, what happened, for the log)."""
    job = slurm_job_id()
    if job is None:
        return False, "no SLURM_JOB_ID in the environment"
    try:
        result = subprocess.run(
            ["scontrol", "requeue", job], check=False, capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol requeue {job} failed: {exc}"
    if result.returncode != 0:
        return False, f"scontrol requeue {job} failed (rc={result.returncode}): {result.stderr.strip()}"
    return True, f"job {job} requeued"


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or detached: nothing to flush
            pass


class PreemptionCoordinator(ProcessBound):
    """The ranks' agreement on a preemption signal, and what they do at the end of the agreed step.

    The flag travels in an all-reduce that runs anyway (the ledger's agreement before backward,
    :meth:`agree`); where none runs (the pipelined step), :meth:`agree_over_world` runs a small one.
    """

    def __init__(self, signum: int) -> None:
        self.signal = PreemptionSignal(signum)
        self.signal.install()  # before Lightning's signal connector runs: it sees a handler and adds none of its own
        #: Every rank has learned that some rank got the signal: stop at the end of this step.
        self.agreed = False

    @property
    def signum(self) -> int:
        return self.signal.signum

    @property
    def requested(self) -> bool:
        """This rank got the signal (the others may not know yet)."""
        return self.signal.requested

    def agree(self, any_rank_asked: bool) -> None:
        self.agreed = self.agreed or any_rank_asked

    def agree_over_world(self) -> None:
        """One MAX all-reduce of this rank's flag over every rank (a collective)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.agree(bool(flag.item()))

    def preempt(self, trainer: Any, broadcast: Any, rank: int, say: Any) -> None:
        """The Trainer's: at the end of the agreed step, save Lightning's ``hpc_ckpt_N.ckpt`` (every rank), requeue
        (rank 0), stop; Lightning resumes from it when SLURM starts the job again."""
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        path = broadcast(path)  # rank 0's name, in case the ranks see the folder differently
        self.save_and_requeue(path, lambda: trainer.save_checkpoint(path), trainer.global_step, broadcast, rank, say)

    def save_and_requeue(
        self, path: str, save: Callable[[], None], step: int, broadcast: Any, rank: int, say: Any
    ) -> None:
        """At the end of the agreed step, on every rank: ``save()`` the preemption checkpoint (at ``path``, the same
        on every rank), requeue the job (rank 0) and stop (:class:`Preempted`, exit code 0). If ``scontrol requeue``
        fails, the checkpoint stays and training goes on."""
        self.agreed = False
        save()
        # Say it before the requeue: `scontrol requeue` ends this job's tasks within seconds, and a line written
        # after it can be lost (seen in CI: the requeued job's log lacked it).
        job = slurm_job_id()
        message = f"sgdtp: preempted at step {step}: checkpoint saved to {path}; requeueing job {job}; stopping"
        if job is not None:
            say(message.removeprefix("sgdtp: "))
        _flush_output()
        done, what = requeue_slurm_job() if rank == 0 else (False, "")
        done, what = broadcast((done, what))
        if not done:
            say(f"preemption signal: checkpoint saved to {path}, but {what}; training goes on")
            self.signal.requested = False
            return
        say(what)
        _flush_output()
        raise Preempted(message)

    def close(self) -> None:
        self.signal.uninstall()
