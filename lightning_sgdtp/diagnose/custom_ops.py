"""``custom_op_device`` / ``custom_op_spec``: ops of :mod:`lightning_sgdtp.graph` called with tensors their specs
refuse (an op registered for ``cuda`` called with CPU tensors, a wrong dtype or rank), and ops in the graphs
registered for a device type the model does not use.

It needs what the checks that ran the step saw, passed in as data: the spec errors recorded while they ran, the
custom ops in their graphs, and their ``compile_error`` findings. A spec error usually stops tracing, so it is the
cause of one of those compile errors, not a second problem: the result names the compile errors it explains
(:attr:`CustomOps.explained`) and :func:`~lightning_sgdtp.diagnose.diagnose` leaves them out of the report.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_sgdtp.diagnose.context import DiagnoseContext, tensors
from lightning_sgdtp.diagnose.report import CheckResult, Finding
from lightning_sgdtp.graph.registry import NAMESPACE, registered
from lightning_sgdtp.graph.specs import SpecError

_SPEC_FIXES = {
    "dtype": "cast the tensor before the call, or allow this dtype in the spec (a tuple of dtypes)",
    "ndim": "reshape the tensor before the call, or change the spec's ndim",
    "count": "call the op with one tensor per input spec",
    "type": "pass tensors (constants belong in forward_fn/backward_fn, e.g. via a closure)",
    "shape": "make shape_fn return the shape forward_fn really returns",
}


@dataclass
class CustomOps(CheckResult):
    explained: list[Finding] = field(default_factory=list)  # compile errors that a spec error caused


def _op_name(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name
    else:
        return None
    return name.replace("::", ".") if name.startswith(f"{NAMESPACE}::") else None


def ops_in(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The ops of :mod:`lightning_sgdtp.graph` (``sgdtp.NAME``) that a graph calls."""
    return frozenset(n for n in (_op_name(node.target) for node in gm.graph.nodes if node.op == "call_function") if n)


def _spec_error_finding(err: SpecError, where: str | None, source: str | None) -> Finding:
    if err.field == "device":
        got_type = err.got.split(":")[0] if err.got else "?"
        name = (err.op or "").split(".")[-1]
        return Finding(
            "custom_op_device",
            "error",
            f"{err.op} is registered for {err.expected}, but its {err.where} {err.index} ({err.arg!r}) is on {err.got}",
            f"register the op for the device you train on (input_specs with device={got_type!r}, or None for"
            f" any device), or register one op per device (e.g. {name}_{got_type}) and choose by"
            " tensor.device.type in your module",
            where=where,
            source=source,
            details=err.to_dict(),
        )
    return Finding(
        "custom_op_spec",
        "error",
        str(err),
        _SPEC_FIXES.get(err.field or "", "call the op with tensors that match its specs"),
        where=where,
        source=source,
        details=err.to_dict(),
    )


def check(
    ctx: DiagnoseContext,
    spec_errors: Iterable[SpecError],
    ops_used: Iterable[str],
    compile_errors: Sequence[Finding] = (),
) -> CustomOps:
    """Findings for ``spec_errors`` (recorded while the step ran) and for ``ops_used`` (the custom ops in its
    graphs); ``compile_errors``: the ``compile_error`` findings of those runs, whose causes these may be."""
    findings: list[Finding] = []
    explained: list[Finding] = []
    reported: set[tuple[Any, ...]] = set()
    for err in spec_errors:
        key = (err.op, err.where, err.index, err.field, err.got)
        if key in reported:
            continue
        reported.add(key)
        causes = [
            f
            for f in compile_errors
            if f.check == "compile_error"
            and "SpecError" in f.details.get("message", "")
            and err.op in f.details["message"]
        ]
        where = next((f.where for f in causes if f.where), None)
        source = next((f.source for f in causes if f.where), None)
        explained += [f for f in causes if not any(f is e for e in explained)]
        findings.append(_spec_error_finding(err, where, source))
    # Ops in the graphs whose specs name a device type the module does not use (never reached, or reached only
    # on meta/fake tensors): report before the first real step fails.
    by_op = {f"{NAMESPACE}.{h.name}": h for h in registered()}
    module_types = {p.device.type for p in ctx.module.parameters()} | {t.device.type for t in tensors(ctx.batch)}
    used = sorted(set(ops_used))
    for op in used:
        handle = by_op.get(op)
        if handle is None or any(k[0] == op for k in reported):
            continue
        wanted = sorted({s.device.type for s in handle.input_specs if s.device is not None} - module_types)
        if wanted and module_types:
            findings.append(
                Finding(
                    "custom_op_device",
                    "error",
                    f"{op} is registered for {', '.join(wanted)}, but this model runs on {', '.join(sorted(module_types))}",
                    f"register {op} for {', '.join(sorted(module_types))} (or device=None), or register one op per"
                    " device and choose by tensor.device.type",
                    details=handle.describe(),
                )
            )
    return CustomOps(findings, {"custom_ops_used": used}, explained=explained)
