"""``diagnose(module, example_batch)``: what will go wrong when the sgdtp strategy compiles this step, and what to do.

It runs the step the way the strategy does (``torch.compile(module.training_step, backend=SGDTPCompiler(...))``
for a LightningModule, the module's forward for a plain ``nn.Module``, or your ``step_fn``), through the helpers
the strategy's compiled engine uses (:mod:`lightning_sgdtp.engine.step_compile`: the same compile call, the same
eager ``self.log`` and torchmetrics ``Metric.forward``), and reports:

- ``graph_break``: every graph break, with Dynamo's reason and your source line (``torch._dynamo.explain``);
- ``recompile``: every recompilation and the guard that failed. The step runs on the example batch, again with
  another ``batch_idx``, on a batch whose first dimension differs (or ``other_batches``), and on the example
  batch again;
- ``mixed_devices``: parameters and buffers on more than one device (``meta`` included);
- ``custom_op_device`` / ``custom_op_spec``: ops of :mod:`lightning_sgdtp.graph` called with tensors their
  specs refuse (an op registered for ``cuda`` called with CPU tensors, a wrong dtype or rank);
- ``compile_cache``: a compile cache written by another torch build or another user (cache pollution);
- ``compile_error``: anything else that stops the step from compiling or running.

Each finding has a severity (``error``, ``warning``, ``info``), a message, where it is (file:line and the source
line, when known) and ``fix``: what to do. ``print(diagnosis)`` gives plain text, ``diagnosis.to_json()`` JSON;
``sgdtp diagnose path/to/file.py:make [--json]`` is the same from a shell.

Running it resets TorchDynamo's caches (``torch._dynamo.reset()``), and it leaves the module as it found it:
the parameters' ``.grad``, buffers (e.g. BatchNorm statistics), metric states and train/eval mode. It runs forward
and backward, never an optimizer step.

Each check is a module with ``check(ctx)`` (:mod:`.devices`, :mod:`.graph_breaks`, :mod:`.recompiles`,
:mod:`.custom_ops`, :mod:`.compile_cache_hygiene`), reads a :class:`~.context.DiagnoseContext` and returns a
:class:`~.report.CheckResult`; what one check needs from another is passed to it as data, and :func:`diagnose`
merges the results once. The package is callable: ``lightning_sgdtp.diagnose(...)`` is :func:`diagnose`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import time
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_sgdtp.diagnose import compile_cache_hygiene, custom_ops, devices, graph_breaks, recompiles
from lightning_sgdtp.diagnose.compile_cache_hygiene import CACHE_MARKER, cache_identity, cache_path, check_compile_cache
from lightning_sgdtp.diagnose.context import DiagnoseContext
from lightning_sgdtp.diagnose.report import SEVERITIES, CheckResult, Diagnosis, Finding
from lightning_sgdtp.graph.registry import record_spec_errors

__all__ = [
    "CACHE_MARKER",
    "SEVERITIES",
    "CheckResult",
    "DiagnoseContext",
    "Diagnosis",
    "Finding",
    "cache_identity",
    "cache_path",
    "check_compile_cache",
    "diagnose",
]


def diagnose(
    module: nn.Module,
    example_batch: Any,
    step_fn: Callable[[Any], Any] | None = None,
    *,
    other_batches: Iterable[Any] | None = None,
    backend: str | Callable[..., Any] = "sgdtp",
    backward: bool = True,
    check_cache: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    write_cache_marker: bool = True,
) -> Diagnosis:
    """Compile the step the way the sgdtp strategy does, on ``example_batch``, and report what goes wrong.

    Args:
        module: a LightningModule (its ``training_step(batch, batch_idx)`` is diagnosed) or a plain ``nn.Module``
            (its forward: ``module(*batch)`` for a tuple batch, else ``module(batch)``).
        example_batch: one batch, as the DataLoader yields it.
        step_fn: diagnose ``step_fn(batch)`` instead (a closure over ``module``).
        other_batches: batches to run after the example batch to look for recompilations. Default: one batch
            whose first dimension differs from the example's. ``[]`` to skip.
        backend: ``"sgdtp"`` (the strategy's ``SGDTPCompiler``), another TorchDynamo backend name (``"aot_eager"``
            is fast) or a backend callable.
        backward: also run backward once through the compiled step (compiles the backward graphs).
        check_cache: check Inductor's compile cache for files of another torch build or another user.
        cache_dir: the cache directory to check (default: ``TORCHINDUCTOR_CACHE_DIR``, else Inductor's default).
        write_cache_marker: write the version marker into a healthy cache directory that has none.
    """
    start = time.monotonic()
    ctx = DiagnoseContext.create(
        module,
        example_batch,
        step_fn,
        other_batches=other_batches,
        backend=backend,
        backward=backward,
        cache_dir=cache_dir,
        write_cache_marker=write_cache_marker,
    )
    placed = devices.check(ctx)
    results: list[CheckResult] = [placed]
    explained: list[Finding] = []
    if placed.runnable:
        ctx = dataclasses.replace(ctx, batch=placed.batch)
        with record_spec_errors() as spec_errors:
            traced = graph_breaks.check(ctx)
            results.append(traced)
            ops_used = set(traced.ops_used)
            if traced.traced:  # recompiles only when the graph breaks are explained
                recompiled = recompiles.check(ctx)
                results.append(recompiled)
                ops_used |= recompiled.ops_used
        ran = [f for r in results for f in r.findings if f.check == "compile_error"]
        ops = custom_ops.check(ctx, spec_errors, ops_used, compile_errors=ran)
        results.append(ops)
        explained = ops.explained
        torch._dynamo.reset()
    if check_cache:
        results.append(compile_cache_hygiene.check(ctx))

    findings = [f for r in results for f in r.findings if not any(f is e for e in explained)]
    stats: dict[str, Any] = {"kind": ctx.kind}
    for r in results:
        stats.update(r.stats)
    stats["seconds"] = round(time.monotonic() - start, 2)
    return Diagnosis(target=ctx.target, backend=ctx.backend_name, findings=findings, stats=stats)


class _CallableModule(types.ModuleType):
    """``lightning_sgdtp.diagnose`` is this package and, called, :func:`diagnose`: both ``lightning_sgdtp.diagnose(
    module, batch)`` and ``lightning_sgdtp.diagnose.check_compile_cache(path)`` work."""

    def __call__(self, *args: Any, **kwargs: Any) -> Diagnosis:
        return diagnose(*args, **kwargs)


__signature__ = inspect.signature(diagnose)
sys.modules[__name__].__class__ = _CallableModule
