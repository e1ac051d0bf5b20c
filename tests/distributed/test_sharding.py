"""Sharded data parallel (``sharding="full"|"optimizer"``) against single-process training of the same model.

``jobs/tp_parity.py`` (our models) and ``jobs/zoo.py`` (transformers models): the launching process trains the
reference on one device on the global batch, then every rank trains with sgdtp; AdamW (as configured: on DTensor
parameters torch's foreach path), 6 steps (4 for the zoo). Measured here (fp32, 2-core CPU, gloo):

- first-step gradients (full tensors gathered from the shards) against the reference: 4e-7 relative; a gradient
  not reduced (each rank its own half-batch gradient) is off by ~0.3-1;
- ``rel`` (the update over the run against the reference's): 4.7e-5 (GPT, full), 7e-5 (GPT, optimizer + clipping);
  5e-4 (hybrid dp=2 x tp=2, MultiheadAttention model, clipping); 2.4e-5 (accumulating 2 micro-batches); 1.4e-5
  (hybrid sharding 2 x 2, clipping); 0.061 with bf16 all-gathers and bf16 reduce-scatters (bf16 tolerances); the
  negative control (no reduction) measures > 0.2.
  Tolerance 1e-2, as the tensor-parallel parity tests.

Memory is asserted from byte counts taken from the tensors themselves (``held_bytes``: the storages of the
parameters, gradients and optimizer state a rank holds after the first step), with 2 and 4 ranks: at most the
1/N share of the unsharded total plus one block's gathered parameters (the largest transformer block).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.launch import JOBS, job_env, negative_control, parity_result, rel_update_diff, run, tiered

REL_TOL, GRAD_TOL = 1e-2, 1e-4
#: bf16 all-gathers round the weights the step computes with: the tolerances of the bf16 tensor-parallel tests
#: (measured with accumulation: first-step gradients 8.9e-3, rel 0.071)
BF16 = {"data_gpt_bf16_gather": (3e-2, 0.15)}
DATA_FULL = {"parallelism": "data", "sharding": "full"}
AUTO_FULL = {"parallelism": "auto", "sharding": "full", "max_memory_per_rank": "300KB"}
CASES: dict[str, dict[str, Any]] = {
    # parallelism="auto" (issue 26): a limit replicated training does not fit (453 KB predicted), sharding fixed by
    # the user: the planner plans the rest (dp 2), and the run is the one of DATA_FULL
    "data_gpt_full": {"model": "small_gpt", "devices": 2, "phases": [AUTO_FULL], "trainer": {}},
    "data_gpt_optimizer_clip": {
        "model": "small_gpt",
        "devices": 2,
        "phases": [{"parallelism": "data", "sharding": "optimizer"}],
        "trainer": {"gradient_clip_val": 0.3},
    },
    "data_gpt_full_4_ranks": {"model": "small_gpt", "devices": 4, "phases": [DATA_FULL], "trainer": {}},
    # accumulation: every micro-batch reduce-scatters its gradients into the shards, summed there
    "data_gpt_full_accum": {
        "model": "small_gpt",
        "devices": 2,
        "phases": [DATA_FULL],
        "trainer": {"accumulate_grad_batches": 2},
    },
    # parameters all-gathered and gradients reduce-scattered in bfloat16: the forward and backward compute with
    # bf16-rounded weights, the gradients travel rounded
    "data_gpt_bf16_gather": {
        "model": "small_gpt",
        "devices": 2,
        "phases": [
            {"parallelism": "data", "sharding": "optimizer", "param_gather_dtype": "bf16", "grad_comm_dtype": "bf16"}
        ],
        "trainer": {},
    },
    # hybrid sharding: split inside each group of 2 ranks (a node's), replicated across the 2 groups; clipping
    "data_gpt_hybrid_shard": {
        "model": "small_gpt",
        "devices": 4,
        "phases": [{**DATA_FULL, "shard_size": 2}],
        "trainer": {"gradient_clip_val": 0.3},
    },
    # 2-D: tensor parallel over tp=2 inside each of 2 data-parallel replicas, each parameter a DTensor over (dp, tp)
    # (_StridedShard where both split the same dimension); clipping by the norm over both dimensions
    "hybrid_mha_full_clip": {
        "model": "MHALanguageModel",
        "devices": 4,
        "phases": [{"parallelism": "hybrid", "tensor_parallel_size": 2, "sharding": "full"}],
        "trainer": {"gradient_clip_val": 0.3},
    },
    # 3-D (issue 26): hybrid sharding x tensor parallel on 8 ranks, a ("dp_replicate", "dp_shard", "tp") mesh of
    # 2 x 2 x 2: each tensor-parallel shard split over 2 rows, replicated across the 2 groups; clipping. Measured
    # (2026-12-03, 2-core CPU): first-step gradients 5.0e-7, rel 1.2e-5, 28 of 28 sharded gradients proved reduced
    "hybrid_gpt_hsdp_tp_8_ranks": {
        "model": "small_gpt",
        "devices": 8,
        "phases": [{"parallelism": "hybrid", "tensor_parallel_size": 2, "sharding": "full", "shard_size": 2}],
        "trainer": {"gradient_clip_val": 0.3},
    },
}
_RESULTS: dict[str, dict] = {}

#: The slow tier (tests/README.md): more ranks, accumulation and bf16 gathers over the same 1-D sharding, and the
#: 2-D MHA case. The default run keeps full, optimizer + clipping, shard_size (2 x 2, 4 ranks) here; with tensor
#: parallel in test_model_zoo.py (transformers GPT-2, hybrid dp=2 x tp=2, sharding="full": parity, proof, bytes);
#: with pipeline stages in test_pipeline_parallel.py.
SLOW = {
    "data_gpt_full_4_ranks",
    "data_gpt_full_accum",
    "data_gpt_bf16_gather",
    "hybrid_mha_full_clip",
    "hybrid_gpt_hsdp_tp_8_ranks",  # 8 processes: the 4-rank pair (sharding x tensor parallel) is gpt2_hybrid_sharded
}


def result(name: str, tmp_path_factory: pytest.TempPathFactory, scenario: dict[str, Any], **env: str) -> dict:
    return parity_result(_RESULTS, "tp_parity.py", name, scenario, tmp_path_factory.mktemp(name), **env)


def grad_error(r: dict) -> float:
    ref, got = r["ref_grads"], r["grads"]
    assert got.keys() == ref.keys(), sorted(set(ref) ^ set(got))
    return max(float((got[k] - v).norm() / v.norm().clamp_min(1e-12)) for k, v in ref.items())


@pytest.mark.covers("data + sharding optimizer", "gradient clipping", param="data_gpt_optimizer_clip")
@pytest.mark.covers(
    "data + sharding full", "gradient clipping", param="data_gpt_hybrid_shard", note="shard_size=2, 4 ranks"
)
@pytest.mark.covers("data + sharding full", "gradient accumulation", param="data_gpt_full_accum")
@pytest.mark.parametrize("name", tiered(list(CASES), SLOW))
def test_sharded_training_matches_one_process(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    scenario = CASES[name]
    r = result(name, tmp_path_factory, scenario)
    grad_tol, rel_tol = BF16.get(name, (GRAD_TOL, REL_TOL))
    assert grad_error(r) < grad_tol, f"{name}: first-step gradients differ by {grad_error(r):.3g}"
    rel = rel_update_diff(r["init"], r["ref"], r["sgdtp"])
    assert rel < rel_tol, f"{name}: relative update difference {rel:.3g}"
    if "gradient_clip_val" in scenario["trainer"]:  # clipping acted: the global norm exceeded 0.3
        norm = sum(float(g.norm() ** 2) for g in r["ref_grads"].values()) ** 0.5
        assert norm > 0.3 * 1.5, norm
    plan = r["info"]["plans"][0]
    sharding = plan["sharding"]
    (part,) = sharding["parts"]
    assert part["mode"] == scenario["phases"][0]["sharding"] and part["split"]
    # every graph that holds sharded parameters proved each of their gradients reduced, and reduce-scatters them
    proved = [g for g in sharding["collectives_per_graph"] if "proved_reduced" in g]
    assert proved and all(g["proved_reduced"] == g["sharded_gradients"] > 0 for g in proved), sharding
    assert all(g["collectives_in_backward"].get("reduce_scatter_tensor") for g in proved), sharding
    assert all(g["collectives_in_forward"].get("all_gather_into_tensor") for g in proved), sharding
    if "shard_size" in scenario["phases"][0]:  # split over 2, replicated twice: the replicas' all-reduce follows
        assert (part["dp"], part["replicas"]) == (2, 2), part
        assert all(g["collectives_in_backward"].get("all_reduce") for g in proved), sharding
    if part["mode"] == "optimizer":  # gathered once, kept for backward: no all-gather in any backward graph
        assert all("all_gather_into_tensor" not in g["collectives_in_backward"] for g in proved), sharding
    # the ledger syncs nothing sharded; what it still covers (not sharded) went through the gradient buckets
    assert plan["bytes_per_step"]["fallback"] == 0
    if scenario["phases"][0]["parallelism"] == "auto":  # planned: the winner, the next two, and why, on rank 0
        planner = plan["planner"]
        assert planner["chosen"]["layout"] == "dp 2, sharding=full" and planner["limit"] == 300_000, planner
        assert plan["config"]["parallelism"] == "data" and plan["config"]["sharding"] == "full"
        log = r["log"]
        assert "planner: parallelism='auto' chose dp 2, sharding=full:" in log and "limit 292.97 KiB" in log, log
        assert log.count("planner: next: ") == min(2, len(planner["candidates"]) - 1) == 1, log  # sharding fixed
        held = sharding["held_bytes"]["total"]  # what the rank holds after the first step, within the limit
        assert held <= planner["limit"], (held, planner["limit"])


HELD = [
    "data_gpt_full",
    "data_gpt_full_4_ranks",
    "data_gpt_hybrid_shard",
    "hybrid_mha_full_clip",
    "hybrid_gpt_hsdp_tp_8_ranks",
]


@pytest.mark.parametrize("name", tiered(HELD, SLOW & set(HELD)))
def test_each_rank_holds_its_share_of_the_bytes(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Parameters + gradients + AdamW state per rank <= 1/N of the unsharded bytes + one block's parameters."""
    r = result(name, tmp_path_factory, CASES[name])
    sharding = r["info"]["plans"][0]["sharding"]
    (part,) = sharding["parts"]
    held, n = sharding["held_bytes"], part["dp"]
    whole = part["param_bytes_before"]  # this rank's parameters unsharded (its tensor-parallel part in hybrid)
    unsharded = 4 * whole  # parameters, gradients, AdamW's exp_avg and exp_avg_sq
    assert held["parameters"] <= whole / n + part["largest_block_bytes"], (held, part)
    assert held["total"] <= unsharded / n + part["largest_block_bytes"], (held, part, n)
    assert held["total"] < 0.75 * unsharded if n >= 2 else True  # far from a replica's bytes
    assert held["optimizer_state"] <= 2 * whole / n + 2 * part["largest_block_bytes"] // 4, (held, part)


@pytest.mark.slow  # default: the missed reduce-scatter control below, and the data-parallel one
def test_negative_control_without_the_reduction_does_not_match(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The parity can fail: the same sharded run with no gradient reduction trains each shard on half a batch."""
    r = result("data_gpt_no_dp_sync", tmp_path_factory, negative_control(CASES["data_gpt_full"], "dp-sync"))
    assert "NOT reduce-scattered" in r["log"], "the switch was not honoured"
    assert grad_error(r) > 100 * GRAD_TOL
    assert rel_update_diff(r["init"], r["ref"], r["sgdtp"]) > 20 * REL_TOL


def test_a_missed_reduce_scatter_is_caught_at_compile(tmp_path: Path) -> None:
    """The reduce-scatter dropped from the sharded reads (proof left on): the first compile fails on every rank,
    naming the parameters, before any optimizer step."""
    import json

    out = tmp_path / "job"
    out.mkdir()
    (out / "scenario.json").write_text(json.dumps(negative_control(CASES["data_gpt_full"], "reduce-scatter")))
    env = job_env(SGDTP_FAST_EXIT="1")
    done = run([__import__("sys").executable, str(JOBS / "tp_parity.py"), str(out)], timeout=400, env=env)
    assert done.returncode != 0, done.stdout[-3000:]
    assert "UnreducedGradientError" in done.stdout and "is not reduced over the data-parallel group" in done.stdout
    assert "model.blocks.0" in done.stdout, done.stdout[-3000:]
    assert not (out / "sgdtp.pt").exists()
