"""``sgdtp doctor``: can this machine run lightning-sgdtp, and how?

Two halves, so that an environment recorded elsewhere can be checked here (``sgdtp doctor --env FILE``, and the
tests' recorded machines):

- :func:`probe` reads the machine: Python and its ABI tag, torch and its build (cpu / cuXXX / rocmX.Y), the CUDA
  runtime and driver, NCCL, the GPUs and their links (``nvidia-smi topo -m``), the process-group backends, the
  C++ compiler Inductor needs on CPU and Triton on GPU, Lightning and torchmetrics. Plain data.
- :func:`check` compares such data with ``supported.json`` (shipped in the package) and returns one row per
  item, with a verdict (``ok``, ``warn``, ``fail``) and the fix for anything that is not ok.

``sgdtp doctor --sbatch FILE`` adds :func:`check_sbatch`: a SLURM batch script's GPU request against its tasks per
node and the ``--devices`` it passes (one task per GPU), read by :func:`parse_sbatch` into plain data.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shlex
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
    verdict: str  # "ok" | "untested" (within the supported range, never run) | "warn" | "fail"
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
        "compile_cache": compile_cache_facts(),
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


def compile_cache_facts() -> dict[str, Any]:
    """The default compile cache (``compile_cache="auto"``): its folder, bundles and bytes; or why there is none."""
    from lightning_sgdtp.compiler.artifacts import CACHE_ENV, default_cache_folder, default_cache_problem

    folder = default_cache_folder()
    if folder is None:
        return {"folder": None, "why": default_cache_problem() or f"{CACHE_ENV}={os.environ.get(CACHE_ENV)}"}
    bundles = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return {"folder": str(folder), "bundles": len(bundles), "bytes": size}


def compile_cache_row(facts: dict[str, Any]) -> Row:
    """The compile cache's row: where it is, how big, how to clear it (never a failure: jobs compile without it)."""
    if facts.get("folder") is None:
        return Row("compile cache (default)", f"off ({facts.get('why')})", "ok")
    found = f"{facts['folder']}: {facts['bundles']} bundle(s), {facts['bytes'] / 2**20:.1f} MiB"
    return Row(
        "compile cache (default)", found, "ok", f"to clear: rm -rf {facts['folder']}; off: SGDTP_COMPILE_CACHE=off"
    )


# ----------------------------------------------------------------------------------------------------- check
def _parse(version: str | None) -> tuple[int, ...]:
    if not version:
        return ()
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _within(version: str | None, spec: dict[str, str]) -> bool:
    v = _parse(version)
    return bool(v) and v >= _parse(spec["min"]) and ("below" not in spec or v < _parse(spec["below"]))


def _tested(version: str, spec: dict[str, str]) -> bool:
    """``version`` is the release CI ran (``3.11.7`` for ``3.11``; ``2.13.0+cpu`` for ``2.13.0``)."""
    tested = spec.get("tested")
    return tested is not None and _parse(version)[: len(_parse(tested))] == _parse(tested)


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
        if found and _within(found, spec) and _tested(found, spec):
            rows.append(Row(item, found, "ok"))
        elif found and _within(found, spec):
            ran = (
                f"CI runs {spec['tested']}"
                if "tested" in spec
                else "no GPU has run this project yet (docs/hardware.md)"
            )
            rows.append(Row(item, found, "untested", f"expected to work ({item} {_range(spec)}), never run: {ran}"))
        else:
            verdict = "fail" if required else "warn"
            rows.append(Row(item, found or "missing", verdict, f"{item} {_range(spec)} is needed: {fix}"))

    versioned("python", env.get("python"), s["python"], "install a supported CPython (3.11 is what CI runs)")
    if env.get("implementation", "cpython") != "cpython":
        rows.append(Row("implementation", env["implementation"], "fail", "torch needs CPython"))
    platform, tested = env.get("platform", "?"), s.get("platforms_tested", [])
    if platform in tested:
        rows.append(Row("platform", platform, "ok"))
    elif platform in s["platforms"]:
        rows.append(Row("platform", platform, "untested", f"expected to work, never run: CI runs {', '.join(tested)}"))
    else:
        rows.append(Row("platform", platform, "warn", f"tested on {', '.join(tested)} only"))
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
    if "compile_cache" in env:
        rows.append(compile_cache_row(env["compile_cache"]))
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


# ---------------------------------------------------------------------------------------------------- sbatch
_SHORT_OPTIONS = {"N": "nodes", "n": "ntasks", "G": "gpus", "c": "cpus-per-task"}
_NTASKS_VARS = ("$SLURM_NTASKS_PER_NODE", "${SLURM_NTASKS_PER_NODE}")


def _sbatch_options(text: str) -> dict[str, str]:
    """The ``#SBATCH`` options, as sbatch reads them: lines that start with ``#SBATCH`` (not ``##SBATCH``) before
    the first command; ``--name=value``, ``--name value``, ``-N2``, ``-N 2``; the last one of a name wins."""
    options: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.lstrip().startswith("#"):
                break
            continue
        words = shlex.split(line[len("#SBATCH") :], comments=True)
        for i, word in enumerate(words):
            if not word.startswith("-") or word == "-":
                continue
            name, eq, value = word.lstrip("-").partition("=")
            if not word.startswith("--") and len(name) > 1 and not eq:  # -N2
                name, value = name[0], name[1:]
            elif not eq and i + 1 < len(words) and not words[i + 1].startswith("-"):
                value = words[i + 1]
            options[_SHORT_OPTIONS.get(name, name) if not word.startswith("--") else name] = value
    return options


def _count(value: str) -> int:
    """``8``, ``a100:8`` (GPU type first) or ``2-4`` (a node range: its minimum)."""
    try:
        return int(value.split(":")[-1].split("-")[0])
    except ValueError:
        raise ValueError(f"#SBATCH value {value!r} is not a count (8, a100:8 or 2-4)") from None


def _script_arg(text: str, flag: str) -> str | None:
    """The last value the script passes after ``flag`` (``--devices 8``, ``--devices="${X}"``), outside comments;
    a shell default ``${VAR:-x}`` is read as ``x``."""
    found = None
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in re.finditer(rf"{flag}(?:=|\s+)[\"']?([^\s\"'\\]+)", line):
            found = m.group(1)
    default = re.fullmatch(r"\$\{\w+:-([^}]*)\}", found or "")
    return default.group(1) if default else found


def parse_sbatch(text: str) -> dict[str, Any]:
    """What a batch script asks SLURM for and what it passes to training, as plain data: ``nodes``,
    ``ntasks_per_node``, ``gpus_per_node`` (from ``--gpus-per-node``, ``--gres=gpu:N``, ``--gpus`` over the nodes or
    ``--gpus-per-task`` times the tasks; ``None`` without a GPU request) and ``gpu_request`` (the option that set
    it), ``devices`` and ``accelerator`` (the values the script passes after those flags; ``None`` if it does not)."""
    options = _sbatch_options(text)
    nodes = _count(options["nodes"]) if options.get("nodes") else 1
    tasks = _count(options["ntasks-per-node"]) if options.get("ntasks-per-node") else None
    gres = next((g for g in options.get("gres", "").split(",") if g.split(":")[0] == "gpu"), None)
    gpus: int | float | None = None
    request = None
    if options.get("gpus-per-node"):
        gpus, request = _count(options["gpus-per-node"]), f"--gpus-per-node={options['gpus-per-node']}"
    elif gres:
        gpus, request = (_count(gres) if ":" in gres else 1), f"--gres={gres}"
    elif options.get("gpus"):
        per_node = _count(options["gpus"]) / nodes
        gpus, request = int(per_node) if per_node.is_integer() else per_node, f"--gpus={options['gpus']}"
    elif options.get("gpus-per-task") and tasks:
        gpus, request = _count(options["gpus-per-task"]) * tasks, f"--gpus-per-task={options['gpus-per-task']}"
    return {
        "nodes": nodes,
        "ntasks_per_node": tasks,
        "gpus_per_node": gpus or None,
        "gpu_request": request if gpus else None,
        "devices": _script_arg(text, "--devices"),
        "accelerator": _script_arg(text, "--accelerator"),
    }


def check_sbatch(text: str) -> list[Row]:
    """A batch script's layout: one task per device (``--devices`` = ``--ntasks-per-node``) and, for a GPU run, one
    GPU per task (GPUs per node = ``--ntasks-per-node``). Options given to ``sbatch`` on its command line override
    the script's and are not seen here."""
    job = parse_sbatch(text)
    tasks, gpus, devices, accelerator = (job[k] for k in ("ntasks_per_node", "gpus_per_node", "devices", "accelerator"))
    if tasks is None:
        fix = "add '#SBATCH --ntasks-per-node=N', N = devices per node: Lightning starts one process per task"
        return [Row("sbatch tasks per node", "no --ntasks-per-node", "fail", fix)]
    rows = [Row("sbatch tasks per node", f"{job['nodes']} node(s) x {tasks} task(s)", "ok")]
    if devices is None:
        rows.append(
            Row("sbatch --devices", "not passed", "warn", f"pass --devices ${{SLURM_NTASKS_PER_NODE}} ({tasks})")
        )
    elif devices in _NTASKS_VARS or devices == str(tasks):
        rows.append(Row("sbatch --devices", f"{devices} (= --ntasks-per-node={tasks})", "ok"))
    else:
        fix = (
            f"pass --devices ${{SLURM_NTASKS_PER_NODE}} (or make the two equal): Lightning stops every task with"
            f" devices={devices} and --ntasks-per-node={tasks}"
        )
        rows.append(Row("sbatch --devices", f"--devices {devices}, --ntasks-per-node={tasks}", "fail", fix))
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator in (None, "auto") and gpus is not None)
    item = "sbatch GPUs per node"
    if not on_gpu:
        if gpus:
            fix = "drop the GPU request (or give sbatch --gpus-per-node=0), or train with --accelerator gpu"
            rows.append(Row(item, f"{job['gpu_request']} for a run with --accelerator {accelerator}", "warn", fix))
        else:
            rows.append(Row(item, f"none: --accelerator {accelerator}", "ok"))
    elif gpus is None:
        found = f"no GPU requested (0 per node) for {tasks} task(s) per node and --accelerator {accelerator}"
        fix = f"add '#SBATCH --gpus-per-node={tasks}' (one GPU per task); a commented '##SBATCH' line is not read"
        rows.append(Row(item, found, "fail", fix))
    elif gpus != tasks:
        found = f"{gpus:g} per node ({job['gpu_request']}) for {tasks} task(s) per node (--ntasks-per-node={tasks})"
        fix = (
            f"one task per GPU: '#SBATCH --gpus-per-node={tasks}', or --ntasks-per-node={gpus:g} and --devices {gpus:g}"
        )
        rows.append(Row(item, found, "fail", fix))
    else:
        rows.append(Row(item, f"{gpus} per node ({job['gpu_request']}), one per task", "ok"))
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

    marks = {
        "ok": "[green]ok[/green]",
        "untested": "[yellow]untested[/yellow]",
        "warn": "[yellow]warn[/yellow]",
        "fail": "[red]FAIL[/red]",
    }
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
