"""Make ``strategy="sgdtp"`` available without importing lightning-sgdtp.

Lightning has no entry points for strategies, so the wheel ships ``lightning_sgdtp_autoload.pth``
whose single line ``import _lightning_sgdtp_autoload`` runs this module at interpreter start.

This module must stay tiny: it imports nothing that the interpreter has not already imported
(no torch, no lightning, no lightning_sgdtp). It installs a ``sys.meta_path`` finder that waits
for ``lightning.pytorch.strategies`` or ``pytorch_lightning.strategies`` (the Trainer's) or
``lightning.fabric.strategies`` / ``lightning_fabric.strategies`` (Fabric's) to be imported, lets
that import run normally, and then registers ``"sgdtp"`` in that namespace's registry
with a lazy factory. Only when a Trainer or Fabric asks for the strategy does the factory import
``lightning_sgdtp`` and build the real strategy (the ``pytorch_lightning`` twin for the
``pytorch_lightning`` namespace).

Set ``SGDTP_NO_AUTOLOAD=1`` to disable this hook. ``import lightning_sgdtp`` still registers the
strategy explicitly. Nothing here may ever crash the interpreter: failures become a warning.
"""

import os
import sys

STRATEGY_NAME = "sgdtp"
ENV_OPT_OUT = "SGDTP_NO_AUTOLOAD"
_DESCRIPTION = "lightning-sgdtp: compiled training step with gradient communication in the compiled backward"

# module whose execution we wait for -> namespace passed to the lazy factory
_TARGETS = {
    "lightning.pytorch.strategies": "lightning.pytorch",
    "pytorch_lightning.strategies": "pytorch_lightning",
    "lightning.fabric.strategies": "lightning.fabric",
    "lightning_fabric.strategies": "lightning_fabric",
}
# The registry's attribute in each namespace's ``strategies`` module (the Trainer's and Fabric's).
_REGISTRY_ATTRIBUTES = ("StrategyRegistry", "STRATEGY_REGISTRY")


def _disabled():
    value = os.environ.get(ENV_OPT_OUT, "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _warn(message):
    import warnings

    warnings.warn(f"lightning-sgdtp autoload: {message}", RuntimeWarning, stacklevel=2)


def _make_factory(namespace):
    def sgdtp_lazy_factory(**kwargs):
        # Imported only now, when the Trainer resolves strategy="sgdtp".
        from lightning_sgdtp.frontends.registration import get_strategy_class, register_namespace

        register_namespace(namespace)  # replaces this factory with the real class (idempotent)
        return get_strategy_class(namespace)(**kwargs)

    sgdtp_lazy_factory.__qualname__ = f"sgdtp_lazy_factory[{namespace}]"
    sgdtp_lazy_factory.namespace = namespace
    return sgdtp_lazy_factory


def _registry_of(module):
    for attribute in _REGISTRY_ATTRIBUTES:
        registry = getattr(module, attribute, None)
        if registry is not None:
            return registry
    return None


def _register(module, namespace):
    """Register the lazy factory in ``module.StrategyRegistry``; never raises."""
    try:
        registry = _registry_of(module)
        if registry is None:
            _warn(f"{module.__name__} has no strategy registry; strategy={STRATEGY_NAME!r} not registered")
            return
        if STRATEGY_NAME in registry:
            return  # already registered (explicitly, by lightning_sgdtp, or by someone else): keep it
        registry.register(STRATEGY_NAME, _make_factory(namespace), description=_DESCRIPTION)
    except Exception as exc:  # noqa: BLE001 - an import hook must never break the user's import
        _warn(f"could not register strategy={STRATEGY_NAME!r} in {namespace}: {exc!r}")


_searching = set()  # names being looked up right now (guards against re-entry from other finders)


class _PostExecLoader:
    """Wraps the real loader: run the module normally, then register into it."""

    def __init__(self, loader, namespace):
        self._loader = loader
        self._namespace = namespace

    def create_module(self, spec):
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module):
        # Hide the wrapper: the module looks exactly as if it had been imported without the hook.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _register(module, self._namespace)

    def __getattr__(self, name):
        if name == "_loader":  # not set yet (e.g. during copy): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self._loader, name)


class SGDTPAutoloadFinder:
    """``sys.meta_path`` finder that reacts only to the four ``*.strategies`` module names."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        namespace = _TARGETS.get(fullname)
        if namespace is None or fullname in _searching:
            return None
        _searching.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is cls or isinstance(finder, cls):
                    continue
                find_spec = getattr(finder, "find_spec", None)
                if find_spec is None:
                    continue
                spec = find_spec(fullname, path, target)
                if spec is not None:
                    break
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            spec.loader = _PostExecLoader(spec.loader, namespace)
            return spec
        except Exception as exc:  # noqa: BLE001
            _warn(f"import hook failed for {fullname}: {exc!r}")
            return None
        finally:
            _searching.discard(fullname)


def install():
    """Install the finder (idempotent) and register into namespaces that are already imported."""
    if _disabled():
        return False
    try:
        if not any(f is SGDTPAutoloadFinder for f in sys.meta_path):
            sys.meta_path.insert(0, SGDTPAutoloadFinder)
        for fullname, namespace in _TARGETS.items():
            module = sys.modules.get(fullname)
            if module is not None and _registry_of(module) is not None:
                _register(module, namespace)
    except Exception as exc:  # noqa: BLE001
        _warn(f"could not install the import hook: {exc!r}")
        return False
    return True


def uninstall():
    """Remove the finder (already-registered factories stay registered)."""
    sys.meta_path[:] = [f for f in sys.meta_path if f is not SGDTPAutoloadFinder]


install()
