"""Once a process must end, it ends within seconds: after SIGTERM / SIGINT, and after this rank failed.

Python runs a signal handler only in the main thread, between two bytecodes. A rank blocked inside a collective
(gloo and NCCL wait in C++ for up to ``collective_timeout``, 30 minutes by default) never gets there: Lightning's
SIGTERM handler (which only sets a flag, to stop at the next batch) and ``KeyboardInterrupt`` wait with it, and
``timeout``'s SIGTERM or a Ctrl-C leaves the job hanging. A rank that failed can block the same way on its way
out (a teardown collective, a process group destroyed with work in flight).

:class:`ShutdownWatchdog` closes that gap with the interpreter's own mechanism, ``signal.set_wakeup_fd``: the
C-level handler writes the signal number to a pipe the moment the signal arrives, whatever the main thread is
doing. A daemon thread reads the pipe; from then on the main thread has ``grace`` seconds to end the ordinary way
(Lightning stops at the next batch, tears down, prints its traceback). If the process is still alive after that,
the thread tells the peers (the failure report of :mod:`lightning_sgdtp.runtime.faults`: they end within seconds,
naming this rank), prints why on stderr and ends the process with ``os._exit`` (128 + the signal; 1 after a
failure). A failed rank starts the same countdown from :meth:`ShutdownWatchdog.failed`, and at interpreter exit
it leaves at once (:func:`_leave_failed_at_exit`): its traceback is printed by then, and nothing it could still do is
worth a hang.

The preemption signal (``SIGUSR1`` by default, see :mod:`lightning_sgdtp.runtime.preemption`) is not watched: it asks for
a checkpoint, not an end.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from lightning_sgdtp.runtime.process_bound import ProcessBound

log = logging.getLogger("lightning.pytorch.sgdtp")

#: Seconds the main thread has to end on its own after SIGTERM / SIGINT or after this rank failed.
DEFAULT_GRACE = 10.0
WATCHED = (signal.SIGTERM, signal.SIGINT)


class ShutdownWatchdog(ProcessBound):
    """See the module docstring. ``where()`` says what the rank is doing (for the message); ``tell_peers(text)``
    reports the failure to the other ranks."""

    def __init__(
        self,
        rank: int,
        where: Callable[[], str] = lambda: "",
        tell_peers: Callable[[str], None] = lambda text: None,
        grace: float = DEFAULT_GRACE,
        ignore: tuple[int, ...] = (),
    ) -> None:
        self.rank, self.where, self.tell_peers, self.grace = rank, where, tell_peers, grace
        self.watched = tuple(s for s in WATCHED if s not in ignore)
        self._deadline: float | None = None
        self._reason = ""
        self._code = 1
        self._wake = threading.Event()
        self._read_fd = self._write_fd = -1

    # ------------------------------------------------------------------------------------------- start
    def install(self) -> bool:
        """Watch the signals (main thread only; False where that is not possible: another thread, or a wakeup fd
        already taken, e.g. by asyncio). The countdown of :meth:`failed` works either way."""
        self._start_thread(self._countdown, "sgdtp-shutdown")
        if threading.current_thread() is not threading.main_thread() or not self.watched:
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd), os.close(write_fd)
            return False
        if previous != -1:  # someone else's: give it back, do not steal it
            signal.set_wakeup_fd(previous)
            os.close(read_fd), os.close(write_fd)
            return False
        self._read_fd, self._write_fd = read_fd, write_fd
        self._start_thread(self._read_signals, "sgdtp-signals")
        return True

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        threading.Thread(target=target, name=name, daemon=True).start()

    def close(self) -> None:
        """At the end of teardown: stop watching signals, and stop a failure's countdown (the main thread made it
        through teardown: the error is on its way to the caller). A signal's countdown keeps running."""
        if self._code == 1:
            self._deadline = None
        if self._write_fd != -1:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(-1)
            os.close(self._write_fd)  # the reader sees EOF and stops
            self._write_fd = -1

    # ---------------------------------------------------------------------------------------- triggers
    def _read_signals(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                os.close(self._read_fd)
                return
            for signum in data:
                if signum in self.watched:
                    name = signal.Signals(signum).name
                    self._arm(f"received {name}", 128 + signum)

    def failed(self, error: BaseException) -> None:
        """This rank failed: start the countdown, and leave at once at interpreter exit."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        self._arm(f"failed ({type(error).__name__}: {first[:300]})", 1)
        _leave_failed_at_exit()

    def _arm(self, reason: str, code: int) -> None:
        if self._deadline is None:
            self._reason, self._code = reason, code
            self._deadline = time.monotonic() + self.grace
            self._wake.set()

    # ----------------------------------------------------------------------------------------- the end
    def _countdown(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while self._deadline is not None and time.monotonic() < self._deadline:
                time.sleep(min(0.2, max(0.0, self._deadline - time.monotonic())))
            if self._deadline is not None:
                break
            # settled (teardown finished after a failure): wait for the next reason to end
        where = ""
        with contextlib.suppress(Exception):
            where = self.where()
        message = (
            f"sgdtp: rank {self.rank} {self._reason} {self.grace:.0f} s ago and is still running"
            f"{f' ({where})' if where else ''}: it is blocked (a collective waits for a peer that will not come, or"
            f" teardown). Ending it now with exit code {self._code}, and telling the other ranks."
        )
        with contextlib.suppress(Exception):
            self.tell_peers(f"rank {self.rank} {self._reason}")
        with contextlib.suppress(Exception):
            log.error(message)
            print(message, file=sys.stderr, flush=True)
            sys.stdout.flush()
        os._exit(self._code)


_LEAVE_HOOK: list[bool] = []


def _leave_failed_at_exit() -> None:
    """Registered when a rank fails (so it runs first at exit). If the error ended the program (uncaught: Python
    has printed its traceback and set ``sys.last_value``), flush and leave without destroying anything; if the
    caller caught it, let the interpreter exit as usual."""
    if _LEAVE_HOOK:
        return
    _LEAVE_HOOK.append(True)

    def leave() -> None:
        if getattr(sys, "last_value", None) is None:
            return
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(1)

    atexit.register(leave)


def leave_process_group(meet: bool = True, timeout: float = 30.0) -> None:
    """At the end of a run, while Python is still alive: meet the peers (bounded), then destroy the default process
    group. Left to the interpreter, the process group and its store are freed while it finalizes, when a thread that
    returns from a c10d call and asks for the GIL is ended by ``pthread_exit``, whose unwinding through C++ calls
    ``std::terminate`` ("terminate called without an active exception", exit -6) after a successful run (the fault
    guard's heartbeat, ``docs/fabric.md``; gloo's work after pipeline training, ``engine/pipelined.py``). The
    barrier (``meet``; not after a failure) keeps a rank from closing its connections while a peer still finishes its
    last collective; a peer that is gone or busy elsewhere costs at most ``timeout``, and any failure is ignored (the
    run is over)."""
    from datetime import timedelta

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(Exception):
        if meet and dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
