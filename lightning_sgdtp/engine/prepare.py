"""The per-part preparation both engines apply, in one visible order.

A "part" is what one compiled program runs: the whole LightningModule (the compiled engine) or one pipeline stage
(the pipelined engine, which splits first and then prepares each stage the same way). The order is fixed:

1. **tensor parallel** (DTensor, ``parallelize_module``): first, because the later steps must see the split
   parameters;
2. **activation checkpointing** of each block (non-reentrant ``checkpoint_wrapper``): after the split, before
   compile, so that Dynamo traces each checkpointed block as one higher-order op and the recomputation stays
   inside the compiled region (the in-graph buckets are planned over the whole backward);
3. **compile** through the ``"sgdtp"`` backend: last. A stage module is compiled here; the compiled engine
   compiles the LightningModule's step methods (not its ``forward``) with the same helper,
   :func:`~lightning_sgdtp.engine.step_compile.compile_step`, when Lightning first calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_sgdtp.parallel.checkpointing import checkpoint_blocks
from lightning_sgdtp.parallel.tensor import TensorPlan, apply_tensor_parallel


@dataclass
class PartPreparation:
    """What to apply to a part. ``None``/empty skips a step."""

    tensor_plan: TensorPlan | None = None
    tp_mesh: Any | None = None
    #: Names of the blocks to checkpoint (those the part holds are wrapped; activation_checkpointing=True).
    checkpoint: list[str] | None = None
    #: The ``"sgdtp"`` backend to compile the part's forward with (None: the caller compiles its step methods).
    backend: Callable[..., Any] | None = None


def prepare_part(part: nn.Module, how: PartPreparation) -> list[str]:
    """Apply ``how`` to ``part`` in place: tensor parallel, activation checkpointing, compile. Returns the names
    of the blocks wrapped for activation checkpointing."""
    if how.tensor_plan is not None:
        apply_tensor_parallel(part, how.tensor_plan, how.tp_mesh)
    wrapped = checkpoint_blocks(part, [how.checkpoint]) if how.checkpoint else []
    if how.backend is not None:
        part.compile(backend=how.backend)
    return wrapped


def is_tensor_parallel(module: nn.Module) -> bool:
    """Whether tensor parallelism was applied already (some parameter is a DTensor)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())
