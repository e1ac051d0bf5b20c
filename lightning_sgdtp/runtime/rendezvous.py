"""Bounded rendezvous: join the job's process group within ``rendezvous_timeout``, or fail saying where.

The engine is torch's: a c10d ``TCPStore`` hosted by global rank 0 at ``MASTER_ADDR:MASTER_PORT`` and
``torch.distributed.init_process_group`` on top of it. What we add is a separate, bounded wait for the
rendezvous (``init_process_group`` alone would wait ``collective_timeout``, 30 minutes by default, on an
unreachable address) and an error that names the address, the port and what to check.
Under torchrun the agent hosts the store (every rank is a client) and keeps it across restarts: the keys of a
failed attempt (gloo's listening addresses among them) are still there, and a restarted rank that read one
would try to connect to a dead process. So the process group's keys are namespaced by attempt
(``TORCHELASTIC_RESTART_COUNT``).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("lightning.pytorch.sgdtp")


class RendezvousError(RuntimeError):
    """The ranks could not meet at MASTER_ADDR:MASTER_PORT in time. The message says what to check."""


def init_process_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    collective_timeout: float,
    rendezvous_timeout: float,
    device_id: torch.device | None = None,
) -> None:
    """Create the default process group, waiting at most ``rendezvous_timeout`` seconds for the rendezvous."""
    if dist.is_initialized():
        return
    log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
    os.environ["MASTER_ADDR"] = host
    os.environ["MASTER_PORT"] = str(port)
    timeout = timedelta(seconds=collective_timeout)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store: dist.Store = dist.TCPStore(
            host,
            port,
            world_size,
            is_master=rank == 0 and not agent_store,
            timeout=timedelta(seconds=rendezvous_timeout),
            wait_for_workers=not agent_store,
        )
    except (dist.DistError, RuntimeError, OSError) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        role = (
            f"rank 0 hosts the rendezvous store on port {port} and waited for the {world_size - 1} other rank(s)"
            if rank == 0
            else f"rank {rank} tried to reach the rendezvous store that global rank 0 hosts"
        )
        raise RendezvousError(
            f"sgdtp: rendezvous failed at MASTER_ADDR={host} MASTER_PORT={port} within rendezvous_timeout="
            f"{rendezvous_timeout:g} s ({role}): {lines[0] if lines else type(exc).__name__}. Check that"
            f" {host} is the address of the node running global rank 0 and that it is reachable from this node,"
            f" that port {port} is free there and not blocked by a firewall, and that all {world_size} ranks were"
            " launched (Trainer devices x num_nodes must match the launcher's tasks)."
        ) from exc
    if agent_store:
        store = dist.PrefixStore(f"sgdtp/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device_id
    )


def check_world_size(launcher: str, started: int, devices: int, num_nodes: int) -> None:
    """The launcher started as many processes as ``Trainer(devices, num_nodes)`` asks for, or say how to fix it."""
    from lightning_sgdtp.config import SGDTPConfigError

    expected = devices * num_nodes
    if started != expected:
        raise SGDTPConfigError(
            f"the launcher ({launcher}) started {started} processes, but Trainer(devices={devices},"
            f" num_nodes={num_nodes}) asks for {expected}. Make devices x num_nodes equal the launcher's total tasks"
            " (SLURM: --nodes x --ntasks-per-node; torchrun: --nnodes x --nproc-per-node)."
        )
