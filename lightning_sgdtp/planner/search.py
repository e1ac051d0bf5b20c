"""The planner, part two: every layout a job could use, what each costs, and the fastest one that fits. Pure.

:func:`candidate_layouts` lists every dp x tp x pp x sharding whose sizes multiply to the world size, with the
reason a layout is left out: tensor parallel across nodes (``tp`` must divide the devices of one node), more stages
than blocks, sharding without data-parallel ranks. Layouts the strategy does not build yet (tensor parallel with
pipeline stages; hybrid sharding with pipeline stages) are predicted like the others and marked, so the table shows what they would give; the
strategy never picks them.

:func:`plan` adds what the layout leaves open (activation checkpointing where it is built, the pipeline's
micro-batches, hybrid sharding inside a node) and predicts for each: the memory on the fullest rank
(:mod:`~lightning_sgdtp.planner.memory`, plus the activations of :mod:`~lightning_sgdtp.planner.cost`) and the
step time (:func:`~lightning_sgdtp.planner.cost.step_time`). The layouts that fit come first, the fastest first:
fastest per sample, because a layout's global batch is ``dp`` x the batch each rank loads (tensor-parallel and
pipeline ranks share their samples), so fewer data-parallel ranks train on fewer samples per step. Options the
user set stay fixed (``fixed``: ``{"tp": 2}``, ``{"sharding": "full"}``, ``{"checkpointing": False}``, ...).

A layout fits when both of its peaks do: the training one (``RankMemory.total``) and the setup one
(``RankMemory.setup``): a model built whole (``materialized``) sits whole on every rank before it is split, so no
layout fits a limit below the whole model; built on the meta device, each rank allocates only its part. The plan
says which way it assumed and what the other would need (:meth:`Plan.setup_lines`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from lightning_sgdtp.parallel import TECHNIQUES
from lightning_sgdtp.parallel.pipeline.schedules import SCHEDULES, check_chunks
from lightning_sgdtp.parallel.technique import Technique, searched_axes
from lightning_sgdtp.planner.cost import (
    Hardware,
    ModelProfile,
    Schedule,
    StepTime,
    activation_bytes,
    step_time,
    tp_split_fraction,
)
from lightning_sgdtp.planner.inputs import FIXABLE, world_problem
from lightning_sgdtp.planner.memory import (
    SHARDINGS,
    Layout,
    RankMemory,
    is_materialized,
    model_bytes,
    predict_memory,
)
from lightning_sgdtp.planner.units import PlannerInputError, parse_memory, size_text, time_text

CKPT_NOT_WITH_TP = "activation checkpointing with tensor parallel is not built yet (torch 2.13's AOTAutograd)"
#: Where the docs explain the setup peak and building the model on the meta device.
SETUP_DOC = "docs/big-models.md"


@dataclass
class Candidate:
    """One row of the table: a layout and its schedule, predicted memory and time, whether it fits, and why it
    is left out or not built (``skipped``; ``built`` False: predicted, never chosen)."""

    layout: Layout
    schedule: Schedule = field(default_factory=Schedule)
    memory: RankMemory | None = None
    time: StepTime | None = None
    fits: bool | None = None
    skipped: str | None = None
    built: bool = True

    @property
    def choosable(self) -> bool:
        return self.built and self.skipped is None and bool(self.fits)

    def describe(self) -> str:
        text = self.layout.describe()
        if self.layout.pp > 1 and self.time is not None:
            text += f", {self.schedule.micro_batches} micro-batches{self.schedule.describe()}"
        return text + (", checkpointing" if self.schedule.checkpointing else "")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": self.describe(), "built": self.built}
        if self.skipped:
            out["skipped"] = self.skipped
        if self.memory is not None:
            out["memory"] = self.memory.to_dict()
            out["fits"] = self.fits
        if self.time is not None:
            out["step_s"] = self.time.to_dict()
            out["seconds_per_sample"] = self.time.seconds_per_sample
        return out


def candidate_layouts(world_size: int, devices_per_node: int, blocks: int) -> list[Candidate]:
    """Every layout of ``world_size`` ranks: the ones the strategy can build, the ones it cannot yet (``built``
    False, with the reason) and the impossible ones (``skipped``, with the reason)."""
    problem = world_problem(world_size, devices_per_node)  # the front doors check first (check_inputs): a guard
    if problem:
        raise PlannerInputError(problem)
    out = []
    for sizes, skipped in _axis_sizes(searched_axes(TECHNIQUES), world_size, devices_per_node, blocks):
        dp = world_size // math.prod(sizes.values())
        named = {k: v for k, v in sizes.items() if k in ("tp", "pp")}
        axes = tuple((k, v) for k, v in sizes.items() if k not in named)
        for sharding in SHARDINGS if dp > 1 else ("none",):
            out.append(Candidate(Layout(dp=dp, sharding=sharding, axes=axes, **named), skipped=skipped))
    return out


def _axis_sizes(
    techniques: list[Technique], world_size: int, devices_per_node: int, blocks: int
) -> Iterator[tuple[dict[str, int], str | None]]:
    """Every combination of the searched axes' sizes (innermost first, each dividing the ranks the axes before it
    leave), with the first reason one of them is left out (None: none)."""
    if not techniques:
        yield {}, None
        return
    first, rest = techniques[0], techniques[1:]
    assert first.axis is not None
    for size in first.sizes(world_size, devices_per_node, blocks):
        if world_size % size:
            continue
        refused = first.refuses(size, devices_per_node, blocks)
        for sizes, skipped in _axis_sizes(rest, world_size // size, devices_per_node, blocks):
            yield {first.axis.name: size, **sizes}, refused or skipped


def _heads_problem(module: nn.Module, tp: int, checked: dict[int, str | None]) -> str | None:
    """Why tensor parallel over ``tp`` ranks cannot split ``module`` (the strategy refuses it at setup): a query head
    count it does not divide; None when it can. ``checked``: the answers so far, by tp."""
    if tp not in checked:
        from lightning_sgdtp.parallel.tensor.plan import auto_plan

        counts = sorted(auto_plan(module, tp).indivisible_heads)
        checked[tp] = f"tp={tp} does not divide the query heads ({', '.join(map(str, counts))})" if counts else None
    return checked[tp]


def _schedules(layout: Layout, batch: int, devices_per_node: int, blocks: int) -> list[tuple[Layout, Schedule]]:
    """What a layout leaves open: checkpointing (of a block stack; with tensor parallel it is predicted and marked
    not built), micro-batches (stages x 1, 2, 4, 8, or one sample
    each: whole samples dividing the batch, at least one per stage as 1F1B needs; none: the batch is too small for
    the pipeline), hybrid sharding over one node's ranks."""
    layouts = [layout]
    per_node = devices_per_node // layout.tp
    if layout.sharding != "none" and 1 < per_node < layout.dp and layout.dp % per_node == 0:
        layouts.append(replace(layout, shard_size=per_node))
    chunks = [1]
    pipelines = [("1f1b", 1)]
    if layout.pp > 1:
        options = {k * layout.pp for k in (1, 2, 4, 8)} | {batch}
        chunks = sorted(m for m in options if batch % m == 0 and m >= layout.pp)
        # GPipe: 1F1B's bubble with every micro-batch in flight; interleaved: 2 stages per rank, where the blocks
        # allow it (each stage needs one)
        pipelines += [("gpipe", 1)] + ([("interleaved_1f1b", 2)] if 2 * layout.pp <= blocks else [])
    return [
        (lay, Schedule(checkpointing=ckpt, micro_batches=m, pipeline=name, stages_per_rank=v))
        for lay in layouts
        for ckpt in ((False, True) if blocks > 1 else (False,))
        for m in chunks
        for name, v in pipelines
        if not check_chunks(name, m, layout.pp, layout.pp * v)
    ]


def _matches(layout: Layout, schedule: Schedule, fixed: dict[str, Any], devices_per_node: int) -> bool:
    """Whether a row keeps what the user fixed; ``shard_size``: a number of ranks, or ``"node"`` (the
    data-parallel ranks of one node: all of them when the data-parallel group fits in one node)."""
    values = {**vars(layout), **vars(schedule)}
    for key, want in fixed.items():
        if key == "shard_size" and want == "node":
            per_node = max(devices_per_node // layout.tp, 1)
            want = None if layout.dp <= per_node else per_node
        if values[key] != want:
            return False
    return True


@dataclass
class Plan:
    """The table: every candidate with its prediction, the choosable ones first (fastest per sample first).
    ``materialized``: planned for a model built whole on every rank (else built on the meta device); ``whole``: the
    whole model's parameter and buffer bytes, what each rank holds at setup when it is built whole."""

    limit: int | None
    hardware: Hardware
    model: ModelProfile
    candidates: list[Candidate] = field(default_factory=list)
    global_batch: int | None = None
    materialized: bool = False
    whole: int = 0

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.choosable]

    @property
    def best(self) -> Candidate | None:
        return self.fitting[0] if self.fitting else None

    def smallest(self) -> Candidate | None:
        built = [c for c in self.candidates if c.memory is not None and c.built]
        return min(built, key=lambda c: (c.memory.peak, c.memory.total) if c.memory else (0, 0), default=None)

    def _against_limit(self, n: int) -> str:
        if self.limit is None:
            return ""
        return f", fits {size_text(self.limit)}" if n <= self.limit else f", does not fit {size_text(self.limit)}"

    def setup_lines(self, c: Candidate) -> list[str]:
        """The setup peak per rank of ``c`` the way this plan assumes the model is built, and what the other way
        needs: built whole, every rank holds all of it before the split; built on the meta device, each rank
        materializes its part (its parameters on that layout)."""
        if c.memory is None:
            return []
        part, whole = size_text(c.memory.parameters), size_text(self.whole)
        on_meta = "each rank materializes its part"
        if not self.materialized:
            return [
                f"setup peak per rank: {part} (model built on the meta device: {on_meta})",
                f"built whole instead: {whole} on every rank{self._against_limit(self.whole)} ({SETUP_DOC})",
            ]
        fix = f": build it on the meta device ({SETUP_DOC})" if self.limit and self.whole > self.limit else ""
        held = f"all of it on every rank before the split{self._against_limit(self.whole)}"
        return [
            f"setup peak per rank: {whole} (model built whole: {held}){fix}",
            f"built on the meta device instead: {part} per rank ({on_meta})",
        ]

    def why(self) -> str:
        """Why the winner won, against the runner-up: the parts of the step that differ most."""
        fit = self.fitting
        if not fit:
            return "no layout fits"
        if len(fit) == 1:
            return "the only layout that fits"
        a, b = fit[0].time, fit[1].time
        assert a is not None and b is not None
        per_a, per_b = a.to_dict(), b.to_dict()
        parts = [k for k in per_a if k not in ("total", "samples")]
        diff = max(parts, key=lambda k: per_b[k] / b.samples - per_a[k] / a.samples)
        ratio = b.seconds_per_sample / max(a.seconds_per_sample, 1e-30)
        if ratio < 1.01:
            tie = ", without recompute" if fit[1].schedule.checkpointing > fit[0].schedule.checkpointing else ""
            return f"as fast as the next per sample (within 1%){tie}"
        return f"{ratio:.2f}x faster per sample than the next, mostly {diff.replace('_', ' ')}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "hardware": self.hardware.name,
            "model": vars(self.model),
            "global_batch": self.global_batch,
            "materialized": self.materialized,
            "whole_model_bytes": self.whole,
            "chosen": self.best.to_dict() if self.best else None,
            "why": self.why(),
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def line(self, c: Candidate, width: int = 52) -> str:
        """One row of the table; ``width``: the layout column's (the longest name shown)."""
        if c.memory is None or c.time is None:
            return f"  {c.describe():<{width}} skipped: {c.skipped}"
        too_large = "too large" if self.limit is None or c.memory.total > self.limit else "too large at setup"
        mark = "fits" if c.fits else too_large
        mark += "" if c.built else f"; not built: {c.skipped}"
        per = c.time.seconds_per_sample
        return (
            f"  {c.describe():<{width}} {time_text(c.time.total):>9}/step {time_text(per):>9}/sample"
            f" {size_text(c.memory.total):>11} ({mark})"
        )

    def describe(self, rows: int | None = None) -> list[str]:
        """The table for a terminal: the choice, why, then one line per layout (``rows`` of them)."""
        limit = f"limit {size_text(self.limit)} per rank" if self.limit else "no memory limit"
        batch = (
            f"global batch {self.global_batch} x {self.model.tokens} tokens"
            if self.global_batch
            else f"{self.model.batch} sample(s) of {self.model.tokens} tokens per replica"
        )
        fit = len(self.fitting)
        head = [f"{fit} of {len(self.candidates)} layouts fit and are built ({limit}; {self.hardware.name}; {batch})"]
        if self.best:
            head.append(f"chosen: {self.best.describe()}: {self.why()}")
        else:
            smallest = self.smallest()
            need = f", needs {size_text(smallest.memory.peak)}" if smallest and smallest.memory else ""
            head.append(
                f"none chosen: no built layout fits; the smallest, {smallest.describe() if smallest else 'none'}{need}"
            )
        shown_setup = self.best or self.smallest()
        head += self.setup_lines(shown_setup) if shown_setup else []
        shown = self.candidates if rows is None else self.candidates[:rows]
        width = max([52, *(len(c.describe()) for c in shown)])
        return head + [self.line(c, width) for c in shown]


def plan(
    module: nn.Module,
    model: ModelProfile,
    hardware: Hardware,
    world_size: int,
    devices_per_node: int,
    max_memory_per_rank: str | int | None = None,
    optimizer_states: int = 2,
    fixed: dict[str, Any] | None = None,
    global_batch: int | None = None,
    materialized: bool | None = None,
) -> Plan:
    """Every layout of ``world_size`` ranks for ``module`` (``model``: its profile and batch), predicted; the
    ones that fit ``max_memory_per_rank`` (default: the hardware's memory) and that the strategy builds first,
    fastest per sample first. ``fixed``: layout and schedule fields the user set (:data:`FIXABLE`).

    ``global_batch``: samples per step over all replicas, the same for every layout (each replica then runs
    ``global_batch / dp``: how Megatron and torchtitan compare layouts). Without it each data-parallel replica
    runs ``model.batch`` samples (a Lightning DataLoader's batch), whatever ``dp`` is.

    ``materialized``: the model is built whole on every rank (its setup peak: the whole model), or on the meta
    device (each rank materializes its part); None: whole unless ``module``'s parameters are on the meta device."""
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(FIXABLE)
    if unknown:
        raise PlannerInputError(f"cannot fix {sorted(unknown)}: the planner's fields are {list(FIXABLE)}")
    if fixed.get("pipeline", "1f1b") not in SCHEDULES:
        raise PlannerInputError(f"cannot fix pipeline={fixed['pipeline']!r}: the schedules are {list(SCHEDULES)}")
    given = max_memory_per_rank if max_memory_per_rank is not None else hardware.memory_bytes
    limit = parse_memory(given) if given is not None else None
    if materialized is None:
        materialized = is_materialized(module)
    result = Plan(
        limit, hardware, model, global_batch=global_batch, materialized=materialized, whole=model_bytes(module)
    )
    memory: dict[Layout, RankMemory] = {}
    split: dict[tuple[int, bool], float] = {}
    heads_checked: dict[int, str | None] = {}
    for candidate in candidate_layouts(world_size, devices_per_node, model.blocks):
        sizes = {k: v for k, v in fixed.items() if k in ("dp", "tp", "pp", "sharding")}
        if any(getattr(candidate.layout, k) != v for k, v in sizes.items()):
            continue  # a layout the user's options exclude, listed or not
        if candidate.built and not candidate.skipped and candidate.layout.tp > 1:
            candidate.skipped = _heads_problem(module, candidate.layout.tp, heads_checked)
        if candidate.skipped and candidate.built:
            result.candidates.append(candidate)
            continue
        batch = model.batch
        if global_batch is not None:
            batch = global_batch // candidate.layout.dp
            if batch < 1 or global_batch % candidate.layout.dp:
                if candidate.built and not candidate.skipped:
                    candidate.skipped = f"global batch {global_batch} does not divide over dp={candidate.layout.dp}"
                    result.candidates.append(candidate)
                continue
        schedules = _schedules(candidate.layout, batch, devices_per_node, model.blocks)
        if not schedules and candidate.built and not candidate.skipped:
            candidate.skipped = (
                f"{batch} sample(s) per replica for {candidate.layout.pp} stages: 1F1B needs one per stage"
            )
            result.candidates.append(candidate)
        for layout, schedule in schedules:
            if not _matches(layout, schedule, fixed, devices_per_node):
                continue
            row = Candidate(layout, schedule, skipped=candidate.skipped, built=candidate.built)
            if layout.tp > 1 and schedule.checkpointing and row.built:
                row.skipped, row.built = CKPT_NOT_WITH_TP, False
            if layout not in memory:
                memory[layout] = predict_memory(module, layout, optimizer_states, materialized)
            unsharded = replace(layout, sharding="none", shard_size=None)
            if unsharded not in memory:
                memory[unsharded] = predict_memory(module, unsharded, optimizer_states)
            profile = model.with_batch(batch)
            acts = activation_bytes(profile, layout, hardware, schedule)
            row.memory = replace(memory[layout], activations=acts)
            row.fits = limit is None or row.memory.peak <= limit  # the training peak and the setup one
            held = memory[unsharded].parameters
            key = (layout.tp, layout.sharding != "none")
            if key not in split:
                split[key] = tp_split_fraction(module, layout)
            row.time = step_time(profile, layout, hardware, devices_per_node, held, schedule, split[key])
            result.candidates.append(row)
    result.candidates.sort(
        key=lambda c: (
            not c.choosable,
            c.memory is None,
            c.time.seconds_per_sample if c.time else 0.0,
            c.schedule.checkpointing,  # at equal time, no recompute
            c.schedule.pipeline != "1f1b",  # and the default schedule
            c.memory.total if c.memory else 0,
        )
    )
    return result


def check_a_layout_is_left(result: Plan, world_size: int, fixed: dict[str, Any]) -> None:
    """Raise, naming the fixed options and why each layout they keep is left out, when they keep no built layout."""
    if not any(c.built and c.time is not None for c in result.candidates):
        reasons = sorted({c.skipped for c in result.candidates if c.skipped}) or ["none"]
        raise PlannerInputError(
            f"no layout of {world_size} ranks keeps your options {fixed}: {'; '.join(reasons)}. Remove or change the"
            " options that fix the layout."
        )


def check_fits(result: Plan) -> None:
    """Raise, naming the smallest built layout and its predicted memory, when none fits the limit; when the whole
    model, built on every rank, is what does not fit, naming that and the fix (build it on the meta device)."""
    if result.limit is None or result.fitting:
        return
    if result.materialized and result.whole > result.limit:
        raise PlannerInputError(_whole_does_not_fit(result))
    smallest = result.smallest()
    need = size_text(smallest.memory.total) if smallest and smallest.memory else "unknown"
    raise PlannerInputError(
        f"no layout fits max_memory_per_rank={size_text(result.limit)}: the smallest,"
        f" {smallest.describe() if smallest else 'none'}, needs {need} per rank (activations included). Use more"
        " ranks, a larger limit, a smaller batch per rank, or a smaller model."
    )


def _whole_does_not_fit(result: Plan) -> str:
    """The message when the model built whole does not fit: what each rank would need built on the meta device."""
    assert result.limit is not None
    built = [c for c in result.candidates if c.memory is not None and c.built]
    smallest = min(built, key=lambda c: c.memory.total if c.memory else 0, default=None)
    text = (
        f"no layout fits max_memory_per_rank={size_text(result.limit)}: the model is built whole, so every rank holds"
        f" all of it ({size_text(result.whole)}) at setup, before it is split. Build it on the meta device, so that"
        f" each rank materializes only its part ({SETUP_DOC})"
    )
    if smallest is None or smallest.memory is None:
        return text + "."
    text += f"; the smallest layout, {smallest.describe()}, then needs {size_text(smallest.memory.total)} per rank"
    if smallest.memory.total > result.limit:
        text += " (activations included), more than the limit too: use more ranks, a larger limit or a smaller batch"
    return text + "."
