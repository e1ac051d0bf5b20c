"""Offline installation (docs/offline-install.md), end to end: build the wheel, download every dependency into a
wheelhouse, install into a fresh virtual environment with `pip install --no-index --find-links`, run the doctor.

The download step needs the package index (or pip's cache); the install step gets no index at all.
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
    # 1. On a machine with access to the index: our wheel, then everything it needs (torch: the CPU build here).
    _run([*pip, "wheel", "--no-deps", "--wheel-dir", str(wheelhouse), str(REPO)])
    (ours,) = wheelhouse.glob("lightning_sgdtp-*.whl")
    _run([*pip, "download", "--dest", str(wheelhouse), str(ours), "torch==2.13.0"])
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
    out = subprocess.run(
        [str(venv / "bin" / "sgdtp"), "doctor", "--json"],
        capture_output=True,
        text=True,
        env=offline,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )
    report = json.loads(out.stdout)
    assert out.returncode == 0 and report["ok"], out.stdout[-3000:] + out.stderr[-3000:]
    assert report["environment"]["torch"].startswith("2.13.0") and report["wheel_tag"].startswith("cpu-cp")
    # 4. The wheel stands alone: its long description is README.md (what `pip show -v` and an index page show).
    described = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(m.metadata('lightning-sgdtp')['Description'])"],
        capture_output=True, text=True, env=offline, cwd=tmp_path, timeout=120, check=False,
    ).stdout  # fmt: skip
    first = (REPO / "README.md").read_text().splitlines()[0]
    assert first in described and len(described) > 1000, described[:500]
