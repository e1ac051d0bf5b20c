"""Fabric parity: a Fabric loop (``fabric.setup``, ``fabric.backward``, ``optimizer.step``) on a model we did not
write, trained with Fabric's ``"ddp"`` (the reference) and with ``"sgdtp"`` in each of the scenario's cells, in the
same processes.

Usage: python tests/distributed/jobs/fabric_parity.py OUT_DIR [SCENARIO], with the scenario (JSON; else
OUT_DIR/scenario.json) = {"model": a name in helpers.zoo.ZOO, "layers": n, "devices": 2, "steps": 3,
"global_batch": 8, "accumulate": 1, "clip": null, "cells": [{"name": ..., "sgdtp": SGDTPFabricStrategy kwargs,
"accumulate": n, "clip": max_norm, "loop": "call" | "lightning", "compile_module": torch.compile kwargs (the model
compiled before fabric.setup, as a user does)}], "checks": ["bad_input", ...]}.
Fabric's launcher starts the other ranks by running this script again. Rank 0 writes OUT_DIR/init.pt,
OUT_DIR/ref.pt, OUT_DIR/<cell>.pt (full parameters after the steps) and OUT_DIR/info.json (per cell: the bytes each
rank holds, the plan's layout and sync, the errors of the bad-input checks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.training import full, params, read_scenario
from helpers.zoo import ZOO, zoo_data

from lightning_sgdtp.frontends.fabric import SGDTPFabricStrategy
from lightning_sgdtp.parallel.sharding import held_bytes


def loss_of(model: torch.nn.Module, name: str, batch: list[torch.Tensor]) -> torch.Tensor:
    """The loss a Fabric loop computes around the model (eagerly, outside the compiled call)."""
    x, y = batch
    if ZOO[name].data == "images":
        return F.cross_entropy(model(pixel_values=x).logits, y)
    logits = model(input_ids=x).logits if ZOO[name].family.startswith("transformers") else model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train(fabric: Fabric, scenario: dict[str, Any], cell: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """The loop users write; the same for the reference and every cell."""
    torch.manual_seed(0)
    model = ZOO[scenario["model"]].build(scenario.get("layers", 1))
    if cell.get("compile"):  # the noise floor: Fabric "ddp" with the model torch.compile()d (Inductor)
        model = torch.compile(model)
    if cell.get("compile_module") is not None:  # the user's own compile: sgdtp takes the module and the settings
        model = torch.compile(model, **cell["compile_module"])
    accumulate = cell.get("accumulate", scenario.get("accumulate", 1))
    clip = cell.get("clip", scenario.get("clip"))
    if cell.get("setup") == "module_first":  # setup_module, then the optimizer from the set-up model
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:  # the optimizer made before setup (from the parameters tensor parallel / sharding then split)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = fabric.setup(model, optimizer)
    dp = fabric.strategy.distributed_sampler_kwargs["num_replicas"]
    per_rank = scenario.get("global_batch", 8) // dp // accumulate
    data = fabric.setup_dataloaders(zoo_data(scenario["model"], n=64, batch_size=per_rank))
    batches = iter(data)
    first_grads: dict[str, torch.Tensor] = {}
    for step in range(scenario.get("steps", 3)):
        for micro in range(accumulate):
            batch = next(batches)
            last = micro == accumulate - 1
            with fabric.no_backward_sync(model, enabled=not last):
                loss = loss_of(model, scenario["model"], batch) / accumulate
                fabric.backward(loss)
        if step == 0:  # the averaged gradients the optimizer gets (AdamW would hide a x2 or x0.5 scale)
            first_grads = {n: full(p.grad) for n, p in model.module.named_parameters() if p.grad is not None}
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, first_grads


def gathered_held(model: Any, optimizer: Any) -> list[dict[str, int]]:
    mine = held_bytes(model.module, [optimizer.optimizer])  # .module: the model as the user passed it
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def bad_input(fabric: Fabric) -> dict[str, str]:
    """What Fabric lets through and the strategy refuses, each before any step: the errors' texts."""
    errors: dict[str, str] = {}
    model = ZOO["mha"].build(1)

    def refused(name: str, call: Any) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            errors[name] = f"{type(exc).__name__}: {exc}"
        else:
            errors[name] = "NOT REFUSED"

    refused("optimizer_before_model", lambda: fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1)))
    refused("compiled", lambda: fabric.setup(torch.compile(ZOO["mha"].build(1)), _reapply_compile=False))
    ddp = torch.nn.Sequential(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2)))
    refused("ddp_wrapped", lambda: fabric.setup(ddp))
    fabric.setup(model)
    refused("setup_twice", lambda: fabric.setup(model))
    return errors


def resume_across_front_ends(out: Path, devices: int) -> dict[str, float]:
    """Fabric (sharded) saves; the Trainer (tensor parallel) resumes from that file, trains a step and saves; Fabric
    (replicated) loads the Trainer's checkpoint. The same LightningModule class on both sides (the parameter
    names). Returns the largest difference of each hand-over (0 when the weights and optimizer moments travel)."""
    import lightning.pytorch as L
    from helpers.training import quiet_trainer
    from helpers.zoo import zoo_module

    from lightning_sgdtp import SGDTPStrategy

    def moments(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        names = {id(p): n for n, p in module.named_parameters()}
        return {names[id(p)]: full(st["exp_avg"]) for p, st in optimizer.state.items() if "exp_avg" in st}

    diffs: dict[str, float] = {}
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=SGDTPFabricStrategy(sharding="full"))
    fabric.launch()
    torch.manual_seed(0)
    module = zoo_module("llama", layers=1)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    for x, y in list(fabric.setup_dataloaders(zoo_data("llama", n=16, batch_size=4)))[:2]:
        logits = model(x)
        fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    saved, saved_moments = params(module), moments(optimizer.optimizer, module)
    fabric.save(out / "fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 2})
    fabric.strategy.teardown()

    class Loaded(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            got, got_moments = params(pl_module), moments(trainer.optimizers[0], pl_module)
            diffs["fabric_to_trainer"] = max((got[k] - saved[k]).abs().max().item() for k in saved)
            diffs["fabric_to_trainer_moments"] = max(
                (got_moments[k] - saved_moments[k]).abs().max().item() for k in saved_moments
            )

    torch.manual_seed(1)  # other initial weights: only the checkpoint can make them equal
    trained = zoo_module("llama", layers=1)
    strategy = SGDTPStrategy(parallelism="tensor")
    trainer = quiet_trainer(strategy, out / "trainer", devices=devices, max_steps=1, callbacks=[Loaded()])
    trainer.fit(trained, zoo_data("llama", n=16, batch_size=4), ckpt_path=str(out / "fabric.ckpt"))
    trainer.save_checkpoint(out / "trainer.ckpt")
    after = strategy.full_state_dict()

    fabric = Fabric(accelerator="cpu", devices=devices, strategy=SGDTPFabricStrategy())
    fabric.launch()
    torch.manual_seed(2)
    module = zoo_module("llama", layers=1)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    rest = fabric.load(out / "trainer.ckpt", {"model": model, "optimizer": optimizer}, strict=False)
    got = params(module)
    diffs["trainer_to_fabric"] = max((got[k] - after[k]).abs().max().item() for k in after)
    diffs["trainer_to_fabric_step"] = float(rest.get("global_step", -1))
    diffs["trainer_to_fabric_has_moments"] = float(bool(moments(optimizer.optimizer, module)))
    fabric.strategy.teardown()
    return diffs


def main(out: Path) -> None:
    scenario = read_scenario(out, sys.argv[2] if len(sys.argv) > 2 else None)
    devices = scenario.get("devices", 2)
    info: dict[str, Any] = {"cells": {}}

    ref_fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp")
    ref_fabric.launch()
    torch.manual_seed(0)
    init = params(ZOO[scenario["model"]].build(scenario.get("layers", 1)))
    ref_model, ref_optimizer, ref_grads = train(ref_fabric, scenario, {})
    info["ref_held"] = gathered_held(ref_model, ref_optimizer)
    ref = params(ref_model.module)
    if ref_fabric.global_rank == 0:
        torch.save(init, out / "init.pt")
        torch.save(ref, out / "ref.pt")
        torch.save(ref_grads, out / "ref_grads.pt")

    for cell in scenario["cells"]:
        strategy = "ddp" if cell.get("compile") else SGDTPFabricStrategy(**cell.get("sgdtp", {}))
        precision = cell.get("precision", "32-true")
        fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision=precision)
        fabric.launch()
        model, optimizer, grads = train(fabric, scenario, cell)
        result = params(model.module)
        plan = strategy.plan if isinstance(strategy, SGDTPFabricStrategy) else {}
        cell_info = {"held": gathered_held(model, optimizer), "plan": plan}
        cell_info["compiled_around"] = isinstance(model._forward_module, torch._dynamo.eval_frame.OptimizedModule)
        fabric.strategy.teardown()
        if fabric.global_rank == 0:
            torch.save(result, out / f"{cell['name']}.pt")
            torch.save(grads, out / f"{cell['name']}_grads.pt")
            info["cells"][cell["name"]] = cell_info

    if "bad_input" in scenario.get("checks", []):
        fabric = Fabric(accelerator="cpu", devices=devices, strategy=SGDTPFabricStrategy())
        fabric.launch()
        info["bad_input"] = bad_input(fabric)
        fabric.strategy.teardown()

    if "resume" in scenario.get("checks", []):
        info["resume"] = resume_across_front_ends(out, devices)

    if ref_fabric.global_rank == 0:
        (out / "info.json").write_text(json.dumps(info, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
