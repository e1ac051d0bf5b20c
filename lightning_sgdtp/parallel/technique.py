"""The one interface every parallelism declares itself through, so that one more technique is added in one place.

A technique (tensor parallel, sharding, activation checkpointing, pipeline stages; context and expert parallel
next) is an object of a :class:`Technique` subclass, registered in :data:`lightning_sgdtp.parallel.TECHNIQUES`. It
declares its options and their checks, its mesh axis (:class:`Axis`) if it has one, its plan and apply steps and
what the planner searches. Config, ``ParallelDims``, the planner's search, the plan report and the compile-cache
key loop over the registered techniques instead of naming each one; ``engine/parallelize.py`` stays the explicit
recipe, one line per technique.

This module is plain data and default methods: it imports nothing of the package, and a technique imports neither
the options (``config``), the planner nor the front ends. A check receives the options object and reads its
fields by name; it returns a :class:`Problem` (the message names the option and the fix) that config raises.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class Axis:
    """A technique's dimension of the rank grid.

    ``name``: the mesh dimension (``"tp"``); ``position``: its place in the grid, larger is inner (consecutive
    ranks: the fastest links); ``splits_batch``: its ranks read different samples (the batch is split over it);
    ``averages_grads``: gradients are averaged over it; ``fast_links``: it must lie on one node's fast links."""

    name: str
    position: int
    splits_batch: bool = False
    averages_grads: bool = False
    fast_links: bool = False


@dataclass(frozen=True)
class Problem:
    """What is wrong with a technique's options, and the fix. ``later``: the combination is valid but not built
    yet (config raises ``NotAvailableYetError`` instead of ``SGDTPConfigError``)."""

    message: str
    later: bool = False


class Technique:
    """One parallelism. Subclasses set the class attributes and override the steps they take part in; every
    method has a do-nothing default, so a technique declares only what it does.

    ``name``: how the plan and the report name it; ``axis``: its mesh axis (None: it divides no ranks);
    ``fields``: its option names (fields of the options object); ``defaults``: the default of each option the
    options object has no field for (a technique that declares its own options); ``graph_fields``: the options that
    change the compiled graphs (part of the compile-cache key); ``searched``: whether the planner enumerates the
    axis's sizes."""

    name: ClassVar[str] = ""
    axis: ClassVar[Axis | None] = None
    fields: ClassVar[tuple[str, ...]] = ()
    defaults: ClassVar[dict[str, Any]] = {}
    graph_fields: ClassVar[tuple[str, ...]] = ()
    #: The planner searches this axis's sizes (False: it searches the technique another way, e.g. sharding's modes).
    searched: ClassVar[bool] = True

    # ------------------------------------------------------------------------------------------- options
    def check(self, config: Any) -> Problem | None:
        """The first problem of this technique's options in ``config`` (None: they are valid)."""
        return None

    def size(self, config: Any, dims: Any) -> int:
        """The ranks of this technique's axis in ``dims`` (a ``ParallelDims``); 1 without an axis."""
        return dims.size(self.axis.name) if self.axis is not None else 1

    def report(self, config: Any, dims: Any) -> dict[str, Any]:
        """This technique in the plan (``strategy.plan["techniques"]``): its axis and size, its options."""
        out: dict[str, Any] = {"options": {f: getattr(config, f) for f in self.fields}}
        if self.axis is not None:
            out.update(axis=self.axis.name, size=self.size(config, dims) if dims is not None else 1)
        return out

    # --------------------------------------------------------------------------------------- plan, apply
    def plan(self, config: Any, dims: Any, module: Any, part: str) -> Any | None:
        """Pure: this technique's piece of a part's plan (None: nothing to apply)."""
        return None

    def apply(self, part: Any, piece: Any, dims: Any) -> list[str]:
        """Apply ``piece`` to ``part`` in place; the rank-0 log lines."""
        return []

    def per_step(self, piece: Any, dims: Any) -> AbstractContextManager[Any] | None:
        """What each training step runs under (e.g. a batch split by sequence); None: nothing."""
        return None

    # ------------------------------------------------------------------------------------------- planner
    def sizes(self, world_size: int, devices_per_node: int, blocks: int) -> Sequence[int]:
        """The sizes of this technique's axis the planner searches, each dividing ``world_size`` (the ranks left
        by the axes searched before it)."""
        return (1,)

    def refuses(self, size: int, devices_per_node: int, blocks: int) -> str | None:
        """Why the planner leaves a size out (the table shows the reason), or None."""
        return None

    def traffic(self, layout: Any, activation_bytes: float) -> float:
        """Bytes this technique sends per step and rank in ``layout`` beyond what the planner's cost model counts
        (0: nothing, or counted there); ``activation_bytes``: one activation of the rank's batch. The cost model
        prices them over the link of the technique's axis (``StepTime.technique_sends``)."""
        return 0.0


def divisors(n: int) -> list[int]:
    """The sizes an axis of ``n`` ranks can take: every divisor of ``n``, smallest first."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_all(techniques: Sequence[Technique], config: Any) -> Problem | None:
    """The first problem of any technique's options (in the order given), or None."""
    for technique in techniques:
        problem = technique.check(config)
        if problem is not None:
            return problem
    return None


def option_names(techniques: Sequence[Technique]) -> tuple[str, ...]:
    """Every technique's option names, in order, once each."""
    return tuple(dict.fromkeys(f for t in techniques for f in t.fields))


def own_defaults(techniques: Sequence[Technique]) -> dict[str, Any]:
    """The defaults of the options the techniques declare themselves (no field of the options object)."""
    return {k: v for t in techniques for k, v in t.defaults.items()}


def searched_axes(techniques: Sequence[Technique]) -> list[Technique]:
    """The techniques whose axis the planner searches, innermost first (the enumeration's order)."""
    return sorted((t for t in techniques if t.axis is not None and t.searched), key=lambda t: -t.axis.position)  # type: ignore[union-attr]
