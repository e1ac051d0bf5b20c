"""``graph_break``: every graph break of the step, with Dynamo's reason, the user's source line and a fix
(``torch._dynamo.explain`` on the example batch).

The strategy's own breaks, Lightning's ``self.log``/``self.log_dict`` and torchmetrics' ``Metric.forward`` run
eagerly (:mod:`lightning_sgdtp.engine.step_compile`), are reported as ``info``: they are by design. Its result
says whether the step could be traced at all (:attr:`GraphBreaks.traced`: the recompile check runs only then)
and which custom ops the graphs call (:attr:`GraphBreaks.ops_used`, for the custom-op check).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from lightning_sgdtp.diagnose.context import DiagnoseContext, running
from lightning_sgdtp.diagnose.custom_ops import ops_in
from lightning_sgdtp.diagnose.locate import compile_error, headline, hints, is_library_file
from lightning_sgdtp.diagnose.report import CheckResult, Finding
from lightning_sgdtp.engine.step_compile import bookkeeping_hooks


@dataclass
class GraphBreaks(CheckResult):
    traced: bool = False  # torch._dynamo.explain ran through the step
    ops_used: frozenset[str] = field(default_factory=frozenset)


def eager_bookkeeping_names(ctx: DiagnoseContext) -> frozenset[str]:
    """How the bookkeeping functions that run eagerly appear in Dynamo's break reasons (lower case)."""
    names = {"_no_log"}  # self.log without a Trainer
    for owner, hook in bookkeeping_hooks(ctx.module) + bookkeeping_hooks(ctx.module, installed=True):
        method = getattr(type(owner), hook, None)
        if method is not None:
            names.add(method.__qualname__.lower())
    return frozenset(names)


def break_fix(reason: str, bookkeeping: frozenset[str] = frozenset()) -> tuple[str, str]:
    """``(severity, fix)`` for a graph-break reason."""
    low = reason.lower()
    if "torch.compiler.disable" in low and any(re.search(rf"(?<!\w){re.escape(n)}(?!\w)", low) for n in bookkeeping):
        return "info", (
            "nothing to do: under the sgdtp strategy Lightning's self.log/self.log_dict and torchmetrics' metric"
            " updates run eagerly, one clean break per call. For no break at all, log and update metrics from a"
            " callback (on_train_batch_end) instead"
        )
    if "torch.compiler.disable" in low or "skip calling" in low:
        return "warning", (
            "this function is marked torch.compiler.disable: it runs eagerly between two graphs, and the gradients"
            " of parameters used inside it are averaged after backward (the ledger's fallback) instead of inside"
            " the compiled backward. Remove the decorator if its code is traceable"
        )
    if "graph_break()" in low or "torch._dynamo.graph_break" in low:
        return "warning", "remove the explicit torch._dynamo.graph_break() call"
    if ".item()" in low or "capture_scalar_outputs" in low:
        return "warning", (
            "keep the value a tensor (torch.where(cond, a, b) instead of `if x.item() > 0`), or set"
            " torch._dynamo.config.capture_scalar_outputs = True"
        )
    if "data-dependent" in low or "generic_jump" in low or "branch" in low:
        return "warning", "branch on tensor values with torch.where or torch.cond, not with a Python if"
    if "print" in low or "logging" in low:
        return "warning", "remove print()/logging calls from the step, or move them to a callback"
    hint = "; ".join(hints(reason))
    return "warning", (
        "rewrite this line with traceable torch operations, or move it out of the step (e.g. into a callback)"
        + (f". Dynamo's hint: {hint}" if hint else "")
    )


def check(ctx: DiagnoseContext) -> GraphBreaks:
    bookkeeping = eager_bookkeeping_names(ctx)
    try:
        with running(ctx.module):
            out = torch._dynamo.explain(ctx.fn)(*ctx.make_args(ctx.batch, 0))
    except Exception as e:  # noqa: BLE001 - reported as a finding
        finding = compile_error(e, "tracing the step (torch._dynamo.explain)")
        return GraphBreaks([finding], {"graphs": None, "graph_breaks": None}, traced=False)
    stats = {"graphs": out.graph_count, "graph_breaks": max(out.graph_break_count, len(out.break_reasons))}
    ops = frozenset().union(*(ops_in(gm) for gm in out.graphs))
    seen: dict[tuple[str, str | None], Finding] = {}
    for r in out.break_reasons:
        frames = [f for f in r.user_stack if not is_library_file(f.filename)] or list(r.user_stack)
        frame = frames[-1] if frames else None
        where = f"{frame.filename}:{frame.lineno}" if frame else None
        key = (headline(r.reason), where)
        if key in seen:
            seen[key].details["count"] += 1
            continue
        severity, fix = break_fix(r.reason, bookkeeping)
        seen[key] = Finding(
            "graph_break",
            severity,
            f"graph break: {key[0]}",
            fix,
            where=where,
            source=(frame.line or "").strip() or None if frame else None,
            details={
                "reason": r.reason.split("\n\n For more details")[0].strip(),
                "hints": hints(r.reason),
                "stack": [f"{f.filename}:{f.lineno} in {f.name}" for f in r.user_stack],
                "count": 1,
            },
        )
    return GraphBreaks(list(seen.values()), stats, traced=True, ops_used=ops)
