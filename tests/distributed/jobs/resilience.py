"""Nothing is lost: runs killed mid-epoch or mid-save resume to the parameters of an uninterrupted run.

Usage: python tests/distributed/jobs/resilience.py PART OUT_DIR, with PART one of
  straight      train 14 steps (3 epochs of 6 batches per rank, checkpoint every 2 steps), uninterrupted;
  killed        the same, but the whole job is SIGKILLed at the start of step 9 (mid-epoch 2);
  save_killed   the same, but SIGKILLed in the middle of writing its 4th checkpoint (step 8);
  resumed       `fit(ckpt_path="last")` in a new job, after killed or save_killed, to step 14;
  torchrun      under `torchrun --max-restarts=1`, `fit(ckpt_path="last")`: rank 1 SIGKILLs itself at step 9
                in the first attempt; torchrun restarts both ranks, which resume on their own.
Rank 0 writes OUT_DIR/PART.pt (final parameters) and OUT_DIR/PART.json. The model uses dropout, so random
states must be restored too.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import VOCAB, BreaksModel, token_data
from helpers.training import params
from helpers.training import quiet_trainer as make_trainer

from lightning_sgdtp import SGDTPStrategy

MAX_STEPS, KILL_AT = 14, 9


class DropoutModel(BreaksModel):
    def __init__(self, part: str) -> None:
        super().__init__()
        self.part = part

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = F.dropout(self.emb(x), p=float(os.environ.get("SGDTP_TEST_DROPOUT", "0.3")), training=True)
        h = h + self.body(h)
        h = h + self.side_branch(h)
        loss = F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.global_step != KILL_AT:
            return
        if self.part == "killed" and self.global_rank == 0:
            os.killpg(0, signal.SIGKILL)  # the whole job, as a node failure or `scancel -s KILL` would
        if self.part == "torchrun" and self.global_rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


def kill_during_save(out: Path, save_number: int) -> None:
    """Make the n-th torch.save into ``out`` write half a file, then SIGKILL the job (a crash in the middle of a save)."""
    real_save, count = torch.save, [0]

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not str(getattr(f, "name", "")).startswith(str(out)):  # torch.distributed pickles objects too
            return real_save(obj, f, *args, **kwargs)
        count[0] += 1
        if count[0] == save_number:
            f.write(b"PK\x03\x04 half a checkpoint")
            f.flush()
            os.killpg(0, signal.SIGKILL)
        real_save(obj, f, *args, **kwargs)

    torch.save = save


def main(part: str, out: Path) -> None:
    if part == "save_killed":
        kill_during_save(out, 4)
    L.seed_everything(0, verbose=False)
    model = DropoutModel(part)
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_last=True)
    strategy = SGDTPStrategy(collective_timeout=30)
    trainer = make_trainer(strategy, out, max_steps=MAX_STEPS, callbacks=[ckpt], enable_checkpointing=True)
    resume = part in ("resumed", "torchrun")
    trainer.fit(model, token_data(n=48), ckpt_path="last" if resume else None)
    if trainer.global_rank == 0:
        torch.save(params(model), out / f"{part}.pt")
        info = {"global_step": trainer.global_step, "epoch": trainer.current_epoch, "world": trainer.world_size}
        (out / f"{part}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
