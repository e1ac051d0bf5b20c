"""Which rank does what: data-parallel x tensor-parallel sizes, their validation, and the device mesh.

:class:`ParallelDims` is plain data, checked in ``__post_init__`` with errors that say what divides what.
The rank layout comes from :func:`lightning_sgdtp.topology.rank_layout`: each tensor-parallel group (a row
of the mesh) lies on the fastest links of one node; data parallel runs across the rows (and the nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_sgdtp.config import SGDTPConfigError
from lightning_sgdtp.topology import Topology, TopologyError, rank_layout

MESH_DIMS = ("dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """``dp x tp == world_size``; ``tp`` ranks per tensor-parallel group, all on one node."""

    dp: int
    tp: int
    world_size: int
    devices_per_node: int

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1 or self.dp * self.tp != self.world_size:
            raise SGDTPConfigError(
                f"data-parallel size {self.dp} x tensor-parallel size {self.tp} must equal the world size"
                f" {self.world_size}: choose a tensor_parallel_size that divides {self.world_size}."
            )
        if self.devices_per_node % self.tp:
            raise SGDTPConfigError(
                f"tensor_parallel_size={self.tp} does not divide the {self.devices_per_node} devices of a node:"
                " a tensor-parallel group must lie inside one node (it needs the fastest links). Use a"
                f" tensor_parallel_size that divides {self.devices_per_node}"
                + (f", e.g. {self.devices_per_node}." if self.devices_per_node <= self.world_size else ".")
            )

    @classmethod
    def resolve(
        cls, parallelism: str, requested: Any, world_size: int, devices_per_node: int, topology: Topology | None
    ) -> ParallelDims:
        """Turn the user's ``tensor_parallel_size`` (an int, ``"auto"`` or None) into sizes, or explain why not."""
        if parallelism == "data":
            return cls(dp=world_size, tp=1, world_size=world_size, devices_per_node=devices_per_node)
        auto = requested in (None, "auto")
        if parallelism == "tensor":
            tp = world_size if auto else int(requested)
            if tp != world_size:
                raise SGDTPConfigError(
                    f"parallelism='tensor' uses every rank in one tensor-parallel group, but tensor_parallel_size="
                    f"{requested} != {world_size} ranks. Use parallelism='hybrid' to combine data parallel with"
                    f" tensor-parallel groups of {requested}, or drop tensor_parallel_size."
                )
            if world_size > devices_per_node:
                raise SGDTPConfigError(
                    f"parallelism='tensor' over {world_size} ranks spans nodes ({devices_per_node} devices per node);"
                    " tensor parallel needs the fastest links. Use parallelism='hybrid' (tensor parallel inside a"
                    " node, data parallel across nodes)."
                )
        else:
            tp = (topology.auto_tp_size() if topology is not None else devices_per_node) if auto else int(requested)
            if world_size % tp:
                raise SGDTPConfigError(
                    f"tensor_parallel_size={tp} does not divide the world size {world_size}"
                    f" ({world_size // devices_per_node} node(s) x {devices_per_node} devices)."
                )
        return cls(dp=world_size // tp, tp=tp, world_size=world_size, devices_per_node=devices_per_node)

    def layout(self, topology: Topology) -> list[list[int]]:
        """The ``dp x tp`` grid of global ranks (row = one tensor-parallel group)."""
        try:
            return rank_layout(topology, self.tp)
        except TopologyError as exc:
            raise SGDTPConfigError(str(exc)) from exc

    def coordinates(self, layout: list[list[int]], rank: int) -> tuple[int, int]:
        """(dp index, tp index) of ``rank`` in ``layout``."""
        for d, row in enumerate(layout):
            if rank in row:
                return d, row.index(rank)
        raise ValueError(f"rank {rank} is not in the layout {layout}")

    def build_mesh(self, device_type: str, layout: list[list[int]]) -> Any:
        """A 2-D ``DeviceMesh`` named ``("dp", "tp")`` over ``layout``. Every rank must call it (it makes groups)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device_type, torch.tensor(layout, dtype=torch.int), mesh_dim_names=MESH_DIMS)


@dataclass(frozen=True)
class PipelineDims:
    """``pp x dp == world_size``: ``pp`` ranks per pipeline (one stage, or several interleaved, each); ``dp``
    pipelines, each a data-parallel replica of the whole model.

    Pipelines run across nodes and data parallel inside them where the nodes allow it: a stage sends one
    activation per micro-batch to its neighbour, while data parallel all-reduces every gradient, so the fast
    intra-node links go to data parallel. Rank ``r`` is stage ``r // dp`` of pipeline ``r % dp``.
    """

    pp: int
    dp: int
    world_size: int

    @classmethod
    def resolve(cls, requested: int | None, world_size: int, num_nodes: int) -> PipelineDims:
        pp = requested if requested is not None else (num_nodes if num_nodes > 1 else world_size)
        if pp < 2 or world_size % pp:
            raise SGDTPConfigError(
                f"pipeline_stages={pp} must divide the {world_size} ranks (devices x num_nodes) and be >= 2:"
                f" {world_size} ranks make {world_size // max(pp, 1)} pipeline(s) of {pp} only when {pp} divides"
                f" {world_size}. Use pipeline_stages from {[d for d in range(2, world_size + 1) if world_size % d == 0]}."
            )
        return cls(pp=pp, dp=world_size // pp, world_size=world_size)

    def layout(self) -> list[list[int]]:
        """The ``pp x dp`` grid of global ranks (row = one stage; column = one pipeline)."""
        return [[s * self.dp + d for d in range(self.dp)] for s in range(self.pp)]

    def coordinates(self, rank: int) -> tuple[int, int]:
        """(pipeline index = data-parallel rank, stage index = pipeline rank) of ``rank``."""
        return rank % self.dp, rank // self.dp

    def build_mesh(self, device_type: str) -> Any:
        """A 2-D ``DeviceMesh`` named ``("pp", "dp")``. Every rank must call it (it makes groups)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device_type, torch.tensor(self.layout(), dtype=torch.int), mesh_dim_names=("pp", "dp"))
