"""The gradient-bucket pass, tested in one process on captured graphs (a fake 2-rank process group)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._inductor.utils import run_and_get_code
from torch.testing._internal.distributed.fake_pg import FakeStore

from lightning_sgdtp import SGDTPCompiler, SGDTPConfig
from lightning_sgdtp.compiler.buckets import GradSlot, plan_buckets


def slots(*sizes: int, dtype: str = "float32") -> list[GradSlot]:
    return [GradSlot(f"p{i}", n, dtype, 4) for i, n in enumerate(sizes)]


def test_plan_buckets_keeps_order_and_cap() -> None:
    assert plan_buckets(slots(10, 10, 10, 10), cap_bytes=80) == [[0, 1], [2, 3]]
    assert plan_buckets(slots(100, 1, 1), cap_bytes=80) == [[0], [1, 2]]  # an oversized grad stands alone
    assert plan_buckets(slots(1, 2, 3), cap_bytes=10**9) == [[0, 1, 2]]
    mixed = slots(1, 1) + [GradSlot("h", 1, "bfloat16", 2)] + slots(1)
    assert plan_buckets(mixed, cap_bytes=10**9) == [[0, 1], [2], [3]]  # never mixes dtypes
    with pytest.raises(ValueError):
        plan_buckets(slots(1), 0)


@pytest.fixture(scope="module")
def fake_world() -> None:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 10))


def backward_code(overlap: bool, cap_mb: float = 0.3) -> tuple[str, SGDTPCompiler]:
    torch._dynamo.reset()
    model = mlp()
    compiler = SGDTPCompiler(SGDTPConfig(bucket_cap_mb=cap_mb, overlap=overlap))
    step = torch.compile(model, backend=compiler)
    x = torch.randn(8, 256)
    _, codes = run_and_get_code(lambda: step(x).sum().backward())
    return codes[-1], compiler


CALL = re.compile(
    r"^\s*(?:torch\.ops\._c10d_functional\.(all_reduce_|wait_tensor)\.default\((\w+)|.*(extern_kernels\.mm|cpp_fused_\w+)\()"
)


def schedule(code: str) -> list[tuple[str, str]]:
    """The generated backward's calls, in order: ("all_reduce_", buf), ("wait_tensor", buf), ("compute", name)."""
    events = []
    for line in code.splitlines():
        if "def " in line or "async_compile" in line:
            continue
        m = CALL.match(line)
        if m and m.group(1):
            events.append((m.group(1), m.group(2)))
        elif m and m.group(3):
            events.append(("compute", m.group(3)))
    return events


def test_plan_follows_gradient_production_order(fake_world: None) -> None:
    _, compiler = backward_code(overlap=True)
    (plan,) = compiler.graphs
    assert plan.in_graph_sync and plan.world_size == 2
    names = [p for b in plan.buckets for p in b.params]
    # backward produces the last layer's gradients first
    assert "8" in names[0] and "0" in names[-1], names
    assert all(b.wire_bytes <= 0.3 * 2**20 or len(b.params) == 1 for b in plan.buckets)
    assert sum(b.numel for b in plan.buckets) == sum(p.numel() for p in mlp().parameters())


def test_generated_code_issues_all_reduce_before_later_backward_compute(fake_world: None) -> None:
    """Overlap, shown in the code Inductor generated: the first bucket is sent, then backward compute
    continues (matmuls of earlier layers), and only then does the code wait for it."""
    code, compiler = backward_code(overlap=True)
    events = schedule(code)
    issued = [i for i, e in enumerate(events) if e[0] == "all_reduce_"]
    assert len(issued) == len(compiler.graphs[0].buckets) >= 3, events
    first_buf = events[issued[0]][1]
    wait = next(i for i, e in enumerate(events) if e == ("wait_tensor", first_buf))
    between = [e for e in events[issued[0] + 1 : wait] if e[0] == "compute" and "mm" in e[1]]
    assert len(between) >= 2, f"no backward matmul overlaps the first bucket's all-reduce: {events}"
    # every bucket is issued before the last matmul of backward: communication runs during backward
    last_mm = max(i for i, e in enumerate(events) if e == ("compute", "extern_kernels.mm"))
    assert sum(1 for i in issued if i < last_mm) >= len(issued) - 1, events


def test_overlap_false_waits_for_each_bucket_before_more_backward_compute(fake_world: None) -> None:
    """The baseline: with overlap=False every bucket's wait comes right after its all-reduce, before any
    further backward matmul, so communication and compute never overlap."""
    code, compiler = backward_code(overlap=False)
    events = schedule(code)
    issued = [i for i, e in enumerate(events) if e[0] == "all_reduce_"]
    assert len(issued) == len(compiler.graphs[0].buckets) >= 3, events
    for i in issued:
        wait = next(j for j, e in enumerate(events) if e == ("wait_tensor", events[i][1]))
        between = [e for e in events[i + 1 : wait] if e[0] == "compute" and "mm" in e[1]]
        assert not between, f"a matmul runs while bucket {events[i][1]} is in flight: {events}"


def test_bf16_wire_dtype_halves_bytes(fake_world: None) -> None:
    torch._dynamo.reset()
    compiler = SGDTPCompiler(SGDTPConfig(bucket_cap_mb=100, grad_comm_dtype="bf16"))
    model = mlp()
    step = torch.compile(model, backend=compiler)
    step(torch.randn(4, 256)).sum().backward()
    (bucket,) = compiler.graphs[0].buckets
    assert bucket.wire_dtype == "bfloat16" and bucket.wire_bytes * 2 == bucket.numel * 4
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_registered_backend_with_design_doc_options(fake_world: None) -> None:
    """``torch.compile(model, backend="sgdtp", options={...})``: the string name and the options dict."""
    torch._dynamo.reset()
    options = {"distributed": {"plugin": "sgdtp", "strategy": "data", "bucket_cap_mb": 0.3}}
    step = torch.compile(mlp(), backend="sgdtp", options=options)
    x = torch.randn(8, 256)
    _, codes = run_and_get_code(lambda: step(x).sum().backward())
    issued = [e for e in schedule(codes[-1]) if e[0] == "all_reduce_"]
    assert len(issued) >= 3, codes[-1]


def test_registered_backend_sends_pipeline_options_to_the_strategy(fake_world: None) -> None:
    torch._dynamo.reset()
    options = {"distributed": {"plugin": "sgdtp", "strategy": "data", "pipeline_chunks": 4}}
    step = torch.compile(mlp(), backend="sgdtp", options=options)
    with pytest.raises(Exception, match=r"Trainer\(strategy=SGDTPStrategy\(options=...\)\)"):
        step(torch.randn(2, 256))


def test_measured_cost_model_plans_the_buckets_and_predicts_exposure(fake_world: None) -> None:
    from lightning_sgdtp.compiler.backend import CompileSettings
    from lightning_sgdtp.compiler.bucket_cost import CostModel

    torch._dynamo.reset()
    cost = CostModel(latency_s=5e-5, seconds_per_byte=1e-9, flops_per_s=2e9, bytes_per_s=1e10)
    compiler = SGDTPCompiler(SGDTPConfig(), settings=CompileSettings(cost=cost))  # bucket_cap_mb="auto"
    step = torch.compile(mlp(), backend=compiler)
    step(torch.randn(8, 256)).sum().backward()
    step(torch.randn(5, 256)).sum().backward()  # a short last batch: recompiled for a dynamic batch size
    plan, dynamic = compiler.graphs
    assert dynamic.sizing["rule"] == "measured" and type(dynamic.sizing["predicted_backward_ms"]) is float
    assert plan.sizing["rule"] == "measured"
    assert plan.sizing["predicted_exposed_ms"] <= plan.sizing["one_bucket_exposed_ms"]
    assert plan.sizing["predicted_backward_ms"] > 0
    assert sum(b.numel for b in plan.buckets) == sum(p.numel() for p in mlp().parameters())
    assert len(plan.buckets) >= 2  # with compute this slow next to the link, sending early pays
    assert plan.buckets[-1].wire_bytes < plan.wire_bytes / 2  # a small last bucket


@pytest.mark.parametrize("guarded", [True, False])
def test_inductor_bucketing_switched_on_by_the_user_cannot_merge_our_buckets(
    fake_world: None, guarded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user who turns on Inductor's own all-reduce bucketing globally: our planned buckets stay as planned. The
    unguarded run (our guard emptied) shows that Inductor would merge them otherwise (the test can fail)."""
    from lightning_sgdtp.compiler import backend

    if not guarded:
        monkeypatch.setattr(backend, "OURS_ALONE", {})
    with torch._inductor.config.patch(bucket_all_reduces_fx="all"):
        code, compiler = backward_code(overlap=True)
    issued = [e for e in schedule(code) if e[0] == "all_reduce_"]
    planned = len(compiler.graphs[0].buckets)
    assert planned >= 3
    if guarded:
        assert len(issued) == planned, issued
    else:
        assert len(issued) < planned, issued
