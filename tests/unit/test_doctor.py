"""`sgdtp doctor` on recorded environments (tests/data/doctor/*.json) and on this machine.

The recorded machines: this CI box (`cpu-ci`), an 8 x H100 NVLink box with the CUDA build, a 4 x A100 box that
has the CPU build of torch installed, the H100 box without Triton, an old stack (Python 3.9, torch 2.1,
Lightning 2.1), a box without a C++ compiler, and one without torch. This machine, and the `sgdtp doctor` command:
tests/integration/test_cli.py.
"""

from __future__ import annotations

import json

import pytest
from helpers import DATA as TEST_DATA

from lightning_sgdtp import doctor

DATA = TEST_DATA / "doctor"


def _env(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def _verdicts(name: str) -> dict[str, tuple[str, str]]:
    return {r.item: (r.verdict, r.fix) for r in doctor.check(_env(name))}


@pytest.mark.parametrize(
    ("name", "ok", "tag", "failing"),
    [
        ("cpu-ci", True, "cpu-cp311-linux_x86_64", []),
        ("h100-8x-nvlink", True, "cu121-cp311-linux_x86_64", []),
        (
            "gpus-with-cpu-torch",
            False,
            "cu121-cp311-linux_x86_64",
            ["torch build for the GPUs", "triton (Inductor on GPU)"],
        ),
        ("gpu-no-triton", False, "cu121-cp311-linux_x86_64", ["triton (Inductor on GPU)"]),
        ("old-stack", False, "cpu-cp39-linux_x86_64", ["python", "torch", "lightning", "torchmetrics"]),
        ("no-compiler", False, "cpu-cp311-linux_x86_64", ["C++ compiler (Inductor on CPU)"]),
        ("no-torch", False, "cpu-cp311-linux_x86_64", ["torch", "gloo (CPU collectives)"]),
    ],
)
def test_recorded_environments(name: str, ok: bool, tag: str, failing: list[str]) -> None:
    env = _env(name)
    rows = doctor.check(env)
    result = doctor.report(env, rows)
    assert result["ok"] is ok and result["wheel_tag"] == tag
    assert sorted(r.item for r in rows if r.verdict == "fail") == sorted(failing)
    assert all(r.fix for r in rows if r.verdict != "ok"), "every failure says what to do"


def test_fixes_name_what_to_install() -> None:
    assert (
        "install the CUDA build: cu121-cp311-linux_x86_64"
        in _verdicts("gpus-with-cpu-torch")["torch build for the GPUs"][1]
    )
    assert "pip install torch==2.13.0" in _verdicts("old-stack")["torch"][1]
    assert "apt install g++" in _verdicts("no-compiler")["C++ compiler (Inductor on CPU)"][1]
    h100 = _verdicts("h100-8x-nvlink")
    assert h100["GPU links"] == ("ok", "") and h100["NCCL"][0] == "ok" and h100["CUDA driver"][0] == "ok"
    assert _verdicts("gpus-with-cpu-torch")["GPU links"] == ("ok", "")  # PCIe only: found, nothing to fix
