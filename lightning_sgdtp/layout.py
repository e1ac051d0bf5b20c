"""Which rank does what: one ``ParallelLayout`` of pipeline x data x tensor parallel sizes and its rank grid.

``pp x dp x tp == world_size``, checked with errors that say what divides what. Two shapes of grid exist today
(pipeline x tensor x data, 3-D, is refused by the config):

- tensor / hybrid: a ``dp x tp`` grid, one row per tensor-parallel group. The rows come from
  :func:`lightning_sgdtp.topology.rank_layout`: each group lies on the fastest links of one node; data parallel
  runs across rows (and nodes).
- pipeline (x data): a ``pp x dp`` grid, one row per stage. Pipelines run across nodes and data parallel inside
  them where the nodes allow it: a stage sends one activation per micro-batch to its neighbour, while data
  parallel all-reduces every gradient, so the fast intra-node links go to data parallel. Rank ``r`` is stage
  ``r // dp`` of pipeline ``r % dp``.

Data parallel alone has no grid: every rank is a replica, the data-parallel group is the world.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.topology import Topology, TopologyError, rank_layout


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension and, once known, the grid of global ranks of the 2-D mesh."""

    world_size: int
    devices_per_node: int
    num_nodes: int = 1
    pp: int = 1
    dp: int = 1
    tp: int = 1
    #: Rows of global ranks: tensor-parallel groups (``dp x tp``) or stages (``pp x dp``); None: data parallel.
    grid: list[list[int]] | None = None
    #: Hybrid sharding (``shard_size``): the data-parallel ranks one parameter is split over (None: all of them);
    #: consecutive ranks (one node's), replicated across the ``dp // shard`` groups.
    shard: int | None = None

    def __post_init__(self) -> None:
        if min(self.pp, self.dp, self.tp) < 1 or self.pp * self.dp * self.tp != self.world_size:
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

    # ------------------------------------------------------------------------------------------ resolve
    @classmethod
    def resolve(
        cls,
        config: SGDTPConfig,
        world_size: int,
        devices_per_node: int,
        num_nodes: int = 1,
        topology: Topology | None = None,
    ) -> ParallelLayout:
        """The layout the options ask for on this cluster, or an error that says why not.

        Without ``topology`` (before any process starts) only the sizes are checked; with it, the grid is built.
        """
        base = {"world_size": world_size, "devices_per_node": devices_per_node, "num_nodes": num_nodes}
        if config.pipelined:
            pp = pipeline_size(config.pipeline_stages, world_size, num_nodes)
            config.check_pipeline_sizes(pp)
            dp = world_size // pp
            return cls(**base, pp=pp, dp=dp, grid=[[s * dp + d for d in range(dp)] for s in range(pp)])
        if config.parallelism == "data":
            # Sharded: a ("dp", "tp") mesh with tp = 1 (the parameters are DTensors over its dp dimension).
            grid = [[r] for r in range(world_size)] if config.sharded else None
            return cls(**base, dp=world_size, grid=grid, shard=hybrid_shard_size(config, world_size, devices_per_node))
        tp = tensor_parallel_size(config, world_size, devices_per_node, topology)
        sizes = cls(**base, dp=world_size // tp, tp=tp)  # checked before the topology is asked for a grid
        if topology is None:
            return sizes
        try:
            return dataclasses.replace(sizes, grid=rank_layout(topology, tp))
        except TopologyError as exc:
            raise SGDTPConfigError(str(exc)) from exc

    @classmethod
    def for_cluster(
        cls, config: SGDTPConfig, world_size: int, devices_per_node: int, num_nodes: int, device_type: str
    ) -> tuple[ParallelLayout, list[str]]:
        """The layout on the running cluster (the topology read for tensor parallel) and its log lines."""
        from lightning_sgdtp import topology
        from lightning_sgdtp.parallel.pipeline import stages_per_rank

        tensor = not config.pipelined and config.parallelism != "data"
        topo = topology.detect(device_type, devices_per_node, num_nodes) if tensor else None
        layout = cls.resolve(config, world_size, devices_per_node, num_nodes, topo)
        lines = [f"topology: {topo.describe()}"] if topo is not None else []
        if layout.grid is not None:
            stages = layout.pp * stages_per_rank(config.pipeline_schedule, config.pipeline_stages_per_rank)
            lines.append(layout.describe(config, stages, config.pipeline_micro_batches(layout.pp)))
        return layout, lines

    # ---------------------------------------------------------------------------------------- queries
    @property
    def mesh_dims(self) -> tuple[str, str] | None:
        """Names of the 2-D mesh's dimensions: ``("pp", "dp")``, ``("dp", "tp")``, or None (no mesh)."""
        if self.pp > 1:
            return ("pp", "dp")
        return ("dp", "tp") if self.grid is not None else None

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp": .., "dp": .., "tp": ..}`` of global ``rank``."""
        if self.grid is None:
            return {"pp": 0, "dp": rank, "tp": 0}
        for row, ranks in enumerate(self.grid):
            if rank in ranks:
                col = ranks.index(rank)
                return {"pp": row, "dp": col, "tp": 0} if self.pp > 1 else {"pp": 0, "dp": row, "tp": col}
        raise ValueError(f"rank {rank} is not in the layout {self.grid}")

    def sampler_kwargs(self, rank: int) -> dict[str, int]:
        """``DistributedSampler`` arguments, sized by the data-parallel group: the ranks of one tensor-parallel
        group (or of one pipeline) read the same batches."""
        return {"num_replicas": self.dp, "rank": self.coordinates(rank)["dp"]}

    def build_mesh(self, device_type: str) -> Any | None:
        """The 2-D ``DeviceMesh`` over the grid (None for data parallel alone). Every rank must call it."""
        if self.mesh_dims is None:
            return None
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh(device_type, torch.tensor(self.grid, dtype=torch.int), mesh_dim_names=self.mesh_dims)

    def build_shard_mesh(self, device_type: str) -> Any | None:
        """Hybrid sharding: the ``("dp_replicate", "dp_shard")`` mesh (rows: the groups a parameter is split over);
        None otherwise. Every rank must call it."""
        if self.shard is None:
            return None
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        grid = torch.arange(self.world_size, dtype=torch.int).reshape(self.dp // self.shard, self.shard)
        return DeviceMesh(device_type, grid, mesh_dim_names=("dp_replicate", "dp_shard"))

    def describe(self, config: SGDTPConfig, stages: int = 0, micro_batches: int = 0) -> str:
        """The one log line of this decision."""
        if self.pp > 1:
            return (
                f"pipeline: {self.dp} pipeline(s) of {self.pp} ranks ({stages} stages, {config.pipeline_schedule},"
                f" {micro_batches} micro-batches per step); stage groups (rows, data parallel inside each)"
                f" {self.grid}"
                + ("; pipelines run across nodes" if self.num_nodes > 1 and self.pp == self.num_nodes else "")
            )
        auto = config.tensor_parallel_size in (None, "auto")
        if self.tp == 1 and self.shard is not None:
            groups = [list(range(g * self.shard, (g + 1) * self.shard)) for g in range(self.dp // self.shard)]
            where = " (one node each)" if config.shard_size == "node" else ""
            return (
                f"mesh dp={self.dp} as {self.dp // self.shard} x {self.shard}: parameters split inside each group of"
                f" {self.shard} ranks{where} {groups}, replicated across the groups (sharding={config.sharding},"
                f" shard_size={config.shard_size!r}: hybrid sharding)"
            )
        if self.tp == 1:
            return f"mesh dp={self.dp}: parameters split over the {self.dp} ranks (sharding={config.sharding})"
        return (
            f"mesh dp={self.dp} x tp={self.tp}: tensor-parallel groups {self.grid} (rows, each inside one node);"
            " data parallel across rows" + (" (tensor_parallel_size='auto': one fast-link island)" if auto else "")
        )


def hybrid_shard_size(config: SGDTPConfig, dp: int, devices_per_node: int) -> int | None:
    """``shard_size`` in ranks (None: split over all ``dp`` ranks), or an error naming the sizes that fit."""
    size = devices_per_node if config.shard_size == "node" else config.shard_size
    if size is None or not config.sharded:
        return None
    if dp % size:
        raise SGDTPConfigError(
            f"shard_size={config.shard_size!r} ({size} ranks) does not divide the {dp} data-parallel ranks: use a"
            f" divisor of {dp} (e.g. {max(d for d in range(1, dp + 1) if dp % d == 0 and d <= size)}), 'node', or None."
        )
    return None if size == dp else size


def pipeline_size(requested: int | None, world_size: int, num_nodes: int) -> int:
    """Ranks per pipeline: ``pipeline_stages``, or one pipeline per node when there are several, else all ranks."""
    pp = requested if requested is not None else (num_nodes if num_nodes > 1 else world_size)
    if pp < 2 or world_size % pp:
        raise SGDTPConfigError(
            f"pipeline_stages={pp} must divide the {world_size} ranks (devices x num_nodes) and be >= 2:"
            f" {world_size} ranks make {world_size // max(pp, 1)} pipeline(s) of {pp} only when {pp} divides"
            f" {world_size}. Use pipeline_stages from {[d for d in range(2, world_size + 1) if world_size % d == 0]}."
        )
    return pp


def tensor_parallel_size(config: SGDTPConfig, world_size: int, devices_per_node: int, topology: Topology | None) -> int:
    """Turn the user's ``tensor_parallel_size`` (an int, ``"auto"`` or None) into a size, or explain why not."""
    requested = config.tensor_parallel_size
    auto = requested in (None, "auto")
    if config.parallelism == "tensor":
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
        return tp
    tp = (topology.auto_tp_size() if topology is not None else devices_per_node) if auto else int(requested)
    if world_size % tp:
        raise SGDTPConfigError(
            f"tensor_parallel_size={tp} does not divide the world size {world_size}"
            f" ({world_size // devices_per_node} node(s) x {devices_per_node} devices)."
        )
    return tp
