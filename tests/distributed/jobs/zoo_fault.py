"""A zoo model trained by sgdtp in one mode, with a failure injected on one rank, or nothing injected (the test
sends a signal). The default ``collective_timeout`` (1800 s) is kept: the job must end in seconds without it.

Usage: python tests/distributed/jobs/zoo_fault.py OUT_DIR [SCENARIO], the scenario (JSON; else
OUT_DIR/scenario.json) = {"model": zoo name, "devices": N, "sgdtp": SGDTPStrategy kwargs, "fail_rank": r,
"fail_step": s, "where": "training_step" | "backward" | "callback" | "checkpoint" | "hang" | "freeze" (SIGSTOP
itself in training_step, as a hung driver call or a stalled node looks from outside), "front": "fabric" for a
Fabric loop} (no ``fail_rank``: nothing is
injected; the run is long enough for a signal to arrive mid-step). Every rank writes ``OUT/step-<rank>`` (its pid)
when it starts step 1, so the test knows the job is training; the failing rank writes ``OUT/struck`` (the time)
right before it raises.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.training import quiet_trainer, read_scenario
from helpers.zoo import ZooModule, zoo_data

from lightning_sgdtp import SGDTPStrategy


class InjectedFailure(RuntimeError):
    """The failure the test injects."""


class Failing(ZooModule):
    """The zoo module whose ``training_step`` or backward raises on one rank at one step."""

    def __init__(self, name: str, fail: tuple[int, int] | None, where: str, out: Path) -> None:
        super().__init__(name)
        self.fail, self.where, self.out = fail, where, out

    def _strike(self, where: str) -> None:
        if self.fail != (self.global_rank, self.global_step):
            return
        if self.where == "hang" and where == "training_step":  # outside any collective, until a signal ends it
            time.sleep(3600)
        if self.where == "freeze" and where == "training_step":
            freeze(self.out)
        if self.where == where:
            (self.out / "struck").write_text(repr(time.time()))
            raise InjectedFailure(f"injected failure in {where} on rank {self.global_rank} at step {self.global_step}")

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._strike("training_step")
        return super().training_step(batch, batch_idx)

    def on_before_backward(self, loss: Any) -> None:
        self._strike("backward")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._strike("checkpoint")


def freeze(out: Path) -> None:
    """Stop this whole process (every thread: the heartbeat too), as a hung driver call or a frozen node does."""
    (out / "struck").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGSTOP)


class Marks(L.Callback):
    """Writes ``step-<rank>`` at step 1; raises in ``on_train_batch_end`` where the scenario says ``callback``;
    saves a checkpoint at every step where it says ``checkpoint``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_start(self, trainer: L.Trainer, module: Failing, *args: Any) -> None:
        if trainer.global_step == 1:
            (self.out / f"step-{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer: L.Trainer, module: Failing, *args: Any) -> None:
        module._strike("callback")
        if module.where == "checkpoint":
            trainer.save_checkpoint(self.out / "ckpt" / f"step{trainer.global_step}.ckpt")


def fabric_loop(out: Path, scenario: dict[str, Any], fail: tuple[int, int] | None) -> None:
    """The same model and failure in a Fabric loop (``"front": "fabric"``): rank ``fail[0]`` raises in its loop at
    step ``fail[1]``, after the forward, before ``fabric.backward``; Fabric has no ``on_exception`` hook."""
    import torch
    import torch.nn.functional as F
    from lightning.fabric import Fabric

    from lightning_sgdtp import SGDTPFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=scenario["devices"], strategy=SGDTPFabricStrategy(**scenario["sgdtp"]))
    fabric.launch()
    torch.manual_seed(0)
    module = ZooModule(scenario["model"]).model
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    data = fabric.setup_dataloaders(zoo_data(scenario["model"], 64, batch_size=scenario.get("batch", 4)))
    step, steps = 0, scenario.get("steps", 6 if fail else 100_000)
    while step < steps:
        for x, y in data:
            if step == 1:
                (out / f"step-{fabric.global_rank}").write_text(str(os.getpid()))
            logits = model(x)
            if fail == (fabric.global_rank, step) and scenario.get("where") == "freeze":
                freeze(out)
            if fail == (fabric.global_rank, step):
                (out / "struck").write_text(repr(time.time()))
                raise InjectedFailure(f"injected failure in the loop on rank {fabric.global_rank} at step {step}")
            fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
            optimizer.step()
            optimizer.zero_grad()
            step += 1


def main(out: Path) -> None:
    scenario = read_scenario(out, sys.argv[2] if len(sys.argv) > 2 else None)
    fail = (scenario["fail_rank"], scenario["fail_step"]) if "fail_rank" in scenario else None
    if scenario.get("front") == "fabric":
        return fabric_loop(out, scenario, fail)
    L.seed_everything(0, verbose=False)
    model = Failing(scenario["model"], fail, scenario.get("where", "training_step"), out)
    steps = scenario.get("steps", 6 if fail else 100_000)
    trainer = quiet_trainer(
        SGDTPStrategy(**scenario["sgdtp"]), out / "run", devices=scenario["devices"], callbacks=[Marks(out)],
        max_steps=steps, max_epochs=-1,
    )  # fmt: skip
    trainer.fit(model, zoo_data(scenario["model"], 64, batch_size=scenario.get("batch", 4)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
