"""How a step is compiled: the one helper the compiled engine and ``sgdtp diagnose`` share, so the two cannot drift.

Logging and metrics are eager bookkeeping. Dynamo would trace into ``self.log`` (one recompile per metric name)
and into torchmetrics' ``Metric.forward`` (a recompile per step: the update counter is guarded on). Running them
eagerly costs one clean graph break each and keeps the graphs static.

A module the user compiled already (``torch.compile(model)``, ``model.compile()``) is taken back to the plain module
(:func:`adopt_compiled`) and its settings are kept for the step's compile: ``dynamic`` and ``fullgraph`` passed on,
the Inductor config of its ``mode`` and ``options`` given to the sgdtp backend's Inductor (:class:`UserCompile`).
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: The LightningModule methods that run eagerly inside a compiled step (besides every Metric's forward).
LOGGING_HOOKS = ("log", "log_dict")
#: ``torch.compile`` arguments the strategy does not pass on to its compile of the step.
NOT_PASSED_ON = ("name", "recompile_limit", "isolate_recompiles", "shapes_spec")


@dataclass(frozen=True)
class UserCompile:
    """A module's own ``torch.compile`` settings, as the strategy's compile of the step takes them. ``how``: what the
    user did; ``dynamic`` / ``fullgraph``: passed on (with ``fullgraph``, graph breaks are errors but for the eager
    bookkeeping's); ``inductor``: the Inductor config of its ``mode`` and ``options``, under the sgdtp backend's own;
    ``unused``: each setting the strategy cannot use, with why."""

    how: str
    dynamic: bool | None = None
    fullgraph: bool = False
    inductor: dict[str, Any] = field(default_factory=dict)
    unused: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """The one rank-0 line that says what was used and what not."""
        used = [f"dynamic={self.dynamic}"] if self.dynamic is not None else []
        used += ["fullgraph=True (but for self.log and metrics, run eagerly)"] if self.fullgraph else []
        used += [f"Inductor config {self.inductor}"] if self.inductor else []
        taken = f"with your {', '.join(used)}" if used else "(no setting of yours to pass on)"
        text = f"{self.how}: the step is compiled by the strategy, backend 'sgdtp', {taken}"
        return text + "".join(f"; not used: {key}: {why}" for key, why in self.unused.items())


#: module -> its :class:`UserCompile`, for :func:`compile_step` (weak: a module trained and dropped goes).
_ADOPTED: weakref.WeakKeyDictionary[nn.Module, UserCompile] = weakref.WeakKeyDictionary()
#: The modules :func:`adopt_compiled` has seen: Lightning assigns a module twice per call (fit, then connect).
_SEEN: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def user_compile(kwargs: dict[str, Any], how: str) -> UserCompile:
    """What the strategy takes of ``torch.compile(model, **kwargs)``: a pure function of the arguments."""
    backend = kwargs.get("backend") or "inductor"
    name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
    unused: dict[str, str] = {}
    inductor: dict[str, Any] = {}
    if name == "inductor":
        mode = kwargs.get("mode")  # (list_mode_options(None) lists every mode's)
        inductor = torch._inductor.list_mode_options(mode, kwargs.get("dynamic")) if mode else {}
        inductor = {**inductor, **(kwargs.get("options") or {})}
    else:
        its = [key for key in ("mode", "options") if kwargs.get(key)]
        key = f"backend={name!r}" + (f" and its {' and '.join(its)}" if its else "")
        unused[key] = "replaced by the strategy's 'sgdtp' backend: Inductor with the gradient sync in the graph"
    if inductor.pop("triton.cudagraphs", False):
        unused["CUDA graphs (triton.cudagraphs, of mode='reduce-overhead' / 'max-autotune')"] = (
            "the strategy does not capture its graphs, which hold the gradient collectives, in CUDA graphs"
        )
    for key in NOT_PASSED_ON:
        if kwargs.get(key) not in (None, False):
            unused[f"{key}={kwargs[key]!r}"] = "not passed on to the strategy's compile of the step"
    return UserCompile(how, kwargs.get("dynamic"), bool(kwargs.get("fullgraph")), inductor, unused)


def compile_kwargs(context: Any) -> dict[str, Any]:
    """The ``torch.compile`` arguments a Dynamo context was made with (``OptimizedModule.dynamo_ctx``, or the one a
    ``model.compile()`` function holds), as far as torch's objects keep them (``mode`` as its Inductor options)."""
    backend = getattr(context, "callback", None)
    for _ in range(8):  # torch's wrappers around the backend: each keeps the one inside
        backend = getattr(backend, "_torchdynamo_orig_backend", backend)
    kwargs = {"dynamic": getattr(context, "_dynamic", None), "fullgraph": getattr(context, "fullgraph", False) is True}
    if isinstance(backend, torch._TorchCompileInductorWrapper):
        kwargs["options"] = dict(backend.config)
    elif isinstance(backend, torch._TorchCompileWrapper):
        kwargs["backend"] = backend.compiler_name
    elif backend is not None:
        kwargs["backend"] = backend
    return kwargs


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
    user = _ADOPTED.get(module)
    # With the user's fullgraph=True, graph breaks are errors but for these (torch._dynamo.error_on_graph_break).
    allowed = torch._dynamo.error_on_graph_break(False) if user is not None and user.fullgraph else lambda f: f
    for owner, hook in bookkeeping_hooks(module):
        logging_without_trainer = owner is module and hook in LOGGING_HOOKS and not has_trainer
        eager = _no_log if logging_without_trainer else torch.compiler.disable(getattr(owner, hook))
        setattr(owner, hook, allowed(eager))


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
    included; a module with its own forward keeps its frame (its hooks eager, its forward compiled). A module the user
    had compiled (:func:`adopt_compiled`) is compiled with the settings of theirs that :class:`UserCompile` keeps."""
    from torch._dynamo import external_utils, trace_rules

    owner = getattr(fn, "__self__", None)
    top = owner.forward if isinstance(owner, nn.Module) and fn.__name__ == "_call_impl" else fn
    if isinstance(top, (types.FunctionType, types.MethodType)) and trace_rules.check(top):  # not a module itself
        fn = external_utils.wrap_inline(fn)
    user = _ADOPTED.get(owner) if isinstance(owner, nn.Module) else None  # the settings of the user's own compile
    if user is None:
        return torch.compile(fn, backend=backend)
    if isinstance(getattr(backend, "inductor_patches", None), dict):  # the sgdtp backend's own settings win
        backend.inductor_patches = {**user.inductor, **backend.inductor_patches}
    compiled = torch.compile(fn, backend=backend, dynamic=user.dynamic)
    return torch._dynamo.error_on_graph_break(True)(compiled) if user.fullgraph else compiled


def adopt_compiled(
    module: Any, say: Callable[[str], None], who: str = "trainer.fit()", fabric_kwargs: dict[str, Any] | None = None
) -> None:
    """Take back a module the user compiled already, in place, keeping its settings for :func:`compile_step`: Lightning's
    unwrapped ``torch.compile(model)`` (``_compiler_ctx``), ``model.compile()`` (``_compiled_call_impl``), or a
    wrapper Fabric stripped (``fabric_kwargs``: its arguments, which Fabric would re-apply around the strategy's module
    and so trace the step with the user's backend: set to ``disable=True``, a no-op). Submodules compiled by the user
    stay so: Dynamo traces them into the step. ``say``: told the one line of what was used (nothing: nothing was
    compiled); ``who``: the call that got the module. Anything but a real ``nn.Module`` (a
    ``Mock(spec=LightningModule)``) is left alone."""
    from torch._dynamo.eval_frame import OptimizedModule, _TorchDynamoContext

    if not issubclass(type(module), nn.Module):
        return
    if isinstance(module, OptimizedModule):  # Fabric's setup(..., _reapply_compile=False)
        from lightning_sgdtp.config import SGDTPConfigError

        raise SGDTPConfigError(
            f"{who} got a torch.compile()d {type(module._orig_mod).__name__} that it was told not to unwrap. The sgdtp"
            " strategy compiles the step itself: leave _reapply_compile at its default (it then takes your compile"
            " settings), or pass the plain module."
        )
    user: UserCompile | None = None
    context = getattr(module, "_compiler_ctx", None)
    if isinstance(context, dict) and context.get("compiler") == "dynamo":  # Lightning's from_compiled
        _restore_methods(module, context)
        user = user_compile(compile_kwargs(context.get("dynamo_ctx")), "torch.compile(model)")
    elif fabric_kwargs is not None:
        user = user_compile(fabric_kwargs, "torch.compile(model)")
        fabric_kwargs["disable"] = True
    impl = module.__dict__.get("_compiled_call_impl")
    if isinstance(impl, types.FunctionType):  # model.compile(): torch's function, its context in the closure
        cells = [c.cell_contents for c in impl.__closure__ or ()]
        context = next((c for c in cells if isinstance(c, _TorchDynamoContext)), None)
        user = user or user_compile(compile_kwargs(context), "model.compile()")
        module._compiled_call_impl = None
    compiled = [name for name, m in module.named_modules() if isinstance(m, OptimizedModule)]
    inside = f"submodule(s) {compiled[:5]} compiled by you: traced into the step (their settings apply outside it)"
    if user is not None:
        _ADOPTED[module] = user
        say(user.line() + (f"; {inside}" if compiled else ""))
    elif compiled and module not in _SEEN:
        say(inside)
    _SEEN.add(module)


def _restore_methods(module: nn.Module, context: dict[str, Any]) -> None:
    """Undo Lightning's ``from_compiled``: its ``original_<method>`` entries back on the module (the class's own
    method again where that is what it was), and the module no longer marked compiled."""
    for key, original in context.items():
        name = key.removeprefix("original_")
        if name == key:
            continue
        own = getattr(original, "__func__", None)
        if own is not None and own is getattr(type(module), name, None):
            module.__dict__.pop(name, None)
        else:
            setattr(module, name, original)
    module._compiler_ctx = None
