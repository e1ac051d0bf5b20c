"""Checkpoints and resume, every layout in one place: a resumed run ends where the uninterrupted run ends.

- data parallel (``jobs/dp_resume.py``): three jobs as on a cluster, bitwise equal to training straight through;
- tensor / hybrid (``jobs/tp_parity.py``, two phases): a sharded, signed checkpoint folder, resumed on another
  mesh; ``sgdtp consolidate`` makes one file;
- pipeline (``jobs/pp_parity.py``, two phases): one shard per stage, resumed with another split or no pipeline;
- killed jobs (``jobs/resilience.py``): SIGKILLed mid-epoch or mid-save, or restarted by torchrun, bitwise equal
  to the uninterrupted run (CPU, one thread per rank, dropout included; no handler runs on SIGKILL);
- verification: checkpoints are checked against their (signed) manifest before anything is unpickled.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from helpers.launch import (
    JOBS,
    REPO,
    job_env,
    max_abs_diff,
    parity_result,
    rel_update_diff,
    run,
    run_job,
    run_scenario,
    tiered,
)

from lightning_sgdtp.trust import MANIFEST

REL_TOL = {"tensor": 1e-2, "pipeline": 1e-3}  # fp32, as in test_tensor_parallel.py / test_pipeline_parallel.py


# ------------------------------------------------------------------------------------------- data parallel
# Slow tier: resume stays in the default run through the killed-job tests below (bitwise, one checkpoint file) and,
# sharded, through resume_tp_to_dp (a DCP folder of DTensor shards, read back on another layout).
@pytest.mark.covers("data + sharding full", "consolidate", param="full")
@pytest.mark.parametrize("sharding", tiered(["none", "full"], slow={"none", "full"}))
def test_resume_ends_with_exactly_the_uninterrupted_parameters(sharding: str, tmp_path: Path) -> None:
    """Three jobs as on a cluster: 2 epochs straight; 1 epoch + checkpoint; a new job resumed from it. Replicated
    (one checkpoint file) and sharded (a DCP folder of each rank's shards and optimizer state).

    Bitwise equality needs deterministic kernels: the jobs run one thread per rank (Inductor's CPU
    embedding backward adds with atomics across threads, which reorders float sums)."""
    for part in ("straight", "first", "resumed", "ref"):
        run_job("dp_resume.py", part, str(tmp_path), *([sharding] if part != "ref" else []))
    straight = torch.load(tmp_path / "straight.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), max_abs_diff(straight, resumed)
    assert max_abs_diff(straight, torch.load(tmp_path / "ref.pt")) < 1e-4  # and it matches ddp
    info = json.loads((tmp_path / "resume-resumed.json").read_text())
    if sharding != "none":  # a folder of shards; `sgdtp consolidate` makes the one file of the first job's weights
        assert (tmp_path / "ckpt" / "last.ckpt" / ".metadata").is_file()
        one = tmp_path / "one.ckpt"
        cmd = [
            sys.executable,
            "-m",
            "lightning_sgdtp.cli",
            "consolidate",
            str(tmp_path / "ckpt" / "last.ckpt"),
            str(one),
        ]
        subprocess.run(cmd, check=True, cwd=REPO)
        consolidated, first = torch.load(one, weights_only=False)["state_dict"], torch.load(tmp_path / "first.pt")
        assert consolidated.keys() == first.keys() and all(torch.equal(consolidated[k], first[k]) for k in first)
    assert info["global_step"] == 8
    assert "last.ckpt" in info["ckpt_files"] and not [f for f in info["ckpt_files"] if ".tmp" in f]


# ----------------------------------------------------------------------------------------- tensor parallel
# 3 steps on one layout, a checkpoint, 3 more on the other (jobs/tp_parity.py, small GPT, 2 ranks)
ON_ANOTHER_MESH: dict[str, list[dict[str, Any]]] = {
    # the second phase splits differently (a tp_plan: only the MLPs): the checkpoint is resharded between plans
    "resume_tp_to_tp": [
        {"parallelism": "tensor"},
        {
            "parallelism": "tensor",
            "tp_plan": {"model.blocks.*.mlp.fc": "colwise", "model.blocks.*.mlp.proj": "rowwise"},
        },
    ],
    "resume_tp_to_dp": [{"parallelism": "tensor"}, {"parallelism": "data"}],
    "resume_dp_to_tp": [{"parallelism": "data"}, {"parallelism": "tensor"}],
    # sharded (DTensors over dp) <-> replicated <-> tensor parallel: DCP reshards by parameter name
    "resume_sharded_to_dp": [{"parallelism": "data", "sharding": "full"}, {"parallelism": "data"}],
    "resume_dp_to_sharded": [{"parallelism": "data"}, {"parallelism": "data", "sharding": "optimizer"}],
    "resume_tp_to_sharded": [{"parallelism": "tensor"}, {"parallelism": "data", "sharding": "full"}],
}
_TP: dict[str, dict] = {}
#: Default run: tensor -> data (the sharded folder and `sgdtp consolidate` read it). The other directions go through
#: the same DCP resharding by parameter name.
SLOW_MESH = {
    "resume_tp_to_tp",
    "resume_dp_to_tp",
    "resume_sharded_to_dp",
    "resume_dp_to_sharded",
    "resume_tp_to_sharded",
}


def tp_result(name: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    scenario = {"model": "small_gpt", "devices": 2, "phases": ON_ANOTHER_MESH[name], "trainer": {}}
    return parity_result(_TP, "tp_parity.py", name, scenario, tmp_path_factory.mktemp(name))


@pytest.mark.covers("tensor", "resume on another layout", target="data", param="resume_tp_to_dp")
@pytest.mark.covers(
    "tensor", "resume on another layout", target="tensor", note="another tp_plan", param="resume_tp_to_tp"
)
@pytest.mark.covers("tensor", "resume on another layout", target="data + sharding full", param="resume_tp_to_sharded")
@pytest.mark.covers("data", "resume on another layout", target="tensor", param="resume_dp_to_tp")
@pytest.mark.covers(
    "data", "resume on another layout", target="data + sharding optimizer", param="resume_dp_to_sharded"
)
@pytest.mark.covers("data + sharding full", "resume on another layout", target="data", param="resume_sharded_to_dp")
@pytest.mark.parametrize("case", tiered(list(ON_ANOTHER_MESH), SLOW_MESH))
def test_resume_on_another_mesh(case: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """3 steps on one layout, a checkpoint, 3 more on the other: equal to 6 uninterrupted steps in one process."""
    r = tp_result(case, tmp_path_factory)
    rel = rel_update_diff(r["init"], r["ref"], r["sgdtp"])
    assert rel < REL_TOL["tensor"], f"{case}: relative update difference {rel:.3g}"
    plans = r["info"]["plans"]
    assert [p["parallelism"] for p in plans] == [phase["parallelism"] for phase in ON_ANOTHER_MESH[case]]
    if case == "resume_tp_to_tp":  # the user's tp_plan, applied by the strategy: only the MLPs are split
        plan = plans[1]["tensor_parallel_plan"]
        assert plan["source"] == "tp_plan"
        assert sorted(plan["styles"]) == [f"model.blocks.{i}.mlp.{n}" for i in range(2) for n in ("fc", "proj")]
        assert plan["replicated"]["model.blocks.0.attn.qkv"] == "not in tp_plan"


@pytest.mark.covers("tensor", "consolidate")
def test_sharded_checkpoint_folder_and_consolidation(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tensor parallel writes a sharded, signed folder; `sgdtp consolidate` makes one file plain torch loads."""
    from helpers.models import small_gpt

    from lightning_sgdtp.trust import verify_dir

    r = tp_result("resume_tp_to_dp", tmp_path_factory)
    ckpt = Path(r["info"]["ckpt"])
    assert ckpt.is_dir() and (ckpt / ".metadata").is_file() and len(list(ckpt.glob("*.distcp"))) == 2
    verify_dir(ckpt)  # SHA256 manifest of every file
    assert not list(ckpt.parent.glob(".*tmp*")), "temporary folders left behind"
    out = ckpt.parent / "consolidated.ckpt"
    subprocess.run([sys.executable, "-m", "lightning_sgdtp.cli", "consolidate", str(ckpt), str(out)], check=True)
    full = torch.load(out, weights_only=True)
    saved = torch.load(r["out"] / "saved.pt")
    assert full["state_dict"].keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(full["state_dict"][name], value), name
    assert full["global_step"] == 3 and len(full["optimizer_states"]) == 1
    # plain PyTorch: the model class alone loads it
    model = small_gpt()
    model.load_state_dict(full["state_dict"])


# --------------------------------------------------------------------------------------- pipeline parallel
PP2 = {"pipeline_stages": 2, "pipeline_chunks": 4}
# 3 steps with a pipeline, a checkpoint, 3 more in a fresh module (jobs/pp_parity.py, 4-block GPT, 2 ranks)
PER_STAGE: dict[str, list[dict[str, Any]]] = {
    "resume_pp_to_pp": [PP2, {**PP2, "pipeline_split": ["model.blocks.1"]}],  # another split
    "resume_pp_to_dp": [PP2, {}],  # no pipeline
    # 4 ranks: 2 pipelines, each stage split over its 2 replicas (DTensor shards) -> data parallel over 4 ranks,
    # replicated: another layout and another data-parallel size (shards of 2 read as whole tensors on 4 ranks)
    "resume_pp_sharded_to_dp4": [{**PP2, "sharding": "full"}, {}],
    # 4 ranks: one pipeline of 2 stages, each split over its tensor-parallel group of 2 -> data parallel over 4
    "resume_pp_tp_to_dp4": [{**PP2, "parallelism": "tensor"}, {}],
}
DEVICES = {"resume_pp_sharded_to_dp4": 4, "resume_pp_tp_to_dp4": 4}
#: Default run: pipeline -> no pipeline (one shard file per stage, resharded into a whole module).
SLOW_STAGE = {"resume_pp_to_pp", "resume_pp_sharded_to_dp4", "resume_pp_tp_to_dp4"}


@pytest.mark.covers("pipeline", "resume on another layout", target="data", param="resume_pp_to_dp")
@pytest.mark.covers(
    "pipeline", "resume on another layout", target="pipeline", note="another split", param="resume_pp_to_pp"
)
@pytest.mark.covers(
    "pipeline x data",
    "resume on another layout",
    target="data",
    note="sharding='full'; data on 4 ranks",
    param="resume_pp_sharded_to_dp4",
)
@pytest.mark.covers(
    "pipeline x tensor", "resume on another layout", target="data", note="data on 4 ranks", param="resume_pp_tp_to_dp4"
)
@pytest.mark.covers("pipeline", "consolidate", param="resume_pp_to_dp")
@pytest.mark.covers("pipeline x tensor", "consolidate", param="resume_pp_tp_to_dp4")
@pytest.mark.covers("pipeline x data", "consolidate", note="sharding='full'", param="resume_pp_sharded_to_dp4")
@pytest.mark.parametrize("case", tiered(list(PER_STAGE), SLOW_STAGE))
def test_checkpoint_per_stage_resume_and_consolidate(case: str, tmp_path: Path) -> None:
    """3 steps, a sharded checkpoint (each rank its stage), resumed in a fresh module (another split, or no
    pipeline), 3 more steps: as 6 uninterrupted steps of one process. The folder consolidates to one file."""
    from lightning_sgdtp.checkpoint import sharded

    devices = DEVICES.get(case, 2)
    run_scenario("pp_parity.py", {"devices": devices, "phases": PER_STAGE[case], "trainer": {}}, tmp_path)
    load = lambda n: torch.load(tmp_path / f"{n}.pt")
    rel = rel_update_diff(load("init"), load("ref"), load("sgdtp"))
    assert rel < REL_TOL["pipeline"], f"{case}: relative update difference {rel:.3g}"
    ckpt = Path(json.loads((tmp_path / "info.json").read_text())["ckpt"])
    assert sharded.is_sharded(ckpt) and len(list(ckpt.glob("*.distcp"))) == devices  # one shard file per rank
    merged = torch.load(sharded.consolidate(ckpt, tmp_path / "one.ckpt"), weights_only=False)
    saved = load("saved")
    assert merged["state_dict"].keys() >= saved.keys() - {"model.lm_head.weight"}
    for name, value in merged["state_dict"].items():
        assert torch.equal(value, saved[name]), name
    states = merged["optimizer_states"][0]["state"]
    assert all(isinstance(k, str) for k in states) and "model.blocks.3.mlp.fc.weight" in states


# ----------------------------------------------------------------------------------------------- killed jobs
RESILIENCE = str(JOBS / "resilience.py")


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}
    assert not different, f"max |diff| per parameter: {different}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """14 steps uninterrupted (3 epochs of 6 batches per rank, a checkpoint every 2 steps)."""
    out = tmp_path_factory.mktemp("straight")
    result = run([sys.executable, RESILIENCE, "straight", str(out)])
    assert result.returncode == 0, result.stdout[-4000:]
    return torch.load(out / "straight.pt")


@pytest.mark.parametrize(
    ("part", "resumes_at"),
    [
        ("killed", "resuming epoch 1 after batch 2"),  # killed at step 9; last complete checkpoint: step 8
        ("save_killed", "resuming epoch 0 after batch 2"),  # killed writing last.ckpt at step 4: resumes at 2
    ],
)
def test_killed_run_resumes_to_the_uninterrupted_parameters(
    straight: dict[str, torch.Tensor], tmp_path: Path, part: str, resumes_at: str
) -> None:
    killed = run([sys.executable, RESILIENCE, part, str(tmp_path)])
    assert killed.returncode == -9, f"the job was not killed (rc={killed.returncode}):\n{killed.stdout[-3000:]}"
    assert not (tmp_path / f"{part}.pt").exists()
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    if part == "save_killed":  # the half-written file is there, under a name that Lightning never loads
        assert any(name.startswith(".last.ckpt.tmp-") for name in ckpts), ckpts
    resumed = run([sys.executable, RESILIENCE, "resumed", str(tmp_path)])
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    # log wording: where a run resumes is not in the plan yet (TEST_CHANGES.md: wanted plan["resumed_from"])
    assert f"sgdtp: {resumes_at}" in resumed.stdout, resumed.stdout[-3000:]
    _assert_bitwise(straight, torch.load(tmp_path / "resumed.pt"))
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".tmp-" in p.name], "stale temporary files remain"


@pytest.mark.slow  # the same resume as the killed-job test; torchrun itself: test_faults.py
def test_torchrun_restart_resumes_on_its_own(straight: dict[str, torch.Tensor], tmp_path: Path) -> None:
    """torchrun --max-restarts=1: rank 1 dies at step 9 of the first attempt; the restart resumes from last."""
    env = job_env()
    port = env.pop("MASTER_PORT")
    env.pop("MASTER_ADDR")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", RESILIENCE, "torchrun", str(tmp_path)]
    result = run(cmd, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    # log wording: where a run resumes is not in the plan yet (TEST_CHANGES.md: wanted plan["resumed_from"])
    assert "sgdtp: resuming epoch 1 after batch 2" in result.stdout, result.stdout[-3000:]
    _assert_bitwise(straight, torch.load(tmp_path / "torchrun.pt"))


# ------------------------------------------------------------------------------------------------ verification
# One process, devices=1: train 2 steps (part "train") or resume from ckpt/last.ckpt to 4 steps; every torch.load
# is recorded, so a refusal proves nothing was unpickled.
CHECKPOINT_JOB = r"""
import os, sys, torch, lightning.pytorch as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_sgdtp import SGDTPStrategy
from lightning_sgdtp.trust import ArtifactVerificationError

root, part = sys.argv[1], sys.argv[2]
kwargs = eval(sys.argv[3])

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

loaded = []
real_load = torch.load
torch.load = lambda *a, **k: loaded.append(a[0]) or real_load(*a, **k)  # records every unpickling
trainer = L.Trainer(
    strategy=SGDTPStrategy(**kwargs), accelerator="cpu", devices=1, max_steps=2 if part == "train" else 4,
    logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_last=True)],
)
data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
try:
    trainer.fit(Net(), data, ckpt_path=None if part == "train" else os.path.join(root, "ckpt", "last.ckpt"))
    print("RESULT ok", trainer.global_step)
except ArtifactVerificationError as err:
    print("RESULT refused", err.check, os.path.basename(err.path), "unpickled:", len(loaded))
    print(err)
"""


def _job(root: Path, part: str, **kwargs: object) -> str:
    result = run([sys.executable, "-c", CHECKPOINT_JOB, str(root), part, repr(kwargs)], timeout=300)
    assert result.returncode == 0, result.stdout[-5000:]
    return next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))


def _sealed(checkpoint: Path) -> list[str]:
    """The records of a checkpoint's seal (its manifest inside the file: lightning_sgdtp.trust.sealed)."""
    return sorted(n.split("/", 1)[1] for n in zipfile.ZipFile(checkpoint).namelist() if "/.sgdtp/" in n)


def test_strategy_checkpoints_are_verified_before_unpickling(tmp_path: Path) -> None:
    assert _job(tmp_path, "train") == "RESULT ok 2"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # what ddp's folder lists
    assert all(_sealed(tmp_path / "ckpt" / name) == [f".sgdtp/{MANIFEST}"] for name in os.listdir(tmp_path / "ckpt"))
    assert _job(tmp_path, "resume") == "RESULT ok 4"  # verified, then loaded

    last = tmp_path / "ckpt" / "last.ckpt"
    good = last.read_bytes()
    last.write_bytes(good[: len(good) // 2])
    assert _job(tmp_path, "resume") == "RESULT refused archive last.ckpt unpickled: 0"
    middle = len(good) // 3  # a byte of torch's records (the seal and the zip directory are at the end)
    last.write_bytes(good[:middle] + bytes([good[middle] ^ 0xFF]) + good[middle + 1 :])
    assert _job(tmp_path, "resume") == "RESULT refused SHA256 last.ckpt unpickled: 0"
    torch.save(torch.load(io.BytesIO(good), weights_only=False), last)  # a checkpoint that nothing vouches for
    assert _job(tmp_path, "resume") == "RESULT refused manifest last.ckpt unpickled: 0"
    assert _job(tmp_path, "resume", verify_artifacts=False) == "RESULT ok 4"


@pytest.mark.slow  # suite budget (issue 26's stop): covered by the test above and tests/unit/trust/test_trust.py
def test_signed_checkpoints_need_the_trusted_key(tmp_path: Path) -> None:
    private, public, other = tmp_path / "k.pem", tmp_path / "k.pub.pem", tmp_path / "other.pub.pem"
    key = ed25519.Ed25519PrivateKey.generate()
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    for path, k in ((public, key), (other, ed25519.Ed25519PrivateKey.generate())):
        path.write_bytes(
            k.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
    signed = tmp_path / "run"
    assert _job(signed, "train", signing_key=str(private)) == "RESULT ok 2"
    assert sorted(os.listdir(signed / "ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert _sealed(signed / "ckpt" / "last.ckpt") == [f".sgdtp/{MANIFEST}", f".sgdtp/{MANIFEST}.pem-sig"]
    assert _job(signed, "resume", trusted_key=str(public)) == "RESULT ok 4"
    assert _job(signed, "resume", trusted_key=str(other)) == "RESULT refused signature last.ckpt unpickled: 0"
    unsigned = tmp_path / "unsigned"
    assert _job(unsigned, "train") == "RESULT ok 2"
    assert _job(unsigned, "resume", trusted_key=str(public)) == "RESULT refused signature last.ckpt unpickled: 0"
