"""Lightning's precisions (``16-mixed``, ``bf16-mixed``, ``bf16-true``, ``16-true``) trained with sgdtp in data,
sharded (``sharding="full"``) and tensor-parallel modes on 2 gloo ranks, against Lightning's ``strategy="ddp"`` at
the same precision, same seed, same data (``jobs/precision.py``: a small MLP language model, AdamW lr=1e-2, 4 steps;
several cases run one after another in the same two processes).

``16-mixed`` on CPU: ``Trainer(precision="16-mixed", accelerator="cpu")`` is turned into ``bf16-mixed`` by Lightning
itself, for every strategy (``test_16_mixed_on_cpu_is_lightnings_bf16_mixed``). The fp16 autocast + GradScaler path
is reached on CPU with ``plugins=[MixedPrecision("16-mixed", "cpu")]``: that is what the job trains, under ddp and
under sgdtp. Every precision runs on CPU in every mode here: none is skipped.

Measures: ``rel`` = ||delta_sgdtp - delta_ddp|| / ||delta_ddp|| (delta = final - initial parameters) and the largest
difference of a step's loss (mean over the ranks). Measured here (2026-12-05, 2 cores, gloo), rel / loss:

    precision    floor (ddp vs ddp on       data            sharded         tensor          control (no sync)
                 torch.compile(model))
    16-mixed     5.4e-06 / 2.4e-07          5.4e-06/2.4e-07 5.4e-06/2.4e-07 6.7e-04/1.0e-05 0.82 / 7.2e-03
    bf16-mixed   2.7e-06 / 4.8e-07          2.7e-06/4.8e-07 2.7e-06/4.8e-07 2.1e-02/4.8e-04 (> 2x every TOL)
    bf16-true    8.9e-03 / 2.8e-05          8.9e-03/2.8e-05 8.9e-03/2.8e-05 2.9e-02/2.9e-04 0.83 / 7.5e-03
    16-true      4.9e-02 / 7.0e-03          4.9e-02/7.0e-03 4.9e-02/6.6e-03 0.11   /2.4e-02 1.14 / 1.05

Data and sharded parallel differ from ddp by exactly what compiling ddp's own model does (the floor). Tensor
parallel adds its own rounding: a row-parallel layer sums two half-precision partial products, each rounded, where
ddp rounds one. ``TOL`` sits 2.5-40x above what was measured and at least 2x below the control (sgdtp with
``debug_skip_sync="dp-sync"``), which ``test_tolerances_sit_between_the_noise_floor_and_a_missed_sync`` asserts
for every precision. The half-precision weights are the noisy ones: bf16-true rounds an AdamW step to a few ulps of
the weight; in 16-true AdamW's second moment (gradient squared, ~1e-10) underflows in float16, so eager and compiled
kernels already part by rel 0.05. For ``*-true`` the data-parallel runs set ``optimizer_update="eager"`` (AdamW as
ddp runs it): the default there is torch's fused kernel, which computes in float32 inside and gave other numbers
than ddp's foreach AdamW (measured rel 0.035 bf16-true, 0.88 16-true), a different update, not a gradient-path
difference. 16-true also sets AdamW's ``eps=1e-4``: the default 1e-8 is 0 in float16 (0 / 0: NaN weights, under ddp
too).

Gradient scaling with the in-graph collectives (``test_a_non_finite_step_is_skipped_on_every_rank``): an inf in one
gradient element on rank 0 only, at step 2. With ``sharding`` each rank's GradScaler checks only its own shards, and
DTensor reduces the verdict of a check by its *first* gradient's placement: with a replicated first parameter
(``gain``, no dimension divisible by 2, kept whole) the rank holding the poisoned shard skipped the step and the other
did not (before the fix: scales 65536 / 32768, AdamW steps 4 / 3, rel 0.18 against ddp). The strategy now shares the
verdict over every rank (``lightning_sgdtp/sync/comm.py``: ``found_inf_agreed``, in ``Job.optimizer_step``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from helpers.launch import rel_update_diff, run_scenario
from lightning.pytorch.plugins import MixedPrecision

PRECISIONS = ("16-mixed", "bf16-mixed", "bf16-true", "16-true")
MODES = ("data", "sharded", "tensor")
STEPS, INIT_SCALE = 4, 2.0**16
#: (rel, loss) tolerances per precision and mode: the module's docstring gives the measured floors and controls.
TOL = {
    "16-mixed": {"data": (1e-4, 1e-5), "sharded": (1e-4, 1e-5), "tensor": (5e-3, 1e-4)},
    "bf16-mixed": {"data": (1e-4, 1e-5), "sharded": (1e-4, 1e-5), "tensor": (0.06, 2e-3)},
    "bf16-true": {"data": (0.03, 3e-4), "sharded": (0.03, 3e-4), "tensor": (0.08, 1.5e-3)},
    "16-true": {"data": (0.15, 0.02), "sharded": (0.15, 0.02), "tensor": (0.3, 0.07)},
}
#: One launch per entry: its cases run one after another in the same 2 processes. Only "scaler_sharded" is in
#: the default tier: 16-mixed, Lightning's GradScaler around sharding's in-graph reduce-scatter, an inf on one rank,
#: compared with ddp (a ddp run and one cold compile of the sharded step).
LAUNCHES: dict[str, list[dict[str, Any]]] = {
    "scaler_sharded": [{"name": "inject_sharded", "precision": "16-mixed", "mode": "sharded", "inject": True}],
    "scaler_data": [{"name": "inject_data", "precision": "16-mixed", "mode": "data", "inject": True}],
    **{
        precision: [{"name": f"{precision}_{mode}", "precision": precision, "mode": mode} for mode in MODES]
        + [{"name": f"{precision}_{mode}", "precision": precision, "mode": mode} for mode in ("noise", "control")]
        for precision in PRECISIONS
    },
}
_RESULTS: dict[str, dict[str, Any]] = {}


def result(launch: str, name: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Case ``name`` of launch ``launch`` (run once per test session: several tests read it)."""
    if launch not in _RESULTS:
        out = tmp_path_factory.mktemp(launch)
        run_scenario("precision.py", {"cases": LAUNCHES[launch]}, out, timeout=900)
        _RESULTS[launch] = {c["name"]: torch.load(out / f"{c['name']}.pt") for c in LAUNCHES[launch]}
    return _RESULTS[launch][name]


def loss_diff(r: dict[str, Any]) -> float:
    return max(abs(a - b) for a, b in zip(r["ref_losses"], r["losses"]))


def all_finite(params: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(v.float()).all()) for v in params.values() if v.is_floating_point())


def check_layout(r: dict[str, Any], mode: str) -> None:
    """Each rank holds what the mode says: the whole model (data), half of every divisible parameter (sharded:
    ``gain`` kept whole), half of the split MLP (tensor parallel: colwise mlp.0, rowwise mlp.2)."""
    full = {k: tuple(v.shape) for k, v in r["ref"].items()}
    for rank in r["ranks"]:
        held = {k: tuple(v.shape) for k, v in rank["params"].items()}
        if mode == "data":
            assert held == full, held
        elif mode == "sharded":
            assert held["gain"] == (3,) and held["mlp.0.weight"] == (32, 32) and held["head.bias"] == (32,), held
        else:
            assert held["mlp.0.weight"] == (32, 32) and held["mlp.2.weight"] == (32, 32), held


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_parity_with_ddp(precision: str, mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    r = result(precision, f"{precision}_{mode}", tmp_path_factory)
    check_layout(r, mode)
    dtype = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(precision, torch.float32)
    assert {v.dtype for v in r["run"].values()} == {v.dtype for v in r["ref"].values()} == {dtype}
    assert all_finite(r["run"]) and all(math.isfinite(x) for x in r["losses"])
    rel_tol, loss_tol = TOL[precision][mode]
    rel, dl = rel_update_diff(r["init"], r["ref"], r["run"]), loss_diff(r)
    assert rel < rel_tol, f"{precision} {mode}: relative update difference {rel:.3g} >= {rel_tol}"
    assert dl < loss_tol, f"{precision} {mode}: a step's loss differs by {dl:.3g} >= {loss_tol}"
    for rank in r["ranks"]:  # every step taken (the GradScaler skipped none, as under ddp)
        assert rank["steps"] == [float(STEPS)] and rank["steps"] == r["ref_ranks"][0]["steps"], rank["steps"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_tolerances_sit_between_the_noise_floor_and_a_missed_sync(
    precision: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The floor: ddp against ddp on torch.compile(model) (the same arithmetic reordered by the compiler) stays below
    every tolerance of this precision. The control: sgdtp without the gradient sync (``debug_skip_sync="dp-sync"``)
    is caught by every tolerance, by a factor of 2 at least."""
    noise = result(precision, f"{precision}_noise", tmp_path_factory)
    control = result(precision, f"{precision}_control", tmp_path_factory)
    floor = rel_update_diff(noise["init"], noise["ref"], noise["run"]), loss_diff(noise)
    missed = rel_update_diff(control["init"], control["ref"], control["run"]), loss_diff(control)
    for mode, (rel_tol, loss_tol) in TOL[precision].items():
        assert floor[0] < rel_tol and floor[1] < loss_tol, (precision, mode, floor)
        assert missed[0] > 2 * rel_tol and missed[1] > 2 * loss_tol, (precision, mode, missed)


@pytest.mark.parametrize(
    "mode", [pytest.param("sharded", id="sharded"), pytest.param("data", id="data", marks=pytest.mark.slow)]
)
def test_a_non_finite_step_is_skipped_on_every_rank(mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """16-mixed (Lightning's GradScaler) around the in-graph all-reduce / reduce-scatter: an inf in one gradient
    element on rank 0 alone at step 2 makes every rank skip that step and halve its scale, as ddp does."""
    r = result(f"scaler_{mode}", f"inject_{mode}", tmp_path_factory)
    check_layout(r, mode)
    for ranks in (r["ref_ranks"], r["ranks"]):  # the injection happened: rank 0's step-2 loss, nowhere else
        assert [[math.isfinite(x) for x in rank["losses"]] for rank in ranks] == [
            [True, False, True, True],
            [True, True, True, True],
        ], [rank["losses"] for rank in ranks]
    ref = r["ref_ranks"][0]
    assert ref["steps"] == [STEPS - 1.0] and ref["scale"] == INIT_SCALE / 2, ref  # ddp skipped it: one halving
    for rank, got in enumerate(r["ranks"]):
        assert (got["scale"], got["steps"]) == (ref["scale"], ref["steps"]), (
            f"rank {rank}: {got['scale'], got['steps']}"
        )
    if mode == "data":  # every rank holds the same whole model
        first, second = (rank["params"] for rank in r["ranks"])
        assert all(torch.equal(first[k], second[k]) for k in first), "the ranks' parameters differ"
    assert all_finite(r["run"])
    rel_tol, loss_tol = TOL["16-mixed"][mode]
    rel = rel_update_diff(r["init"], r["ref"], r["run"])
    assert rel < rel_tol, f"{mode}: relative update difference to ddp {rel:.3g} >= {rel_tol}"
    finite = [i for i, x in enumerate(r["ref_losses"]) if math.isfinite(x)]
    assert max(abs(r["ref_losses"][i] - r["losses"][i]) for i in finite) < loss_tol


def test_16_mixed_on_cpu_is_lightnings_bf16_mixed(tmp_path: Path) -> None:
    """``precision="16-mixed"`` on CPU: Lightning's accelerator connector turns it into bf16-mixed (no GradScaler)
    for ddp and sgdtp alike; the fp16 + GradScaler path is the plugin ``MixedPrecision("16-mixed", "cpu")``."""
    for strategy in ("ddp", "sgdtp"):
        kwargs: dict[str, Any] = {"accelerator": "cpu", "devices": 2, "logger": False, "default_root_dir": tmp_path}
        with pytest.warns(UserWarning, match="AMP with fp16 is not supported on CPU"):
            plugin = L.Trainer(strategy=strategy, precision="16-mixed", **kwargs).precision_plugin
        assert isinstance(plugin, MixedPrecision) and (plugin.precision, plugin.scaler) == ("bf16-mixed", None)
        plugin = L.Trainer(strategy=strategy, plugins=[MixedPrecision("16-mixed", "cpu")], **kwargs).precision_plugin
        assert plugin.precision == "16-mixed" and isinstance(plugin.scaler, torch.amp.GradScaler)


def test_the_scaler_checks_the_local_part_of_mixed_gradients() -> None:
    """In one process (a fake 2-rank group: its all-reduce does nothing): a tensor-parallel optimizer holds plain
    gradients beside DTensor ones, which torch's own check refuses in one call (before the fix 16-mixed with
    parallelism="tensor" failed at the first step: "got mixed torch.Tensor and DTensor"). Inside
    ``found_inf_agreed`` both are unscaled, an inf in a shard is found, and the scaler is left as it was."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_sgdtp.sync.comm import found_inf_agreed

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        plain = torch.nn.Parameter(torch.ones(3))
        split = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
        optimizer = torch.optim.SGD([plain, split], lr=0.1)
        for poisoned in (False, True):
            scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
            scaler.scale(torch.ones(()))
            plain.grad = torch.full((3,), 4.0)
            split.grad = distribute_tensor(torch.full((4, 2), 4.0), mesh, [Shard(0)])
            if poisoned:
                split.grad.to_local()[0, 0] = float("inf")
            with found_inf_agreed(scaler):
                scaler.unscale_(optimizer)
            (found,) = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
            assert float(found) == float(poisoned) and "_unscale_grads_" not in vars(scaler)
            assert torch.equal(plain.grad, torch.ones(3)) and float(split.grad.to_local()[1, 1]) == 1.0
    finally:
        dist.destroy_process_group()
