"""A LightningModule that breaks the pipeline contract trains with ``pipeline_stages=2``: the job must fail, and
its output must name what is broken.

Usage: python tests/distributed/jobs/pp_contract.py MODULE OUT_DIR, with MODULE one of the classes below.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import GPTLightningModule, pp_gpt, token_data
from helpers.training import quiet_trainer

from lightning_sgdtp import SGDTPStrategy


class NoSelfCall(GPTLightningModule):
    """Breaks the contract: runs its model without calling self(...)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


class NoLoss(GPTLightningModule):
    """Breaks the contract on the last stage only: training_step returns nothing (the other stage waits)."""

    def training_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


class Untraceable(GPTLightningModule):
    """Breaks the contract: data-dependent Python control flow in forward."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.sum() > 0:
            return self.model(idx)
        return self.model(idx + 1)


BROKEN = {cls.__name__: cls for cls in (NoSelfCall, NoLoss, Untraceable)}

if __name__ == "__main__":
    name, out = sys.argv[1], Path(sys.argv[2])
    L.seed_everything(0, verbose=False)
    model = BROKEN[name].from_config(pp_gpt().config)
    strategy = SGDTPStrategy(pipeline_stages=2, pipeline_chunks=4, collective_timeout=20)
    quiet_trainer(strategy, out / "sgdtp", devices=2).fit(model, token_data(batch_size=8))
