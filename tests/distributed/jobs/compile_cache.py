"""A 2-rank job with ``compile_cache``: usage ``python tests/distributed/jobs/compile_cache.py CACHE OUT_DIR NAME``.
CACHE ``auto``: no option, the default compile cache (its folder from ``SGDTP_COMPILE_CACHE``, set by the test).
``SGDTP_TEST_FIT_TWICE=1``: then a second fit in the same process (OUT_DIR/NAME-again.pt).

Every rank writes OUT_DIR/NAME-RANK.json with its Inductor FX-graph and AOTAutograd cache hits and misses; rank 0
also writes OUT_DIR/NAME.pt (final parameters). TORCHINDUCTOR_CACHE_DIR is set by the test (a fresh node).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as L
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from helpers.models import small_gpt, token_data
from helpers.training import params
from helpers.training import quiet_trainer as trainer

from lightning_sgdtp import SGDTPStrategy

if __name__ == "__main__":
    cache, out, name = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    L.seed_everything(0, verbose=False)
    model = small_gpt()
    run = trainer(SGDTPStrategy() if cache == "auto" else SGDTPStrategy(compile_cache=cache), out / name, max_steps=3)
    run.fit(model, token_data(n=32))
    keys = ("fxgraph_cache_hit", "fxgraph_cache_miss")
    stats = {k: counters["inductor"].get(k, 0) for k in keys}
    stats |= {k: counters["aot_autograd"].get(k, 0) for k in ("autograd_cache_hit", "autograd_cache_miss")}
    stats["graphs"] = [g["graph_id"] for g in run.strategy.plan["graphs"]]
    (out / f"{name}-{run.global_rank}.json").write_text(json.dumps(stats))
    if run.global_rank == 0:
        torch.save(params(model), out / f"{name}.pt")
    if os.environ.get("SGDTP_TEST_FIT_TWICE") == "1":  # a second fit in this process (a notebook, a sweep)
        L.seed_everything(0, verbose=False)
        again = small_gpt()
        trainer(
            SGDTPStrategy() if cache == "auto" else SGDTPStrategy(compile_cache=cache), out / name, max_steps=3
        ).fit(again, token_data(n=32))
        if run.global_rank == 0:
            torch.save(params(again), out / f"{name}-again.pt")
