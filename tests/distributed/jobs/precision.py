"""Lightning's precisions under sgdtp against Lightning's DDP at the same precision, several cases in one launch.

Usage: python tests/distributed/jobs/precision.py OUT_DIR [SCENARIO], with the scenario (JSON; else
OUT_DIR/scenario.json) = {"cases": [{"name": str, "precision": "16-mixed" | "bf16-mixed" | "bf16-true" |
"16-true", "mode": "data" | "sharded" | "tensor" | "control" | "noise", "inject": bool}, ...]}. Every case runs in the
same two processes, one after another (Lightning's launcher starts rank 1 once, by running this script again):
Lightning's ``strategy="ddp"`` on the plain module (the reference, once per precision and injection), then the
case's run: sgdtp in its mode (``"control"``: data parallel with the gradient sync switched off,
``debug_skip_sync="dp-sync"``), or ``"noise"``: ddp on ``torch.compile(model)`` (the noise floor: the same
arithmetic, reordered by the compiler).

``"16-mixed"`` is given as the plugin ``MixedPrecision("16-mixed", "cpu")`` (fp16 autocast and Lightning's
GradScaler): ``Trainer(precision="16-mixed")`` on CPU is turned into ``"bf16-mixed"`` by Lightning itself, for
every strategy. ``"inject": true`` puts an inf into one gradient element (``head.bias[-1]``) on rank 0 only, at
step 2: a poisoned sample (``POISONED``) that rank 0 alone reads there (data and sharded modes read with the same
DistributedSampler as ddp). The model's first parameter (``gain``) has no dimension that divides by 2: sharding
keeps it whole, and GradScaler's inf check sees a replicated gradient first.

Rank 0 writes OUT_DIR/NAME.pt per case: {"init", "ref", "run": full parameters; "ref_losses", "losses": the mean
over ranks of each step's loss; "ranks": per rank {"params": its local tensors (a shard's local part),
"scale": the GradScaler's scale or None, "steps": the AdamW step counts of its parameters}, "ref_ranks": the same
for the reference; "plan": the sgdtp plan (None for ddp)}.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import SEQ, VOCAB
from helpers.training import params, quiet_trainer, read_scenario

from lightning_sgdtp import SGDTPStrategy

STEPS, BATCH, SAMPLES = 4, 4, 32
#: The poisoned sample. Lightning gives every rank a shuffling DistributedSampler (seed 0, from seed_everything):
#: with 2 replicas rank 0 reads perm[0::2], its batch 1 (step 2) perm[8:16:2]; tensor parallel's one data-parallel
#: rank reads perm[8:16] at step 2. perm[8]: step 2, rank 0 alone (data, sharded); step 2 on both (tensor).
POISONED = int(torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0))[8])
STRATEGY = {
    "data": {},
    "control": {"debug_skip_sync": "dp-sync"},  # the negative control: data parallel without the gradient sync
    "sharded": {"sharding": "full"},
    "tensor": {"parallelism": "tensor"},
}


class PrecisionNet(L.LightningModule):
    """An embedding, a two-layer MLP (split by tensor parallel: colwise then rowwise), a head; the loss in fp32.
    ``poisoned``: the loss adds ``poison * head.bias[-1]``, 0 unless a sample carries an inf: then that one gradient
    element is inf (a plain tensor times a parameter: data and sharded modes only)."""

    def __init__(self, poisoned: bool = False, eps: float = 1e-8) -> None:
        super().__init__()
        self.poisoned, self.eps = poisoned, eps
        self.gain = nn.Parameter(torch.ones(3))  # first, and no dimension divides by 2: kept whole when sharded
        self.emb = nn.Embedding(VOCAB, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, VOCAB)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, y, poison = batch
        h = self.emb(x) * self.gain.mean()
        h = h + self.mlp(h)
        logits = self.head(h).float()
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        if self.poisoned:
            loss = loss + (poison.to(self.head.bias.dtype) * self.head.bias[-1]).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=self.eps)


def data(batch_size: int, inject: bool) -> DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    poison = torch.zeros(SAMPLES)
    if inject:
        poison[POISONED] = float("inf")
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1), poison), batch_size=batch_size, shuffle=False)


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def rank_state(trainer: L.Trainer, model: L.LightningModule, losses: Losses) -> list[dict[str, Any]]:
    """Every rank's local parameters, scaler scale, AdamW step counts and losses (a collective)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    assert scaler is None or "_unscale_grads_" not in vars(scaler), "the strategy left its wrapper on the GradScaler"
    optimizer = trainer.optimizers[0]
    steps = sorted({float(s["step"]) for s in optimizer.state.values() if "step" in s})
    mine = {
        "params": {k: local(v) for k, v in model.state_dict().items()},
        "scale": None if scaler is None else float(scaler.get_scale()),
        "steps": steps,
        "losses": losses.losses,
    }
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def train(precision: str, mode: str, inject: bool, root: Path) -> tuple[dict[str, Any], ...]:
    """One run: ``mode`` "ddp", "noise" or an sgdtp mode. Returns (init, full params, ranks, plan)."""
    L.seed_everything(0, verbose=False)
    # 16-true: AdamW's default eps (1e-8) is 0 in float16, and a gradient element that is exactly 0 then makes a NaN
    # weight (0 / 0), under ddp too: 1e-4 (a normal float16) instead.
    model = PrecisionNet(poisoned=inject, eps=1e-4 if precision == "16-true" else 1e-8)
    init = params(model)
    precision_kwargs: dict[str, Any] = (
        {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}
    )
    # Half-precision weights (*-true): AdamW as ddp runs it (foreach, in the weights' dtype). optimizer_update="auto"
    # would give data parallel torch's fused kernel, which computes in float32 inside: other numbers (in float16
    # ddp's exp_avg_sq underflows to 0), not a gradient-path difference.
    eager = {"optimizer_update": "eager"} if precision.endswith("-true") and mode in ("data", "control") else {}
    strategy: Any = "ddp" if mode in ("ddp", "noise") else SGDTPStrategy(**STRATEGY[mode], **eager)
    losses = Losses()
    trainer = quiet_trainer(strategy, root, callbacks=[losses], max_steps=STEPS, **precision_kwargs)
    # Tensor parallel: one data-parallel rank reads the global batch (both ranks the same), ddp's two ranks half each.
    batch = BATCH * 2 if mode == "tensor" else BATCH
    trainer.fit(torch.compile(model) if mode == "noise" else model, data(batch, inject))
    if precision == "16-mixed":
        assert type(trainer.precision_plugin) is MixedPrecision and trainer.precision_plugin.scaler is not None
    ranks = rank_state(trainer, model, losses)
    plan = None if isinstance(strategy, str) else strategy.plan
    return init, params(model), ranks, plan


def main(out: Path) -> None:
    scenario = read_scenario(out, sys.argv[2] if len(sys.argv) > 2 else None)
    refs: dict[tuple[str, bool], tuple[Any, ...]] = {}
    for case in scenario["cases"]:
        name, precision, mode, inject = case["name"], case["precision"], case["mode"], case.get("inject", False)
        if (precision, inject) not in refs:
            refs[precision, inject] = train(precision, "ddp", inject, out / f"ref_{precision}_{inject}")
        init, ref, ref_ranks, _ = refs[precision, inject]
        _, run, ranks, plan = train(precision, mode, inject, out / name)
        if dist.get_rank() == 0:
            world = len(ranks)
            result = {
                "init": init,
                "ref": ref,
                "run": run,
                "ref_losses": [sum(r["losses"][i] for r in ref_ranks) / world for i in range(STEPS)],
                "losses": [sum(r["losses"][i] for r in ranks) / world for i in range(STEPS)],
                "ref_ranks": ref_ranks,
                "ranks": ranks,
                "plan": plan,
            }
            torch.save(result, out / f"{name}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    os._exit(0) if os.environ.get("SGDTP_FAST_EXIT") else None
