"""The heartbeat thread's two verdicts (lightning_sgdtp/runtime/watch.py), in one process on a real c10d TCPStore.

The test plays rank 0: it hosts the store and writes rank 0's heartbeats by hand; the Liveness under test is rank 1.
``end_process`` (``os._exit`` in a job) is replaced by a recorder, so the verdict is read instead of ending pytest.
Each verdict has its negative control: the same situation with the detection off, or with the reason not to judge.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.runtime import faults, watch
from lightning_sgdtp.runtime.faults import Liveness


class Ended(Exception):
    pass


@pytest.fixture
def ends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The exit codes the heartbeat thread asked for."""
    codes: list[int] = []
    monkeypatch.setattr(faults, "end_process", codes.append)
    return codes


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    yield server


def _rank0_beats(store: dist.TCPStore, prefix: str, stop: threading.Event, **fields: Any) -> threading.Thread:
    """Rank 0's heartbeat, written by the test until ``stop``."""

    def run() -> None:
        seq = 0
        while not stop.wait(0.2):
            seq += 1
            beat = {"host": socket.gethostname(), "pid": os.getpid(), "seq": seq, "step": 3, "phase": "in backward"}
            beat.update(fields)
            store.set(f"{prefix}/beat/0", json.dumps(beat))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _liveness(store: dist.TCPStore, heartbeat: float | None, stall: float | None) -> Liveness:
    live = Liveness("127.0.0.1", store.port, 1, 2, "test", 60.0, heartbeat, stall)
    live.phase, live.step, live.settled = "in training_step", 3, True
    return live


def _wait(ends: list[int], seconds: float) -> float:
    started = time.monotonic()
    while not ends and time.monotonic() - started < seconds:
        time.sleep(0.05)
    return time.monotonic() - started


def test_a_silent_peer_is_named_frozen_within_the_bound_and_killed_on_this_host(
    store: dist.TCPStore, ends: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        stop = threading.Event()
        _rank0_beats(store, "sgdtp/liveness/test", stop, pid=frozen.pid)
        live = _liveness(store, heartbeat=1.0, stall=None)
        live.start()
        time.sleep(0.5)
        stop.set()  # rank 0 freezes: its heartbeat stops
        waited = _wait(ends, 5)
        live._stop.set()
        assert ends == [1], "no verdict"
        assert 0.7 <= waited <= 2.0, waited  # from the last beat, up to 0.2 s before the freeze
        err = capsys.readouterr().err
        assert f"rank 0 (host {socket.gethostname()}, pid {frozen.pid}) is frozen or lost: no heartbeat for" in err
        assert "last seen in backward at step 3 (SIGKILLed: it ran on this host, stopped)" in err
        assert "Rank 1 was in training_step at step 3" in err
        assert frozen.wait(5) == -signal.SIGKILL, "the stopped process on this host was not ended"
        failed = json.loads(store.get("sgdtp/liveness/test/failed/0"))  # the others read it from the store
        assert failed["failure"].startswith("frozen or lost") and failed["primary"]
    finally:
        frozen.kill()
        frozen.wait()


def test_negative_control_no_verdict_with_heartbeat_timeout_off(store: dist.TCPStore, ends: list[int]) -> None:
    stop = threading.Event()
    _rank0_beats(store, "sgdtp/liveness/test", stop)
    live = _liveness(store, heartbeat=None, stall=None)
    live.interval = 0.2
    live.start()
    time.sleep(0.5)
    stop.set()
    _wait(ends, 2.5)  # the positive case ends in 1-1.2 s
    live.close()
    assert ends == []


def _looping(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


@pytest.mark.parametrize(
    ("loop", "peer_blocked", "expect"),
    [
        ("python", 100.0, "stuck"),
        ("compiling", 100.0, "patient"),  # the same loop under TorchDynamo's frame conversion
        ("sleeping", 100.0, None),  # blocked in C, as a waiting rank: not this rank's fault
        ("python", 0.0, None),  # nobody waits for it
    ],
)
def test_a_rank_running_python_in_one_phase_while_a_peer_waits_is_stuck(
    store: dist.TCPStore,
    ends: list[int],
    capsys: pytest.CaptureFixture[str],
    loop: str,
    peer_blocked: float,
    expect: str | None,
) -> None:
    stop, halt = threading.Event(), threading.Event()
    _rank0_beats(store, "sgdtp/liveness/test", stop, blocked=peer_blocked)
    if loop == "compiling":  # the same loop, its code as if in TorchDynamo's convert_frame.py (during a compile)
        code = _looping.__code__.replace(co_filename="/site-packages/torch/_dynamo/convert_frame.py")
        target = types.FunctionType(code, globals())
    else:
        target = _looping if loop == "python" else (lambda stop: stop.wait(30))
    worker = threading.Thread(target=target, args=(halt,), daemon=True)
    worker.start()
    live = _liveness(store, heartbeat=1.0, stall=1.2)
    live.start()
    live.main = watch.MainThread(ident=worker.ident or 0)  # the "main thread" is the worker
    try:
        waited = _wait(ends, 2.5 if expect == "stuck" else 2.2)
    finally:
        live._stop.set()
        halt.set()
        stop.set()
    err = capsys.readouterr().err
    if expect == "stuck":
        assert ends == [1], err
        assert waited <= 2.4, waited
        assert f"rank 1 (host {socket.gethostname()}, pid {os.getpid()}) is stuck in training_step at step 3" in err
        assert "while rank 0 (in backward at step 3) waited in a collective (stall_timeout=1.2 s)" in err
        assert 'test_watch.py", line' in err and "in _looping" in err, "the stack of the stuck thread"
        failed = json.loads(store.get("sgdtp/liveness/test/failed/1"))
        assert failed["failure"].startswith("RankStuckError: stuck in training_step at step 3") and failed["primary"]
    else:
        assert ends == [], err
    if expect == "patient":
        assert "rank 1 has been compiling for" in err and "not stuck, stall_timeout=1.2 s does not apply" in err


def test_patience_names_the_long_phases() -> None:
    assert watch.patience("in training_step", ["/x/torch/_inductor/compile_fx.py"], True) == "compiling"
    assert watch.patience("in load_checkpoint", [], True) == "saving or loading a checkpoint"
    assert watch.patience("in setup: materialize and load pretrained weights", [], True) == "setting up"
    assert watch.patience("in training_step", [], False) == "in its first step"
    assert watch.patience("after save_checkpoint", [], True) is None  # done saving: the exemption is over
    # a compiled graph running is not compiling: eval_frame and output_code are on the stack then, not these
    assert watch.patience("in training_step", ["/x/torch/_dynamo/eval_frame.py"], True) is None


def test_a_big_job_watches_its_neighbours_only() -> None:
    assert watch.watched(1, 4) == [0, 2, 3]
    assert watch.watched(0, 256) == [1, 2, 3, 4, 252, 253, 254, 255]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"heartbeat_timeout": 0.5}, "heartbeat_timeout=0.5 must be a number of seconds >= 1"),
        ({"stall_timeout": True}, "stall_timeout=True must be a number"),
        ({"heartbeat_timeout": 30, "stall_timeout": 20}, "stall_timeout=20 must be longer than heartbeat_timeout=30"),
    ],
)
def test_bad_watch_options_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(SGDTPConfigError, match=match):
        SGDTPConfig(**options)
    assert SGDTPConfig(heartbeat_timeout=False, stall_timeout=False).watch_timeouts == (None, None)
    assert SGDTPConfig(stall_timeout=60).watch_timeouts == (15.0, 60)
