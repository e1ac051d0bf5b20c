"""What the two front ends' strategies share (the Trainer's ``SGDTPStrategy`` and Fabric's ``SGDTPFabricStrategy``),
without importing Lightning: a mixin placed before Lightning's ``ParallelStrategy`` in each class. Properties read
the strategy's own fields (``_config``, ``_dims``, ``_engine``, ...); collectives go through :mod:`lightning_sgdtp.sync.comm`
under the fault guard, so that a lost peer is named.
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
import typing
from collections.abc import Callable
from typing import Any

import torch

from lightning_sgdtp.config import SGDTPConfig
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.observe.report import plan_dict
from lightning_sgdtp.sync import comm


class FrontEnd:
    """The strategy's fields both front ends keep, and what reads them."""

    _config: SGDTPConfig
    _dims: ParallelDims | None
    _engine: Any
    _num_nodes: int
    _process_group_backend: str | None
    _planner: dict[str, Any] | None
    _report: Any
    _guard: Any
    parallel_devices: list[torch.device] | None
    local_rank: int
    world_size: int

    @property
    def config(self) -> SGDTPConfig:
        return self._config

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def dims(self) -> ParallelDims | None:
        """Every parallel dimension, the rank grid and the meshes (known once the processes exist)."""
        return self._dims

    @property
    def engine(self) -> Any:
        """What runs the steps: the compiled engine or the pipelined one (chosen at setup)."""
        return self._engine

    @property
    def grad_sync(self) -> Any:
        return self._engine.grad_sync if self._engine is not None else None

    @property
    def dp_size(self) -> int:
        return self._dims.dp if self._dims is not None else self.num_nodes * self.num_processes

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def plan(self) -> dict[str, Any]:
        """Everything the plugin decided, as plain data (also written to ``sgdtp_plan.json`` next to the logs)."""
        return plan_dict(
            self._config, self._dims, self._engine, self._report.graph_breaks, world_size=self.world_size,
            dp_size=self.dp_size, num_nodes=self.num_nodes, process_group_backend=self._process_group_backend,
            planner=self._planner,
        )  # fmt: skip

    def _check_sizes(self) -> None:
        """Sizes that cannot work fail here, in the launching process, before any process starts (with
        ``parallelism="auto"``: at setup, once the planner chose)."""
        if not self._config.planned:
            ParallelDims.resolve(self._config, self.num_nodes * self.num_processes, self.num_processes, self.num_nodes)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        comm.barrier(self._guard, args[0] if args else "", self.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return comm.broadcast_object(self._guard, obj, src)


def strategy_signature(init: Callable[..., None]) -> inspect.Signature:
    """``SGDTPStrategy.__init__`` as LightningCLI and ``help()`` see it: its own parameters (``options``, Lightning's),
    then every option as a keyword-only parameter typed as its field (``None``: the option's default). An option
    is declared once, as a field here."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    hints = typing.get_type_hints(SGDTPConfig)
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hints[f.name] | None)
        for f in dataclasses.fields(SGDTPConfig)
    ]
    return inspect.Signature([*own, *options])


def strategy_docs() -> str:
    """``SGDTPStrategy.__init__``'s ``Args:``: ``options``, then each option's help text from :class:`SGDTPConfig`."""
    doc = inspect.cleandoc(SGDTPConfig.__doc__ or "")
    entries = textwrap.dedent(doc[doc.index("Args:") + len("Args:") :].strip("\n"))
    head = (
        'options: the design documents\' ``{"distributed": {"plugin": "sgdtp", "strategy": "data", ...}}``;'
        " explicit keyword arguments win over it."
    )
    summary = "The strategy's options: ``options`` and every field of :class:`SGDTPConfig` (``docs/options.md``)."
    return f"{summary}\n\nArgs:\n" + textwrap.indent(f"{head}\n{entries}", "    ") + "\n"
