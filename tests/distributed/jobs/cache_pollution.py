"""Compile a model with plain Inductor first (filling AOTAutograd's and Inductor's caches), then the same
model with sgdtp, on 2 gloo ranks; gradients must still be averaged. Usage: cache_pollution.py OUT_DIR."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from lightning_sgdtp import SGDTPCompiler


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))


def worker(rank: int, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch._dynamo.utils import counters

    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))  # different data per rank
    plain = torch.compile(model())
    plain(x).sum().backward()
    saved = counters["aot_autograd"]["autograd_cache_saved"]
    torch._dynamo.reset()

    m = model()
    compiled = torch.compile(m, backend=SGDTPCompiler())
    compiled(x).sum().backward()

    ref = model()
    ref(x).sum().backward()
    ok, local_differs = [], []
    for p, r in zip(m.parameters(), ref.parameters()):
        g = r.grad.clone()
        dist.all_reduce(g)
        ok.append(bool(torch.allclose(p.grad, g / 2, atol=1e-6)))
        local_differs.append(not torch.allclose(r.grad, g / 2))
    if rank == 0:
        info = {"synced": ok, "local_differs": local_differs, "autograd_cache_saved": saved}
        Path(out, "cache.json").write_text(json.dumps(info))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(sys.argv[1]) / "inductor-cache")
    mp.spawn(worker, args=(sys.argv[1],), nprocs=2)
