"""A zoo model (tests/helpers/zoo.py: unchanged third-party models) trained by sgdtp in one mode, against the same
model trained in one process on the same global batches.

Usage: python tests/distributed/jobs/zoo.py OUT_DIR [SCENARIO], with the scenario (JSON; else OUT_DIR/scenario.json)
= {"model": zoo name, "devices": N, "dp": data-parallel size, "sgdtp": SGDTPStrategy kwargs, "trainer": Trainer
kwargs (precision, accumulate_grad_batches, ...), "optimizer": "adamw" | "sgd", "lr": float, "steps": int,
"padded": bool (text padded per sample, labels -100 on the padding),
"env": {name: value} set on every rank (e.g. the negative-control switch), "reference": "ddp" (Lightning's DDP on
the same ranks: for BatchNorm models, whose batch statistics are per rank) or absent (one process),
"pretrained": true (the initial model written with save_pretrained to OUT/pretrained, the ranks build it on the meta
device and the strategy reads it by shard: pretrained=OUT/pretrained), "export": true (after fit, the strategy's
save_pretrained writes OUT/exported), "corrupt": {"drop" | "reshape": name} (the pretrained folder made not to
fit), "reference": "none" (no reference run), "meta": true (built on the meta device without pretrained weights: the
strategy initializes each rank's part; rank 0 writes ``init_check.json``: the tensors not finite, the replicated
ones (plain, or DTensors replicated on the mesh: norms, replicated key/value projections) that differ between ranks,
what stayed on meta, after setup)}.

The launching process trains the reference on one device (global batch = dp x per-rank batch, in the order
Lightning's shuffling DistributedSampler gives the ranks), then Lightning's launcher starts the ranks. Rank 0 writes
``init.pt``, ``ref.pt``, ``sgdtp.pt`` (the whole state dict, buffers included, merged from the pipeline stages),
``ref_grads.pt`` / ``grads.pt`` (first-step gradients) and ``info.json`` (plan, logged metrics, seconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.training import (
    FirstStepGrads,
    gather_full,
    held_bytes,
    metrics,
    params,
    quiet_trainer,
    read_scenario,
    shuffled_like_lightning,
)
from helpers.zoo import zoo_data, zoo_module

from lightning_sgdtp import SGDTPStrategy

BATCH, SAMPLES = 4, 64


def local_state(strategy: SGDTPStrategy, module: L.LightningModule) -> dict[str, torch.Tensor]:
    """What this rank holds of the module's state (a pipeline stage's part; all of it otherwise), as full tensors."""
    state = params(module)
    runner = getattr(strategy.engine, "runner", None)
    return runner.stage_state_dict(state) if runner is not None else state


def local_ids(trainer: L.Trainer) -> set[int] | None:
    runner = getattr(trainer.strategy.engine, "runner", None)
    return {id(p) for p in runner.local_parameters} if runner is not None else None


def corrupt(folder: Path, how: dict[str, str] | None) -> None:
    """A checkpoint that does not fit its model: ``{"drop": name}`` leaves a tensor out, ``{"reshape": name}`` gives
    it one row fewer."""
    if not how:
        return
    from safetensors.torch import load_file, save_file

    (file,) = folder.glob("*.safetensors")
    tensors = load_file(file)
    if "drop" in how:
        del tensors[how["drop"]]
    if "reshape" in how:
        tensors[how["reshape"]] = tensors[how["reshape"]][:-1].contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


class InitCheck(L.Callback):
    """Right after setup (before any step): every rank's tensors are finite and none left on meta (other pipeline
    stages' aside); a tensor not split (plain) is the same on every rank of the job, a split one (DTensor) finite
    whole. Rank 0 writes ``OUT/init_check.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        runner = getattr(trainer.strategy.engine, "runner", None)
        released = {id(slot[2]) for slot in runner.released.slots} if runner is not None and runner.released else set()
        mine, bad, meta = {}, [], []
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            local = t.to_local() if isinstance(t, DTensor) else t  # a split tensor: each rank checks its shard
            if local.is_meta:
                meta += [] if id(t) in released else [name]  # another stage's, on a pipeline rank: never held
            elif local.is_floating_point() and not torch.isfinite(local).all():
                bad.append(name)
            elif not isinstance(t, DTensor) or all(p.is_replicate() for p in t.placements):  # replicated: alike
                mine[name] = local.detach().cpu().clone()
        every: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(every, (mine, bad, meta))
        if trainer.global_rank == 0:
            first: dict[str, torch.Tensor] = {}
            for state, _, _ in every:
                for n, v in state.items():
                    first.setdefault(n, v)
            differ = sorted({n for state, _, _ in every for n, v in state.items() if not torch.equal(v, first[n])})
            report = {
                "nonfinite": sorted({n for _, b, _ in every for n in b}),
                "meta_left": sorted({n for _, _, m in every for n in m}),
                "differ": differ,
                "replicated_checked": len(first),
            }
            (self.out / "init_check.json").write_text(json.dumps(report))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    scenario = read_scenario(out, sys.argv[2] if len(sys.argv) > 2 else None)
    name, devices, dp = scenario["model"], scenario["devices"], scenario["dp"]
    batch, layers = scenario.get("batch", BATCH), scenario.get("layers", 2)
    padded = scenario.get("padded", False)  # padded text, labels -100 on the padding (zoo_data)
    optimizer, lr, steps = scenario.get("optimizer", "adamw"), scenario.get("lr", 1e-2), scenario.get("steps", 4)
    trainer_kwargs = dict(scenario.get("trainer", {}))
    os.environ.update(scenario.get("env", {}))
    accumulate = trainer_kwargs.get("accumulate_grad_batches", 1)
    if scenario.get("reference") == "ddp":  # Lightning's DDP on the same ranks, in the same processes, first
        L.seed_everything(0, verbose=False)
        ref_model = zoo_module(name, optimizer, lr, layers)
        init = params(ref_model)
        grads = FirstStepGrads()
        ref = quiet_trainer("ddp", out / "ref", devices=devices, callbacks=[grads], max_steps=steps, **trainer_kwargs)
        ref.fit(ref_model, zoo_data(name, SAMPLES, batch_size=batch, padded=padded))
        if ref.global_rank == 0:
            torch.save(init, out / "init.pt")
            torch.save(params(ref_model), out / "ref.pt")
            torch.save(grads.grads, out / "ref_grads.pt")
    elif "LOCAL_RANK" not in os.environ and scenario.get("reference") != "none":  # the launching process: reference
        L.seed_everything(0, verbose=False)
        ref_model = zoo_module(name, optimizer, lr, layers)
        torch.save(params(ref_model), out / "init.pt")
        grads = FirstStepGrads()
        ref = quiet_trainer("auto", out / "ref", devices=1, callbacks=[grads], max_steps=steps, **trainer_kwargs)
        started = time.perf_counter()
        ref.fit(ref_model, shuffled_like_lightning(zoo_data(name, SAMPLES, padded=padded), batch * dp))
        (out / "ref.json").write_text(json.dumps({"metrics": metrics(ref), "seconds": time.perf_counter() - started}))
        torch.save(params(ref_model), out / "ref.pt")
        torch.save(grads.grads, out / "ref_grads.pt")

    pretrained = scenario.get("pretrained", False)
    if pretrained and "LOCAL_RANK" not in os.environ:  # the initial weights as a Hugging Face folder, before any rank
        L.seed_everything(0, verbose=False)
        zoo_module(name, optimizer, lr, layers).model.save_pretrained(out / "pretrained")
        corrupt(out / "pretrained", scenario.get("corrupt"))
    L.seed_everything(0, verbose=False)
    options = dict(scenario["sgdtp"], **({"pretrained": str(out / "pretrained")} if pretrained else {}))
    strategy = SGDTPStrategy(**options)
    first = FirstStepGrads(local=local_ids if "pipeline_stages" in scenario["sgdtp"] else None)
    trainer = quiet_trainer(
        strategy, out / "sgdtp", devices=devices, callbacks=[first], max_steps=steps, **trainer_kwargs
    )
    meta = pretrained or scenario.get("meta", False)
    if meta:
        trainer.callbacks.append(InitCheck(out))
    with trainer.init_module(empty_init=True) if meta else contextlib.nullcontext():  # on meta: no memory
        model = zoo_module(name, optimizer, lr, layers)
    started = time.perf_counter()
    trainer.fit(model, zoo_data(name, SAMPLES, batch_size=batch, padded=padded))
    seconds = time.perf_counter() - started
    # A pipeline's stages merged; otherwise rank 0's state (each replica has all of it, and its buffers are the ones
    # broadcast to the others before each step: BatchNorm statistics differ per rank after a step, as with DDP).
    pipelined = getattr(strategy.engine, "runner", None) is not None
    final = gather_full(local_state(strategy, model)) if pipelined else params(model)
    grads = gather_full(first.grads or {})
    if scenario.get("export"):
        strategy.save_pretrained(out / "exported")
    held: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(held, held_bytes(model, [o for o in trainer.optimizers]))
    if trainer.global_rank == 0:
        torch.save(final, out / "sgdtp.pt")
        torch.save(grads, out / "grads.pt")
        info: dict[str, Any] = {
            "plan": strategy.plan,
            "metrics": metrics(trainer),
            "seconds": seconds,
            "accumulate": accumulate,
            # per rank, counted from the tensors after fit; the whole model's parameter bytes, from the reference
            "held": held,
            "whole_parameter_bytes": held_bytes(zoo_module(name, optimizer, lr, layers), [])["parameters"],
        }
        (out / "info.json").write_text(json.dumps(info, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
