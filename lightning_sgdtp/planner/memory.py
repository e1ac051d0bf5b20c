"""The planner, part one: the memory a layout leaves on the fullest rank, predicted from the module alone.

Pure: reads names, shapes and dtypes (the module may be on the meta device), starts no process, touches no device.
A layout is plain data (:class:`Layout`: dp x tp x pp and the sharding); the prediction composes the decisions the
strategy itself makes for that layout, so that what it predicts is what the strategy would do:

- **pipeline stages** (``pp > 1``): :func:`~lightning_sgdtp.parallel.pipeline.split.plan_pipeline_split`'s split,
  a parameter held by every stage that uses it (a tied embedding and head on two stages), as a pipeline rank holds
  them after the other stages are released (``parallel/stage_memory.py``);
- **tensor parallel** (``tp > 1``): :func:`~lightning_sgdtp.parallel.tensor.plan.auto_plan`'s styles, a parameter of a
  split module held 1/tp, the others whole (what the plan leaves replicated; with sharding, embeddings too);
- **sharding** (``"full"`` / ``"optimizer"``): every parameter split over dp along
  :func:`~lightning_sgdtp.parallel.sharding.shard_dim` (whole where no dimension divides), as its gradient and its
  optimizer state; ``"full"`` also gathers one block at a time inside the step (the largest block, whole over dp),
  ``"optimizer"`` the whole parameters once per step.

Before the first step there is a second peak, the **setup** one (``RankMemory.setup``, :func:`setup_bytes`). It
depends on how the model was built: built whole with real weights (``materialized``; the strategy then moves it to
the device and broadcasts rank 0's weights), every rank holds the whole model, parameters and buffers, before
anything is divided; built on the meta device, each rank allocates only its part (its shards, tensor-parallel
slices, pipeline stages: ``RankMemory.parameters``) and fills it. No gradient or optimizer state exists yet.

Activations (and the pipeline's micro-batches in flight) depend on the batch: :func:`~lightning_sgdtp.planner.cost.
activation_bytes` predicts them and the search adds them (``RankMemory.activations``). Not predicted: the
allocator's overhead. Its parameter bytes are checked against what every rank held after ``fit`` in the support
matrix runs (``docs/model-support.json``; ``tests/unit/planner/test_planner_memory.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

SHARDINGS = ("none", "optimizer", "full")


class LayoutError(ValueError):
    """A layout that cannot exist (a size below 1, an unknown sharding, sharding without data parallel)."""


@dataclass(frozen=True)
class Layout:
    """How the ranks divide the model: ``dp`` replicas (or shards) x ``tp`` tensor-parallel ranks x ``pp`` stages;
    with sharding, ``shard_size`` ranks a parameter is split over (hybrid sharding; None: all ``dp``)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sharding: str = "none"
    shard_size: int | None = None
    #: The sizes of registered techniques' axes that have no field here (name, size).
    axes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for name, value in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp), *self.axes):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name}={value!r} must be an integer >= 1 (the number of ranks in that dimension)")
        if self.sharding not in SHARDINGS:
            raise LayoutError(f"sharding={self.sharding!r} is not known: one of {list(SHARDINGS)}")
        size = self.shard_size
        if size is not None and (self.sharding == "none" or not isinstance(size, int) or size < 1 or self.dp % size):
            raise LayoutError(f"shard_size={size!r} needs sharding and must divide dp={self.dp}")

    @property
    def shard_group(self) -> int:
        """Ranks a sharded parameter is split over (1 without sharding)."""
        return 1 if self.sharding == "none" else self.shard_size or self.dp

    def size(self, axis: str) -> int:
        """The ranks of ``axis`` (``"tp"``, ``"pp"``, or a registered technique's; 1 when it has none)."""
        return getattr(self, axis) if axis in ("dp", "tp", "pp") else dict(self.axes).get(axis, 1)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * math.prod(n for _, n in self.axes)

    def describe(self) -> str:
        sizes = [f"dp {self.dp}"] + [f"tp {self.tp}"] * (self.tp > 1) + [f"pp {self.pp}"] * (self.pp > 1)
        sizes += [f"{name} {n}" for name, n in self.axes if n > 1]
        text = " x ".join(sizes)
        if self.sharding != "none":
            text += f", sharding={self.sharding}" + (f" in groups of {self.shard_size}" if self.shard_size else "")
        return text


@dataclass(frozen=True)
class RankMemory:
    """Bytes on the fullest rank: parameters, gradients, optimizer state (``optimizer_states`` tensors per
    parameter: 2 for Adam / AdamW), the block ``sharding="full"`` gathers at a time, and the activations of a step
    (``cost.activation_bytes``; 0 where not predicted). ``total`` is the training peak; ``setup`` the bytes the
    rank needs before the first step (:func:`setup_bytes`), which can be the larger one for a model built whole."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int = 0
    activations: int = 0
    setup: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered + self.activations

    @property
    def peak(self) -> int:
        """What the rank must hold at some point: the setup peak or the training one, the larger (what must fit)."""
        return max(self.total, self.setup)

    def to_dict(self) -> dict[str, int]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "gathered": self.gathered,
            "activations": self.activations,
            "total": self.total,
            "setup": self.setup,
            "peak": self.peak,
        }


def _tp_split(module: nn.Module, layout: Layout) -> set[int]:
    """Ids of the parameters the automatic tensor plan splits over the ``tp`` ranks (with sharding, embeddings and a
    head tied to one stay whole over tp, as the strategy keeps them: ``sharding.keep_embeddings_whole``)."""
    if layout.tp == 1:
        return set()
    from lightning_sgdtp.parallel.sharding import keep_embeddings_whole
    from lightning_sgdtp.parallel.tensor.plan import SPLIT_STYLES, auto_plan

    plan = auto_plan(module, layout.tp)
    if layout.sharding != "none":
        keep_embeddings_whole(module, plan)
    return {
        id(p)
        for name, m in module.named_modules()
        if plan.styles.get(name) in SPLIT_STYLES
        for p in m._parameters.values()
        if p is not None
    }


def _stages(module: nn.Module, pp: int) -> list[dict[int, nn.Parameter]]:
    """The parameters each pipeline stage holds (one stage, everything, without a pipeline)."""
    if pp == 1:
        return [{id(p): p for p in module.parameters()}]
    from lightning_sgdtp.parallel.pipeline.split import plan_pipeline_split, stage_parameters

    return stage_parameters(module, plan_pipeline_split(module, pp))


def _bytes_on_rank(p: nn.Parameter, layout: Layout, tp_split: set[int]) -> int:
    from lightning_sgdtp.parallel.sharding import shard_dim

    size = p.numel() * p.element_size()
    shape = list(p.shape)
    if id(p) in tp_split and shape:  # the tensor-parallel shard (its exact dimension is the style's)
        size, shape[0] = math.ceil(size / layout.tp), math.ceil(shape[0] / layout.tp)
    if layout.sharding != "none" and shard_dim(tuple(shape), layout.shard_group) is not None:
        size = math.ceil(size / layout.shard_group)
    return size


def _largest_block(module: nn.Module, layout: Layout, tp_split: set[int]) -> int:
    """The block ``sharding="full"`` gathers whole over dp (its tensor-parallel shard), the largest one."""
    from lightning_sgdtp.parallel.checkpointing import find_block_stack

    found = find_block_stack(module)
    if found is None:
        return 0
    whole = Layout(tp=layout.tp)
    return max(
        (sum(_bytes_on_rank(p, whole, tp_split) for p in block.parameters()) for block in found[1].children()),
        default=0,
    )


def model_bytes(module: nn.Module) -> int:
    """The whole model's parameter and buffer bytes (a tied parameter counted once): what every rank holds at
    setup when the model is built whole, before it is split."""
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def is_materialized(module: nn.Module) -> bool:
    """Whether ``module`` was built with real weights (no parameter on the meta device): the strategy then holds
    the whole of it on every rank at setup; a model built on the meta device is materialized part by part."""
    return not any(p.is_meta for p in module.parameters())


def setup_bytes(module: nn.Module, layout: Layout, materialized: bool = False) -> int:
    """Bytes the fullest rank of ``layout`` holds at setup, before the first step: the whole model on every rank
    when it is built whole (``materialized``), only the rank's part of the parameters when it is built on the meta
    device (each rank allocates its shards, slices and stages; gradients and optimizer state come later)."""
    return predict_memory(module, layout, optimizer_states=0, materialized=materialized).setup


def predict_memory(
    module: nn.Module, layout: Layout, optimizer_states: int = 2, materialized: bool = False
) -> RankMemory:
    """Bytes on the fullest rank of ``layout`` for ``module``: its parameters, their gradients, ``optimizer_states``
    tensors of optimizer state per parameter (2: Adam, AdamW; 1: SGD with momentum; 0: plain SGD), and what is
    gathered during the step: under ``sharding="full"`` the largest block, under ``"optimizer"`` the rest of the
    parameters (they are split between steps only). Activations are not counted (see the module docstring).
    ``setup``: the bytes before the first step, the whole model when it is built whole (``materialized``), else
    the rank's parameters (:func:`setup_bytes`)."""
    if layout.sharding != "none" and layout.dp == 1:
        raise LayoutError(f"sharding={layout.sharding!r} splits over the data-parallel ranks, and dp=1 has none")
    tp_split = _tp_split(module, layout)
    stages = _stages(module, layout.pp)

    def fullest_stage(lay: Layout) -> int:
        return max(sum(_bytes_on_rank(p, lay, tp_split) for p in stage.values()) for stage in stages)

    fullest = fullest_stage(layout)
    gathered = 0
    if layout.sharding == "full":
        gathered = _largest_block(module, layout, tp_split)
    elif layout.sharding == "optimizer":  # the parameters are whole during the step: the rest of them gathered
        gathered = fullest_stage(Layout(dp=layout.dp, tp=layout.tp, pp=layout.pp)) - fullest
    # every parameter counted as trainable (a gradient and optimizer state each): frozen ones are not told apart yet
    setup = model_bytes(module) if materialized else fullest
    return RankMemory(fullest, fullest, optimizer_states * fullest, gathered, setup=setup)


def parameter_fraction(module: nn.Module, layout: Layout) -> float:
    """The share of the model's parameter bytes the fullest rank holds (a tied parameter counted once in the
    whole), the figure the support matrix measures after ``fit`` as ``holds``."""
    whole = sum(p.numel() * p.element_size() for p in module.parameters())
    return predict_memory(module, layout).parameters / max(whole, 1)


def table(
    module: nn.Module, layouts: list[Layout], optimizer_states: int = 2, materialized: bool = False
) -> list[dict[str, Any]]:
    """One row per layout: its description and predicted bytes on the fullest rank, smallest total first."""
    rows = [
        {"layout": layout.describe(), **predict_memory(module, layout, optimizer_states, materialized).to_dict()}
        for layout in layouts
    ]
    return sorted(rows, key=lambda r: r["total"])
