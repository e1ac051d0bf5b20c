"""Parity of a registered fused op under the sgdtp strategy: the same MLP written with plain torch ops, trained with DDP.

Usage: python tests/distributed/jobs/graph_parity.py OUT_DIR. Lightning's launcher starts the second rank by running this
script again, so the op is registered here, at import, in both processes. Rank 0 writes OUT_DIR/{init,ref,sgdtp}.pt
(parameters) and OUT_DIR/info.json (what the compiler saw, call counts, the strategy's plan).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.training import params
from helpers.training import quiet_trainer as trainer

from lightning_sgdtp import SGDTPStrategy, graph
from lightning_sgdtp.compiler.backend import SGDTPCompiler

CALLS = {"forward": 0, "backward": 0}
IN, HIDDEN, STEPS, LR = 16, 32, 4, 0.1


def fused_linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu(x @ w.T + b) in one call (stands in for a hand-written kernel)."""
    CALLS["forward"] += 1
    return F.gelu(torch.addmm(b, x, w.t()))


def fused_linear_gelu_backward(ctx: graph.BackwardContext, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Hand-written: recompute z = x @ w.T + b, then d gelu(z)/dz = Phi(z) + z * phi(z) (exact, erf-based)."""
    CALLS["backward"] += 1
    x, w, b = ctx.inputs
    z = torch.addmm(b, x, w.t())
    cdf = 0.5 * (1.0 + torch.erf(z * 0.7071067811865476))
    pdf = torch.exp(-0.5 * z * z) * 0.3989422804014327
    gz = grad * (cdf + z * pdf)
    return gz @ w, gz.t() @ x, gz.sum(0)


FUSED = graph.register(
    name="linear_gelu",
    forward_fn=fused_linear_gelu,
    backward_fn=fused_linear_gelu_backward,
    input_specs=[
        graph.TensorSpec(device="cpu", ndim=2, name="x"),
        graph.TensorSpec(device="cpu", ndim=2, name="weight"),
        graph.TensorSpec(device="cpu", ndim=1, name="bias"),
    ],
    output_specs=[("tensor", "cpu")],
    shape_fn=lambda x, w, b: (x.shape[0], w.shape[0]),
)

# What the sgdtp backend is given: the number of linear_gelu nodes in every captured graph.
OP_NODES: list[int] = []
_compile = SGDTPCompiler.__call__


def _counting_compile(self: SGDTPCompiler, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    OP_NODES.append(sum(1 for n in gm.graph.nodes if n.target is FUSED.op))
    return _compile(self, gm, example_inputs)


SGDTPCompiler.__call__ = _counting_compile


class MLP(L.LightningModule):
    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.fused:
            h = FUSED(x, self.fc1.weight, self.fc1.bias)
        else:
            h = F.gelu(self.fc1(x))
        return F.mse_loss(self.head(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, IN, generator=g)
    y = torch.sin(x[:, :1] * 2) + 0.1 * x[:, 1:2]
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


def main(out: Path) -> None:
    L.seed_everything(0, verbose=False)
    ref_model = MLP(fused=False)
    init = params(ref_model)
    trainer("ddp", out / "ref", max_steps=STEPS).fit(ref_model, data())

    L.seed_everything(0, verbose=False)
    model = MLP(fused=True)
    assert all(torch.equal(init[k], v) for k, v in params(model).items()), "both models must start equal"
    strategy = SGDTPStrategy()
    run = trainer(strategy, out / "sgdtp", max_steps=STEPS)
    run.fit(model, data())

    if run.global_rank == 0:
        torch.save(init, out / "init.pt")
        torch.save(params(ref_model), out / "ref.pt")
        torch.save(params(model), out / "sgdtp.pt")
        info = {
            "op_nodes": OP_NODES,
            "calls": CALLS,
            "plan": strategy.plan,
            "world_size": run.world_size,
        }
        (out / "info.json").write_text(json.dumps(info, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    os._exit(0) if os.environ.get("SGDTP_FAST_EXIT") else None
