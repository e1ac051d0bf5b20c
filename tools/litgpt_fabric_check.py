"""The real LitGPT ``GPT`` (the ``litgpt`` package, unchanged) in a Fabric loop: ``"sgdtp"`` against Fabric ``"ddp"``.

    pip install --no-deps litgpt psutil      # litgpt 0.5.13's pins (huggingface-hub<1.4, jsonargparse<=4.41) clash
    python tools/litgpt_fabric_check.py      # data, sharding="full", tensor parallel (~70 s on 2 CPU cores)
    python tools/litgpt_fabric_check.py tensor

Not a test: litgpt is not a test dependency (docs/fabric.md). Each layout trains the same model from the same
initial weights for 4 steps of a global batch of 8 (per rank: 8 / the data-parallel size) with AdamW; rank 0 prints
``rel`` per layout: the relative difference of the layout's update and Fabric ddp's (parameters gathered).
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

CELLS: dict[str, dict[str, Any]] = {
    "data": {"bucket_cap_mb": 25},
    "sharded_full": {"sharding": "full"},
    "tensor": {"parallelism": "tensor"},
}


def run(options: dict[str, Any] | None) -> tuple[L.Fabric, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from litgpt import GPT, Config
    from torch.distributed.tensor import DTensor

    from lightning_sgdtp import SGDTPFabricStrategy

    strategy = "ddp" if options is None else SGDTPFabricStrategy(**options)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    config = Config(
        n_layer=2, n_head=4, n_query_groups=2, n_embd=64, block_size=32, vocab_size=128, padded_vocab_size=128,
        bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=128,
        rotary_percentage=1.0, parallel_residual=False,
    )  # fmt: skip
    model = GPT(config)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    tokens = torch.randint(0, 128, (32, 33), generator=torch.Generator().manual_seed(1))
    per_rank = 8 // fabric.strategy.distributed_sampler_kwargs["num_replicas"]  # a global batch of 8 in every layout
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    for x, y in fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=per_rank)):
        logits = model(x)
        fabric.backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.module.state_dict().items()
    }
    if options is not None:
        fabric.strategy.teardown()
    return fabric, init, state


def main(names: list[str]) -> None:
    unknown = [n for n in names if n not in CELLS]
    if unknown:
        raise SystemExit(f"unknown layout(s) {unknown}; choose from {list(CELLS)}")
    _, init, ref = run(None)
    results = {}
    for name in names or list(CELLS):
        fabric, _, got = run(CELLS[name])
        keys = [k for k in ref if ref[k].is_floating_point()]
        diff = sum(float((ref[k] - got[k]).norm() ** 2) for k in keys) ** 0.5
        update = sum(float((ref[k] - init[k]).norm() ** 2) for k in keys) ** 0.5
        results[name] = diff / update
    if fabric.global_rank == 0:
        for name, rel in results.items():
            print(f"{name:13s} rel {rel:.2e} (Fabric ddp: the reference)")


if __name__ == "__main__":
    main(sys.argv[1:])
