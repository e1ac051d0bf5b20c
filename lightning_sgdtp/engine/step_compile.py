"""How a step is compiled: the one helper the compiled engine and ``sgdtp diagnose`` share, so the two cannot drift.

Logging and metrics are eager bookkeeping. Dynamo would trace into ``self.log`` (one recompile per metric name)
and into torchmetrics' ``Metric.forward`` (a recompile per step: the update counter is guarded on). Running them
eagerly costs one clean graph break each and keeps the graphs static.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn

#: The LightningModule methods that run eagerly inside a compiled step (besides every Metric's forward).
LOGGING_HOOKS = ("log", "log_dict")


def is_lightning_module(module: Any) -> bool:
    """A ``lightning.pytorch`` or ``pytorch_lightning`` LightningModule (without importing either)."""
    return any(
        c.__name__ == "LightningModule" and c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
        for c in type(module).__mro__
    )


def overrides(module: nn.Module, method: str) -> bool:
    """Whether the LightningModule's class defines ``method`` itself (not only Lightning's default)."""
    for cls in type(module).__mro__:
        if method in cls.__dict__:
            return cls.__name__ != "LightningModule"
    return False


def bookkeeping_hooks(module: nn.Module, installed: bool = False) -> list[tuple[Any, str]]:
    """The methods to run eagerly: Lightning's logging and every torchmetrics metric's forward.

    ``installed=False``: those not wrapped yet; ``installed=True``: those we wrapped (instance attributes).
    """
    from torchmetrics import Metric

    logging = LOGGING_HOOKS if is_lightning_module(module) else ()  # a plain module's own `log` is its business
    hooks: list[tuple[Any, str]] = [(module, hook) for hook in logging if hasattr(module, hook)]
    hooks += [(m, "forward") for m in module.modules() if isinstance(m, Metric)]
    return [(owner, hook) for owner, hook in hooks if (hook in owner.__dict__) == installed]


@torch.compiler.disable
def _no_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``self.log`` of a LightningModule without a Trainer (Lightning would warn at every call)."""


def run_bookkeeping_eagerly(module: nn.Module, keep_logging: bool = False) -> None:
    """Wrap the bookkeeping methods of ``module`` in ``torch.compiler.disable`` (instance attributes).
    ``keep_logging``: ``self.log`` works without a Trainer (Fabric's, set after setup): kept, not silenced."""
    has_trainer = keep_logging or getattr(module, "_trainer", None) is not None
    for owner, hook in bookkeeping_hooks(module):
        logging_without_trainer = owner is module and hook in LOGGING_HOOKS and not has_trainer
        setattr(owner, hook, _no_log if logging_without_trainer else torch.compiler.disable(getattr(owner, hook)))


def restore_bookkeeping(module: nn.Module) -> None:
    """Undo :func:`run_bookkeeping_eagerly`."""
    for owner, hook in bookkeeping_hooks(module, installed=True):
        delattr(owner, hook)


@contextlib.contextmanager
def bookkeeping_eagerly(module: nn.Module) -> Generator[None, None, None]:
    """:func:`run_bookkeeping_eagerly` for the duration (what ``sgdtp diagnose`` runs under)."""
    run_bookkeeping_eagerly(module)
    try:
        yield
    finally:
        restore_bookkeeping(module)


def compile_step(fn: Callable[..., Any], backend: Any) -> Callable[..., Any]:
    """The step as the strategy compiles it: the whole callable (``training_step``, a stage's forward) through
    ``backend`` (an :class:`~lightning_sgdtp.compiler.backend.SGDTPCompiler`, or a name or callable in diagnose).

    Dynamo never starts a frame in torch's own files: a module's call (Fabric's ``_call_impl``) whose ``forward``
    is torch's too (``nn.Sequential``, ``nn.TransformerEncoder``) would run wholly eager. Such a call gets torch's
    own extra frame (``wrap_inline``, what ``torch.compile(module)`` does for these), traced whole, hooks
    included; a module with its own forward keeps its frame (its hooks eager, its forward compiled)."""
    from torch._dynamo import external_utils, trace_rules

    owner = getattr(fn, "__self__", None)
    top = owner.forward if isinstance(owner, nn.Module) and fn.__name__ == "_call_impl" else fn
    if isinstance(top, (types.FunctionType, types.MethodType)) and trace_rules.check(top):  # not a module itself
        fn = external_utils.wrap_inline(fn)
    return torch.compile(fn, backend=backend)


def check_not_compiled(module: nn.Module, who: str = "trainer.fit()", stripped: bool = False) -> None:
    """Refuse a module the user compiled already (``torch.compile(model)`` or ``model.compile()``): the strategy
    compiles the step itself, with its own backend. ``who``: the call that got it, named in the error; ``stripped``:
    the caller removed a ``torch.compile`` wrapper before the strategy saw the module (Fabric does)."""
    from torch._dynamo.eval_frame import OptimizedModule

    from lightning_sgdtp.config import SGDTPConfigError

    compiled_in_place = getattr(module, "_compiled_call_impl", None) is not None
    what = "LightningModule" if who == "trainer.fit()" else type(getattr(module, "_orig_mod", module)).__name__
    wrapped = stripped or isinstance(module, OptimizedModule) or getattr(module, "_compiler_ctx", None) is not None
    if wrapped or compiled_in_place:
        raise SGDTPConfigError(
            f"{who} got a torch.compile()d {what}. The sgdtp strategy compiles the training step itself (with its"
            " own backend, which puts gradient communication in the graph): pass the plain"
            f" {'LightningModule' if who == 'trainer.fit()' else 'module'}, i.e. drop the torch.compile(...) call."
        )
    compiled = [name for name, m in module.named_modules() if isinstance(m, OptimizedModule)]
    if compiled:
        raise SGDTPConfigError(
            f"submodule(s) {compiled[:5]} of {type(module).__name__} are torch.compile()d. The sgdtp strategy"
            " compiles the whole training step itself; remove the torch.compile(...) call(s) from your model."
        )
