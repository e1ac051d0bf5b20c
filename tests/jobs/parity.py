"""One parity case: train the same model with a reference strategy and with sgdtp, in the same processes.

Usage: python tests/jobs/parity.py CASE OUT_DIR. Lightning's launcher starts the second rank by running
this script again. Rank 0 writes OUT_DIR/{ref,sgdtp}.pt (final parameters) and OUT_DIR/info.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models import BreaksModel, ManualModel, small_gpt, token_data

from lightning_sgdtp import SGDTPStrategy

# name -> (model factory, trainer kwargs, sgdtp kwargs, reference strategy kwargs)
CASES: dict[str, tuple[Callable[[], L.LightningModule], dict[str, Any], dict[str, Any]]] = {
    "breaks": (BreaksModel, {}, {}),
    "gpt": (small_gpt, {}, {"bucket_cap_mb": 0.01}),
    "accum_clip": (BreaksModel, {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}, {}),
    "bf16_mixed": (small_gpt, {"precision": "bf16-mixed"}, {}),
    "act_ckpt": (small_gpt, {}, {"activation_checkpointing": True}),
    "manual": (ManualModel, {}, {}),
    "bf16_comm": (BreaksModel, {}, {"grad_comm_dtype": "bf16"}),
    "no_sync_control": (BreaksModel, {}, {}),  # negative control: sync switched off, must NOT match
}


def trainer(strategy: Any, root: Path, **kwargs: Any) -> L.Trainer:
    defaults = {
        "accelerator": "cpu",
        "devices": 2,
        "max_steps": 6,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "default_root_dir": str(root),
        "num_sanity_val_steps": 0,
        "limit_val_batches": 0,
    }
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, **defaults)


def params(model: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def switch_off_sync(strategy: SGDTPStrategy) -> None:
    """Negative control: no in-graph collectives, no fallback. Proves the comparison can fail."""
    strategy._compiler.in_graph_sync = False
    strategy._ledger.sync = lambda record, everything=False: []
    strategy._ledger.uncovered = lambda params=None: []


def count_calls(obj: Any, name: str, counts: dict[str, int], key: str) -> None:
    method = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return method(*args, **kwargs)

    setattr(obj, name, counted)


class FirstStepGrads(L.Callback):
    """The averaged gradients the optimizer sees at the first step (AdamW hides a gradient scale error; this doesn't)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, module: L.LightningModule, optimizer: Any) -> None:
        if not self.grads:
            self.grads = {
                n.replace("_checkpoint_wrapped_module.", ""): p.grad.detach().clone()
                for n, p in module.named_parameters()
                if p.grad is not None
            }


def main(case: str, out: Path) -> None:
    factory, trainer_kwargs, sgdtp_kwargs = CASES[case]
    data = token_data()

    L.seed_everything(0, verbose=False)
    ref_model = factory()
    init = params(ref_model)
    ref_grads, grads = FirstStepGrads(), FirstStepGrads()
    ref = trainer("ddp_find_unused_parameters_true", out / "ref", callbacks=[ref_grads], **trainer_kwargs)
    ref.fit(ref_model, data)

    L.seed_everything(0, verbose=False)
    model = factory()
    strategy = SGDTPStrategy(**sgdtp_kwargs)
    run = trainer(strategy, out / "sgdtp", callbacks=[grads], **trainer_kwargs)
    counts = {"backwards": 0, "syncs": 0}
    orig_setup = strategy._setup_training

    def setup_then_instrument(trainer: L.Trainer) -> None:
        orig_setup(trainer)
        count_calls(strategy, "pre_backward", counts, "backwards")
        count_calls(strategy.ledger, "sync", counts, "syncs")
        if case == "no_sync_control":
            switch_off_sync(strategy)

    strategy._setup_training = setup_then_instrument
    run.fit(model, data)

    if run.global_rank == 0:
        torch.save(init, out / "init.pt")
        torch.save({"ref": ref_grads.grads, "sgdtp": grads.grads}, out / "grads.pt")
        torch.save(params(ref_model), out / "ref.pt")
        torch.save(params(model), out / "sgdtp.pt")
        (out / "info.json").write_text(json.dumps({"plan": strategy.plan, **counts}, default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    os._exit(0) if os.environ.get("SGDTP_FAST_EXIT") else None
