"""`sgdtp doctor` on recorded environments (tests/data/doctor/*.json) and on this machine.

The recorded machines: this CI box (`cpu-ci`), an 8 x H100 NVLink box with the CUDA build, a 4 x A100 box that
has the CPU build of torch installed, the H100 box without Triton, an old stack (Python 3.9, torch 2.1,
Lightning 2.1), a box without a C++ compiler, and one without torch. This machine, and the `sgdtp doctor` command:
tests/integration/test_cli.py. `--sbatch` (a batch script's GPU request against its tasks and `--devices`): small
scripts written here, and examples/slurm/train_gpt.sbatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import DATA as TEST_DATA
from helpers import REPO

from lightning_sgdtp.cli import main
from lightning_sgdtp.observe import doctor

DATA = TEST_DATA / "doctor"


def _env(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def _verdicts(name: str) -> dict[str, tuple[str, str]]:
    return {r.item: (r.verdict, r.fix) for r in doctor.check(_env(name))}


@pytest.mark.parametrize(
    ("name", "ok", "tag", "failing"),
    [
        ("cpu-ci", True, "cpu-cp311-linux_x86_64", []),
        # recorded with torch 2.5.1 and Lightning 2.5.0: below what pyproject.toml now requires (what CI ran)
        ("h100-8x-nvlink", False, "cu121-cp311-linux_x86_64", ["torch", "lightning"]),
        (
            "gpus-with-cpu-torch",
            False,
            "cu121-cp311-linux_x86_64",
            ["torch build for the GPUs", "triton (Inductor on GPU)"],
        ),
        ("gpu-no-triton", False, "cu121-cp311-linux_x86_64", ["torch", "lightning", "triton (Inductor on GPU)"]),
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
    assert h100["GPU links"] == ("ok", "") and h100["NCCL"][0] == "untested" and h100["CUDA driver"][0] == "untested"
    assert "never run: no GPU has run this project yet" in h100["NCCL"][1]
    assert _verdicts("gpus-with-cpu-torch")["GPU links"] == ("ok", "")  # PCIe only: found, nothing to fix


# ------------------------------------------------------------------------------------------------------ --sbatch
SBATCH_GPU_RUN = """#!/bin/bash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node={tasks}
{gpu_line}
#SBATCH --cpus-per-task=8
set -euo pipefail
srun python train.py --accelerator {accelerator} --devices {devices} --num_nodes "${{SLURM_JOB_NUM_NODES}}"
"""


def _sbatch_rows(
    tmp_path: Path,
    tasks: int = 8,
    gpu_line: str = "#SBATCH --gpus-per-node=8",
    accelerator: str = "gpu",
    devices: str = '"${SLURM_NTASKS_PER_NODE}"',
) -> dict[str, doctor.Row]:
    """``check_sbatch`` on SBATCH_GPU_RUN filled in, written to ``tmp_path/job.sbatch``; rows by item."""
    script = tmp_path / "job.sbatch"
    script.write_text(SBATCH_GPU_RUN.format(tasks=tasks, gpu_line=gpu_line, accelerator=accelerator, devices=devices))
    return {r.item: r for r in doctor.check_sbatch(script.read_text())}


@pytest.mark.parametrize(
    ("case", "options"),
    [
        ("gpus-per-node matches tasks", {}),
        ("gres with a GPU type", {"gpu_line": "#SBATCH --gres=gpu:a100:8  # one per task"}),
        ("gpus over the nodes", {"gpu_line": "#SBATCH -G 16"}),
        ("literal devices", {"tasks": 4, "gpu_line": "#SBATCH --gpus-per-node=4", "devices": "4"}),
        ("cpu run, no GPU", {"gpu_line": "", "accelerator": "cpu"}),
    ],
)
def test_sbatch_layout_that_fits_passes(tmp_path: Path, case: str, options: dict) -> None:
    rows = _sbatch_rows(tmp_path, **options)
    assert all(r.verdict == "ok" for r in rows.values()), (case, rows)


def test_sbatch_commented_out_gpu_line_on_a_gpu_run_fails_naming_both(tmp_path: Path) -> None:
    row = _sbatch_rows(tmp_path, gpu_line="##SBATCH --gpus-per-node=8")["sbatch GPUs per node"]
    assert row.verdict == "fail"
    assert "no GPU requested (0 per node) for 8 task(s) per node and --accelerator gpu" in row.found
    assert "#SBATCH --gpus-per-node=8" in row.fix


def test_sbatch_fewer_gpus_than_tasks_fails_naming_both(tmp_path: Path) -> None:
    row = _sbatch_rows(tmp_path, gpu_line="#SBATCH --gres=gpu:4")["sbatch GPUs per node"]
    assert row.verdict == "fail"
    assert row.found == "4 per node (--gres=gpu:4) for 8 task(s) per node (--ntasks-per-node=8)"
    assert "'#SBATCH --gpus-per-node=8'" in row.fix and "--ntasks-per-node=4 and --devices 4" in row.fix


def test_sbatch_devices_not_matching_tasks_fails(tmp_path: Path) -> None:
    row = _sbatch_rows(tmp_path, devices="4")["sbatch --devices"]
    assert row.verdict == "fail" and row.found == "--devices 4, --ntasks-per-node=8"
    assert "${SLURM_NTASKS_PER_NODE}" in row.fix


def test_sbatch_gpus_on_a_cpu_run_warns(tmp_path: Path) -> None:
    row = _sbatch_rows(tmp_path, accelerator="cpu")["sbatch GPUs per node"]
    assert row.verdict == "warn" and "--gpus-per-node=0" in row.fix


def test_the_example_sbatch_passes_and_the_cli_checks_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    example = REPO / "examples" / "slurm" / "train_gpt.sbatch"
    job = doctor.parse_sbatch(example.read_text())
    assert (job["nodes"], job["ntasks_per_node"], job["gpus_per_node"], job["accelerator"]) == (2, 8, 8, "gpu")
    assert all(r.verdict == "ok" for r in doctor.check_sbatch(example.read_text()))

    cpu_ci = str(DATA / "cpu-ci.json")
    assert main(["doctor", "--json", "--env", cpu_ci, "--sbatch", str(example)]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][-1]["item"] == "sbatch GPUs per node"
    _sbatch_rows(tmp_path, gpu_line="#SBATCH --gres=gpu:4")
    assert main(["doctor", "--json", "--env", cpu_ci, "--sbatch", str(tmp_path / "job.sbatch")]) == 1
    assert not json.loads(capsys.readouterr().out)["ok"]


def test_what_never_ran_is_untested_not_ok() -> None:
    """Within the supported range but not what CI ran: 'untested' (it does not fail the check); CI's own stack: ok."""
    assert {r.verdict for r in doctor.check(_env("cpu-ci"))} == {"ok"}
    env = {**_env("cpu-ci"), "platform": "linux-aarch64", "torch": "2.14.0+cpu", "python": "3.12.1"}
    rows = {r.item: r for r in doctor.check(env)}
    for item, ran in (("platform", "linux-x86_64"), ("torch", "2.13.0"), ("python", "3.11")):
        assert rows[item].verdict == "untested" and f"never run: CI runs {ran}" in rows[item].fix, rows[item]
    assert doctor.report(env, list(rows.values()))["ok"]
