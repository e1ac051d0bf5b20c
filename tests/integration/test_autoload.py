"""``strategy="sgdtp"`` without importing lightning-sgdtp: the .pth autoload hook and the registration, each in a
fresh interpreter (the hook module's and the registration's in-process tests: tests/unit/frontends/test_registration.py).

The subprocess tests need the package *installed* (``pip install -e .`` or ``pip install .``) because
the hook is a ``.pth`` file in site-packages; they are skipped otherwise. Each one starts a fresh
interpreter in an empty working directory and prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO

# The pytest interpreter itself went through site-packages' .pth files at startup.
installed = pytest.mark.skipif(
    "_lightning_sgdtp_autoload" not in sys.modules,
    reason="lightning-sgdtp's .pth hook is not installed: run `pip install -e .` first",
)
needs_pl = pytest.mark.skipif(importlib.util.find_spec("pytorch_lightning") is None, reason="needs pytorch_lightning")
needs_cli = pytest.mark.skipif(
    importlib.util.find_spec("jsonargparse") is None,
    reason="LightningCLI needs jsonargparse (pip install -e '.[test]')",
)


def run_py(code: str, tmp_path: Path, **env_extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGDTP_NO_AUTOLOAD"}
    env.update(env_extra)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,  # not the repo: exercise the installed package and keep lightning_logs/ out of the tree
    )
    assert proc.returncode == 0, (
        f"subprocess failed ({proc.returncode})\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    results = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"no RESULT line\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(results[-1])


# (a) ------------------------------------------------------------------------------------------------
@installed
def test_lightning_pytorch_trainer_resolves_sgdtp_lazily(tmp_path):
    r = run_py(
        """
        import json, sys
        import lightning.pytorch as L
        from lightning.pytorch.strategies import StrategyRegistry

        before = {
            "registered": "sgdtp" in StrategyRegistry,
            "factory": getattr(dict.get(StrategyRegistry, "sgdtp", {}).get("strategy"), "__name__", None),
            "imported": sorted(m for m in sys.modules if m.startswith("lightning_sgdtp")),
        }
        trainer = L.Trainer(strategy="sgdtp", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        from lightning_sgdtp.frontends.trainer import SGDTPStrategy
        print("RESULT " + json.dumps({
            "before": before,
            "cls": type(trainer.strategy).__name__,
            "is_real_class": type(trainer.strategy) is SGDTPStrategy,
            "is_lightning_strategy": isinstance(trainer.strategy, L.strategies.Strategy),
            "registry_now_real_class": StrategyRegistry["sgdtp"]["strategy"] is SGDTPStrategy,
        }))
        """,
        tmp_path,
    )
    assert r["before"] == {"registered": True, "factory": "sgdtp_lazy_factory", "imported": []}
    assert r["cls"] == "SGDTPStrategy"
    assert r["is_real_class"] and r["is_lightning_strategy"]
    assert r["registry_now_real_class"]


# (a') -----------------------------------------------------------------------------------------------
@installed
def test_fabric_resolves_sgdtp_lazily_in_both_namespaces(tmp_path):
    """``Fabric(strategy="sgdtp")`` with nothing imported: ``lightning.fabric`` gets SGDTPFabricStrategy, the
    standalone ``lightning_fabric`` its twin (``lightning.fabric`` rewritten), and neither imports the Trainer's
    namespace of the other package."""
    r = run_py(
        """
        import json, sys
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import STRATEGY_REGISTRY

        before = {
            "registered": "sgdtp" in STRATEGY_REGISTRY,
            "imported": sorted(m for m in sys.modules if m.startswith("lightning_sgdtp")),
        }
        fabric = Fabric(strategy="sgdtp", accelerator="cpu", devices=2)
        from lightning_sgdtp.frontends.fabric import SGDTPFabricStrategy
        import lightning_fabric
        twin_fabric = lightning_fabric.Fabric(strategy="sgdtp", accelerator="cpu", devices=2)
        twin = type(twin_fabric.strategy)
        print("RESULT " + json.dumps({
            "before": before,
            "is_real_class": type(fabric.strategy) is SGDTPFabricStrategy,
            "twin_module": twin.__module__,
            "twin_is_fabric_strategy": isinstance(twin_fabric.strategy, lightning_fabric.strategies.Strategy),
            "no_lightning_fabric_in_twin_mro": not any(c.__module__.startswith("lightning.") for c in twin.__mro__),
        }))
        """,
        tmp_path,
    )
    assert r["before"] == {"registered": True, "imported": []}
    assert r["is_real_class"]
    assert r["twin_module"] == "lightning_sgdtp._lf_strategy"
    assert r["twin_is_fabric_strategy"] and r["no_lightning_fabric_in_twin_mro"]


# (b) ------------------------------------------------------------------------------------------------
@installed
@needs_pl
def test_pytorch_lightning_trainer_gets_the_twin(tmp_path):
    r = run_py(
        """
        import json, pickle, sys
        import pytorch_lightning as pl

        before = {
            "registered": "sgdtp" in pl.strategies.StrategyRegistry,
            "imported": sorted(m for m in sys.modules if m.startswith("lightning_sgdtp")),
        }
        trainer = pl.Trainer(strategy="sgdtp", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
        cls = type(trainer.strategy)
        twin = sys.modules["lightning_sgdtp._pl_strategy"]
        import lightning_sgdtp.frontends.trainer as src
        from lightning_sgdtp.frontends.registration import get_pl_twin

        code = twin.__spec__.loader.get_code(twin.__name__)
        print("RESULT " + json.dumps({
            "before": before,
            "cls": cls.__name__,
            "module": cls.__module__,
            "is_pl_strategy": isinstance(trainer.strategy, pl.strategies.Strategy),
            "is_get_pl_twin": cls is get_pl_twin(),
            "registry_now_twin": pl.strategies.StrategyRegistry["sgdtp"]["strategy"] is cls,
            "no_lightning_pytorch_in_twin_mro": not any(c.__module__.startswith("lightning.") for c in cls.__mro__),
            "file_is_source": twin.__file__ == src.__file__ and code.co_filename == src.__file__,
            "pickle_roundtrip": pickle.loads(pickle.dumps(cls)) is cls,
        }))
        """,
        tmp_path,
    )
    assert r["before"] == {"registered": True, "imported": []}
    assert r["cls"] == "SGDTPStrategy"
    assert r["module"] == "lightning_sgdtp._pl_strategy"
    assert r["is_pl_strategy"] and r["is_get_pl_twin"] and r["registry_now_twin"]
    assert r["no_lightning_pytorch_in_twin_mro"]
    assert r["file_is_source"] and r["pickle_roundtrip"]


# (c) ------------------------------------------------------------------------------------------------
def test_import_lightning_sgdtp_registers_the_real_class(tmp_path):
    # Autoload disabled: the registration must come from `import lightning_sgdtp` itself.
    r = run_py(
        """
        import json, sys
        import lightning_sgdtp
        from lightning_sgdtp.frontends.trainer import SGDTPStrategy
        from lightning.pytorch.strategies import StrategyRegistry

        print("RESULT " + json.dumps({
            "registered": "sgdtp" in StrategyRegistry,
            "is_real_class": dict.get(StrategyRegistry, "sgdtp", {}).get("strategy") is SGDTPStrategy,
            "pl_imported": "pytorch_lightning" in sys.modules,
        }))
        """,
        tmp_path,
        SGDTP_NO_AUTOLOAD="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    assert r["registered"], (
        "`import lightning_sgdtp` must call lightning_sgdtp.frontends.registration.register_strategies()"
    )
    assert r["is_real_class"]
    assert not r["pl_imported"], "import lightning_sgdtp must not import pytorch_lightning"


@needs_pl
def test_register_strategies_registers_twin_when_pytorch_lightning_already_imported(tmp_path):
    r = run_py(
        """
        import json
        import pytorch_lightning as pl
        from lightning_sgdtp.frontends.registration import get_pl_twin, register_strategies

        register_strategies()
        entry = dict.get(pl.strategies.StrategyRegistry, "sgdtp", {})
        print("RESULT " + json.dumps({
            "twin": entry.get("strategy") is get_pl_twin(),
            "description": bool(entry.get("description")),
        }))
        """,
        tmp_path,
        SGDTP_NO_AUTOLOAD="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    assert r == {"twin": True, "description": True}


# (d) ------------------------------------------------------------------------------------------------
@installed
def test_startup_hook_imports_nothing(tmp_path):
    r = run_py(
        """
        import importlib, json, sys
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in
                       {"torch", "lightning", "pytorch_lightning", "lightning_fabric", "lightning_sgdtp"})
        hooked = any(getattr(f, "__name__", "") == "SGDTPAutoloadFinder" for f in sys.meta_path)
        # Re-import the hook module from scratch: it must bring in no other module.
        mod = sys.modules.pop("_lightning_sgdtp_autoload")
        mod.uninstall()
        before = set(sys.modules)
        importlib.import_module("_lightning_sgdtp_autoload")
        print("RESULT " + json.dumps({"heavy": heavy, "hooked": hooked, "added": sorted(set(sys.modules) - before)}))
        """,
        tmp_path,
    )
    assert r["heavy"] == []
    assert r["hooked"]
    assert r["added"] == ["_lightning_sgdtp_autoload"]


# (e) ------------------------------------------------------------------------------------------------
@installed
def test_opt_out_env_var(tmp_path):
    r = run_py(
        """
        import json, sys
        hooked = any(getattr(f, "__name__", "") == "SGDTPAutoloadFinder" for f in sys.meta_path)
        import lightning.pytorch as L
        try:
            L.Trainer(strategy="sgdtp", accelerator="cpu", devices=1, logger=False)
            error = None
        except ValueError as exc:
            error = str(exc)
        print("RESULT " + json.dumps({
            "hooked": hooked,
            "registered": "sgdtp" in L.strategies.StrategyRegistry,
            "error": error,
        }))
        """,
        tmp_path,
        SGDTP_NO_AUTOLOAD="1",
    )
    assert r["hooked"] is False and r["registered"] is False
    assert r["error"] and "sgdtp" in r["error"]


# (f) ------------------------------------------------------------------------------------------------
@installed
@needs_cli
def test_lightning_cli_config_resolves_sgdtp(tmp_path):
    (tmp_path / "config.yaml").write_text(
        "trainer:\n  strategy: sgdtp\n  accelerator: cpu\n  devices: 1\n  logger: false\n"
    )
    r = run_py(
        """
        import json, sys
        import torch
        import lightning.pytorch as L
        from lightning.pytorch.cli import LightningCLI

        class TinyModel(L.LightningModule):
            def __init__(self, hidden: int = 4):
                super().__init__()
                self.layer = torch.nn.Linear(hidden, 1)

            def training_step(self, batch, batch_idx):
                return self.layer(batch).sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        common = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"]
        from_args = LightningCLI(TinyModel, run=False, args=["--trainer.strategy=sgdtp", *common])
        from_file = LightningCLI(TinyModel, run=False, args=["--config=config.yaml"])
        print("RESULT " + json.dumps({
            "args": type(from_args.trainer.strategy).__name__,
            "config": type(from_file.trainer.strategy).__name__,
            "module": type(from_args.trainer.strategy).__module__,
        }))
        """,
        tmp_path,
    )
    assert r == {"args": "SGDTPStrategy", "config": "SGDTPStrategy", "module": "lightning_sgdtp.frontends.trainer"}
