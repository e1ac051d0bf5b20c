"""``recompile``: every recompilation of the step and the guard that failed.

The step is compiled as the strategy compiles it (:func:`lightning_sgdtp.engine.step_compile.compile_step`, with
the same eager bookkeeping) and run on the example batch (then backward once), again with ``batch_idx=1`` for a
``training_step``, on a batch whose first dimension differs (or ``other_batches``), and on the example batch again.
A recompilation on the resized batch is expected (diagnose made it on purpose); any other one happens in training
too. Only worth running when the step traced (:attr:`~lightning_sgdtp.diagnose.graph_breaks.GraphBreaks.traced`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sgdtp.diagnose.context import DiagnoseContext, loss_of, resized, running
from lightning_sgdtp.diagnose.custom_ops import ops_in
from lightning_sgdtp.diagnose.locate import compile_error, headline, source_line, user_frame_from_text
from lightning_sgdtp.diagnose.report import CheckResult, Finding
from lightning_sgdtp.engine.step_compile import compile_step


@dataclass
class Recompiles(CheckResult):
    ops_used: frozenset[str] = field(default_factory=frozenset)


def make_backend(backend: str | Callable[..., Any], module: nn.Module) -> Callable[..., Any] | str:
    """``"sgdtp"``: the strategy's :class:`~lightning_sgdtp.compiler.backend.SGDTPCompiler`; else ``backend``."""
    if backend == "sgdtp":
        from lightning_sgdtp.compiler.backend import SGDTPCompiler

        return SGDTPCompiler(param_names={id(p): n for n, p in module.named_parameters()})
    return backend


def recompile_fix(reason: str, synthetic: bool) -> str:
    low = reason.lower()
    if "size mismatch" in low or "stride mismatch" in low:
        return (
            "batch shapes change between steps"
            + (" (here: the other-size batch diagnose ran on purpose)" if synthetic else "")
            + ". Each new shape costs a recompilation until Dynamo switches that dimension to dynamic. Keep shapes"
            " fixed (DataLoader(drop_last=True), pad sequences to one length), or mark the dimension dynamic before"
            " the first step: torch._dynamo.mark_dynamic(tensor, dim)"
        )
    if "dtype mismatch" in low:
        return "feed every batch in one dtype (cast in the DataLoader's collate_fn or the dataset)"
    if "device mismatch" in low:
        return "feed every batch on one device"
    if "requires_grad mismatch" in low:
        return "requires_grad of an input changes between steps: keep it constant"
    if "batch_idx" in low:
        return (
            "the step's code depends on the value of batch_idx (each new value recompiles until Dynamo makes it"
            " dynamic): do not branch on batch_idx inside training_step; move periodic work to a callback"
        )
    if "___check_obj_id" in low or "id_match" in low or "id mismatch" in low:
        return "an object's identity changes between steps: create it once (in __init__ or setup), not in the step"
    if "___stack" in low:
        return (
            "a value the step computed (e.g. with .item()) reaches the code after a graph break as a Python number;"
            " every new value recompiles, and after Dynamo's recompile limit the step runs eagerly. Keep it a tensor"
            " (torch.where instead of if), or remove the graph break before it"
        )
    if re.search(r"(==|!=|<|>)\s*-?\d", reason):
        return (
            "the step depends on the value of a Python number: pass it as a tensor, or keep it constant between steps"
        )
    return "keep the step's inputs (shapes, dtypes, Python values, object identities) the same between steps"


def frame_label(co_name: str) -> str:
    """Dynamo names the code after a graph break ``torch_dynamo_resume_in_<fn>_at_<line>``: say it in words."""
    m = re.fullmatch(r"torch_dynamo_resume_in_(\w+)_at_(\d+)", co_name)
    return f"{m.group(1)} (the part after the graph break at line {m.group(2)})" if m else co_name


def calls_of(ctx: DiagnoseContext) -> list[tuple[str, Any, int, bool]]:
    """``(description, batch, batch_idx, synthetic)`` of each call, in order."""
    calls: list[tuple[str, Any, int, bool]] = [("the example batch", ctx.batch, 0, False)]
    if ctx.takes_batch_idx:
        calls.append(("the example batch with batch_idx=1", ctx.batch, 1, False))
    if ctx.other_batches is None:
        other = resized(ctx.batch)
        extra = [(desc, b, True) for b, desc in ([other] if other else [])]
    else:
        extra = [(f"other_batches[{i}]", b, False) for i, b in enumerate(ctx.other_batches)]
    for desc, b, synthetic in extra:
        calls.append((desc, b, len(calls), synthetic))
    if len(calls) > 1:
        calls.append(("the example batch again", ctx.batch, len(calls), False))
    return calls


def _findings_of(metrics: list[Any], desc: str, synthetic: bool) -> list[Finding]:
    """The findings in Dynamo's compilation metrics of one call."""
    findings = []
    for m in metrics:
        reason = getattr(m, "recompile_reason", None)
        if getattr(m, "fail_reason", None) and "recompile" in str(m.fail_reason).lower():
            findings.append(
                Finding(
                    "recompile",
                    "error",
                    f"{m.co_name} hit Dynamo's recompile limit: {headline(str(m.fail_reason))}",
                    "the step now runs eagerly: remove what changes between steps (see the other recompile findings)",
                    where=f"{m.co_filename}:{m.co_firstlineno}",
                )
            )
        if not reason:
            continue
        where, source = user_frame_from_text(reason)
        if where is None:
            where, source = f"{m.co_filename}:{m.co_firstlineno}", source_line(m.co_filename, m.co_firstlineno)
        guard = reason.split("\n")[0].strip()
        guard = re.sub(r"^\d+/\d+:\s*", "", guard)
        guard = guard.split("  #")[0].strip()
        findings.append(
            Finding(
                "recompile",
                "warning",
                f"{frame_label(m.co_name)} recompiled on {desc}; guard failed: {guard}",
                recompile_fix(reason + (" batch_idx" if "batch_idx" in guard else ""), synthetic),
                where=where,
                source=source,
                details={"call": desc, "reason": reason, "frame": m.co_name, "compile_id": str(m.compile_id)},
            )
        )
    return findings


def check(ctx: DiagnoseContext) -> Recompiles:
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    calls = calls_of(ctx)
    inner = make_backend(ctx.backend, ctx.module)
    graphs: list[frozenset[str]] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(ops_in(gm))
        return (lookup_backend(inner) if isinstance(inner, str) else inner)(gm, example_inputs)

    torch._dynamo.reset()
    clear_compilation_metrics()
    findings: list[Finding] = []
    with running(ctx.module):
        compiled = compile_step(ctx.fn, counting_backend)
        for index, (desc, b, batch_idx, synthetic) in enumerate(calls):
            seen = len(get_compilation_metrics())
            try:
                output = compiled(*ctx.make_args(b, batch_idx))
                if ctx.backward and index == 0:
                    loss = loss_of(output)
                    if loss is not None:
                        loss.backward()
            except Exception as e:  # noqa: BLE001 - reported as a finding
                findings.append(compile_error(e, f"running the compiled step on {desc}"))
                break
            findings += _findings_of(get_compilation_metrics()[seen:], desc, synthetic)
    stats = {
        "recompiles": sum(1 for f in findings if f.check == "recompile" and f.severity == "warning"),
        "compiled_graphs": len(graphs),
        "calls": [c[0] for c in calls],
    }
    return Recompiles(findings, stats, ops_used=frozenset().union(*graphs))
