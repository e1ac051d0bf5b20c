"""Which rank does what: one :class:`ParallelDims` of every parallel dimension, its rank grid and its meshes.

Every dimension is always present (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``ep``; 1 when unused),
their product is checked once against the world size, with errors that say what divides what, and every mesh and
process group is built once at setup (:meth:`ParallelDims.build_meshes`) and asked for by name (``dims.dp_group``,
``dims.tp_mesh``, ...): no engine, pass or report indexes a mesh by a string or builds one.

Data parallel is ``dp = dp_replicate x dp_shard``: the ranks a parameter is split over (``sharding``) and the
groups of them that hold replicas (``shard_size``: hybrid sharding). Three shapes of grid exist:

- tensor / hybrid: a ``dp x tp`` grid, one row per tensor-parallel group. The rows come from
  :func:`lightning_sgdtp.mesh.topology.rank_layout`: each group lies on the fastest links of one node; data parallel
  runs across rows (and nodes).
- pipeline (x data): a ``pp x dp`` grid, one row per stage. Pipelines run across nodes and data parallel inside
  them where the nodes allow it: a stage sends one activation per micro-batch to its neighbour, while data
  parallel all-reduces every gradient, so the fast intra-node links go to data parallel. Rank ``r`` is stage
  ``r // dp`` of pipeline ``r % dp``.
- pipeline x data x tensor: a ``pp x dp x tp`` grid (``parallelism="tensor"`` or ``"hybrid"`` with pipeline
  stages). Tensor parallel is innermost: a stage's tensor-parallel group is ``tp`` consecutive ranks (one node's
  fast links, as the launchers number ranks node by node), its replicas next, the stages outermost. Rank ``r`` is
  stage ``r // (dp * tp)``, replica ``r // tp % dp``, tensor-parallel rank ``r % tp``.

Data parallel alone has no grid: every rank is a replica, the data-parallel group is the world.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.mesh.topology import Topology, TopologyError, rank_layout
from lightning_sgdtp.parallel import TECHNIQUES
from lightning_sgdtp.parallel.pipeline.schedules import pipeline_stages
from lightning_sgdtp.parallel.technique import divisors


@dataclass(frozen=True)
class Meshes:
    """The meshes and groups of one :class:`ParallelDims`, built once at setup (every rank builds them together).

    ``world``: the ``DeviceMesh`` over the grid (``("dp", "tp")``, ``("pp", "dp")``, ``("pp", "dp", "tp")`` or
    hybrid sharding's ``("dp_replicate", "dp_shard", "tp")``), None for data parallel alone; ``dp_tp``: what a
    tensor-parallel parameter is sharded over (the world, or its ``("dp", "tp")`` part in a pipeline); ``shard``: what sharded parameters are split over (the ``dp`` mesh, or the 2-D
    ``("dp_replicate", "dp_shard")`` mesh of hybrid sharding)."""

    world: Any | None = None
    dp: Any | None = None
    tp: Any | None = None
    pp: Any | None = None
    shard: Any | None = None
    dp_tp: Any | None = None


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of every parallel dimension, the grid of global ranks and, once built, the meshes."""

    world_size: int
    devices_per_node: int
    num_nodes: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    #: Context parallel (sequence split across ranks in attention): room for it; 1 today.
    cp: int = 1
    tp: int = 1
    #: Expert parallel (MoE experts split over ranks, inside data parallel): room for it; 1 today.
    ep: int = 1
    #: Global ranks: rows of tensor-parallel groups (``dp x tp``) or of stages (``pp x dp``), or ``pp x dp x tp``
    #: (a pipeline with tensor parallel: a list of ``dp x tp`` grids); None: data parallel.
    grid: list[Any] | None = None
    #: With a pipeline: the stages of one pipeline (several per rank with the interleaved schedule) and the
    #: micro-batches per step; 0 without.
    stages: int = 0
    micro_batches: int = 0
    #: The axes of registered techniques that have no field here (name, size); 1 when not given.
    axes: tuple[tuple[str, int], ...] = ()
    meshes: Meshes | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        sizes = self.axis_sizes()
        if min((*sizes.values(), self.ep)) < 1 or math.prod(sizes.values()) != self.world_size:
            raise SGDTPConfigError(
                f"data-parallel size {self.dp} x tensor-parallel size {self.tp} must equal the world size"
                f" {self.world_size}: choose a tensor_parallel_size that divides {self.world_size}."
            )
        if (self.cp, self.ep) != (1, 1):
            raise SGDTPConfigError(
                f"context parallel (cp={self.cp}) and expert parallel (ep={self.ep}) are not built yet."
            )
        if self.devices_per_node % self.tp:
            raise SGDTPConfigError(
                f"tensor_parallel_size={self.tp} does not divide the {self.devices_per_node} devices of a node:"
                " a tensor-parallel group must lie inside one node (it needs the fastest links). Use a"
                f" tensor_parallel_size that divides {self.devices_per_node}"
                + (f", e.g. {self.devices_per_node}." if self.devices_per_node <= self.world_size else ".")
            )

    # ------------------------------------------------------------------------------------------- sizes
    def size(self, axis: str) -> int:
        """The ranks of ``axis`` (a field here, or a registered technique's axis; 1 when it has none)."""
        if axis in _FIELD_AXES:
            return getattr(self, axis)
        return dict(self.axes).get(axis, 1)

    def axis_sizes(self) -> dict[str, int]:
        """Every axis of the grid and its size, outermost first: data parallel's replicas, context parallel's room
        and each registered technique's axis. Their product is the world size (expert parallel borrows ranks)."""
        positions = {"dp_replicate": 1, "cp": 3} | {t.axis.name: t.axis.position for t in TECHNIQUES if t.axis}
        return {name: self.size(name) for name in sorted(positions, key=positions.__getitem__)}

    @property
    def dp(self) -> int:
        """Data-parallel size: the replicas of one batch (``dp_replicate x dp_shard``)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int | None:
        """Hybrid sharding: the ranks one parameter is split over (None: all the data-parallel ranks)."""
        return self.dp_shard if self.hybrid_shard_enabled else None

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def hybrid_shard_enabled(self) -> bool:
        """Parameters split inside groups of ``dp_shard`` ranks, replicated across ``dp_replicate`` groups."""
        return self.dp_shard > 1 and self.dp_replicate > 1

    @property
    def single_process(self) -> bool:
        return self.world_size == 1

    @property
    def on_mesh(self) -> bool:
        """The model is laid out over the world mesh (split or sharded parameters, pipeline stages); False: every
        rank a plain replica."""
        return self.grid is not None

    @property
    def sharded_checkpoints(self) -> bool:
        """A model laid out on a mesh is saved as a sharded folder, every rank writing its part; replicas alone
        write one file from rank 0."""
        return self.on_mesh

    # ------------------------------------------------------------------------------------------ resolve
    @classmethod
    def resolve(
        cls,
        config: SGDTPConfig,
        world_size: int,
        devices_per_node: int,
        num_nodes: int = 1,
        topology: Topology | None = None,
        fits: Callable[[int], bool] | None = None,
    ) -> ParallelDims:
        """The dimensions the options ask for on this cluster, or an error that says why not.

        Without ``topology`` (before any process starts) only the sizes are checked; with it, the grid is built.
        ``fits``: whether the model splits over a tensor-parallel size (its query heads divide): an automatic size
        is the largest one inside a fast-link island that fits.
        """
        base = {"world_size": world_size, "devices_per_node": devices_per_node, "num_nodes": num_nodes}
        if config.pipelined:
            pp = pipeline_size(config.pipeline_stages, world_size, num_nodes)
            config.check_pipeline_sizes(pp)
            per_stage = world_size // pp
            tp = (
                1
                if config.parallelism in ("data", "auto")
                else tensor_parallel_size(config, per_stage, devices_per_node, None, fits)
            )
            if config.parallelism in ("tensor", "hybrid") and tp == 1:
                why = "leaves one rank per stage" if per_stage == 1 else "gives a tensor-parallel size of 1"
                raise SGDTPConfigError(
                    f"parallelism={config.parallelism!r} with {pp} pipeline stages on {world_size} ranks {why}: no"
                    f" tensor-parallel group. Set pipeline_stages to {world_size} / (ranks per tensor-parallel group)"
                    " and tensor_parallel_size to 2 or more, e.g. pipeline_stages=2 with 4 ranks, or use"
                    " parallelism='data'."
                )
            dp = per_stage // tp
            # "node": the data-parallel ranks of one stage inside one node (a stage's ranks are consecutive)
            shard = hybrid_shard_size(config, dp, min(dp, max(devices_per_node // tp, 1)))
            grid: list[Any] = [[s * dp + d for d in range(dp)] for s in range(pp)]
            if tp > 1:  # tensor parallel innermost: a group is tp consecutive ranks (one node's fast links)
                grid = [[[s * per_stage + d * tp + t for t in range(tp)] for d in range(dp)] for s in range(pp)]
            stages = pipeline_stages(pp, config.pipeline_schedule, config.pipeline_stages_per_rank)
            return cls(
                **base, pp=pp, **_data_parallel(config, dp, shard), tp=tp, grid=grid,
                stages=stages, micro_batches=config.pipeline_micro_batches(pp),
            )  # fmt: skip
        if config.parallelism == "data":
            # Sharded: a ("dp", "tp") mesh with tp = 1 (the parameters are DTensors over its dp dimension).
            grid = [[r] for r in range(world_size)] if config.sharded else None
            shard = hybrid_shard_size(config, world_size, devices_per_node)
            return cls(**base, **_data_parallel(config, world_size, shard), grid=grid)
        tp = tensor_parallel_size(config, world_size, devices_per_node, topology, fits)
        shard = hybrid_shard_size(config, world_size // tp, max(devices_per_node // tp, 1))  # "node": dp ranks of one
        sizes = cls(**base, **_data_parallel(config, world_size // tp, shard), tp=tp)  # checked before the topology
        if topology is None:
            return sizes
        try:
            return dataclasses.replace(sizes, grid=rank_layout(topology, tp))
        except TopologyError as exc:
            raise SGDTPConfigError(str(exc)) from exc

    @classmethod
    def for_cluster(
        cls,
        config: SGDTPConfig,
        world_size: int,
        devices_per_node: int,
        num_nodes: int,
        device_type: str,
        fits: Callable[[int], bool] | None = None,
    ) -> tuple[ParallelDims, list[str]]:
        """The dimensions on the running cluster (the topology read for tensor parallel), their meshes built, and
        their log lines. Every rank must call it (the meshes are collectives). ``fits``: as for :meth:`resolve`."""
        from lightning_sgdtp.mesh import topology

        tensor = not config.pipelined and config.parallelism != "data"
        topo = topology.detect(device_type, devices_per_node, num_nodes) if tensor else None
        dims = cls.resolve(config, world_size, devices_per_node, num_nodes, topo, fits).build_meshes(device_type)
        lines = [f"topology: {topo.describe()}"] if topo is not None else []
        if dims.on_mesh:
            lines.append(dims.describe(config))
        return dims, lines

    # ------------------------------------------------------------------------------------------ meshes
    def build_meshes(self, device_type: str) -> ParallelDims:
        """These dimensions with every mesh built (collectives: every rank must call it, once, at setup)."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        world, names = None, self.mesh_dims or ()
        dp_tp = None
        if self.hybrid_shard_enabled and (self.tp_enabled or self.pp_enabled):  # the dp rows as replicas x shards
            pp = ("pp",) if self.pp_enabled else ()
            tp = ("tp",) if self.tp_enabled else ()
            names = (*pp, "dp_replicate", "dp_shard", *tp)
            sizes = [self.size(name) for name in names]
            world = DeviceMesh(
                device_type, torch.tensor(self.grid, dtype=torch.int).reshape(sizes), mesh_dim_names=names
            )
            shard = world["dp_replicate", "dp_shard"]
            dp = shard._flatten("dp")
            if self.pp_enabled and self.tp_enabled:
                dp_tp = world["dp_replicate", "dp_shard", "tp"]
        elif self.mesh_dims is not None:
            world = DeviceMesh(device_type, torch.tensor(self.grid, dtype=torch.int), mesh_dim_names=self.mesh_dims)
            dp = shard = world["dp"]
            if self.pp_enabled and self.tp_enabled:
                dp_tp = world["dp", "tp"]
        else:
            dp = shard = None
        if self.hybrid_shard_enabled and not self.tp_enabled and not self.pp_enabled:  # rows: the split groups
            grid = torch.arange(self.world_size, dtype=torch.int).reshape(self.dp_replicate, self.dp_shard)
            shard = DeviceMesh(device_type, grid, mesh_dim_names=("dp_replicate", "dp_shard"))
        meshes = Meshes(
            world=world, dp=dp, tp=world["tp"] if "tp" in names else None, pp=world["pp"] if "pp" in names else None,
            shard=shard, dp_tp=dp_tp if dp_tp is not None else world if self.tp_enabled else None,
        )  # fmt: skip
        return dataclasses.replace(self, meshes=meshes)

    def _built(self) -> Meshes:
        if self.meshes is None:
            raise RuntimeError("ParallelDims.build_meshes() has not run: the meshes are built once, at setup")
        return self.meshes

    @property
    def world_mesh(self) -> Any | None:
        """The 2-D ``DeviceMesh`` (``("dp", "tp")`` or ``("pp", "dp")``); None for data parallel alone."""
        return self._built().world

    @property
    def dp_mesh(self) -> Any | None:
        """The 1-D data-parallel mesh of this rank (None for data parallel alone: the world)."""
        return self._built().dp

    @property
    def tp_mesh(self) -> Any | None:
        """The 1-D tensor-parallel mesh of this rank's group (None without tensor parallel)."""
        return self._built().tp

    @property
    def shard_mesh(self) -> Any | None:
        """What sharded parameters are split over: the data-parallel mesh, or hybrid sharding's 2-D mesh."""
        return self._built().shard

    @property
    def dp_tp_mesh(self) -> Any | None:
        """With tensor parallel, the ``("dp", "tp")`` mesh a split parameter is sharded over (a 2-D DTensor; 3-D
        with hybrid sharding)."""
        return self._built().dp_tp

    @property
    def dp_group(self) -> Any:
        """This rank's data-parallel process group (the world's for data parallel alone)."""
        import torch.distributed as dist

        dp = self._built().dp
        return dp.get_group() if dp is not None else dist.group.WORLD

    @property
    def pp_group(self) -> Any:
        """This rank's pipeline process group (the ranks of its pipeline)."""
        return self._built().pp.get_group()

    # ---------------------------------------------------------------------------------------- queries
    @property
    def mesh_dims(self) -> tuple[str, ...] | None:
        """Names of the grid's dimensions: ``("pp", "dp")``, ``("pp", "dp", "tp")``, ``("dp", "tp")``, or None."""
        if self.pp_enabled:
            return ("pp", "dp", "tp") if self.tp_enabled else ("pp", "dp")
        return ("dp", "tp") if self.grid is not None else None

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp": .., "dp": .., "tp": ..}`` of global ``rank``."""
        if self.grid is None:
            return {"pp": 0, "dp": rank, "tp": 0}
        if self.pp_enabled and self.tp_enabled:
            per_stage = self.dp * self.tp
            return {"pp": rank // per_stage, "dp": rank // self.tp % self.dp, "tp": rank % self.tp}
        for row, ranks in enumerate(self.grid):
            if rank in ranks:
                col = ranks.index(rank)
                return {"pp": row, "dp": col, "tp": 0} if self.pp_enabled else {"pp": 0, "dp": row, "tp": col}
        raise ValueError(f"rank {rank} is not in the layout {self.grid}")

    def sampler_kwargs(self, rank: int) -> dict[str, int]:
        """``DistributedSampler`` arguments, sized by the data-parallel group: the ranks of one tensor-parallel
        group (or of one pipeline) read the same batches."""
        return {"num_replicas": self.dp, "rank": self.coordinates(rank)["dp"]}

    def describe(self, config: SGDTPConfig) -> str:
        """The one log line of this decision."""
        return self._describe_grid(config) + self._describe_hybrid_stages(config)

    def _describe_hybrid_stages(self, config: SGDTPConfig) -> str:
        if not (self.pp_enabled and self.hybrid_shard_enabled):
            return ""
        where = " (one node each)" if config.shard_size == "node" else ""
        return (
            f"; each stage's parameters split inside groups of {self.dp_shard} of its {self.dp} data-parallel ranks"
            f"{where}, replicated {self.dp_replicate} times (sharding={config.sharding},"
            f" shard_size={config.shard_size!r}: hybrid sharding)"
        )

    def _describe_grid(self, config: SGDTPConfig) -> str:
        if self.pp_enabled and self.tp_enabled:
            return (
                f"pipeline x data x tensor: {self.dp} pipeline(s) of {self.pp} stages, each stage on a tensor-parallel"
                f" group of {self.tp} ranks ({self.stages} stages, {config.pipeline_schedule}, {self.micro_batches}"
                f" micro-batches per step); grid pp x dp x tp {self.grid}"
            )
        if self.pp_enabled:
            return (
                f"pipeline: {self.dp} pipeline(s) of {self.pp} ranks ({self.stages} stages, {config.pipeline_schedule},"
                f" {self.micro_batches} micro-batches per step); stage groups (rows, data parallel inside each)"
                f" {self.grid}"
                + ("; pipelines run across nodes" if self.num_nodes > 1 and self.pp == self.num_nodes else "")
            )
        auto = config.tensor_parallel_size in (None, "auto")
        if not self.tp_enabled and self.hybrid_shard_enabled:
            groups = [list(range(g * self.shard, (g + 1) * self.shard)) for g in range(self.dp // self.shard)]
            where = " (one node each)" if config.shard_size == "node" else ""
            return (
                f"mesh dp={self.dp} as {self.dp // self.shard} x {self.shard}: parameters split inside each group of"
                f" {self.shard} ranks{where} {groups}, replicated across the groups (sharding={config.sharding},"
                f" shard_size={config.shard_size!r}: hybrid sharding)"
            )
        if not self.tp_enabled:
            return f"mesh dp={self.dp}: parameters split over the {self.dp} ranks (sharding={config.sharding})"
        hybrid = (
            f"; parameters split over groups of {self.dp_shard} rows, replicated {self.dp_replicate} times (hybrid"
            f" sharding x tensor parallel, 3-D mesh dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x"
            f" tp={self.tp})"
            if self.hybrid_shard_enabled
            else ""
        )
        return (
            f"mesh dp={self.dp} x tp={self.tp}: tensor-parallel groups {self.grid} (rows, each inside one node);"
            " data parallel across rows"
            + (
                " (tensor_parallel_size='auto': one fast-link island, or the largest part of one that divides every"
                " attention's query heads)"
                if auto
                else ""
            )
            + hybrid
        )


#: The name the first waves used; every attribute they read is still here.
ParallelLayout = ParallelDims
#: The axes with a field of their own in :class:`ParallelDims`.
_FIELD_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")


def _data_parallel(config: SGDTPConfig, dp: int, shard: int | None) -> dict[str, int]:
    """``dp_replicate`` x ``dp_shard`` of ``dp`` data-parallel ranks: all replicas (no sharding), one shard group of
    all of them (sharding), or groups of ``shard`` ranks (hybrid sharding)."""
    if not config.sharded:
        return {"dp_replicate": dp, "dp_shard": 1}
    size = shard or dp
    return {"dp_replicate": dp // size, "dp_shard": size}


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
            f" {world_size}. Use pipeline_stages from {divisors(world_size)[1:]}."
        )
    return pp


def tensor_parallel_size(
    config: SGDTPConfig,
    world_size: int,
    devices_per_node: int,
    topology: Topology | None,
    fits: Callable[[int], bool] | None = None,
) -> int:
    """Turn the user's ``tensor_parallel_size`` (an int, ``"auto"`` or None) into a size, or explain why not.
    ``fits``: whether the model splits over a size (``parallelism="hybrid"``'s automatic size is the largest divisor
    of one fast-link island that fits: 4 for 12 query heads on an island of 8)."""
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
    if auto and fits is not None:
        tp = max(d for d in divisors(tp) if world_size % d == 0 and (d == 1 or fits(d)))
    if world_size % tp:
        raise SGDTPConfigError(
            f"tensor_parallel_size={tp} does not divide the world size {world_size}"
            f" ({world_size // devices_per_node} node(s) x {devices_per_node} devices)."
        )
    return tp
