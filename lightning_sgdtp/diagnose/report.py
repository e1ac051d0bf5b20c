"""What diagnose hands back: :class:`Finding` (one problem, and what to do about it), :class:`CheckResult` (what
one check returns) and :class:`Diagnosis` (every check's findings and numbers, merged once, as text or JSON)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

SEVERITIES = ("error", "warning", "info")


@dataclass
class Finding:
    """One thing diagnose found. ``fix`` says what to do about it."""

    check: str
    severity: str
    message: str
    fix: str
    where: str | None = None
    source: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class CheckResult:
    """What one check returns: its findings, and its numbers for :attr:`Diagnosis.stats`. Checks that another
    check depends on return a subclass with that data as fields (never by editing another check's findings)."""

    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Diagnosis:
    """What :func:`diagnose` found. ``str(diagnosis)`` is the plain-text report; ``to_json()`` the same as JSON."""

    target: str
    backend: str
    findings: list[Finding]
    stats: dict[str, Any]
    torch_version: str = torch.__version__

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        """No errors (warnings and info allowed)."""
        return not self.errors

    def of(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]

    def to_dict(self) -> dict[str, Any]:
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}
        return {
            "target": self.target,
            "backend": self.backend,
            "torch": self.torch_version,
            "ok": self.ok,
            "counts": counts,
            "stats": self.stats,
            "findings": [asdict(f) for f in self.findings],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def to_text(self) -> str:
        s = self.stats
        lines = [f"sgdtp diagnose: {self.target} (torch {self.torch_version}, backend {self.backend})"]
        if s.get("graphs") is None and "graphs" in s:
            lines.append("  the step could not be traced (see the errors below)")
        elif "graphs" in s:
            ops = ", ".join(s.get("custom_ops_used") or []) or "none"
            lines.append(
                f"  {s['graphs']} graph(s), {s['graph_breaks']} graph break(s), {s.get('recompiles', 0)}"
                f" recompilation(s); custom ops in the graphs: {ops}"
            )
        if s.get("cache_dir"):
            lines.append(f"  compile cache: {s['cache_dir']}")
        order = {sev: i for i, sev in enumerate(SEVERITIES)}
        for f in sorted(self.findings, key=lambda f: order[f.severity]):
            lines.append("")
            lines.append(f"[{f.severity}] {f.check}: {f.message}")
            if f.where:
                lines.append(f"    at {f.where}")
            if f.source:
                lines.append(f"    | {f.source}")
            lines.append(f"    fix: {f.fix}")
        counts = self.to_dict()["counts"]
        lines.append("")
        lines.append(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info")
        return "\n".join(lines)

    __str__ = to_text
