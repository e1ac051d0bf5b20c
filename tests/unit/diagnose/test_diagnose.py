"""``lightning_sgdtp.diagnose``: each check finds its problem, says where, and says what to do (in this process; the
``sgdtp diagnose`` command: tests/integration/test_cli.py)."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Generator
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn

from lightning_sgdtp import graph
from lightning_sgdtp.diagnose import CACHE_MARKER, Diagnosis, check_compile_cache, diagnose

FAST = {"backend": "aot_eager", "check_cache": False}


@pytest.fixture(autouse=True)
def clean() -> Generator[None, None, None]:
    yield
    graph.destroy_all()
    torch._dynamo.reset()


def line_of(fn: object, text: str) -> str:
    """``file:line`` of the first line of ``fn``'s source that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{start + offset}"


class BreakingModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.norm(self.body(x)).relu()
        self.log("h_norm", h.norm())
        if batch_idx % 2 == 0:
            h = h * 2
        torch._dynamo.graph_break()
        return F.mse_loss(self.head(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 4), torch.randn(n, 1)


# ----------------------------------------------------------------------------------- breaks, recompiles
def test_graph_breaks_and_recompiles_of_a_lightning_training_step() -> None:
    module = BreakingModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module.eval()
    result = diagnose(module, batch(), **FAST)

    assert result.stats["kind"] == "LightningModule" and result.target == "BreakingModule.training_step"
    assert result.stats["graphs"] == 3 and result.stats["graph_breaks"] == 2
    breaks = {f.where: f for f in result.of("graph_break")}
    explicit = breaks[line_of(BreakingModule.training_step, "graph_break()")]
    assert explicit.severity == "warning" and explicit.source == "torch._dynamo.graph_break()"
    assert "remove the explicit torch._dynamo.graph_break()" in explicit.fix
    log = breaks[line_of(BreakingModule.training_step, "self.log(")]
    assert log.severity == "info" and "self.log" in log.fix  # the strategy's own clean break for Lightning's log

    recompiles = result.of("recompile")
    guards = [f.message for f in recompiles]
    assert any("batch_idx=1" in m and "batch_idx" in m.split("guard failed:")[1] for m in guards), guards
    by_idx = next(f for f in recompiles if "batch_idx=1" in f.message)
    assert by_idx.where == line_of(BreakingModule.training_step, "if batch_idx % 2")
    assert "do not branch on batch_idx" in by_idx.fix
    size = next(f for f in recompiles if "size mismatch" in f.message)
    assert "first dimension is 4 instead of 8" in size.message and "drop_last=True" in size.fix
    assert result.stats["recompiles"] == len(recompiles) >= 2
    assert all(f.fix for f in result.findings)

    # the module is left as it was: parameters, buffers (BatchNorm statistics), grads, eval mode
    assert not module.training and all(p.grad is None for p in module.parameters())
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert "log" not in module.__dict__

    text = str(result)
    assert "[warning] graph_break: graph break: Call to `torch._dynamo.graph_break()`" in text
    assert "    fix: " in text and "guard failed:" in text
    data = json.loads(result.to_json())
    assert data["counts"]["warning"] == len(result.warnings) and data["findings"][0]["fix"]


class CastingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.float()).sum()


def test_other_batches_dtype_change_and_plain_module() -> None:
    result = diagnose(CastingNet(), torch.randn(8, 4), other_batches=[torch.randn(8, 4).double()], **FAST)
    assert result.target == "CastingNet.forward" and result.stats["graph_breaks"] == 0
    (rec,) = result.of("recompile")
    assert "other_batches[0]" in rec.message and "dtype mismatch" in rec.message and "one dtype" in rec.fix


def test_clean_step_has_no_findings() -> None:
    result = diagnose(nn.Linear(4, 2), torch.randn(8, 4), other_batches=[], **FAST)
    assert result.findings == [] and result.ok
    assert result.stats["graphs"] == 1 and result.stats["recompiles"] == 0

    module = BreakingModule()
    step = diagnose(module, batch(), lambda b: F.mse_loss(module.head(b[0] @ module.body.weight.t()), b[1]), **FAST)
    assert step.stats["kind"] == "step_fn" and "(step_fn of BreakingModule)" in step.target
    assert step.stats["calls"][1] != "the example batch with batch_idx=1" and not step.of("graph_break")


class MetricModule(L.LightningModule):
    """Updates and logs torchmetrics metrics in its step, as most training loops do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 3)
        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.acc(logits.argmax(-1), y)
        self.mean_loss(loss.detach())
        self.log("acc", self.acc)
        self.log_dict({"loss": self.mean_loss})
        return loss


def test_torchmetrics_in_the_step_cause_no_recompile() -> None:
    # As under the strategy, Metric.forward runs eagerly. Diagnose used to trace into it: MeanMetric recompiled on
    # every batch (guard failed: self._update_count == 1, == 2, ...) and MulticlassAccuracy did not even trace
    # (compile_error: PackageNotFoundError for torch_xla), recompiles that training never has.
    def batch_of_classes() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(8, 4), torch.randint(0, 3, (8,))

    module = MetricModule()
    result = diagnose(module, batch_of_classes(), other_batches=[batch_of_classes() for _ in range(3)], **FAST)
    assert not result.of("recompile") and result.stats["recompiles"] == 0, str(result)
    assert not result.of("compile_error") and result.ok, str(result)
    assert len(result.stats["calls"]) == 6  # batch_idx=1, three other batches, the example batch again: all ran
    assert all(f.severity == "info" for f in result.of("graph_break")), str(result)  # the strategy's eager breaks
    assert any(line_of(MetricModule.training_step, "self.acc(") == f.where for f in result.of("graph_break"))
    # the metrics are left as they were, and no wrapper stays behind
    assert module.acc._update_count == module.mean_loss._update_count == 0
    assert "forward" not in module.acc.__dict__ and "log" not in module.__dict__


class LogNet(nn.Module):
    """A plain module with a method of its own called ``log``: not Lightning's, so it is traced like any other."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def log(self, x: torch.Tensor) -> torch.Tensor:
        return (x.abs() + 1).log()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log(self.lin(x)).sum()


def test_package_is_callable_and_a_plain_modules_log_is_traced() -> None:
    import lightning_sgdtp

    result = lightning_sgdtp.diagnose(LogNet(), torch.randn(8, 4), other_batches=[], **FAST)
    assert isinstance(result, Diagnosis) and result.findings == [] and result.stats["graph_breaks"] == 0
    assert (
        lightning_sgdtp.diagnose.diagnose is diagnose
        and lightning_sgdtp.diagnose.check_compile_cache is check_compile_cache
    )


# ----------------------------------------------------------------------------------------------- devices
def test_parameters_on_mixed_devices_meta_and_cpu() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    result = diagnose(model, torch.randn(2, 4), **FAST)
    (mixed,) = result.of("mixed_devices")
    assert mixed.severity == "error" and "cpu: 2 (0.weight, 0.bias); meta: 2 (1.weight, 1.bias)" in mixed.message
    assert "to_empty" in mixed.fix
    assert result.of("compile_skipped") and "graphs" not in result.stats  # nothing was run on meta tensors
    assert not result.ok


# ------------------------------------------------------------------------------------------- custom ops
class CudaOpModel(nn.Module):
    def __init__(self, op: graph.GraphHandle) -> None:
        super().__init__()
        self.op = op
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(self.lin(x)).sum()


def test_custom_op_registered_for_cuda_used_on_cpu() -> None:
    op = graph.register("scale_cuda", lambda x: 2 * x, lambda ctx, g: 2 * g, [("tensor", "cuda")], [("tensor", "cuda")])
    result = diagnose(CudaOpModel(op), torch.randn(8, 4), **FAST)
    (finding,) = result.of("custom_op_device")
    assert finding.severity == "error"
    assert finding.message == "sgdtp.scale_cuda is registered for cuda, but its input 0 ('input0') is on cpu"
    assert finding.where == line_of(CudaOpModel.forward, "self.op(")
    assert "device='cpu'" in finding.fix and "scale_cuda_cpu" in finding.fix
    assert not result.of("compile_error")  # the spec error is the cause; not reported twice


def test_custom_op_in_graph_is_listed_and_checked() -> None:
    op = graph.register("double", lambda x: 2 * x, lambda ctx, g: 2 * g, [("tensor", "cpu")], [("tensor", "cpu")])
    result = diagnose(CudaOpModel(op), torch.randn(8, 4), other_batches=[], **FAST)
    assert result.stats["custom_ops_used"] == ["sgdtp.double"] and result.findings == []
    bad = diagnose(CudaOpModel(op), torch.randn(8, 4).double(), other_batches=[], **FAST)  # module is float32
    assert bad.of("compile_error"), bad  # mat1/mat2 dtype mismatch in eager and compiled alike


# ------------------------------------------------------------------------------------------------ cache
def test_compile_cache_marker_fresh_then_stale(tmp_path: Path) -> None:
    cache = tmp_path / "inductor"
    (info,) = check_compile_cache(cache)
    assert info.severity == "info" and "no compile cache yet" in info.message

    cache.mkdir(mode=0o700)
    (cache / "fxgraph").mkdir()
    (cache / "fxgraph" / "entry").write_text("x")
    (first,) = check_compile_cache(cache)
    assert first.severity == "info" and "wrote the version marker" in first.message
    marker = json.loads((cache / CACHE_MARKER).read_text())
    assert marker["torch"] == torch.__version__ and marker["uid"] == os.geteuid()
    (again,) = check_compile_cache(cache)
    assert "same torch build" in again.message

    marker["torch"] = "1.13.1"
    (cache / CACHE_MARKER).write_text(json.dumps(marker))
    (stale,) = check_compile_cache(cache)
    assert stale.severity == "warning" and "stale compile cache" in stale.message and "torch 1.13.1" in stale.message
    assert f"rm -rf {cache}" in stale.fix and "TORCHINDUCTOR_CACHE_DIR" in stale.fix


def test_compile_cache_of_another_user(tmp_path: Path) -> None:
    cache = tmp_path / "inductor"
    cache.mkdir(mode=0o700)
    (cache / "kernel.so").write_text("x")
    other = os.geteuid() + 4242
    findings = check_compile_cache(cache, uid=other)  # as seen by another user: everything is foreign
    owner = next(f for f in findings if "belongs to" in f.message)
    files = next(f for f in findings if "belong to other users" in f.message)
    assert owner.severity == files.severity == "error" and "TORCHINDUCTOR_CACHE_DIR" in owner.fix
    assert "1 of 1 entries" in files.message and "kernel.so" in files.message and "rm -rf" in files.fix
    assert not (cache / CACHE_MARKER).exists()  # no marker written into a cache with problems

    if os.geteuid() == 0:  # a file really owned by someone else
        os.chown(cache / "kernel.so", 12345, 12345)
        (files,) = check_compile_cache(cache)
        assert files.severity == "error" and "1 of " in files.message and "uid 12345" in files.message

    os.chmod(cache, 0o777)
    assert any(f.severity == "warning" and "writable by every user" in f.message for f in check_compile_cache(cache))


def test_diagnose_includes_the_cache_check(tmp_path: Path) -> None:
    result = diagnose(nn.Linear(2, 2), torch.randn(4, 2), backend="aot_eager", cache_dir=tmp_path, other_batches=[])
    assert result.stats["cache_dir"] == str(tmp_path) and (tmp_path / CACHE_MARKER).exists()
    assert [f.check for f in result.findings] == ["compile_cache"]


def test_diagnosis_text_and_json_agree() -> None:
    result = Diagnosis("x", "aot_eager", [], {"graphs": 1, "graph_breaks": 0, "recompiles": 0})
    assert result.to_text().endswith("0 error(s), 0 warning(s), 0 info")
    assert json.loads(result.to_json())["ok"] is True
