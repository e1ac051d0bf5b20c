"""The main job run twice on one Inductor cache: the second run takes every compiled graph from the cache.

Both runs are ``examples/train_gpt.py`` with its defaults but a smaller model and 3 steps (2 gloo ranks; the
default ``bucket_cap_mb="auto"``, whose measured link timings differ from run to run: only the bucket boundaries
they lead to are part of the key). The first run starts from an empty cache folder of its own, as on a new machine;
what each run's rank 0 reports is read from its ``sgdtp_plan.json`` (``step_program``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.launch import REPO, job_env, read_plans, run

EXAMPLE = str(REPO / "examples" / "train_gpt.py")
ARGS = ["--max_steps", "3", "--n_layer", "2", "--n_embd", "64", "--block_size", "64", "--batch_size", "8"]
ARGS += ["--limit_val_batches", "1", "--accelerator", "cpu", "--devices", "2"]


def _run(root: Path, cache: Path) -> dict:
    result = run(
        [sys.executable, EXAMPLE, *ARGS, "--default_root_dir", str(root)],
        env=job_env(TORCHINDUCTOR_CACHE_DIR=str(cache)),
    )
    assert result.returncode == 0, result.stdout[-4000:]
    (plan,) = read_plans(root)
    return plan["step_program"]


@pytest.mark.slow  # default run: the key's fields (tests/unit/compiler/test_compile_cache_key.py), compile_cache's warm start
def test_the_second_run_of_the_main_job_compiles_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "inductor"
    cold, warm = _run(tmp_path / "cold", cache), _run(tmp_path / "warm", cache)
    # Cold: rank 0 compiled each graph, or took it from the other rank, which compiled it first (the replicas of a
    # node take turns); warm: every graph from the cache.
    graphs = cold["graph_cache"]["hits"] + cold["graph_cache"]["misses"]
    assert graphs >= 2 and warm["graph_cache"] == {"hits": graphs, "misses": 0}, (cold, warm)
    # What the user waits for: the first step of the warm run, with every graph loaded instead of compiled.
    ratio = warm["first_step_s"] / cold["first_step_s"]
    assert ratio <= 0.4, (
        f"first step {warm['first_step_s']:.1f} s warm vs {cold['first_step_s']:.1f} s cold ({ratio:.2f})"
    )
