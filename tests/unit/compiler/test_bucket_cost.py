"""Buckets sized by measurement: the link fit and the planner (pure), and the pass using them on a real graph."""

from __future__ import annotations

import pytest

from lightning_sgdtp.compiler.bucket_cost import CostModel, fit_link, plan_measured

MB = 2**20


def model(latency_ms: float, gbps: float) -> CostModel:
    return CostModel(latency_ms / 1e3, 1 / (gbps * 1e9), flops_per_s=1e11, bytes_per_s=1e10)


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    sizes = [16_384, MB, 8 * MB]
    seconds = [1e-4 + s / 2e9 for s in sizes]
    latency, per_byte = fit_link(sizes, seconds)
    assert latency == pytest.approx(1e-4, rel=1e-6) and per_byte == pytest.approx(1 / 2e9, rel=1e-6)
    assert fit_link([1, 2], [5.0, 1.0]) == (3.0, 0.0)  # a noisy negative slope: no negative bandwidth


def test_planner_sends_early_and_keeps_the_last_bucket_small() -> None:
    # ten 4 MiB gradients produced 10 ms apart; 1 GB/s: 4.2 ms per gradient on the wire, backward ends at 100 ms
    n = 10
    ready = [0.01 * (i + 1) for i in range(n)]
    plan = plan_measured(ready, [4 * MB] * n, ["float32"] * n, 0.1, model(0.1, 1.0))
    assert [i for b in plan.buckets for i in b] == list(range(n))  # order kept, every gradient once
    assert len(plan.buckets[-1]) == 1  # only the last gradient is sent after backward
    assert plan.predicted_exposed_s == pytest.approx(1e-4 + 4 * MB / 1e9, rel=1e-3)
    assert plan.predicted_exposed_s < plan.single_bucket_exposed_s / 5


def test_planner_pays_latency_only_where_it_buys_something() -> None:
    # a huge latency and gradients produced at once: one bucket is best
    plan = plan_measured([0.0] * 6, [MB] * 6, ["float32"] * 6, 0.0, model(50.0, 10.0))
    assert plan.buckets == [list(range(6))]
    # gradients that are tiny next to the latency are merged, not sent one by one
    plan = plan_measured([0.001 * i for i in range(50)], [1024] * 50, ["float32"] * 50, 0.05, model(1.0, 10.0))
    assert len(plan.buckets) < 50


def test_planner_never_mixes_dtypes() -> None:
    dtypes = ["float32", "float32", "bfloat16", "bfloat16", "float32"]
    plan = plan_measured([0.0] * 5, [100] * 5, dtypes, 0.0, model(10.0, 1.0))
    assert all(len({dtypes[i] for i in b}) == 1 for b in plan.buckets)
    assert plan.buckets == [[0, 1], [2, 3], [4]]


def test_planner_keeps_buckets_under_the_cap_unless_one_gradient_is_larger() -> None:
    # all at once, a large latency: one bucket would be best, but not above the cap
    plan = plan_measured([0.0] * 6, [10 * MB] * 6, ["float32"] * 6, 0.0, model(50.0, 10.0), max_bytes=25 * MB)
    assert plan.buckets == [[0, 1], [2, 3], [4, 5]]
    plan = plan_measured([0.0] * 2, [40 * MB] * 2, ["float32"] * 2, 0.0, model(50.0, 10.0), max_bytes=25 * MB)
    assert plan.buckets == [[0], [1]]


def test_measuring_leaves_the_users_random_stream_alone() -> None:
    """A job that measures the cost model and one that reads an earlier job's figures (a cold and a warm cache) must
    draw the same random numbers afterwards: dropout masks, and so a resumed run's parameters, depend on it (the
    killed-job resume test differed by 0.15 whenever its uninterrupted run measured and the resumed one did not)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_sgdtp.compiler.bucket_cost import measure

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        expected = torch.rand(4)
        torch.manual_seed(0)
        measure(None, torch.device("cpu"), reps=1)
        assert torch.equal(torch.rand(4), expected)
    finally:
        dist.destroy_process_group()
