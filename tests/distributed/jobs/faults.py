"""Fault injection: one rank of a running job is killed, raises, hangs or is stuck; the others must end, bounded.

``stuck``: at step 2 the victim compiles a function for 2 x SGDTP_TEST_STALL s, running Python (a busy loop in
TorchDynamo's compile-start callback) while the others wait for it in a collective: it must not be taken for stuck.
Then it loops forever in its step-3 ``training_step``: it must be, within ``stall_timeout=SGDTP_TEST_STALL``.

Usage: python tests/distributed/jobs/faults.py {kill|raise|hang|stuck} VICTIM OUT_DIR. Launched once per simulated node
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
        if batch_idx == 2 and self.global_rank == self.victim and self.mode == "stuck":
            compile_slowly(2 * float(os.environ["SGDTP_TEST_STALL"]))
        if batch_idx >= 3:
            time.sleep(0.05)

    def training_step(self, batch, batch_idx):
        if batch_idx == 3 and self.global_rank == self.victim and self.mode == "stuck":
            spin(float("inf"))
        return super().training_step(batch, batch_idx)


def spin(seconds: float) -> int:
    """Run Python for ``seconds`` (an endless loop with ``inf``)."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += 1
    return n


def compile_slowly(seconds: float) -> None:
    """Compile a small function with ``torch.compile``, running Python ``seconds`` longer inside TorchDynamo's compile
    (a recompile mid-training, as a new shape or a user's own ``torch.compile`` brings)."""
    import torch
    import torch._dynamo.callback

    def start(args: object) -> None:
        torch._dynamo.callback.callback_handler.remove_start_callback(start)
        spin(seconds)

    torch._dynamo.callback.on_compile_start(start)
    torch.compile(lambda t: t * 2 + 1, backend="eager")(torch.ones(3))


if __name__ == "__main__":
    mode, victim, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    world = int(os.environ.get("SGDTP_TEST_WORLD", "3"))
    watch = {}
    if "SGDTP_TEST_STALL" in os.environ:
        watch = {"stall_timeout": float(os.environ["SGDTP_TEST_STALL"]), "heartbeat_timeout": 3}
        if os.environ.get("SGDTP_TEST_STALL_OFF"):  # the negative control
            watch["stall_timeout"] = False
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        strategy=SGDTPStrategy(
            collective_timeout=float(os.environ.get("SGDTP_TEST_TIMEOUT", "5")),
            rendezvous_timeout=float(os.environ.get("SGDTP_TEST_RENDEZVOUS", "300")),
            **watch,
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
