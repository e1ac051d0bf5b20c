"""``sgdtp doctor``: can this machine run lightning-sgdtp, and how?

Two halves, so that an environment recorded elsewhere can be checked here (``sgdtp doctor --env FILE``, and the
tests' recorded machines):

- :func:`probe` reads the machine: Python and its ABI tag, torch and its build (cpu / cuXXX / rocmX.Y), the CUDA
  runtime and driver, NCCL, the GPUs and their links (``nvidia-smi topo -m``), the process-group backends, the
  C++ compiler Inductor needs on CPU and Triton on GPU, Lightning and torchmetrics. Plain data.
- :func:`check` compares such data with ``supported.json`` (shipped in the package) and returns one row per
  item, with a verdict (``ok``, ``warn``, ``fail``) and the fix for anything that is not ok.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUPPORTED = Path(__file__).with_name("supported.json")


@dataclass(frozen=True)
class Row:
    item: str
    found: str
    verdict: str  # "ok" | "warn" | "fail"
    fix: str = ""


# ----------------------------------------------------------------------------------------------------- probe
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def probe() -> dict[str, Any]:
    """Facts about this machine, as plain data (what :func:`check` reads)."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "abi": sys.implementation.cache_tag,  # e.g. cpython-311
        "platform": sysconfig.get_platform(),  # e.g. linux-x86_64
        "lightning": _version("lightning"),
        "pytorch_lightning": _version("pytorch-lightning"),
        "torchmetrics": _version("torchmetrics"),
        "triton": _version("triton") or _version("pytorch-triton-rocm"),
    }
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        cxx = os.environ.get("CXX", "g++")
        version = _run([cxx, "--version"])
        return {**env, "torch": None, "cxx": f"{cxx}: {version.splitlines()[0]}" if version else None}
    env["torch"] = torch.__version__
    env["torch_cuda"] = torch.version.cuda
    env["torch_hip"] = getattr(torch.version, "hip", None)
    env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    env["nccl"] = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        env["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    env["backends"] = sorted(
        name
        for name, available in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
            ("ucc", getattr(dist, "is_ucc_available", lambda: False)()),
        )
        if available
    )
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    env["cuda_driver"] = driver.splitlines()[0].strip() if driver else None
    env["gpu_topology"] = _run(["nvidia-smi", "topo", "-m"])
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        compiler = get_cpp_compiler()
    except Exception:  # noqa: BLE001  (any failure means: no usable compiler found)
        compiler = None
    version = _run([compiler, "--version"]) if compiler else None
    env["cxx"] = f"{compiler}: {version.splitlines()[0]}" if version else None
    return env


# ----------------------------------------------------------------------------------------------------- check
def _parse(version: str | None) -> tuple[int, ...]:
    if not version:
        return ()
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _within(version: str | None, spec: dict[str, str]) -> bool:
    v = _parse(version)
    return bool(v) and v >= _parse(spec["min"]) and ("below" not in spec or v < _parse(spec["below"]))


def _range(spec: dict[str, str]) -> str:
    return f">={spec['min']}" + (f", <{spec['below']}" if "below" in spec else "")


def torch_build(env: dict[str, Any]) -> str:
    """``cpu``, ``cu121`` or ``rocm6.1``: the part of torch's wheel name that says what it was built for."""
    if env.get("torch_cuda"):
        major, minor = (_parse(env["torch_cuda"]) + (0, 0))[:2]
        return f"cu{major}{minor}"
    if env.get("torch_hip"):
        return "rocm" + ".".join(str(x) for x in _parse(env["torch_hip"])[:2])
    return "cpu"


def wheel_tag(env: dict[str, Any], supported: dict[str, Any] | None = None) -> str:
    """The torch wheel that fits this machine, e.g. ``cu121-cp311-linux_x86_64``: with NVIDIA GPUs, the installed
    CUDA build, or else the newest CUDA build the driver can run; with ROCm, the ROCm build; otherwise the CPU
    build. Then the interpreter and the platform."""
    s = supported or json.loads(SUPPORTED.read_text())
    gpus, driver = env.get("gpus") or [], env.get("cuda_driver")
    build = "cpu"
    if env.get("torch_hip") or gpus and env.get("torch_cuda"):
        build = torch_build(env)
    elif gpus and driver:
        build = next((tag for minimum, tag in s["cuda_wheels"] if _parse(driver) >= _parse(minimum)), "cpu")
    abi = env.get("abi", "")
    interp = "cp" + abi.split("-")[-1] if abi.startswith("cpython-") else abi
    return f"{build}-{interp}-{env.get('platform', '').replace('-', '_').replace('.', '_')}"


def check(env: dict[str, Any], supported: dict[str, Any] | None = None) -> list[Row]:
    """One row per item: what was found, ``ok`` / ``warn`` / ``fail``, and the fix."""
    s = supported or json.loads(SUPPORTED.read_text())
    rows: list[Row] = []

    def versioned(item: str, found: str | None, spec: dict[str, str], fix: str, required: bool = True) -> None:
        if found and _within(found, spec):
            rows.append(Row(item, found, "ok"))
        else:
            verdict = "fail" if required else "warn"
            rows.append(Row(item, found or "missing", verdict, f"{item} {_range(spec)} is needed: {fix}"))

    versioned("python", env.get("python"), s["python"], "install a supported CPython (3.11 is what CI runs)")
    if env.get("implementation", "cpython") != "cpython":
        rows.append(Row("implementation", env["implementation"], "fail", "torch needs CPython"))
    rows.append(
        Row("platform", env.get("platform", "?"), "ok")
        if env.get("platform") in s["platforms"]
        else Row("platform", env.get("platform", "?"), "warn", f"tested on {', '.join(s['platforms'])} only")
    )
    torch_fix = f"pip install torch=={s['torch']['tested']} (the {wheel_tag(env, s)} wheel)"
    versioned("torch", env.get("torch"), s["torch"], torch_fix)
    if env.get("torch"):
        rows.append(Row("torch build", torch_build(env), "ok"))
    versioned("lightning", env.get("lightning"), s["lightning"], f"pip install lightning=={s['lightning']['tested']}")
    versioned("torchmetrics", env.get("torchmetrics"), s["torchmetrics"], "pip install torchmetrics")
    backends = env.get("backends") or []
    gpus = env.get("gpus") or []
    if "gloo" in backends:
        rows.append(Row("gloo (CPU collectives)", "available", "ok"))
    else:
        rows.append(Row("gloo (CPU collectives)", "missing", "fail", "install a torch build with distributed support"))
    if env.get("cxx"):
        rows.append(Row("C++ compiler (Inductor on CPU)", env["cxx"], "ok"))
    else:
        rows.append(
            Row("C++ compiler (Inductor on CPU)", "missing", "fail", "install g++ (apt install g++) or set CXX")
        )
    if gpus:
        rows.append(Row("GPUs", f"{len(gpus)} x {gpus[0]}", "ok"))
        if torch_build(env) == "cpu":
            rows.append(Row("torch build for the GPUs", "cpu", "fail", f"install the CUDA build: {wheel_tag(env, s)}"))
        if env.get("torch_cuda"):
            versioned("CUDA runtime", env.get("torch_cuda"), s["cuda"], "install a torch build for a newer CUDA")
            versioned("CUDA driver", env.get("cuda_driver"), s["cuda_driver"], "update the NVIDIA driver")
            versioned("NCCL", env.get("nccl"), s["nccl"], "install a torch CUDA build (it bundles NCCL)")
            if "nccl" not in backends:
                rows.append(Row("nccl backend", "missing", "fail", "install a torch CUDA build with NCCL"))
        if env.get("torch_hip"):
            versioned("ROCm", env.get("torch_hip"), s["rocm"], "install a torch build for a newer ROCm")
        versioned("triton (Inductor on GPU)", env.get("triton"), s["triton"], "pip install triton")
        topo = env.get("gpu_topology")
        links = "NVLink" if topo and re.search(r"\bNV\d+\b", topo) else "PCIe only" if topo else "unknown"
        rows.append(
            Row("GPU links", links, "ok" if links != "unknown" else "warn", "" if topo else "nvidia-smi not found")
        )
    else:
        rows.append(Row("GPUs", "none: CPU training with gloo", "ok"))
    return rows


def report(env: dict[str, Any], rows: list[Row]) -> dict[str, Any]:
    return {
        "ok": not any(r.verdict == "fail" for r in rows),
        "wheel_tag": wheel_tag(env),
        "rows": [asdict(r) for r in rows],
        "environment": {k: v for k, v in env.items() if k != "gpu_topology"},
    }


def render(env: dict[str, Any], rows: list[Row]) -> None:
    """The table, with rich."""
    from rich.console import Console
    from rich.table import Table

    marks = {"ok": "[green]ok[/green]", "warn": "[yellow]warn[/yellow]", "fail": "[red]FAIL[/red]"}
    table = Table(title="sgdtp doctor")
    for column in ("check", "found", "verdict", "fix"):
        table.add_column(column, overflow="fold")
    for r in rows:
        table.add_row(r.item, r.found, marks[r.verdict], r.fix)
    console = Console()
    console.print(table)
    console.print(f"torch wheel for this machine: [bold]{wheel_tag(env)}[/bold]")
    failed = [r.item for r in rows if r.verdict == "fail"]
    console.print("[red]not ready: " + ", ".join(failed) + "[/red]" if failed else "[green]ready[/green]")
