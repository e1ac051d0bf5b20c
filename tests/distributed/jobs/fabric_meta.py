"""Fabric with a model built on the meta device (``fabric.init_module(empty_init=True)``) and pretrained weights read
by shard (``SGDTPFabricStrategy(pretrained=..., sharding="full")``), the optimizer made before ``fabric.setup``.

Usage: python tests/distributed/jobs/fabric_meta.py OUT_DIR. The launching process writes a tiny transformers Llama
with save_pretrained; each rank trains 2 steps; rank 0 writes ``OUT/fabric_meta.json``: the first loss and the loss
of the same weights in one process, and ``OUT/exported`` (the strategy's save_pretrained).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_sgdtp import SGDTPFabricStrategy

CONFIG = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}


def main(out: Path) -> None:
    config = transformers.LlamaConfig(**CONFIG, num_attention_heads=4)
    if "LOCAL_RANK" not in os.environ:
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(out / "pretrained")
    strategy = SGDTPFabricStrategy(pretrained=str(out / "pretrained"), sharding="full")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = transformers.LlamaForCausalLM(config)
    meta = all(p.is_meta for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    tokens = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        loss = model(input_ids=tokens, labels=tokens).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    fabric.strategy.save_pretrained(model, out / "exported")
    if fabric.global_rank == 0:
        reference = transformers.LlamaForCausalLM.from_pretrained(out / "pretrained")
        first = float(reference(input_ids=tokens, labels=tokens).loss)
        (out / "fabric_meta.json").write_text(json.dumps({"meta": meta, "losses": losses, "reference": first}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
