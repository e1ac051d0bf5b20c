"""Data-parallel parity: train the scenario's model with Lightning's DDP and with sgdtp, in the same processes.

Usage: python tests/distributed/jobs/dp_parity.py OUT_DIR [SCENARIO], with the scenario (JSON; else
OUT_DIR/scenario.json) = {"model": a name in helpers.models.MODELS, "trainer": Trainer kwargs, "sgdtp":
SGDTPStrategy kwargs, "data": token_data kwargs (optional), "compile_module": torch.compile kwargs (optional: sgdtp
trains torch.compile(model, **them), as a user passes it), "precision_plugin": "counting" (optional: both train with
a CountingPrecision)}; e.g. `python tests/distributed/jobs/dp_parity.py /tmp/x '{"model": "BreaksModel"}'`. Lightning's launcher starts the
second rank by running this script again. Rank 0 writes OUT_DIR/{init,ref,sgdtp}.pt (parameters),
OUT_DIR/{ref_grads,grads}.pt (first-step gradients) and OUT_DIR/info.json (the plan, backward and sync counts, and
the frames Dynamo compiled after the first step and in all).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.plugins.precision import Precision

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import MODELS, token_data
from helpers.training import FirstStepGrads, params, quiet_trainer, read_scenario

from lightning_sgdtp import SGDTPStrategy


class CountBackwardsAndSyncs(L.Callback):
    """Backward calls (Lightning's ``on_before_backward``, once per backward) and gradient syncs (calls of the
    strategy's ledger ``sync``, counted from the start of training)."""

    def __init__(self) -> None:
        self.counts = {"backwards": 0, "syncs": 0}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, *args: Any) -> None:
        from torch._dynamo.utils import counters

        self.counts.setdefault("compiled_after_first_step", counters["stats"]["unique_graphs"])

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        ledger = trainer.strategy.ledger
        sync = ledger.sync

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.counts["syncs"] += 1
            return sync(*args, **kwargs)

        ledger.sync = counted

    def on_before_backward(self, trainer: L.Trainer, module: L.LightningModule, loss: torch.Tensor) -> None:
        self.counts["backwards"] += 1


class CountingPrecision(Precision):
    """A user's own precision plugin (Lightning's fp32 one, subclassed): counts the calls of the hooks it overrides."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"convert_module": 0, "forward_context": 0, "backward": 0, "optimizer_step": 0}

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self.calls["convert_module"] += 1
        return super().convert_module(module)

    def forward_context(self) -> Any:
        self.calls["forward_context"] += 1
        return super().forward_context()

    def backward(self, *args: Any, **kwargs: Any) -> None:
        self.calls["backward"] += 1
        return super().backward(*args, **kwargs)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        self.calls["optimizer_step"] += 1
        return super().optimizer_step(*args, **kwargs)


def main(out: Path) -> None:
    scenario = read_scenario(out, sys.argv[2] if len(sys.argv) > 2 else None)
    factory, trainer_kwargs = MODELS[scenario["model"]], scenario.get("trainer", {})
    plugin = (lambda: [CountingPrecision()]) if scenario.get("precision_plugin") == "counting" else list
    data = token_data(**scenario.get("data", {}))

    L.seed_everything(0, verbose=False)
    ref_model = factory()
    init = params(ref_model)
    ref_grads, grads = FirstStepGrads(), FirstStepGrads()
    ref = quiet_trainer(
        "ddp_find_unused_parameters_true", out / "ref", callbacks=[ref_grads], plugins=plugin(), **trainer_kwargs
    )
    ref.fit(ref_model, data)

    L.seed_everything(0, verbose=False)
    model = factory()
    strategy = SGDTPStrategy(**scenario.get("sgdtp", {}))
    counter = CountBackwardsAndSyncs()
    run = quiet_trainer(strategy, out / "sgdtp", callbacks=[grads, counter], plugins=plugin(), **trainer_kwargs)
    compile_module = scenario.get("compile_module")
    run.fit(model if compile_module is None else torch.compile(model, **compile_module), data)

    if run.global_rank == 0:
        torch.save(init, out / "init.pt")
        torch.save(ref_grads.grads, out / "ref_grads.pt")
        torch.save(grads.grads, out / "grads.pt")
        torch.save(params(ref_model), out / "ref.pt")
        torch.save(params(model), out / "sgdtp.pt")
        waits = strategy.grad_sync.waits_before_backward
        from torch._dynamo.utils import counters

        info = {"plan": strategy.plan, **counter.counts, "waits_before_backward": waits}
        info["plugin_calls"] = getattr(run.precision_plugin, "calls", None)
        info["compiled_in_all"] = counters["stats"]["unique_graphs"]
        (out / "info.json").write_text(json.dumps(info, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    os._exit(0) if os.environ.get("SGDTP_FAST_EXIT") else None
