"""Register ``strategy="sgdtp"`` in Lightning's strategy registries.

Lightning ships the same trainer under two namespaces: ``lightning.pytorch`` and the standalone
``pytorch_lightning`` (whose classes are distinct: a ``lightning.pytorch`` strategy is not a
``pytorch_lightning`` strategy). ``lightning_sgdtp/strategy.py`` is written against
``lightning.pytorch``/``lightning.fabric`` and is the only module of this package that imports
Lightning. For ``pytorch_lightning`` we build a *twin* the way Lightning itself produces
``pytorch_lightning`` from the ``lightning.pytorch`` sources: the source text of ``strategy.py`` is
rewritten (``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` ->
``lightning_fabric``) and executed as the module ``lightning_sgdtp._pl_strategy``.

The twin module is importable by name (a tiny ``sys.meta_path`` finder serves it), so instances
of the twin pickle and unpickle like any other class, e.g. into spawned worker processes.

This module never imports Lightning by itself: ``lightning.pytorch`` comes in through
``lightning_sgdtp.strategy``; ``pytorch_lightning`` only when the user already imported it (or
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

_SOURCE_MODULE = "lightning_sgdtp.strategy"
_PL_TWIN_MODULE = "lightning_sgdtp._pl_strategy"
_NAMESPACES = ("lightning.pytorch", "pytorch_lightning")

# `lightning.pytorch` -> `pytorch_lightning`, `lightning.fabric` -> `lightning_fabric`; the lookbehind
# keeps e.g. `foo.lightning.pytorch` or `my_lightning.pytorch` untouched.
_REWRITE = re.compile(r"(?<![\w.])lightning\.(pytorch|fabric)\b")
_REWRITE_TO = {"pytorch": "pytorch_lightning", "fabric": "lightning_fabric"}

_lock = threading.RLock()


def rewrite_for_pytorch_lightning(source: str) -> str:
    """Return ``source`` with ``lightning.pytorch``/``lightning.fabric`` rewritten to the standalone packages.

    Line numbers are preserved, so tracebacks through the twin point at the right lines of
    ``strategy.py``.
    """
    return _REWRITE.sub(lambda m: _REWRITE_TO[m.group(1)], source)


def _source_spec() -> importlib.machinery.ModuleSpec:
    spec = importlib.util.find_spec(_SOURCE_MODULE)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot locate the source of {_SOURCE_MODULE} to build its pytorch_lightning twin")
    return spec


class _PLTwinLoader(importlib.abc.Loader):
    """Executes the rewritten source of ``lightning_sgdtp/strategy.py`` as ``lightning_sgdtp._pl_strategy``."""

    def __init__(self, source_spec: importlib.machinery.ModuleSpec) -> None:
        self.source_spec = source_spec
        self.path: str = source_spec.origin  # type: ignore[assignment]

    def _original_source(self) -> str:
        get_source = getattr(self.source_spec.loader, "get_source", None)
        source = get_source(_SOURCE_MODULE) if get_source is not None else None
        if source is None:
            if not self.path.endswith(".py"):
                raise ImportError(f"no source available for {_SOURCE_MODULE} ({self.path}); cannot build its twin")
            with open(self.path, "rb") as fh:
                source = importlib.util.decode_source(fh.read())
        return source

    def get_filename(self, fullname: str) -> str:
        return self.path

    def get_source(self, fullname: str) -> str:
        return rewrite_for_pytorch_lightning(self._original_source())

    def get_code(self, fullname: str):
        # The code object's filename is the real strategy.py: tracebacks show its lines (same numbering).
        return compile(self.get_source(fullname), self.path, "exec", dont_inherit=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__cached__ = None  # not compiled from a .pyc of its own
        module.__sgdtp_twin_of__ = _SOURCE_MODULE
        exec(self.get_code(module.__name__), module.__dict__)  # noqa: S102 - this is what a loader does


class _PLTwinFinder:
    """Serves ``import lightning_sgdtp._pl_strategy`` (e.g. when unpickling in a fresh process)."""

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None):
        if fullname != _PL_TWIN_MODULE:
            return None
        loader = _PLTwinLoader(_source_spec())
        spec = importlib.machinery.ModuleSpec(fullname, loader, origin=loader.path, is_package=False)
        spec.has_location = True  # sets __file__ to strategy.py
        return spec


def _install_twin_finder() -> None:
    if not any(f is _PLTwinFinder for f in sys.meta_path):
        sys.meta_path.append(_PLTwinFinder)


_install_twin_finder()


def get_pl_twin() -> type:
    """Return ``SGDTPStrategy`` built for ``pytorch_lightning`` (imports ``pytorch_lightning``)."""
    with _lock:
        _install_twin_finder()
        module = importlib.import_module(_PL_TWIN_MODULE)
    return module.SGDTPStrategy


def get_strategy_class(namespace: str = "lightning.pytorch") -> type:
    """The ``SGDTPStrategy`` class for ``"lightning.pytorch"`` or ``"pytorch_lightning"``."""
    if namespace == "lightning.pytorch":
        from lightning_sgdtp.strategy import SGDTPStrategy

        return SGDTPStrategy
    if namespace == "pytorch_lightning":
        return get_pl_twin()
    raise ValueError(f"unknown Lightning namespace {namespace!r}; expected one of {_NAMESPACES}")


def _registry(namespace: str):
    # Already imported by the time we get here (through lightning_sgdtp.strategy or the user's code).
    return importlib.import_module(f"{namespace}.strategies").StrategyRegistry


def _register(registry, strategy_cls: type) -> None:
    entry = dict.get(registry, STRATEGY_NAME)  # the registry's own .get() instantiates the strategy
    if entry is not None and entry.get("strategy") is strategy_cls:
        return
    registry.register(STRATEGY_NAME, strategy_cls, description=DESCRIPTION, override=True)


def _pytorch_lightning_ready() -> bool:
    module = sys.modules.get("pytorch_lightning.strategies")
    return module is not None and hasattr(module, "StrategyRegistry")


def register_strategies(pytorch_lightning: bool | None = None) -> None:
    """Register ``SGDTPStrategy`` as ``strategy="sgdtp"``.

    Always in ``lightning.pytorch.strategies.StrategyRegistry``. In
    ``pytorch_lightning.strategies.StrategyRegistry`` (as the twin class) when ``pytorch_lightning``
    is already imported; pass ``pytorch_lightning=True`` to import it if installed, or ``False`` to
    skip it. If ``pytorch_lightning`` is imported later, the autoload hook (see
    ``_lightning_sgdtp_autoload``) registers it then. Idempotent.
    """
    with _lock:
        strategy_cls = get_strategy_class("lightning.pytorch")  # imports lightning.pytorch via strategy.py
        _register(_registry("lightning.pytorch"), strategy_cls)

        if pytorch_lightning is None:
            pytorch_lightning = _pytorch_lightning_ready()
        elif pytorch_lightning:
            pytorch_lightning = importlib.util.find_spec("pytorch_lightning") is not None
        if pytorch_lightning:
            _register(_registry("pytorch_lightning"), get_pl_twin())
