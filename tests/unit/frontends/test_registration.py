"""The .pth autoload hook module and the registration module, in this process: no Lightning imported by the hook,
failures warn and never raise, the source rewrite for pytorch_lightning. (``strategy="sgdtp"`` in fresh
interpreters: tests/integration/test_autoload.py.)"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
import warnings

import pytest
from helpers import REPO


# In-process unit tests of the hook module (fast; no Lightning imported). ------------------------------
def _load_autoload_module():
    """A private copy of the hook module that does not touch this interpreter's sys.meta_path."""
    spec = importlib.util.spec_from_file_location("_sgdtp_autoload_under_test", REPO / "_lightning_sgdtp_autoload.py")
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.meta_path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.meta_path[:] = saved
    return module


class _FakeRegistry(dict):
    def register(self, name, strategy=None, description=None, override=False, **init_params):
        if name in self and not override:
            raise ValueError(name)
        self[name] = {"strategy": strategy, "description": description, "init_params": init_params}


def test_hook_keeps_an_existing_registration():
    hook = _load_autoload_module()
    mine = object()
    registry = _FakeRegistry(sgdtp={"strategy": mine})
    hook._register(types.SimpleNamespace(StrategyRegistry=registry, __name__="x.strategies"), "lightning.pytorch")
    assert registry["sgdtp"]["strategy"] is mine


def test_hook_registers_a_lazy_factory():
    hook = _load_autoload_module()
    registry = _FakeRegistry()
    hook._register(types.SimpleNamespace(StrategyRegistry=registry, __name__="x.strategies"), "pytorch_lightning")
    factory = registry["sgdtp"]["strategy"]
    assert callable(factory) and factory.namespace == "pytorch_lightning"
    assert registry["sgdtp"]["description"]


def test_hook_failure_warns_and_never_raises():
    hook = _load_autoload_module()

    class Broken(_FakeRegistry):
        def register(self, *args, **kwargs):
            raise RuntimeError("boom")

    with pytest.warns(RuntimeWarning, match="boom"):
        hook._register(types.SimpleNamespace(StrategyRegistry=Broken(), __name__="x.strategies"), "lightning.pytorch")
    with pytest.warns(RuntimeWarning, match="no strategy registry"):
        hook._register(types.SimpleNamespace(__name__="x.strategies"), "lightning.pytorch")


def test_hook_without_lightning_installed_finds_nothing():
    hook = _load_autoload_module()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # A search path where the package does not exist behaves like "lightning not installed".
        assert hook.SGDTPAutoloadFinder.find_spec("lightning.pytorch.strategies", ["/nonexistent"]) is None
        assert hook.SGDTPAutoloadFinder.find_spec("json", None) is None  # not a target: not even looked up


@pytest.mark.parametrize(("value", "disabled"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_opt_out_values(monkeypatch, value, disabled):
    hook = _load_autoload_module()
    monkeypatch.setenv("SGDTP_NO_AUTOLOAD", value)
    assert hook._disabled() is disabled


def test_rewrite_for_pytorch_lightning():
    spec = importlib.util.spec_from_file_location(
        "_sgdtp_registration_under_test", REPO / "lightning_sgdtp/frontends/registration.py"
    )
    registration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registration)
    try:
        source = (
            "from lightning.pytorch.strategies.ddp import DDPStrategy\n"
            "from lightning.fabric.plugins import ClusterEnvironment\n"
            "import lightning.pytorch as L\n"
            "x = my_lightning.pytorch + a.lightning.fabric  # untouched\n"
        )
        assert registration.rewrite_for_pytorch_lightning(source) == (
            "from pytorch_lightning.strategies.ddp import DDPStrategy\n"
            "from lightning_fabric.plugins import ClusterEnvironment\n"
            "import pytorch_lightning as L\n"
            "x = my_lightning.pytorch + a.lightning.fabric  # untouched\n"
        )
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if f is not registration._PLTwinFinder]


def _imported_top_level_names(nodes) -> set[str]:
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_hook_module_imports_nothing_heavy():
    """The startup hook imports only what the interpreter already has; lightning_sgdtp only inside the factory."""
    tree = ast.parse((REPO / "_lightning_sgdtp_autoload.py").read_text())
    assert _imported_top_level_names(tree.body) <= {"os", "sys"}
    heavy = {"lightning", "pytorch_lightning", "lightning_fabric", "torch"}
    assert not heavy & _imported_top_level_names(ast.walk(tree))


def test_registration_module_is_lightning_free():
    """Only lightning_sgdtp/frontends/trainer.py may import Lightning (it reaches _registration through strategy.py)."""
    tree = ast.parse((REPO / "lightning_sgdtp" / "frontends" / "registration.py").read_text())
    assert not {"lightning", "pytorch_lightning", "lightning_fabric", "torch"} & _imported_top_level_names(
        ast.walk(tree)
    )
