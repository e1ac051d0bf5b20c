"""Register ``strategy="sgdtp"`` in Lightning's strategy registries: the Trainer's and Fabric's.

Lightning ships the same trainer under two namespaces: ``lightning.pytorch`` and the standalone
``pytorch_lightning`` (whose classes are distinct: a ``lightning.pytorch`` strategy is not a
``pytorch_lightning`` strategy). ``lightning_sgdtp/frontends/trainer.py`` is written against
``lightning.pytorch``/``lightning.fabric`` and is, with Fabric's, the only module of this package that imports
Lightning (the core they share, ``frontends/job.py``, does not). For ``pytorch_lightning`` we build a *twin* the way Lightning itself produces
``pytorch_lightning`` from the ``lightning.pytorch`` sources: the source text of ``trainer.py`` is
rewritten (``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` ->
``lightning_fabric``) and executed as the module ``lightning_sgdtp._pl_strategy``.

The twin module is importable by name (a tiny ``sys.meta_path`` finder serves it), so instances
of the twin pickle and unpickle like any other class, e.g. into spawned worker processes.

Fabric's strategy (``lightning_sgdtp/frontends/fabric.py``, ``lightning.fabric`` only) gets the same treatment:
its twin ``lightning_sgdtp._lf_strategy`` is built for the standalone ``lightning_fabric``.

This module never imports Lightning by itself: ``lightning.pytorch`` comes in through
``lightning_sgdtp.frontends.trainer``; ``pytorch_lightning`` only when the user already imported it (or
asks for it explicitly with ``register_strategies(pytorch_lightning=True)``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
import threading
from typing import Any

STRATEGY_NAME = "sgdtp"
DESCRIPTION = "lightning-sgdtp: compiled training step with gradient communication in the compiled backward"

#: twin module -> the source module it is rewritten from.
_TWINS = {
    "lightning_sgdtp._pl_strategy": "lightning_sgdtp.frontends.trainer",
    "lightning_sgdtp._lf_strategy": "lightning_sgdtp.frontends.fabric",
}
_PL_TWIN_MODULE = "lightning_sgdtp._pl_strategy"
#: namespace -> (the module of its class, the class, the registry's attribute in ``<namespace>.strategies``).
_CLASSES = {
    "lightning.pytorch": ("lightning_sgdtp.frontends.trainer", "SGDTPStrategy", "StrategyRegistry"),
    "pytorch_lightning": ("lightning_sgdtp._pl_strategy", "SGDTPStrategy", "StrategyRegistry"),
    "lightning.fabric": ("lightning_sgdtp.frontends.fabric", "SGDTPFabricStrategy", "STRATEGY_REGISTRY"),
    "lightning_fabric": ("lightning_sgdtp._lf_strategy", "SGDTPFabricStrategy", "STRATEGY_REGISTRY"),
}
_NAMESPACES = tuple(_CLASSES)

# `lightning.pytorch` -> `pytorch_lightning`, `lightning.fabric` -> `lightning_fabric`; the lookbehind
# keeps e.g. `foo.lightning.pytorch` or `my_lightning.pytorch` untouched.
_REWRITE = re.compile(r"(?<![\w.])lightning\.(pytorch|fabric)\b")
_REWRITE_TO = {"pytorch": "pytorch_lightning", "fabric": "lightning_fabric"}

_lock = threading.RLock()


def rewrite_for_pytorch_lightning(source: str) -> str:
    """Return ``source`` with ``lightning.pytorch``/``lightning.fabric`` rewritten to the standalone packages.

    Line numbers are preserved, so tracebacks through the twin point at the right lines of the source.
    """
    return _REWRITE.sub(lambda m: _REWRITE_TO[m.group(1)], source)


def _source_spec(source_module: str) -> importlib.machinery.ModuleSpec:
    spec = importlib.util.find_spec(source_module)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot locate the source of {source_module} to build its standalone-package twin")
    return spec


class _PLTwinLoader(importlib.abc.Loader):
    """Executes the rewritten source of a strategy module (``frontends/trainer.py``, ``frontends/fabric.py``) as its twin."""

    def __init__(self, source_spec: importlib.machinery.ModuleSpec) -> None:
        self.source_spec = source_spec
        self.source_module: str = source_spec.name
        self.path: str = source_spec.origin  # type: ignore[assignment]

    def _original_source(self) -> str:
        get_source = getattr(self.source_spec.loader, "get_source", None)
        source = get_source(self.source_module) if get_source is not None else None
        if source is None:
            if not self.path.endswith(".py"):
                raise ImportError(f"no source available for {self.source_module} ({self.path}); cannot build its twin")
            with open(self.path, "rb") as fh:
                source = importlib.util.decode_source(fh.read())
        return source

    def get_filename(self, fullname: str) -> str:
        return self.path

    def get_source(self, fullname: str) -> str:
        return rewrite_for_pytorch_lightning(self._original_source())

    def get_code(self, fullname: str):
        # The code object's filename is the real source file: tracebacks show its lines (same numbering).
        return compile(self.get_source(fullname), self.path, "exec", dont_inherit=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__cached__ = None  # not compiled from a .pyc of its own
        module.__sgdtp_twin_of__ = self.source_module
        exec(self.get_code(module.__name__), module.__dict__)  # noqa: S102 - this is what a loader does


class _PLTwinFinder:
    """Serves ``import lightning_sgdtp._pl_strategy`` / ``_lf_strategy`` (e.g. when unpickling in a fresh process)."""

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None):
        source = _TWINS.get(fullname)
        if source is None:
            return None
        loader = _PLTwinLoader(_source_spec(source))
        spec = importlib.machinery.ModuleSpec(fullname, loader, origin=loader.path, is_package=False)
        spec.has_location = True  # sets __file__ to the source file
        return spec


def _install_twin_finder() -> None:
    if not any(f is _PLTwinFinder for f in sys.meta_path):
        sys.meta_path.append(_PLTwinFinder)


_install_twin_finder()


def get_pl_twin() -> type:
    """Return ``SGDTPStrategy`` built for ``pytorch_lightning`` (imports ``pytorch_lightning``)."""
    return get_strategy_class("pytorch_lightning")


def get_strategy_class(namespace: str = "lightning.pytorch") -> type:
    """The strategy class of a namespace: ``SGDTPStrategy`` for ``"lightning.pytorch"`` / ``"pytorch_lightning"``,
    ``SGDTPFabricStrategy`` for ``"lightning.fabric"`` / ``"lightning_fabric"`` (the twins for the standalone
    packages)."""
    if namespace not in _CLASSES:
        raise ValueError(f"unknown Lightning namespace {namespace!r}; expected one of {_NAMESPACES}")
    module_name, class_name, _ = _CLASSES[namespace]
    with _lock:
        _install_twin_finder()
        return getattr(importlib.import_module(module_name), class_name)


def _registry(namespace: str):
    # Already imported by the time we get here (through the strategy module or the user's code).
    return getattr(importlib.import_module(f"{namespace}.strategies"), _CLASSES[namespace][2])


def _register(registry, strategy_cls: type) -> None:
    entry = dict.get(registry, STRATEGY_NAME)  # the registry's own .get() instantiates the strategy
    if entry is not None and entry.get("strategy") is strategy_cls:
        return
    registry.register(STRATEGY_NAME, strategy_cls, description=DESCRIPTION, override=True)


def register_namespace(namespace: str) -> None:
    """Register the strategy class of ``namespace`` in its registry (imports that namespace). Idempotent."""
    with _lock:
        _register(_registry(namespace), get_strategy_class(namespace))


def _ready(namespace: str) -> bool:
    module = sys.modules.get(f"{namespace}.strategies")
    return module is not None and hasattr(module, _CLASSES[namespace][2])


def register_strategies(pytorch_lightning: bool | None = None) -> None:
    """Register ``strategy="sgdtp"`` for the Trainer and for Fabric.

    Always in ``lightning.pytorch.strategies.StrategyRegistry`` (``SGDTPStrategy``) and
    ``lightning.fabric.strategies.STRATEGY_REGISTRY`` (``SGDTPFabricStrategy``). In
    ``pytorch_lightning.strategies.StrategyRegistry`` (as the twin class) when ``pytorch_lightning``
    is already imported; pass ``pytorch_lightning=True`` to import it if installed, or ``False`` to
    skip it; the same for ``lightning_fabric`` when it is imported. If either is imported later, the
    autoload hook (see ``_lightning_sgdtp_autoload``) registers it then. Idempotent.
    """
    with _lock:
        register_namespace("lightning.pytorch")  # imports lightning.pytorch via strategy.py
        register_namespace("lightning.fabric")
        if pytorch_lightning is None:
            pytorch_lightning = _ready("pytorch_lightning")
        elif pytorch_lightning:
            pytorch_lightning = importlib.util.find_spec("pytorch_lightning") is not None
        if pytorch_lightning:
            register_namespace("pytorch_lightning")
        if _ready("lightning_fabric"):
            register_namespace("lightning_fabric")
