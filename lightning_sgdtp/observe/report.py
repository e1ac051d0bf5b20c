"""What the plugin decided, shown to the user: one ``sgdtp:`` line per decision on rank 0, ``strategy.plan`` (plain
data), and ``sgdtp_plan.json`` next to the logs (none without a logger, as ``ddp`` writes none; the ``plan_file``
option names another place), rewritten atomically whenever the plan changes.

The report collects; it decides nothing. Each part of the plan comes from the object that owns the decision:
the layout (sizes, rank grid), the engine (tensor-parallel plan, pipeline split, activation checkpointing, the
graphs' buckets), the gradient sync (fallback parameters, what the last step synced, bytes per step).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sgdtp.compiler.buckets import Bucket, GraphBuckets
from lightning_sgdtp.parallel import TECHNIQUES
from lightning_sgdtp.trust.durable import write_atomically

# A child of Lightning's logger: shown wherever Lightning's own info lines are, silenced with them.
log = logging.getLogger("lightning.pytorch.sgdtp")

PLAN_FILENAME = "sgdtp_plan.json"
#: The parts of the plan whose change rewrites ``sgdtp_plan.json`` (the rest is fixed at setup or per step).
_WATCHED = ("graphs", "fallback_params", "grad_sync", "pipeline", "step_program")


class PlanReport:
    """Log lines on rank 0 and the plan file.

    Args:
        rank: this process's global rank (only rank 0 speaks and writes).
    """

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.folder: Path | None = None  # next to the logs: the timeline's folder (None: the working directory)
        self.plan_path: Path | None = None  # the plan file (None: none is written)
        self.graph_breaks: dict[str, int] = {}
        self._breaks_at_setup: dict[str, int] = {}
        self._announced: set[int] = set()
        self._written: str | None = None
        self._token: Any = None

    def place(self, folder: Path, plan_file: str | Path | bool, logger: bool) -> None:
        """Where this run's files go: ``folder`` is next to the logs (the timeline's); the plan file goes where
        ``plan_file`` (the option) says: a file (or into a folder that exists), none with False, and with ``"auto"``
        into ``folder`` if the run has a logger (``logger``), else nowhere."""
        self.folder = folder
        if plan_file == "auto":
            self.plan_path = folder / PLAN_FILENAME if logger else None
        elif plan_file is False:
            self.plan_path = None
        else:
            path = Path(plan_file).expanduser().absolute()
            self.plan_path = path / PLAN_FILENAME if path.is_dir() else path

    def say(self, message: str) -> None:
        if self.rank == 0:
            log.info(f"sgdtp: {message}")

    # ---------------------------------------------------------------------------------------- graphs
    def count_breaks_from_now(self) -> None:
        """Graph breaks are counted from here (a new compiler: what earlier graphs broke on does not count)."""
        self._breaks_at_setup = _graph_break_counts()

    def announce(self, graph: GraphBuckets, origin: str = "captured") -> None:
        """The line of one compiled backward graph: its buckets, or that it has no in-graph collectives."""
        self._announced.add(graph.graph_id)
        if not graph.in_graph_sync:
            why = f" ({graph.fallback})" if graph.fallback else ""
            self.say(
                f"graph {graph.graph_id} {origin}: {len(graph.params)} parameter gradients, no in-graph collectives"
                + why
            )
            return
        sizes = ", ".join(size(b.wire_bytes) for b in graph.buckets)
        sizing = graph.sizing or {}
        predicted = (
            f"; cost model: backward {sizing['predicted_backward_ms']:.1f} ms, exposed {sizing['predicted_exposed_ms']:.1f}"
            f" ms predicted (one bucket: {sizing['one_bucket_exposed_ms']:.1f} ms)"
            if sizing.get("rule") == "measured"
            else ""
        )
        self.say(
            f"graph {graph.graph_id} {origin}: {len(graph.params)} parameter gradients in {len(graph.buckets)}"
            f" bucket(s) [{sizes}], {size(graph.wire_bytes)} all-reduced per backward{predicted}"
        )

    # ------------------------------------------------------------------------------------------ plan
    def publish(self, plan: Callable[[], dict[str, Any]], token: Any = None) -> None:
        """After an optimizer step: log what is new (graph breaks, graphs taken from a cache), and rewrite the
        plan file when what it says changed. ``token``: a cheap summary of what can change the plan (graphs,
        fallback, ...); while it and the graph breaks stay the same, the plan is not even built (it is not free:
        ~0.5 ms a step)."""
        breaks = _graph_break_counts()
        if token is not None and (token, breaks) == self._token:
            return
        self._token = (token, breaks)
        for reason, count in breaks.items():
            new = count - self._breaks_at_setup.get(reason, 0)
            if new > 0:
                short = short_reason(reason)
                if short not in self.graph_breaks:
                    self.say(f"graph break: {short}")
                self.graph_breaks[short] = new
        current = plan()
        for graph in current["graphs"]:
            if graph["graph_id"] not in self._announced:
                self.announce(graph_from_dict(graph), origin="taken from the compile cache")
        key = json.dumps({k: current[k] for k in _WATCHED}, sort_keys=True, default=str)
        if self.rank != 0 or key == self._written:
            return
        if self._written is None:
            b = current["bytes_per_step"]
            self.say(f"bytes communicated per step: {size(b['in_graph'])} in-graph + {size(b['fallback'])} fallback")
        self._written = key
        if self.plan_path is None:
            return
        self.plan_path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(current, indent=2, sort_keys=True, default=str)
        write_atomically(self.plan_path, lambda f: f.write(text.encode()))


def plan_dict(
    config: Any,
    layout: Any | None,
    engine: Any | None,
    graph_breaks: dict[str, int],
    *,
    world_size: int,
    dp_size: int,
    num_nodes: int,
    process_group_backend: str | None,
    planner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``strategy.plan``: each part from the object that decided it (layout, engine, its gradient sync; the
    planner's table with ``parallelism="auto"``)."""
    sync = engine.grad_sync if engine is not None else None
    ledger = sync.ledger if sync is not None else None
    in_graph = ledger.graph_bytes_last_step if ledger else 0
    fallback = ledger.fallback_bytes_last_step if ledger else 0
    parts = engine.plan() if engine is not None else {}
    if sync is not None:
        grad_sync = sync.describe(world_size, dp_size, config.pipelined)
    else:
        grad_sync = "none (one process)" if world_size == 1 else "in-graph"
    return {
        "parallelism": config.parallelism,
        "world_size": world_size,
        "dp_size": dp_size,
        "tp_size": layout.tp if layout is not None else 1,
        # every registered technique: its axis and size, its options
        "techniques": {t.name: t.report(config, layout) for t in TECHNIQUES},
        "mesh_layout": layout.grid if layout is not None else None,
        "tensor_parallel_plan": parts.get("tensor_parallel_plan"),
        # what tensor parallel divides: split_fraction, held_fraction (of the parameter bytes), ...
        "tensor": parts.get("tensor"),
        "pipeline": parts.get("pipeline"),
        "sharding": parts.get("sharding"),
        "part_plan": parts.get("part_plan"),
        "num_nodes": num_nodes,
        "process_group_backend": process_group_backend,
        "config": config.to_dict(),
        "grad_sync": grad_sync,
        "activation_checkpointing": parts.get("activation_checkpointing", []),
        "graphs": parts.get("graphs", []),
        "graph_breaks": dict(graph_breaks),
        "fallback_params": list(sync.fallback_params) if sync is not None else [],
        "last_step_sync": dict(ledger.last_step) if ledger else {},
        "bytes_per_step": {"in_graph": in_graph, "fallback": fallback, "total": in_graph + fallback},
        "step_program": engine.program() if engine is not None else None,
    } | ({"planner": planner} if planner is not None else {})


def graph_from_dict(d: dict[str, Any]) -> GraphBuckets:
    buckets = [Bucket(**{k: v for k, v in b.items() if k in Bucket.__dataclass_fields__}) for b in d["buckets"]]
    fields = {k: v for k, v in d.items() if k in GraphBuckets.__dataclass_fields__ and k != "buckets"}
    return GraphBuckets(**fields, buckets=buckets)


def _graph_break_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def short_reason(reason: str) -> str:
    """Dynamo's graph-break reasons are paragraphs; keep the headline and the explanation, without memory
    addresses (``<function f at 0x7f...>``), so that plans of two runs compare equal."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    short = " ".join(x for x in (lines[0] if lines else reason, explanation) if x)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", short)
