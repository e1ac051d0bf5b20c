"""Fault injection: one rank of a running job is killed, raises, or hangs; the others must end, bounded.

Usage: python tests/distributed/jobs/faults.py {kill|raise|hang} VICTIM OUT_DIR. Launched once per simulated node
(NODE_RANK=i, devices=1, num_nodes=WORLD), or started by Lightning (SGDTP_TEST_DEVICES=N, one node). Every rank writes OUT_DIR/step-RANK when it reaches step 3, so the
test knows when to strike; with ``raise``/``hang`` the victim does it itself at step 3.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning.pytorch as L

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import BreaksModel, token_data

from lightning_sgdtp import SGDTPStrategy


class Victim(BreaksModel):
    def __init__(self, mode: str, victim: int, out: Path) -> None:
        super().__init__()
        self.mode, self.victim, self.out = mode, victim, out

    def on_train_batch_start(self, batch, batch_idx):
        if batch_idx == 3:
            (self.out / f"step-{self.global_rank}").write_text(str(os.getpid()))
            if self.global_rank == self.victim and self.mode == "raise":
                raise RuntimeError(f"injected failure on rank {self.global_rank}")
            if self.global_rank == self.victim and self.mode == "hang":
                time.sleep(3600)
        if batch_idx >= 3:
            time.sleep(0.05)


if __name__ == "__main__":
    mode, victim, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    world = int(os.environ.get("SGDTP_TEST_WORLD", "3"))
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=SGDTPStrategy(
            collective_timeout=float(os.environ.get("SGDTP_TEST_TIMEOUT", "5")),
            rendezvous_timeout=float(os.environ.get("SGDTP_TEST_RENDEZVOUS", "300")),
        ),
        accelerator="cpu",
        devices=int(os.environ.get("SGDTP_TEST_DEVICES", "1")),
        num_nodes=world,
        max_steps=10_000,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    trainer.fit(Victim(mode, victim, out), token_data(n=4 * 10_000))
