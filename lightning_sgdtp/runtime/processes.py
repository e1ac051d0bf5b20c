"""What either front end (the Trainer's ``SGDTPStrategy``, Fabric's ``SGDTPFabricStrategy``) does once its processes
exist, without importing Lightning: join the process group (bounded), start the fault guard and the shutdown
watchdog, check the compile cache folders; then, with the module known, the layout (planned for
``parallelism="auto"``) and its meshes. One place, so that the two front ends cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_sgdtp.compiler.artifacts import check_cache_folders
from lightning_sgdtp.config import SGDTPConfig
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.planner.auto import plan_at_setup
from lightning_sgdtp.runtime import rendezvous
from lightning_sgdtp.runtime.faults import FaultGuard
from lightning_sgdtp.runtime.shutdown import ShutdownWatchdog


@dataclass(frozen=True)
class Cluster:
    """Where this process sits: the launcher's address, its rank and the job's shape."""

    main_address: str
    main_port: int
    global_rank: int
    num_processes: int  # per node
    num_nodes: int
    environment: str  # the cluster environment's class name (errors name it)
    environment_world_size: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes


def join(
    config: SGDTPConfig,
    cluster: Cluster,
    backend: str,
    device: torch.device,
    guard: FaultGuard,
    watchdog: ShutdownWatchdog | None,
    ignore_signals: tuple[int, ...] = (),
) -> ShutdownWatchdog | None:
    """Join the process group within ``rendezvous_timeout`` (or fail naming the address), start ``guard`` and, with
    more than one rank, the shutdown watchdog (a rank blocked in a collective still ends on a signal); then check
    the compile cache folders, before any compile. Returns the watchdog (``watchdog`` when given one already)."""
    expected = cluster.world_size
    rendezvous.check_world_size(
        cluster.environment, cluster.environment_world_size, cluster.num_processes, cluster.num_nodes
    )
    rendezvous.init_process_group(
        cluster.main_address, cluster.main_port, cluster.global_rank, expected, backend,
        config.collective_timeout, config.rendezvous_timeout, device if device.type != "cpu" else None,
    )  # fmt: skip
    guard.start(cluster.main_address, cluster.main_port, cluster.global_rank, expected)
    if expected > 1 and watchdog is None:
        watchdog = ShutdownWatchdog(
            cluster.global_rank, guard.where, lambda text: guard.report(RuntimeError(text)),
            grace=config.shutdown_grace, ignore=ignore_signals,
        )  # fmt: skip
        watchdog.install()
    # Before any compile: a cache folder that cannot be written fails here, named, on the rank that sees it.
    check_cache_folders(None if config.compile_cache == "auto" else config.cache_folder)  # the default only warns
    return watchdog


def splits_heads(module: nn.Module | None) -> Callable[[int], bool] | None:
    """Whether ``module``'s attentions split over a tensor-parallel size (every query head count divides it); None
    without a module with parameters (the size is then the island's, checked when the plan is made)."""
    if module is None or next(module.parameters(), None) is None:
        return None
    from lightning_sgdtp.parallel.tensor.plan import auto_plan

    return lambda tp: not auto_plan(module, tp).indivisible_heads


def lay_out(
    config: SGDTPConfig,
    given: set[str],
    module: Callable[[], nn.Module | None],
    cluster: Cluster,
    device: torch.device,
    precision: str,
    dims: ParallelDims | None,
    fixed: dict[str, Any] | None = None,
) -> tuple[SGDTPConfig, dict[str, Any] | None, ParallelDims, list[str]]:
    """The layout, on every rank alike: with ``parallelism="auto"`` the planner's choice for ``module()`` (a
    measurement: a collective over the world); then the dimensions, the rank grid and every mesh, unless ``dims``
    is built already; ``fixed``: what the front end fixes for the planner (Fabric: no pipeline). Returns the resolved options, ``plan["planner"]`` (or None), the dimensions and the lines
    for rank 0."""
    lines: list[str] = []
    planner = None
    if config.planned:
        args = (config, given, module(), cluster.world_size, cluster.num_processes, device, precision)
        config, planner, lines = plan_at_setup(*args, fixed=fixed)
    if dims is None:  # sizes, the rank grid (topology), every mesh: built once, one line each
        args2 = (config, cluster.world_size, cluster.num_processes, cluster.num_nodes, device.type)
        dims, more = ParallelDims.for_cluster(*args2, fits=splits_heads(module()))
        lines += more
    return config, planner, dims, lines
