"""What every check gets: :class:`DiagnoseContext`, the step to diagnose resolved once (which callable, called
how, on which batch, with which backend), and :func:`running`, the one way a check runs the step.

A check that runs the step does so inside :func:`running`: in train mode, with the strategy's eager bookkeeping
(:func:`lightning_sgdtp.engine.step_compile.bookkeeping_eagerly`: ``self.log``/``self.log_dict`` and every
torchmetrics ``Metric.forward``, exactly as in training), and with the module restored afterwards: parameters'
``.grad``, buffers (e.g. BatchNorm statistics), metric states and train/eval mode.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from lightning_sgdtp.engine.step_compile import bookkeeping_eagerly, is_lightning_module, overrides

#: ``make_args(batch, batch_idx)``: the positional arguments of one call of the step.
MakeArgs = Callable[[Any, int], tuple[Any, ...]]


@dataclass(frozen=True)
class DiagnoseContext:
    """The step under diagnosis, resolved once by :meth:`create`; checks read it and never change it."""

    module: nn.Module
    batch: Any
    fn: Callable[..., Any]
    make_args: MakeArgs
    target: str
    kind: str  # "LightningModule", "nn.Module" or "step_fn"
    takes_batch_idx: bool  # training_step(batch, batch_idx): vary batch_idx too
    backend: str | Callable[..., Any] = "sgdtp"
    backward: bool = True
    other_batches: tuple[Any, ...] | None = None
    cache_dir: str | None = None
    write_cache_marker: bool = True

    @classmethod
    def create(
        cls,
        module: nn.Module,
        batch: Any,
        step_fn: Callable[[Any], Any] | None = None,
        *,
        other_batches: Iterable[Any] | None = None,
        backend: str | Callable[..., Any] = "sgdtp",
        backward: bool = True,
        cache_dir: str | os.PathLike[str] | None = None,
        write_cache_marker: bool = True,
    ) -> DiagnoseContext:
        name = type(module).__name__
        lightning = is_lightning_module(module)
        kind = "step_fn" if step_fn is not None else ("LightningModule" if lightning else "nn.Module")
        fn: Callable[..., Any]
        if step_fn is not None:
            label = getattr(step_fn, "__qualname__", None) or type(step_fn).__name__
            target, fn, make_args = f"{label} (step_fn of {name})", step_fn, _batch_only
        elif lightning and overrides(module, "training_step"):
            target, fn, make_args = f"{name}.training_step", module.training_step, _batch_and_idx
        else:
            target, fn, make_args = f"{name}.forward", module, _forward_args
        return cls(
            module=module,
            batch=batch,
            fn=fn,
            make_args=make_args,
            target=target,
            kind=kind,
            takes_batch_idx=make_args is _batch_and_idx,
            backend=backend,
            backward=backward,
            other_batches=None if other_batches is None else tuple(other_batches),
            cache_dir=None if cache_dir is None else str(cache_dir),
            write_cache_marker=write_cache_marker,
        )

    @property
    def backend_name(self) -> str:
        b = self.backend
        return b if isinstance(b, str) else getattr(b, "__name__", type(b).__name__)


def _batch_only(batch: Any, batch_idx: int) -> tuple[Any, ...]:
    return (batch,)


def _batch_and_idx(batch: Any, batch_idx: int) -> tuple[Any, ...]:
    return (batch, batch_idx)


def _forward_args(batch: Any, batch_idx: int) -> tuple[Any, ...]:
    return tuple(batch) if isinstance(batch, tuple) else (batch,)


# --------------------------------------------------------------------------------------------- running the step
@contextlib.contextmanager
def running(module: nn.Module) -> Generator[None, None, None]:
    """Train mode and the strategy's eager bookkeeping during; grads, buffers, metric states and mode restored
    after. Not reentrant (the bookkeeping wrappers are removed on exit): one per check."""
    from torchmetrics import Metric

    was_training = module.training
    grads = {p: p.grad for p in module.parameters()}
    buffers = {b: b.detach().clone() for b in module.buffers()}
    metrics = {
        m: (m._copy_state_dict(), m._update_count, m._computed, m._forward_cache)
        for m in module.modules()
        if isinstance(m, Metric)
    }
    module.train()
    try:
        with bookkeeping_eagerly(module):
            yield
    finally:
        with torch.no_grad():
            for b, value in buffers.items():
                b.copy_(value)
        for p, g in grads.items():
            p.grad = g
        for m, (state, count, computed, cache) in metrics.items():
            for attr, value in state.items():
                setattr(m, attr, value)
            m._update_count, m._computed, m._forward_cache = count, computed, cache
        module.train(was_training)


# ------------------------------------------------------------------------------------------------- batches
def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a batch or an output (any pytree: tuples, lists, dicts, namedtuples)."""
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return tree_map_only(torch.Tensor, fn, obj)


def resized(batch: Any) -> tuple[Any, str] | None:
    """The batch with its first dimension halved (4 or more) or doubled; ``None`` if it has no such tensor."""
    sizes = {t.shape[0] for t in tensors(batch) if t.dim() >= 1}
    if not sizes:
        return None
    n = max(sizes)
    m = n // 2 if n >= 4 else 2 * n

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != n:
            return t
        return t[:m].clone() if m < n else torch.cat([t, t])

    return map_tensors(batch, resize), f"a batch whose first dimension is {m} instead of {n}"


def loss_of(output: Any) -> torch.Tensor | None:
    """The scalar to run backward on: ``output``, ``output["loss"]`` or the first tensor that requires grad."""
    if isinstance(output, dict):
        output = output.get("loss")
    elif isinstance(output, (list, tuple)):
        output = next((o for o in tensors(output) if o.requires_grad), None)
    if isinstance(output, torch.Tensor) and output.requires_grad and output.is_floating_point():
        return output if output.numel() == 1 else output.float().sum()
    return None
