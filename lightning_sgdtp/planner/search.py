"""The planner, part two: the layouts a job could use, and which of them fit a memory limit. Pure.

:func:`candidate_layouts` lists every dp x tp x pp x sharding whose sizes multiply to the world size and that the
strategy can build today: tensor parallel inside a node (``tp`` divides the devices of one node), at most one stage
per block of the stack, sharding only over data-parallel ranks. Three-dimensional layouts (tensor parallel with
pipeline stages) are not built yet (``NotAvailableYetError`` at setup); they are listed as skipped with that reason,
so the table says why a layout is absent. :func:`plan_memory` predicts each layout's bytes on the fullest rank
(:mod:`~lightning_sgdtp.planner.memory`) and marks those within the limit.

What it does not do yet: predict step time. Until the time model exists, nothing here chooses the fastest layout;
the table is sorted by memory, and a layout that fits is only that: one that fits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_sgdtp.planner.memory import SHARDINGS, Layout, RankMemory, predict_memory

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
TP_NOT_WITH_PP = "tensor parallel with pipeline stages (3-D) is not built yet"


class PlannerInputError(ValueError):
    """A value the planner cannot use; the message names it and the fix."""


def parse_memory(text: str | int) -> int:
    """``"300MB"``, ``"80GB"``, ``"1.5GiB"`` (decimal and binary units, any case) as bytes; an int is bytes."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise PlannerInputError(
            f"memory {text!r}: give a positive number with a unit, e.g. '300MB', '80GB' or '1.5GiB'"
            f" (units: {', '.join(u if len(u) < 3 else u[0] + 'i' + u[2] for u in _UNITS)})"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclass
class Candidate:
    """One layout of the table: its predicted memory, whether it fits, or why it was skipped."""

    layout: Layout
    memory: RankMemory | None = None
    fits: bool | None = None
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": self.layout.describe()}
        if self.skipped:
            out["skipped"] = self.skipped
        if self.memory is not None:
            out.update(self.memory.to_dict(), fits=self.fits)
        return out


def size_text(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``312.0 KiB``, ``1.50 GiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(world_size: int, devices_per_node: int, blocks: int) -> list[Candidate]:
    """Every layout of ``world_size`` ranks: the ones the strategy can build, and the skipped ones with the reason."""
    if world_size < 1 or devices_per_node < 1 or world_size % devices_per_node and world_size > devices_per_node:
        raise PlannerInputError(
            f"world size {world_size} with {devices_per_node} devices per node: the world size must be a multiple of"
            " the devices per node (whole nodes), both >= 1"
        )
    out = []
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            for sharding in SHARDINGS if dp > 1 else ("none",):
                layout = Layout(dp=dp, tp=tp, pp=pp, sharding=sharding)
                reason = None
                if tp > 1 and devices_per_node % tp:
                    reason = f"tensor parallel stays inside a node: tp={tp} does not divide {devices_per_node}"
                elif pp > blocks:
                    reason = f"pp={pp} stages for {blocks} blocks: every stage needs one"
                elif tp > 1 and pp > 1:
                    reason = TP_NOT_WITH_PP
                out.append(Candidate(layout, skipped=reason))
    return out


@dataclass
class MemoryPlan:
    """The candidates with their predicted memory, fitting ones first (least memory first), then the rest."""

    limit: int | None
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.fits]

    def smallest(self) -> Candidate | None:
        built = [c for c in self.candidates if c.memory is not None]
        return min(built, key=lambda c: c.memory.total if c.memory else 0, default=None)

    def to_dict(self) -> dict[str, Any]:
        return {"limit": self.limit, "candidates": [c.to_dict() for c in self.candidates]}

    def describe(self) -> list[str]:
        """One line per layout, for a terminal."""
        limit = f"limit {size_text(self.limit)} per rank" if self.limit else "no memory limit"
        lines = [f"{len(self.fitting)} of {len(self.candidates)} layouts fit ({limit}); step time is not predicted yet"]
        for c in self.candidates:
            if c.memory is None:
                lines.append(f"  {c.layout.describe():<32} skipped: {c.skipped}")
                continue
            m = c.memory
            mark = "fits" if c.fits else "too large"
            lines.append(
                f"  {c.layout.describe():<32} {size_text(m.total):>12} ({mark}): parameters {size_text(m.parameters)},"
                f" gradients {size_text(m.gradients)}, optimizer {size_text(m.optimizer)},"
                f" gathered {size_text(m.gathered)}"
            )
        return lines


def plan_memory(
    module: nn.Module,
    world_size: int,
    devices_per_node: int,
    max_memory_per_rank: str | int | None = None,
    optimizer_states: int = 2,
) -> MemoryPlan:
    """Predict every buildable layout's memory on the fullest rank for ``module`` and mark those within
    ``max_memory_per_rank`` (parameters, gradients, optimizer state and the gathered block; activations are not
    predicted yet, so leave room for them)."""
    from lightning_sgdtp.parallel.checkpointing import find_block_stack

    limit = parse_memory(max_memory_per_rank) if max_memory_per_rank is not None else None
    found = find_block_stack(module)
    blocks = len(list(found[1].children())) if found is not None else 1
    plan = MemoryPlan(limit)
    for candidate in candidate_layouts(world_size, devices_per_node, blocks):
        if candidate.skipped is None:
            candidate.memory = predict_memory(module, candidate.layout, optimizer_states)
            candidate.fits = limit is None or candidate.memory.total <= limit
        plan.candidates.append(candidate)
    plan.candidates.sort(key=lambda c: (c.memory is None, not c.fits, c.memory.total if c.memory else 0))
    return plan


def check_fits(plan: MemoryPlan) -> None:
    """Raise, naming the smallest layout and its predicted memory, when no layout fits the limit."""
    if plan.limit is None or plan.fitting:
        return
    smallest = plan.smallest()
    need = size_text(smallest.memory.total) if smallest and smallest.memory else "unknown"
    raise PlannerInputError(
        f"no layout fits max_memory_per_rank={size_text(plan.limit)}: the smallest,"
        f" {smallest.layout.describe() if smallest else 'none'}, needs {need} per rank before activations. Use more"
        " ranks, a larger limit, or a smaller model."
    )
