"""The Lightning features users combine with a strategy, under Lightning's DDP and under sgdtp, in one launch of 2
ranks (issue 46: the plugin as a true drop-in; as Lightning's own ``test_common.py`` does across strategies).

Usage: python tests/distributed/jobs/contract.py OUT_DIR [FEATURE ...]. Each feature runs with ``ddp`` then with
``sgdtp`` (the same seed, model and data); rank 0 writes OUT_DIR/contract.json: per feature, per strategy, what a
user observes (losses, metrics, predictions, the files a callback wrote, the weights' checksum). The test compares
the two strategies feature by feature. Features (all by default): evaluate, callbacks, resume, save_trainer,
compiled, precision_plugin, profiler, lr_find, cli.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch.optim.swa_utils import get_ema_avg_fn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import BreaksModel, token_data
from helpers.training import quiet_trainer

from lightning_sgdtp import SGDTPStrategy

STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp": lambda: "ddp_find_unused_parameters_true",  # BreaksModel has an unused layer
    "sgdtp": SGDTPStrategy,
}


def checksum(model: torch.nn.Module) -> float:
    """One number per state: the sum of every parameter's values (equal weights give equal sums, to fp32 noise)."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def listing(folder: Path) -> list[str]:
    """The folder's entries, once every rank has written its own (a rank may still be in its teardown)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return sorted(os.listdir(folder)) if folder.exists() else []


def train_data() -> Any:
    return token_data(n=32)


def val_data() -> Any:
    return token_data(n=16, seed=7)


# ------------------------------------------------------------------------------------------- features
def evaluate(strategy: Any, out: Path) -> dict[str, Any]:
    """fit, then validate / test / predict with the same Trainer; the training sampler."""
    model = BreaksModel()
    t = quiet_trainer(strategy, out, max_steps=4, limit_val_batches=None)
    t.fit(model, train_dataloaders=train_data(), val_dataloaders=val_data())
    sampler = t.train_dataloader.sampler
    val = t.validate(model, val_data(), verbose=False)
    test = t.test(model, token_data(n=16, seed=8), verbose=False)
    pred = t.predict(model, token_data(n=8, seed=9))
    return {
        "val": val[0]["val_loss"],
        "test": test[0]["val_loss"],
        "pred": torch.cat(pred).tolist(),
        "sampler": [type(sampler).__name__, getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)],
        "batches": t.num_training_batches,
        "sampler_kwargs": t.strategy.distributed_sampler_kwargs,
    }


class EMA(L.callbacks.WeightAveraging):
    def __init__(self) -> None:
        super().__init__(avg_fn=get_ema_avg_fn(0.9))


def callbacks(strategy: Any, out: Path) -> dict[str, Any]:
    """ModelCheckpoint (every 2 steps, last), EarlyStopping on the validation loss, EMA weight averaging: what they
    leave in their folder and the weights they end with."""
    ckpt = L.callbacks.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=-1, save_last=True)
    stop = L.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0)  # stops at the first check
    ema = EMA()
    model = BreaksModel()
    t = quiet_trainer(
        strategy, out, max_epochs=3, max_steps=-1, limit_train_batches=4, limit_val_batches=2, val_check_interval=2,
        enable_checkpointing=True, callbacks=[ckpt, stop, ema],
    )  # fmt: skip
    t.fit(model, train_dataloaders=train_data(), val_dataloaders=val_data())
    return {
        "files": listing(out / "ckpt"),
        "root": listing(out),  # default_root_dir, with logger=False: what the run left there
        "best": Path(ckpt.best_model_path).name,
        "stopped": [t.current_epoch, t.global_step, stop.stopped_epoch, t.should_stop],
        "weights": checksum(model),
        "ema": checksum(ema._average_model.module) if ema._average_model is not None else None,
    }


def resume(strategy: Any, out: Path) -> dict[str, Any]:
    """4 steps, saved; a new Trainer resumes from the file for 2 more: the weights, the step, the folder."""
    ckpt = L.callbacks.ModelCheckpoint(dirpath=out / "ckpt", save_last=True)
    first = quiet_trainer(strategy(), out, max_steps=4, enable_checkpointing=True, callbacks=[ckpt])
    first.fit(BreaksModel(), train_dataloaders=train_data())
    model = BreaksModel()
    again = quiet_trainer(strategy(), out, max_steps=6, enable_checkpointing=True)
    again.fit(model, train_dataloaders=train_data(), ckpt_path=str(out / "ckpt" / "last.ckpt"))
    return {"weights": checksum(model), "step": again.global_step, "files": listing(out / "ckpt")}


def save_trainer(strategy: Any, out: Path) -> dict[str, Any]:
    """``copy.deepcopy(trainer.strategy)`` and ``torch.save(trainer)`` before fit, on every rank; ``torch.save`` after
    fit too, which fails under DDP on rank 0 (Lightning 2.6's subprocess launcher keeps its ``Popen`` handles), so
    what it raises is recorded, not raised."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    t = quiet_trainer(strategy, out, max_steps=2)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    copy.deepcopy(t.strategy)
    torch.save(t, out / f"before_{rank}.pt")
    t.fit(BreaksModel(), train_dataloaders=train_data())
    try:
        torch.save(t, out / f"after_{rank}.pt")
        after: Any = torch.load(out / f"after_{rank}.pt", weights_only=False).global_step
    except (TypeError, AttributeError, RuntimeError) as exc:  # what DDP raises (asserted by the test)
        after = f"{type(exc).__name__}: {exc}"[:200]
    return {"before": True, "after": after}


def compiled(strategy: Any, out: Path) -> dict[str, Any]:
    """``trainer.fit(torch.compile(model, dynamic=False))``: the most common way users compile, on Lightning's
    BoringModel (Lightning's ``test_trainer_compiled_model_ddp``). Under DDP (torch 2.13, Lightning 2.6) a compiled
    module whose ``training_step`` calls ``self.log`` fails in Dynamo ("'method' object has no attribute
    '__dict__'"); sgdtp compiles the step itself and trains it (``test_lightning_contract.py``)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    model = BoringModel()
    t = quiet_trainer(strategy, out, max_steps=4)
    t.fit(torch.compile(model, dynamic=False))
    return {"weights": checksum(model), "step": t.global_step}


class MyAMP(L.plugins.MixedPrecision):
    """A user's precision plugin (Lightning's ``test_amp_ddp``): a subclass of MixedPrecision."""

    calls = 0

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        MyAMP.calls += 1
        return super().optimizer_step(*args, **kwargs)


def precision_plugin(strategy: Any, out: Path) -> dict[str, Any]:
    MyAMP.calls = 0
    model = BreaksModel()
    t = quiet_trainer(strategy, out, max_steps=4, plugins=[MyAMP("bf16-mixed", "cpu")])
    t.fit(model, train_dataloaders=train_data())
    return {"weights": checksum(model), "plugin_steps": MyAMP.calls}


def profiler(strategy: Any, out: Path) -> dict[str, Any]:
    """The simple profiler's files (one per rank) in its folder."""
    prof = L.profilers.SimpleProfiler(dirpath=out / "prof", filename="perf")
    t = quiet_trainer(strategy, out, max_steps=2, profiler=prof)
    t.fit(BreaksModel(), train_dataloaders=train_data())
    return {"files": listing(out / "prof")}


def lr_find(strategy: Any, out: Path) -> dict[str, Any]:
    """The learning-rate finder's curve and suggestion (it fits a few steps and restores the weights)."""
    from lightning.pytorch.tuner import Tuner

    model = BreaksModel()
    before = checksum(model)
    t = quiet_trainer(strategy, out, max_steps=8)
    finder = Tuner(t).lr_find(model, train_dataloaders=train_data(), num_training=6, min_lr=1e-4, max_lr=1.0)
    return {"lrs": finder.results["lr"], "losses": finder.results["loss"], "restored": checksum(model) == before}


class Data(L.LightningDataModule):
    def train_dataloader(self) -> Any:
        return train_data()


def cli(strategy: Any, out: Path) -> dict[str, Any]:
    """LightningCLI with the strategy given by name on the command line."""
    from lightning.pytorch.cli import LightningCLI

    name = "sgdtp" if isinstance(strategy, SGDTPStrategy) else strategy
    args = [
        "fit", f"--trainer.strategy={name}", "--trainer.accelerator=cpu", "--trainer.devices=2",
        "--trainer.max_steps=3", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={out}",
    ]  # fmt: skip
    run = LightningCLI(BreaksModel, Data, args=args, save_config_callback=None)
    return {"weights": checksum(run.model), "step": run.trainer.global_step}


FEATURES: dict[str, Callable[[Any, Path], dict[str, Any]]] = {
    f.__name__: f
    for f in (evaluate, callbacks, resume, save_trainer, compiled, precision_plugin, profiler, lr_find, cli)
}


def main(out: Path, features: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for feature in features:
        results[feature] = {}
        for name, make in STRATEGIES.items():
            L.seed_everything(0, verbose=False)
            folder = out / feature / name
            # resume builds two Trainers: it gets the factory
            results[feature][name] = FEATURES[feature](make if feature == "resume" else make(), folder)
    return results


if __name__ == "__main__":
    out = Path(sys.argv[1])
    info = main(out, sys.argv[2:] or list(FEATURES))
    if torch.distributed.get_rank() == 0:
        (out / "contract.json").write_text(json.dumps(info, default=str))
