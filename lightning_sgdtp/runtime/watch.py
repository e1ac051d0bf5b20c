"""What the heartbeat thread sees of its own rank and of its peers: the two verdicts no collective can give.

- **Frozen or lost** (:meth:`PeerWatch.silent`): a peer whose heartbeat has not changed for ``heartbeat_timeout``
  seconds (SIGSTOP, a hung driver call that holds the GIL, a swapped-out or stalled node, a node gone) while it
  neither finished nor reported a failure. Seconds, whatever ``collective_timeout`` is.
- **Stuck** (:meth:`MainThread.stuck`): this rank's main thread runs Python (its frame moves) without leaving its
  phase and step for ``stall_timeout`` seconds, while a peer has waited, blocked in a C call (a collective), for as
  long. The rank judges itself, so that it can print its own main thread's stack.

Long phases are not stuck: compiling (TorchDynamo or Inductor on the main thread's stack, whoever called
``torch.compile``), loading or saving a checkpoint, setting up, and the first step of the process (which also
initializes communicators and allocators). They are reported as such once, not ended.

Sampling the main thread is Python's own, cheap introspection (``sys._current_frames``), done by the heartbeat
thread between its beats: nothing runs on the training step's path.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Files only on the stack while a graph compiles (TorchDynamo's frame conversion, Inductor's compile, a pipeline
#: split's trace); at run time a compiled graph is entered through eval_frame and output_code instead.
COMPILE_FILES = (
    "torch/_dynamo/convert_frame.py",
    "torch/_inductor/compile_fx.py",
    "torch/distributed/pipelining/_IR.py",
    "torch/export/",
)

#: Phases (the fault guard's names) that legitimately run long with no collective, and what a user reads.
PATIENT_PHASES = {
    "setup": "setting up",
    "checkpoint": "saving or loading a checkpoint",
    "save_pretrained": "saving the weights",
    "full_state_dict": "gathering the weights",
    "gather pipeline stages": "gathering the weights",
    "measuring the link": "measuring the links",
}

#: Each rank watches this many peers on each side of it on the ring of ranks (all of them in smaller jobs): the
#: store then serves O(world) reads a beat, not O(world^2); a verdict reaches the others through the store.
NEIGHBOURS = 4


def watched(rank: int, world_size: int) -> list[int]:
    """The peers ``rank`` reads the heartbeats of."""
    if world_size <= 2 * NEIGHBOURS + 1:
        return [r for r in range(world_size) if r != rank]
    return sorted({(rank + d) % world_size for d in range(-NEIGHBOURS, NEIGHBOURS + 1) if d})


def patience(phase: str, stack: Iterable[str], settled: bool) -> str | None:
    """Why a rank may stay long in ``phase`` without being stuck, or ``None``. ``stack``: the files of its main
    thread's frames; ``settled``: it has finished its first optimizer step."""
    if any(marker in name for name in stack for marker in COMPILE_FILES):
        return "compiling"
    for key, reason in PATIENT_PHASES.items():
        if phase.startswith("in ") and key in phase:  # inside it, not after it
            return reason
    return None if settled else "in its first step"


@dataclass
class MainThread:
    """Samples the main thread from the heartbeat thread: does it run Python, since when has its position (phase,
    step) not changed, may it take long (:func:`patience`).

    Running Python is two measurements at once, each cheap: the thread's CPU clock advances (``pthread_getcpuclockid``)
    and it holds the GIL (the heartbeat thread's own wake-up is late by about the interpreter's switch interval,
    ``sys.getswitchinterval()``, when it must take the GIL from a running thread). A rank waiting in a collective
    fails one of them: blocked, no CPU; spinning in a CUDA synchronization, the GIL released. (Which Python line
    it is at is no sign: another thread samples it only where the interpreter hands over the GIL, the same place
    each time.)"""

    ident: int = field(default_factory=lambda: threading.main_thread().ident or 0)
    position: tuple[str, int] = ("", -1)
    position_since: float = field(default_factory=time.monotonic)
    moved_at: float = field(default_factory=time.monotonic)
    _cpu: float | None = None
    _wall: float | None = None
    _recent: list[bool] = field(default_factory=list)

    def frame(self) -> Any:
        return sys._current_frames().get(self.ident)

    def _cpu_time(self) -> float | None:
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.ident))
        except (OSError, AttributeError, OverflowError):  # not on this platform, or the thread is gone
            return None

    def sample(self, position: tuple[str, int], now: float, late: float) -> None:
        """``late``: how much later than asked the heartbeat thread woke up (seconds)."""
        if position != self.position:
            self.position, self.position_since, self.moved_at = position, now, now
        cpu = self._cpu_time()
        if cpu is not None and self._cpu is not None and self._wall is not None and now > self._wall:
            # a quarter of a core: a waiting rank uses none, a running one all it gets on a shared machine
            busy = (cpu - self._cpu) / (now - self._wall) >= 0.25
            self._recent = [*self._recent[-3:], busy and late >= 0.5 * sys.getswitchinterval()]
        self._cpu, self._wall = cpu, now
        if sum(self._recent) >= 2:
            self.moved_at = now

    def idle(self, now: float) -> float:
        """Seconds in the same phase and step."""
        return now - self.position_since

    def blocked(self, now: float) -> float:
        """Seconds in the same phase and step without running Python (a C call: a collective, a sleep)."""
        return now - max(self.position_since, self.moved_at)

    def running(self) -> bool:
        """The main thread ran Python in most of the last samples."""
        return sum(self._recent) >= 3

    def files(self) -> list[str]:
        frame, names = self.frame(), []
        while frame is not None:
            names.append(frame.f_code.co_filename.replace(os.sep, "/"))
            frame = frame.f_back
        return names

    def stack(self) -> str:
        """The main thread's Python stack, most recent call last (``traceback`` over ``sys._current_frames``)."""
        frame = self.frame()
        return "".join(traceback.format_stack(frame)) if frame is not None else "(no Python frame)\n"


@dataclass
class Sighting:
    """What a peer's heartbeats looked like: its last beat, and when (this rank's clock) its sequence last changed."""

    beat: dict[str, Any]
    seq: int
    since: float


class PeerWatch:
    """The watched peers' heartbeats, read each beat (one ``multi_get``): who has been silent too long."""

    def __init__(self, peers: list[int], heartbeat_timeout: float | None) -> None:
        self.peers, self.heartbeat_timeout = peers, heartbeat_timeout
        self.seen: dict[int, Sighting] = {}
        self.started = time.monotonic()

    def update(self, beats: dict[int, dict[str, Any] | None], now: float) -> None:
        for rank, beat in beats.items():
            if beat is None:
                continue
            last = self.seen.get(rank)
            if last is None or beat.get("seq") != last.seq:
                self.seen[rank] = Sighting(beat, beat.get("seq", -1), now)

    def silent(self, now: float) -> list[tuple[int, float, dict[str, Any]]]:
        """(rank, seconds of silence, last beat) of each watched peer silent for ``heartbeat_timeout`` s that did not
        finish or report a failure; a peer never seen counts from the start of the watch."""
        if self.heartbeat_timeout is None:
            return []
        out = []
        for rank in self.peers:
            sighting = self.seen.get(rank)
            beat = sighting.beat if sighting else {}
            quiet = now - (sighting.since if sighting else self.started)
            if quiet >= self.heartbeat_timeout and not beat.get("done") and not beat.get("failed"):
                out.append((rank, quiet, beat))
        return out

    def waiting(self, bound: float) -> list[tuple[int, dict[str, Any]]]:
        """The peers whose last beat says they have been blocked in the same phase and step for ``bound`` s."""
        return [
            (rank, s.beat)
            for rank, s in self.seen.items()
            if s.beat.get("blocked", 0) >= bound and not s.beat.get("done")
        ]


def kill_if_frozen(pid: int, host: str) -> bool:
    """SIGKILL a frozen peer on this host (stopped, or in an uninterruptible wait) that runs this same program: a
    stopped process ignores SIGTERM and would keep its memory and devices forever. True when signalled."""
    if host != socket.gethostname() or pid <= 1 or pid == os.getpid():
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        same_program = os.readlink(f"/proc/{pid}/exe") == os.readlink("/proc/self/exe")
    except OSError:
        return False
    if state not in ("T", "t", "D") or not same_program:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True
