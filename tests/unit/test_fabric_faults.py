"""Fabric has no ``on_exception`` hook: ``SGDTPFabricStrategy`` installs an excepthook that tells the peers (the
fault guard) before the rank's script dies, then runs the previous hook. In one process, with a recording guard
(the whole job, rank 0 failing in its loop and the other rank ending in seconds, naming it:
``tests/distributed/test_no_hang.py`` ``fabric_rank0``, slow tier)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from lightning_sgdtp import fabric_strategy


def test_an_uncaught_error_is_reported_to_the_peers_then_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    reported, printed = [], []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: printed.append(exc))
    guard = SimpleNamespace(report=reported.append)
    strategy = SimpleNamespace(_guard=guard, _watchdog=None)
    fabric_strategy._report_uncaught(strategy)
    fabric_strategy._report_uncaught(strategy)  # installed once: a second setup does not chain it twice
    error = RuntimeError("boom on this rank")
    sys.excepthook(RuntimeError, error, None)
    assert reported == [error] and printed == [error]
