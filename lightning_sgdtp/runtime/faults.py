"""Bounded failure: when a rank dies, raises or hangs, every other rank ends with an error that names it.

``torch.distributed`` detects the failure: gloo and NCCL raise when a peer's connection closes, or after the
process-group timeout (``collective_timeout``). What they cannot say is *which* rank is to blame, and a rank
that is stuck outside any collective never learns that the job is over. Both are this module's job, built on
the job's own c10d ``TCPStore`` (the rendezvous store):

- every rank runs a heartbeat thread that writes ``(sequence, phase, step)`` to the store each ``interval``;
- a rank that fails reports its error to the store (``report``);
- when a collective fails, :meth:`Liveness.diagnose` reads the peers' heartbeats and reports and names the
  ranks that *failed* (reported an error), were *lost* (no heartbeat and no report: killed, out of memory, node
  down) or are *stuck* (alive, but not in the collective);
- a rank whose peers have reported a failure ends itself after a grace period, as NCCL's watchdog does, so
  that no process of a dead job is left behind;
- while the job runs, the heartbeat thread also watches: a peer silent for ``heartbeat_timeout`` s is frozen or lost
  (every rank ends, naming it), and a rank whose main thread runs Python without leaving its phase for
  ``stall_timeout`` s while a peer waits is stuck (it prints its stack and ends; the others end naming it). What it
  sees and how it judges: :mod:`lightning_sgdtp.runtime.watch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_sgdtp.runtime.process_bound import ProcessBound
from lightning_sgdtp.runtime.watch import MainThread, PeerWatch, kill_if_frozen, patience, watched

log = logging.getLogger("lightning.pytorch.sgdtp")

# What a store operation raises when the store's host is gone (DistError and DistNetworkError are RuntimeErrors).
_STORE_ERRORS = (RuntimeError, OSError, ValueError)


#: Seconds a rank whose peer reported a failure waits to fail on its own before its watchdog ends it.
FAILURE_GRACE = 5.0


def end_process(code: int) -> None:
    """End this process now, from any thread (``os._exit``: the main thread may be blocked in C)."""
    os._exit(code)


class RankLostError(RuntimeError):
    """Another rank of the job failed, was lost or is stuck; this rank stops too. The message names it."""


class RankStuckError(RuntimeError):
    """This rank ran Python in one phase and step for ``stall_timeout`` s while a peer waited for it."""


@dataclass(frozen=True)
class PeerState:
    rank: int
    host: str = "?"
    pid: int = -1
    seq: int = -1
    phase: str = "starting"
    step: int = -1
    failure: str | None = None
    primary: bool = True
    done: bool = False

    def where(self) -> str:
        return f"{self.phase} at step {self.step}" if self.step >= 0 else self.phase

    def position(self) -> tuple[str, int]:
        return self.phase, self.step

    def who(self) -> str:
        return f"rank {self.rank} (host {self.host}, pid {self.pid})"

    @classmethod
    def read(cls, rank: int, fields: dict[str, Any]) -> PeerState:
        """A peer's state from what it wrote to the store (its beat, failure and done records merged); a field it
        has not written keeps its default."""
        return cls(rank, **{f.name: fields[f.name] for f in dataclasses.fields(cls)[1:] if f.name in fields})


def is_distributed_error(exc: BaseException) -> bool:
    """A collective or the store failed (as opposed to an error in this rank's own code)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    # gloo's timeout inside a compiled graph's wait_tensor reads "Application timeout caused pair closure"
    markers = ("gloo", "NCCL", "c10d", "ProcessGroup", "pair closure", "Connection closed by peer")
    return isinstance(exc, RuntimeError) and any(s in text for s in markers)


class Liveness(ProcessBound):
    """Heartbeats, failure reports and the watchdog for one rank. See the module docstring."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        job_key: str,
        collective_timeout: float,
        heartbeat_timeout: float | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.prefix = f"sgdtp/liveness/{job_key}"
        self.collective_timeout = collective_timeout
        self.heartbeat_timeout, self.stall_timeout = heartbeat_timeout, stall_timeout
        self.interval = max(0.2, min(1.0, collective_timeout / 4, (heartbeat_timeout or 5.0) / 5))
        self.store_timeout = max(2.0, 2 * self.interval)  # what one store operation may wait
        # A rank whose peers reported a failure has this long to fail on its own (with its own, better, message);
        # then its watchdog ends it. Seconds, not collective_timeout: the job has failed, waiting buys nothing.
        self.grace = min(collective_timeout, FAILURE_GRACE) + 2 * self.interval
        self.phase = "in setup"
        self.step = -1
        self.settled = False  # the first optimizer step of this process is done (FaultGuard)
        self.main = MainThread()
        self.watch = PeerWatch(sorted({0, *watched(rank, world_size)} - {rank}), heartbeat_timeout)
        self._said_patient: tuple[str, int] | None = None
        self._seq = 0
        self._reported = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._me = {"host": socket.gethostname(), "pid": os.getpid()}

    # ------------------------------------------------------------------------------------------- store
    def _client(self) -> dist.TCPStore:
        timeout = timedelta(seconds=self.store_timeout)
        return dist.TCPStore(self.host, self.port, is_master=False, timeout=timeout, wait_for_workers=False)

    def _key(self, what: str, rank: int | None = None) -> str:
        return f"{self.prefix}/{what}" + (f"/{rank}" if rank is not None else "")

    def _beat(self, store: dist.TCPStore, done: bool = False) -> None:
        self._seq += 1
        now = time.monotonic()
        value = {**self._me, "seq": self._seq, "phase": self.phase, "step": self.step, "done": done}
        value["blocked"] = round(self.main.blocked(now), 1)
        store.set(self._key("beat", self.rank), json.dumps(value))

    def _read_beats(self, store: dist.TCPStore) -> dict[int, dict[str, Any] | None]:
        """The watched peers' last beats (one ``multi_get`` once every peer has beaten)."""
        ranks = self.watch.peers
        keys = [self._key("beat", r) for r in ranks]
        if not store.check(keys):
            present = [(r, k) for r, k in zip(ranks, keys) if store.check([k])]
            values = dict(zip([r for r, _ in present], store.multi_get([k for _, k in present]) if present else []))
        else:
            values = dict(zip(ranks, store.multi_get(keys)))
        return {r: (json.loads(values[r]) if r in values else None) for r in ranks}

    # ------------------------------------------------------------------------------------------ thread
    def start(self) -> None:
        self.main = MainThread(ident=threading.get_ident())  # the thread that trains
        store = self._client()
        self._beat(store)
        self._thread = threading.Thread(target=self._run, args=(store,), name="sgdtp-liveness", daemon=True)
        self._thread.start()

    def _run(self, store: dist.TCPStore) -> None:
        failed_since: float | None = None
        failures = 0
        last_beat, published = time.monotonic(), (self.phase, self.step)
        store_ok = time.monotonic()
        while True:
            asked = time.monotonic()
            if self._stop.wait(self.interval / 4):
                break
            now = time.monotonic()
            # Sampled each wake: a late wake-up is the GIL held by a running main thread (watch.MainThread).
            self.main.sample((self.phase, self.step), now, late=now - asked - self.interval / 4)
            # Beat every interval, and as soon as the main thread enters a new phase: peers then see where we are.
            if now - last_beat < self.interval and (self.phase, self.step) == published:
                continue
            last_beat, published = now, (self.phase, self.step)
            try:
                self._beat(store)
                failures = int(store.add(self._key("failures"), 0))
                self.watch.update(self._read_beats(store), time.monotonic())
                store_ok = time.monotonic()
            except _STORE_ERRORS as exc:  # the store is gone: after a failure, the grace period still runs
                log.debug(f"sgdtp: heartbeat of rank {self.rank} failed: {exc}")
            if self._reported or self._stop.is_set():
                continue
            self._judge(store, time.monotonic(), store_ok, stall=failures == 0)
            if failures == 0:
                continue
            failed_since = failed_since or time.monotonic()
            if time.monotonic() - failed_since > self.grace:
                self._end_stuck_rank(store)

    # ---------------------------------------------------------------------------------------------- judge
    def _judge(self, store: dist.TCPStore, now: float, store_ok: float, stall: bool) -> None:
        """The two verdicts of :mod:`~lightning_sgdtp.runtime.watch`: a silent peer (or a silent store) ends this
        rank naming it; while no failure is known (``stall``), this rank stuck ends it with its stack."""
        silent = [s for s in self.watch.silent(now) if not self._has_reported(store, s[0])]
        store_quiet = now - store_ok
        if not silent and self.heartbeat_timeout is not None and store_quiet >= self.heartbeat_timeout:
            last = self.watch.seen.get(0)
            if not (last and last.beat.get("done")):
                silent = [(0, store_quiet, {**(last.beat if last else {}), "store": True})]
        if silent:
            self._end_for_silence(store, silent)
        if not stall or self.stall_timeout is None or self.main.idle(now) < self.stall_timeout:
            return
        if not self.main.running():
            return
        waiting = [(r, b) for r, b in self.watch.waiting(self.stall_timeout) if r != self.rank]
        if not waiting:
            return
        reason = patience(self.phase, self.main.files(), self.settled)
        if reason is None:
            self._end_as_stuck(store, now, waiting)
        elif self._said_patient != (self.phase, self.step):
            self._said_patient = (self.phase, self.step)
            message = (
                f"sgdtp: rank {self.rank} has been {reason} for {self.main.idle(now):.0f} s ({self.phase} at step"
                f" {self.step}) while {_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''} for it: not stuck,"
                f" stall_timeout={self.stall_timeout:g} s does not apply while {reason}."
            )
            print(message, file=sys.stderr, flush=True)
            log.warning(message)

    def _has_reported(self, store: dist.TCPStore, rank: int) -> bool:
        """``rank`` reported a failure itself (then silence is its exit, not a freeze); a verdict another rank wrote
        for it (``by``) does not count: this rank sees the silence too and ends at once."""
        try:
            key = self._key("failed", rank)
            return bool(store.check([key])) and "by" not in json.loads(store.get(key))
        except _STORE_ERRORS:
            return False

    def _end_for_silence(self, store: dist.TCPStore, silent: list[tuple[int, float, dict[str, Any]]]) -> None:
        parts = []
        for rank, quiet, beat in silent:
            peer = PeerState.read(rank, beat)
            who, where = peer.who(), peer.where()
            what = "the rendezvous store it hosts does not answer" if beat.get("store") else "no heartbeat"
            parts.append(
                f"{who} is frozen or lost: {what} for {quiet:.0f} s (heartbeat_timeout={self.heartbeat_timeout:g} s),"
                f" last seen {where}"
            )
            failure = {**beat, "failure": f"frozen or lost: {what} for {quiet:.0f} s", "primary": True, "by": self.rank}
            with contextlib.suppress(*_STORE_ERRORS):
                store.set(self._key("failed", rank), json.dumps({**failure, "phase": beat.get("phase", "starting")}))
                store.add(self._key("failures"), 1)
            if kill_if_frozen(int(beat.get("pid", -1)), str(beat.get("host", ""))):
                parts[-1] += " (SIGKILLed: it ran on this host, stopped)"
        message = (
            f"sgdtp: {'; '.join(parts)}. Rank {self.rank} was {self.phase} at step {self.step} and stops too"
            " (exit code 1). A frozen process (SIGSTOP, a hung driver call, a stalled node) or a lost one (a node"
            " gone) never fails a collective by itself; resume from the last checkpoint (ckpt_path='last')."
        )
        self._leave(store, RankLostError(message), message)

    def _end_as_stuck(self, store: dist.TCPStore, now: float, waiting: list[tuple[int, dict[str, Any]]]) -> None:
        idle = self.main.idle(now)
        me = PeerState(self.rank, self._me["host"], self._me["pid"], phase=self.phase, step=self.step)
        where = me.where()
        message = (
            f"sgdtp: {me.who()} is stuck {where}: its main"
            f" thread has run Python for {idle:.0f} s without leaving it while {_ranks(waiting)} waited in a"
            f" collective (stall_timeout={self.stall_timeout:g} s). Its main thread's stack, most recent call"
            f" last:\n{self.main.stack()}This rank ends (exit code 1) and the others end naming it. If the work is"
            " expected (a long evaluation on one rank), raise stall_timeout, or set it to False."
        )
        self._leave(
            store, RankStuckError(f"stuck {where} for {idle:.0f} s (stall_timeout={self.stall_timeout:g} s)"), message
        )

    def _leave(self, store: dist.TCPStore, error: BaseException, message: str) -> None:
        """Print the verdict, report it, keep the store up for the peers (rank 0), end the process."""
        print(message, file=sys.stderr, flush=True)
        log.error(message)
        self.report(error, primary=isinstance(error, RankStuckError))
        end_process(1)

    def _end_stuck_rank(self, store: dist.TCPStore) -> None:
        try:
            peers = self._read_peers(store)
        except _STORE_ERRORS:  # rank 0 has left with the store: the failure was seen, its details are gone
            peers = {}
        blamed = "; ".join(_describe(p) for p in peers.values() if p.failure) or "another rank failed"
        message = (
            f"sgdtp: rank {self.rank} is ending itself: the job has failed ({blamed}) and this rank has not"
            f" failed with it for {self.grace:.0f} s (it is {self.phase} at step {self.step})."
            " Exit code 1, so that the launcher sees the failure and no process is left behind."
        )
        print(message, file=sys.stderr, flush=True)
        log.error(message)
        end_process(1)

    # ------------------------------------------------------------------------------------------ report
    @property
    def reported(self) -> bool:
        """This rank has told the peers that it fails."""
        return self._reported

    def report(self, exc: BaseException, primary: bool) -> None:
        """Tell the peers that this rank fails, and why (``primary``: its own error, not a consequence)."""
        if self._reported:
            return
        self._reported = True
        text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]
        value = {**self._me, "failure": text, "primary": primary, "phase": self.phase, "step": self.step}
        try:
            store = self._client()
            store.set(self._key("failed", self.rank), json.dumps(value))
            store.add(self._key("failures"), 1)
            if self.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
                self._linger(store)
        except _STORE_ERRORS as error:
            log.debug(f"sgdtp: rank {self.rank} could not report its failure: {error}")

    def _linger(self, store: dist.TCPStore) -> None:
        """Rank 0 hosts the store: keep it up until every peer has failed, left or died (bounded by the
        grace period), so that a rank stuck outside a collective reads the failure and ends itself."""
        deadline = time.monotonic() + self.grace + 4 * self.interval
        last = self._read_peers(store)
        quiet_since = {r: time.monotonic() for r in last}
        while time.monotonic() < deadline:
            time.sleep(self.interval / 2)
            now, peers = time.monotonic(), self._read_peers(store)
            for r, p in peers.items():
                if p.seq != last[r].seq:
                    quiet_since[r] = now
            last = peers
            if all(p.failure or p.done or now - quiet_since[r] > 2.5 * self.interval for r, p in peers.items()):
                return

    def close(self) -> None:
        """Stop the heartbeat; after a clean run, tell the peers that this rank left on purpose.

        The thread is joined until its store operations have returned (a beat's two, each bounded by
        ``store_timeout``: a slow or vanished store): a daemon thread that returns from a c10d call while the
        interpreter finalizes is ended by ``pthread_exit``, which aborts the process ("terminate called without an
        active exception", exit -6) after a successful run."""
        self._stop.set()
        if not self._reported:
            try:
                store = self._client()
                self._beat(store, done=True)
                store.set(self._key("done", self.rank), json.dumps({**self._me, "done": True}))
            except _STORE_ERRORS as error:
                log.debug(f"sgdtp: rank {self.rank} could not report its clean exit: {error}")
        if self._thread is not None:
            self._thread.join(timeout=2 * self.store_timeout + self.interval + 1)
            self._thread = None

    # ---------------------------------------------------------------------------------------- diagnose
    def _read_peers(self, store: dist.TCPStore) -> dict[int, PeerState]:
        peers: dict[int, PeerState] = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            fields: dict = {}
            for what in ("beat", "failed", "done"):
                key = self._key(what, rank)
                if store.check([key]):
                    fields.update(json.loads(store.get(key)))
            peers[rank] = PeerState.read(rank, fields)
        return peers

    def diagnose(self, exc: BaseException) -> RankLostError | None:
        """After a failed collective: which peers are to blame? ``None`` when no peer is (a local error)."""
        timed_out = "timed out" in str(exc).lower() or "timeout" in str(exc).lower()
        try:
            store = self._client()
            first = self._read_peers(store)
            deadline = time.monotonic() + 2.5 * self.interval
            current = first
            while time.monotonic() < deadline:
                time.sleep(self.interval / 4)
                current = self._read_peers(store)
                if all(p.failure or p.done or p.seq != first[r].seq for r, p in current.items()):
                    break
        except _STORE_ERRORS:
            return RankLostError(
                f"sgdtp: rank {self.rank} lost contact with the job {self.phase} at step {self.step}: the"
                f" rendezvous store at {self.host}:{self.port} is unreachable, so the process that hosts it"
                " (global rank 0, or the torchrun agent) is gone. This rank stops too."
                f" The collective's error: {_first_line(exc)}"
            )
        failed = [p for p in current.values() if p.failure and p.primary]
        left = [p for p in current.values() if p.done and not p.failure]
        lost = [p for r, p in current.items() if not (p.failure or p.done) and p.seq == first[r].seq]
        alive = [p for r, p in current.items() if not (p.failure or p.done) and p.seq != first[r].seq]
        # Stuck: alive, and somewhere else than this rank (the ranks waiting with us are not to blame).
        elsewhere = [p for p in alive if p.position() != (self.phase, self.step)]
        stuck = (elsewhere or alive) if timed_out else []
        if not (failed or lost or stuck):
            failed = [p for p in current.values() if p.failure]  # only consequences: name them anyway
        if not (failed or lost or stuck or left):
            return None
        parts = [_describe(p) for p in failed]
        parts += [f"{p.who()} finished and left while this rank still expected it in a collective" for p in left]
        parts += [
            f"{p.who()} was lost {p.where()}: no heartbeat for {2.5 * self.interval:.1f} s and no error reported"
            " (killed, e.g. by the out-of-memory killer, or its node went down)"
            for p in lost
        ]
        parts += [
            f"{p.who()} is alive but did not join the collective within collective_timeout="
            f"{self.collective_timeout:g} s: it is {p.where()} (stuck in user code, I/O, or a deadlock)"
            for p in stuck
        ]
        return RankLostError(
            f"sgdtp: {'; '.join(parts)}. Rank {self.rank} was {self.phase} at step {self.step} and stops too."
            f" Resume from the last checkpoint (trainer.fit(..., ckpt_path='last')). The collective's error:"
            f" {_first_line(exc)}"
        )


def _ranks(peers: list[tuple[int, dict[str, Any]]]) -> str:
    named = [f"rank {r} (in {b.get('phase', '?').removeprefix('in ')} at step {b.get('step', -1)})" for r, b in peers]
    return ", ".join(named[:3]) + (f" and {len(named) - 3} more" if len(named) > 3 else "")


def _describe(p: PeerState) -> str:
    verb = "failed" if p.primary else "stopped"
    return f"{p.who()} {verb} {p.where()}: {p.failure}"


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


class FaultGuard:
    """The strategy's side of fault handling: start the heartbeat once the process group exists, name the phase
    of every collective, and turn a failed collective into an error that names the lost rank.

    ``step`` tells the heartbeat which optimizer step the rank is in (Lightning's ``global_step``);
    ``heartbeat_timeout`` and ``stall_timeout`` (seconds, ``None``: off) are the options' (``SGDTPConfig``)."""

    def __init__(
        self,
        collective_timeout: float,
        step: Callable[[], int] = lambda: -1,
        heartbeat_timeout: float | None = None,
        stall_timeout: float | None = None,
    ) -> None:
        self.collective_timeout = collective_timeout
        self.heartbeat_timeout, self.stall_timeout = heartbeat_timeout, stall_timeout
        self.step = step
        self.liveness: Liveness | None = None
        self._failed = False  # reported a failure; kept past close (the exit then meets no peer)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``torch.save(trainer)``, ``copy.deepcopy(strategy)``) keeps the timeout, not the heartbeat: a thread
        of this process; a copy starts its own at :meth:`start`."""
        return {**self.__dict__, "liveness": None}

    def start(self, host: str, port: int, rank: int, world_size: int) -> None:
        """Start the heartbeat (a collective: every rank calls it). One key per job run: heartbeats of an earlier
        attempt (torchrun restarts reuse the store) never count."""
        if world_size < 2 or self.liveness is not None:
            return
        self._failed = False
        key = [uuid.uuid4().hex]
        dist.broadcast_object_list(key, src=0)
        self.liveness = Liveness(
            host, port, rank, world_size, key[0], self.collective_timeout, self.heartbeat_timeout, self.stall_timeout
        )
        self.liveness.start()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Generator[None, None, None]:
        """Name the phase for the heartbeat; a failed collective inside it raises :class:`RankLostError`."""
        live = self.liveness
        if live is None:
            yield
            return
        live.phase, live.step = f"in {phase}", self.step()
        try:
            yield
        except Exception as exc:
            if isinstance(exc, RankLostError) or not is_distributed_error(exc):
                raise
            lost = live.diagnose(exc)
            if lost is None:
                raise
            live.report(lost, primary=False)
            raise lost from exc
        live.phase = f"after {phase}"
        live.settled = live.settled or phase == "optimizer_step"

    def report(self, exc: BaseException) -> None:
        """Tell the peers this rank failed (they end within seconds, naming it)."""
        if self.liveness is not None:
            self.liveness.report(exc, primary=not isinstance(exc, RankLostError))

    @property
    def failed(self) -> bool:
        """This rank has reported a failure (its own, or a peer's it stopped for), in this run, closed or not."""
        return self._failed or (self.liveness is not None and self.liveness.reported)

    def where(self) -> str:
        """What the heartbeat says this rank is doing (``in training_step at step 2``)."""
        live = self.liveness
        return f"{live.phase} at step {live.step}" if live is not None else ""

    def close(self) -> None:
        if self.liveness is not None:
            self._failed = self.failed
            self.liveness.close()
            self.liveness = None
