"""Fabric has no ``on_exception`` hook: ``SGDTPFabricStrategy`` installs an excepthook that tells the peers (the
fault guard) before the rank's script dies, then runs the previous hook. In one process, with a recording guard
(the whole job, rank 0 failing in its loop and the other rank ending in seconds, naming it:
``tests/distributed/test_no_hang.py`` ``fabric_rank0``, slow tier)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from lightning_sgdtp.frontends import fabric as fabric_strategy


def test_an_uncaught_error_is_reported_to_the_peers_then_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    reported, printed = [], []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: printed.append(exc))
    job = SimpleNamespace(failed=reported.append)  # the strategy's Job: tells the fault guard and the watchdog
    fabric_strategy._report_uncaught(job)
    fabric_strategy._report_uncaught(job)  # installed once: a second setup does not chain it twice
    error = RuntimeError("boom on this rank")
    sys.excepthook(RuntimeError, error, None)
    assert reported == [error] and printed == [error]


def test_an_accelerator_the_backend_does_not_run_on_is_refused_when_fabric_is_made() -> None:
    """``Fabric(accelerator=<not cpu or cuda>, strategy="sgdtp")``: refused by Fabric's constructor, before any step,
    naming the accelerator and the fix."""
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.accelerators import Accelerator

    from lightning_sgdtp.config import SGDTPConfigError

    class OtherAccelerator(Accelerator):  # what a third-party plugin brings (XLA, MPS, HPU have their own)
        def setup_device(self, device: torch.device) -> None: ...
        def teardown(self) -> None: ...
        @staticmethod
        def parse_devices(devices: object) -> int:
            return 1

        @staticmethod
        def get_parallel_devices(devices: object) -> list[torch.device]:
            return [torch.device("cpu")]

        @staticmethod
        def auto_device_count() -> int:
            return 1

        @staticmethod
        def is_available() -> bool:
            return True

        @classmethod
        def register_accelerators(cls, registry: object) -> None: ...
        @staticmethod
        def name() -> str:
            return "other"

    with pytest.raises(SGDTPConfigError, match=r"OtherAccelerator.*not supported by the sgdtp strategy.*'cpu'"):
        Fabric(accelerator=OtherAccelerator(), devices=1, strategy="sgdtp")
