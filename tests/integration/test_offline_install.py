"""Offline installation (docs/offline-install.md), end to end: `python -m build` makes the sdist and the wheel,
every dependency is downloaded into a wheelhouse, the wheel is installed into a fresh virtual environment with
`pip install --no-index --find-links`, the doctor runs; then the sdist is built and installed there too (offline:
its build backend comes from the wheelhouse) and the doctor runs again.

The build and download steps need the package index (or pip's cache); the install steps get no index at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import REPO


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout, check=False)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def test_wheelhouse_install_without_an_index(tmp_path: Path) -> None:
    wheelhouse, venv = tmp_path / "wheelhouse", tmp_path / "venv"
    pip = [sys.executable, "-m", "pip"]
    # 1. On a machine with access to the index: our sdist and wheel (`python -m build`: the wheel is built from the
    # sdist, so the sdist holds all it needs), then everything they need (torch: the CPU build here; hatchling:
    # the sdist's build backend).
    _run([sys.executable, "-m", "build", "--outdir", str(wheelhouse), str(REPO)])
    (ours,) = wheelhouse.glob("lightning_sgdtp-*.whl")
    (sdist,) = wheelhouse.glob("lightning_sgdtp-*.tar.gz")
    _run([*pip, "download", "--dest", str(wheelhouse), str(ours), "torch==2.13.0", "hatchling>=1.21"])
    assert list(wheelhouse.glob("torch-*.whl")) and list(wheelhouse.glob("lightning-*.whl"))
    # 2. On the offline machine: a fresh venv, no index, only the wheelhouse.
    _run([sys.executable, "-m", "venv", str(venv)])
    offline = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    offline.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse), PIP_CONFIG_FILE=os.devnull)
    _run(
        [str(venv / "bin" / "pip"), "install", "--no-index", "--find-links", str(wheelhouse), "lightning-sgdtp"],
        offline,
    )
    # 3. The doctor of the new environment (run from outside the repository: the installed package, not the source).
    _doctor(venv, offline, tmp_path)
    # 4. The wheel stands alone: its long description is README.md (what `pip show -v` and an index page show).
    described = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.metadata('lightning-sgdtp')['Description'])"],
        capture_output=True, text=True, env=offline, cwd=tmp_path, timeout=120, check=False,
    ).stdout  # fmt: skip
    first = (REPO / "README.md").read_text().splitlines()[0]
    assert first in described and len(described) > 1000, described[:500]
    # 5. The sdist installs offline too (built there by hatchling from the wheelhouse), and passes the doctor.
    _run(
        [str(venv / "bin" / "pip"), "install", "--no-index", "--find-links", str(wheelhouse), "--force-reinstall",
         "--no-deps", str(sdist)],
        offline,
    )  # fmt: skip
    _doctor(venv, offline, tmp_path)


def _doctor(venv: Path, env: dict[str, str], cwd: Path) -> None:
    out = subprocess.run(
        [str(venv / "bin" / "sgdtp"), "doctor", "--json"], capture_output=True, text=True, env=env, cwd=cwd,
        timeout=300, check=False,
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["ok"], out.stdout[-3000:] + out.stderr[-3000:]
    assert report["environment"]["torch"].startswith("2.13.0") and report["wheel_tag"].startswith("cpu-cp")
