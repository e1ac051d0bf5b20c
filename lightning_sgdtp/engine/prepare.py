"""The per-part preparation both engines apply, in one visible order.

A "part" is what one compiled program runs: the whole LightningModule (the compiled engine) or one pipeline stage
(the pipelined engine, which splits first and then prepares each stage the same way). The order is fixed:

1. **tensor parallel** (DTensor, ``parallelize_module``): first, because the later steps must see the split
   parameters;
2. **sharding** over the data-parallel ranks (``sharding="full"|"optimizer"``, :mod:`~lightning_sgdtp.parallel.sharding`):
   after tensor parallel (a split parameter becomes a 2-D DTensor over ``("dp", "tp")``), before compile, so that
   Dynamo traces each parameter's all-gather and its gradient's reduce-scatter into the graphs;
3. **activation checkpointing** of each block (non-reentrant ``checkpoint_wrapper``): after the split, before
   compile, so that Dynamo traces each checkpointed block as one higher-order op and the recomputation stays
   inside the compiled region (the in-graph buckets are planned over the whole backward);
4. **compile** through the ``"sgdtp"`` backend: last. A stage module is compiled here; the compiled engine
   compiles the LightningModule's step methods (not its ``forward``) with the same helper,
   :func:`~lightning_sgdtp.engine.step_compile.compile_step`, when Lightning first calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_sgdtp.parallel.checkpointing import checkpoint_blocks
from lightning_sgdtp.parallel.sharding import ShardPlan, shard_parameters
from lightning_sgdtp.parallel.tensor import TensorPlan, apply_tensor_parallel


@dataclass
class PartPreparation:
    """What to apply to a part. ``None``/empty skips a step."""

    tensor_plan: TensorPlan | None = None
    tp_mesh: Any | None = None
    #: Sharding over the data-parallel ranks: ``"full"`` or ``"optimizer"`` (None: none), over ``dp_mesh`` (1-D);
    #: ``full_mesh`` is the ``("dp", "tp")`` mesh (tensor-parallel parameters become 2-D DTensors over it).
    sharding: str | None = None
    dp_mesh: Any | None = None
    full_mesh: Any | None = None
    gather_dtype: Any | None = None
    reduce_dtype: Any | None = None
    #: Names of the blocks to checkpoint (those the part holds are wrapped; activation_checkpointing=True).
    checkpoint: list[str] | None = None
    #: The ``"sgdtp"`` backend to compile the part's forward with (None: the caller compiles its step methods).
    backend: Callable[..., Any] | None = None


@dataclass
class Prepared:
    """What :func:`prepare_part` did: the blocks wrapped for activation checkpointing, the sharding plan."""

    checkpointed: list[str]
    shard_plan: ShardPlan | None = None


def prepare_part(part: nn.Module, how: PartPreparation) -> Prepared:
    """Apply ``how`` to ``part`` in place: tensor parallel, sharding, activation checkpointing, compile."""
    if how.tensor_plan is not None:
        apply_tensor_parallel(part, how.tensor_plan, how.tp_mesh)
    shard_plan = None
    if how.sharding is not None:
        shard_plan = shard_parameters(
            part, how.sharding, how.dp_mesh, how.full_mesh, how.gather_dtype, how.reduce_dtype
        )
    wrapped = checkpoint_blocks(part, [how.checkpoint]) if how.checkpoint else []
    if how.backend is not None:
        part.compile(backend=how.backend)
    return Prepared(wrapped, shard_plan)


def is_tensor_parallel(module: nn.Module) -> bool:
    """Whether tensor parallelism was applied already (some parameter is a DTensor)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())
