"""Lightning features under sgdtp on 2 gloo ranks, each against a reference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from launch import JOBS, finish, free_port, job_env, max_abs_diff, run, run_job, start


def test_resume_ends_with_exactly_the_uninterrupted_parameters(tmp_path: Path) -> None:
    """Three jobs as on a cluster: 2 epochs straight; 1 epoch + checkpoint; a new job resumed from it.

    Bitwise equality needs deterministic kernels: the jobs run one thread per rank (Inductor's CPU
    embedding backward adds with atomics across threads, which reorders float sums)."""
    for part in ("straight", "first", "resumed", "ref"):
        run_job("features.py", "resume", str(tmp_path), part)
    straight = torch.load(tmp_path / "straight.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), max_abs_diff(straight, resumed)
    assert max_abs_diff(straight, torch.load(tmp_path / "ref.pt")) < 1e-4  # and it matches ddp
    info = json.loads((tmp_path / "resume-resumed.json").read_text())
    assert info["global_step"] == 8
    assert "last.ckpt" in info["ckpt_files"] and not [f for f in info["ckpt_files"] if ".tmp" in f]


def test_validate_test_predict_and_sampler(tmp_path: Path) -> None:
    run_job("features.py", "eval", str(tmp_path))
    info = json.loads((tmp_path / "eval.json").read_text())
    ref, ours = info["ref"], info["sgdtp"]
    assert abs(ref["val"] - ours["val"]) < 1e-4 and abs(ref["test"] - ours["test"]) < 1e-4
    assert ref["pred"] == ours["pred"]
    # the training sampler is sized by the data-parallel group: 2 replicas, 32 samples / 2 / batch 4 = 4 batches
    assert ours["sampler"] == ["DistributedSampler", 2, 0] and ours["batches"] == 4
    assert info["sampler_kwargs"] == {"num_replicas": 2, "rank": 0}


def test_two_nodes_via_node_rank(tmp_path: Path) -> None:
    """num_nodes=2 with devices=1, one process per simulated node (NODE_RANK=0/1), as a cluster launches it."""
    port = str(free_port())
    cmd = [sys.executable, str(JOBS / "features.py"), "nodes", str(tmp_path)]
    procs = [start(cmd, env=job_env(NODE_RANK=str(node), MASTER_PORT=port)) for node in (0, 1)]
    outputs = [finish(p, timeout=400)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    info = json.loads((tmp_path / "nodes.json").read_text())
    assert info["world_size"] == 2 and info["num_nodes"] == 2 and info["plan_world"] == 2
    finals = torch.load(tmp_path / "params.pt")
    assert max_abs_diff(finals["ref"], finals["sgdtp"]) < 1e-4


def test_errors_before_any_process_is_spawned(tmp_path: Path) -> None:
    """A compiled module and an unsupported precision fail in the launching process, naming the fix."""
    code = r"""
import sys, lightning.pytorch as L, torch
sys.path.insert(0, "tests/jobs")
from models import BreaksModel, token_data
import lightning_sgdtp
from lightning_sgdtp import SGDTPConfigError
errors = []
try:
    L.Trainer(strategy="sgdtp", accelerator="cpu", devices=2, precision="64-true", logger=False)
except SGDTPConfigError as e:
    errors.append(str(e))
t = L.Trainer(strategy="sgdtp", accelerator="cpu", devices=2, logger=False, max_steps=1)
try:
    t.fit(torch.compile(BreaksModel()), token_data())
except SGDTPConfigError as e:
    errors.append(str(e))
m = BreaksModel(); m.body = torch.compile(m.body)
try:
    t.fit(m, token_data())
except SGDTPConfigError as e:
    errors.append(str(e))
import multiprocessing, json
print("ERRORS" + json.dumps(errors))
"""
    result = run([sys.executable, "-c", code], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    errors = json.loads(result.stdout.split("ERRORS", 1)[1].strip().splitlines()[0])
    assert len(errors) == 3, errors
    assert "precision" in errors[0] and "bf16-mixed" in errors[0]
    assert "torch.compile" in errors[1] and "plain LightningModule" in errors[1]
    assert "body" in errors[2] and "remove the torch.compile" in errors[2]
    assert "Initializing distributed" not in result.stdout  # nothing was launched


def test_compile_cache_never_returns_a_backward_without_collectives(tmp_path: Path) -> None:
    """Plain Inductor compiles the model first and fills AOTAutograd's cache; sgdtp must not reuse it."""
    run_job("cache_pollution.py", str(tmp_path))
    info = json.loads((tmp_path / "cache.json").read_text())
    assert info["autograd_cache_saved"] >= 1, "the plain compile did not fill the cache: the test proves nothing"
    assert sum(info["local_differs"]) >= 3, "ranks must see different gradients, else syncing proves nothing"
    assert info["synced"] and all(info["synced"]), info
