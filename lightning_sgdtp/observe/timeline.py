"""A timeline of a few training steps (option ``profile_steps``): torch.profiler on every rank, then a breakdown.

``SGDTPStrategy(profile_steps=(10, 12))`` records optimizer steps 10 to 12 (inclusive) on every rank and writes into
``sgdtp_timeline/`` next to the logs:

- ``rank{R}.trace.json``: torch.profiler's Chrome trace of this rank (open it in https://ui.perfetto.dev or
  ``chrome://tracing``): every op, each gradient bucket's all-reduce on the communication threads, the labels the
  strategy adds (``sgdtp: ...``);
- ``rank{R}.steps.json``: the breakdown of each recorded step, computed from that trace by :func:`breakdown`;
- ``timeline.html`` (rank 0): the breakdown of every rank as a table, and one step of rank 0 as lanes
  (compute, each bucket's all-reduce from launch to wait, exposed communication, the optimizer's update).

The drawing is a few SVG rectangles over intervals the profiler measured; the trace is the full picture, drawn by
Perfetto. The breakdown's terms (per step, milliseconds):

- ``step``: from the first ``training_step`` of the optimizer step to the end of the optimizer step;
- ``forward_backward``: Lightning's closure (training step, backward, the hooks in between);
- ``optimizer_update``: the optimizer step without the closure: the update, with Lightning's
  ``on_before_optimizer_step`` and gradient clipping;
- ``exposed_comm``: time the main thread waits for communication (in-graph bucket waits, the fallback, the
  agreement, eager collectives);
- ``comm_busy``: time the communication threads (gloo) or kernels (NCCL) are busy; ``hidden`` = 1 - exposed / busy;
- ``strategy``: the strategy's own per-step work outside the compiled graphs (autograd-graph walk, agreement,
  fallback, coverage proof, plan file), not counting waits inside it;
- ``buckets``: each in-graph all-reduce: launch, start and end on the wire, wait.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_sgdtp.trust.durable import write_atomically

FOLDER = "sgdtp_timeline"
STEP_LABEL = "sgdtp: step"
CLOSURE_LABEL = "sgdtp: training_step + backward"
OPTIMIZER_LABEL = "sgdtp: optimizer step"
#: Events on the main thread during which it waits for communication.
WAIT_NAMES = ("_c10d_functional::wait_tensor", "sgdtp: wait", "c10d::allreduce_", "c10d::broadcast_", "c10d::barrier")
LAUNCH_NAMES = ("_c10d_functional::all_reduce_", "_c10d_functional::all_reduce")


def label(name: str) -> contextlib.AbstractContextManager:
    """A span named ``name`` in the trace (nearly free when no profiler runs)."""
    return torch.profiler.record_function(name)


def labelled(fn: Callable[[], Any], name: str) -> Callable[[], Any]:
    """``fn`` run inside a span named ``name``."""

    def run() -> Any:
        with label(name):
            return fn()

    return run


class Timeline:
    """Starts and stops torch.profiler around optimizer steps ``first`` .. ``last`` and writes the outputs.

    Args:
        steps: ``(first, last)`` optimizer steps, inclusive.
        folder: where the run's logs go (called when writing: known only once the trainer set it).
        rank: this process's global rank.
        say: logs one line on rank 0.
    """

    def __init__(
        self, steps: tuple[int, int], folder: Callable[[], Path], rank: int, say: Callable[[str], None]
    ) -> None:
        self.first, self.last = steps
        self.folder, self.rank, self.say = folder, rank, say
        self._profiler: Any = None
        self._step: Any = None
        self.outputs: dict[str, Any] | None = None

    @property
    def recording(self) -> bool:
        return self._profiler is not None

    def step_begins(self, step: int) -> None:
        """Called at every ``training_step`` (several per optimizer step with accumulation)."""
        if self.outputs is not None or not self.first <= step <= self.last or self._step is not None:
            return
        if self._profiler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.__enter__()
        self._step = label(f"{STEP_LABEL} {step}")
        self._step.__enter__()

    def step_ends(self, step: int) -> None:
        """Called after each optimizer step."""
        if self._step is None:
            return
        self._step.__exit__(None, None, None)
        self._step = None
        if step >= self.last:
            self._write()

    def close(self) -> None:
        """End of fit: a recording still open (fit ended inside the range) is written."""
        if self._step is not None:
            self._step.__exit__(None, None, None)
            self._step = None
        if self._profiler is not None:
            self._write()

    def _write(self) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        folder = self.folder() / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        # Every file appears whole or not at all (staged, then renamed): rank 0's page reads the other ranks' files
        # while they may still be writing them.
        trace = folder / f"rank{self.rank}.trace.json"
        staged = folder / f".{trace.name}.tmp-{os.getpid()}"
        try:
            profiler.export_chrome_trace(str(staged))
            events = json.loads(staged.read_text())["traceEvents"]
            os.replace(staged, trace)
        finally:
            staged.unlink(missing_ok=True)
        steps = breakdown(events)
        write_atomically(
            folder / f"rank{self.rank}.steps.json", lambda f: f.write(json.dumps(steps, indent=1).encode())
        )
        self.outputs = {"folder": str(folder), "trace": str(trace), "summaries": [s["summary"] for s in steps]}
        if self.rank == 0:
            page = folder / "timeline.html"
            html_text = render_html(folder, steps)
            write_atomically(page, lambda f: f.write(html_text.encode()))
            self.outputs["html"] = str(page)
            s = steps[len(steps) // 2]["summary"] if steps else {}
            self.say(
                f"timeline of steps {self.first}..{self.last}: {page} (traces for Perfetto: {folder}/rank*.trace.json);"
                f" step {s.get('step_ms', 0):.1f} ms, exposed communication {s.get('exposed_comm_ms', 0):.1f} ms,"
                f" optimizer update {s.get('optimizer_update_ms', 0):.1f} ms"
            )

    def describe(self) -> dict[str, Any]:
        """``plan["timeline"]``."""
        return {"steps": [self.first, self.last], **(self.outputs or {"written": False})}


# --------------------------------------------------------------------------------------------- analysis
def _spans(events: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            yield e


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def breakdown(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ``sgdtp: step N`` span of a Chrome trace broken down (see the module docstring); times in ms."""
    spans = list(_spans(events))
    steps = sorted((e for e in spans if e["name"].startswith(STEP_LABEL)), key=lambda e: e["ts"])
    main = {(e["pid"], e["tid"]) for e in steps}
    out = []
    for step in steps:
        t0, t1 = step["ts"], step["ts"] + step["dur"]

        def inside(e: dict[str, Any], t0: float = t0, t1: float = t1) -> bool:
            return t0 <= e["ts"] and e["ts"] + e["dur"] <= t1

        on_main = [e for e in spans if (e["pid"], e["tid"]) in main and inside(e)]
        elsewhere = [e for e in spans if (e["pid"], e["tid"]) not in main and t0 <= e["ts"] < t1]
        closures = [e for e in on_main if e["name"] == CLOSURE_LABEL]
        optimizer = [e for e in on_main if e["name"] == OPTIMIZER_LABEL]
        waits = [(e["ts"], e["ts"] + e["dur"]) for e in on_main if e["name"] in WAIT_NAMES]
        comm = [
            e
            for e in elsewhere
            if e["name"].startswith(("gloo:", "nccl:")) or "nccl" in e["name"].lower() and e.get("cat") == "kernel"
        ]
        own = ("sgdtp: before backward", "sgdtp: after backward", "sgdtp: coverage", "sgdtp: publish plan")
        strategy = [(e["ts"], e["ts"] + e["dur"]) for e in on_main if e["name"] in own]
        closure_ms = sum(e["dur"] for e in closures) / 1e3
        update_ms = sum(e["dur"] for e in optimizer) / 1e3 - closure_ms if optimizer else 0.0
        exposed = _union(waits) / 1e3
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in comm]) / 1e3
        strategy_ms = max(0.0, (_union(strategy) - _union(_clip(waits, strategy))) / 1e3)
        launches = sorted((e for e in on_main if e["name"] in LAUNCH_NAMES), key=lambda e: e["ts"])
        bucket_waits = sorted(
            (e for e in on_main if e["name"] == "_c10d_functional::wait_tensor"), key=lambda e: e["ts"]
        )
        wire = sorted((e for e in comm if "all_reduce" in e["name"].lower()), key=lambda e: e["ts"])
        buckets = []
        for launch in launches:
            # Its all-reduce on the wire and its wait: the first of each, not taken yet, of the same size after it.
            on_wire = _take(wire, launch)
            wait = _take(bucket_waits, launch)
            buckets.append(
                {
                    "elements": _dims(launch),
                    "launch_ms": (launch["ts"] - t0) / 1e3,
                    "wire_start_ms": (on_wire["ts"] - t0) / 1e3 if on_wire else None,
                    "wire_end_ms": (on_wire["ts"] + on_wire["dur"] - t0) / 1e3 if on_wire else None,
                    "wait_start_ms": (wait["ts"] - t0) / 1e3 if wait else None,
                    "wait_end_ms": (wait["ts"] + wait["dur"] - t0) / 1e3 if wait else None,
                }
            )
        summary = {
            "step": step["name"].removeprefix(STEP_LABEL).strip(),
            "step_ms": step["dur"] / 1e3,
            "forward_backward_ms": closure_ms,
            "optimizer_update_ms": update_ms,
            "exposed_comm_ms": exposed,
            "comm_busy_ms": busy,
            "hidden": 1 - exposed / busy if busy > 0 else None,
            "strategy_ms": strategy_ms,
            "buckets": len(buckets),
        }
        lanes = {
            "compute": [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in on_main if e["name"] == CLOSURE_LABEL],
            "optimizer update": _update_lane(optimizer, closures, t0),
            "waits (exposed)": [((a - t0) / 1e3, (b - a) / 1e3) for a, b in waits],
            "communication": [((e["ts"] - t0) / 1e3, e["dur"] / 1e3) for e in comm],
        }
        for i, b in enumerate(buckets[:8]):  # each bucket from its launch to the end of its wait
            end = b["wait_end_ms"] if b["wait_end_ms"] is not None else b["wire_end_ms"]
            if end is not None:
                lanes[f"bucket {i}: launch to wait"] = [(b["launch_ms"], end - b["launch_ms"])]
        out.append({"summary": summary, "buckets": buckets, "lanes": lanes})
    return out


def _dims(event: dict[str, Any]) -> Any:
    dims = (event.get("args") or {}).get("Input Dims") or [None]
    return dims[0]


def _take(events: list[dict[str, Any]], launch: dict[str, Any]) -> dict[str, Any] | None:
    """Remove and return the first event of ``events`` with the launch's input size that starts after it."""
    for e in events:
        if e["ts"] >= launch["ts"] - 1 and _dims(e) == _dims(launch):
            events.remove(e)
            return e
    return None


def _clip(intervals: list[tuple[float, float]], within: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``intervals`` that lie inside any of ``within``."""
    return [(max(a, c), min(b, d)) for a, b in intervals for c, d in within if max(a, c) < min(b, d)]


def _update_lane(optimizer: list[dict], closures: list[dict], t0: float) -> list[tuple[float, float]]:
    lane = []
    for e in optimizer:
        end = e["ts"] + e["dur"]
        after = [c["ts"] + c["dur"] for c in closures if e["ts"] <= c["ts"] <= end]
        start = max(after) if after else e["ts"]
        lane.append(((start - t0) / 1e3, (end - start) / 1e3))
    return lane


# ------------------------------------------------------------------------------------------------- page
_COLORS = {
    "compute": "#4e79a7",
    "optimizer update": "#59a14f",
    "waits (exposed)": "#e15759",
    "communication": "#f28e2b",
}


def render_html(folder: Path, steps: list[dict[str, Any]]) -> str:
    """The page: every rank's breakdown table (from the ``rank*.steps.json`` written so far) and rank 0's middle
    step as lanes."""
    rows = []
    for path in sorted(folder.glob("rank*.steps.json")):
        for s in json.loads(path.read_text()):
            rows.append((path.name.split(".")[0], s["summary"]))
    if not any(r == "rank0" for r, _ in rows):
        rows = [("rank0", s["summary"]) for s in steps] + rows
    keys = ["step_ms", "forward_backward_ms", "optimizer_update_ms", "exposed_comm_ms", "comm_busy_ms", "strategy_ms"]
    head = "".join(f"<th>{k}</th>" for k in ["rank", "step", *keys, "hidden", "buckets"])
    body = "".join(
        f"<tr><td>{r}</td><td>{s['step']}</td>"
        + "".join(f"<td>{s[k]:.2f}</td>" for k in keys)
        + f"<td>{_percent(s['hidden'])}</td><td>{s['buckets']}</td></tr>"
        for r, s in rows
    )
    svg = _lanes_svg(steps[len(steps) // 2]) if steps else "<p>no step recorded</p>"
    traces = "".join(f"<li>{html.escape(p.name)}</li>" for p in sorted(folder.glob("rank*.trace.json")))
    return (
        "<!doctype html><meta charset='utf-8'><title>sgdtp timeline</title>"
        "<style>body{font:14px sans-serif;margin:2em}td,th{padding:2px 8px;text-align:right}</style>"
        "<h1>sgdtp timeline</h1><h2>Breakdown per step (ms)</h2>"
        f"<table><tr>{head}</tr>{body}</table><h2>One step of rank 0</h2>{svg}"
        "<h2>Traces</h2><p>Open in https://ui.perfetto.dev (or chrome://tracing):</p>"
        f"<ul>{traces}</ul>"
    )


def _percent(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f} %"


def _lanes_svg(step: dict[str, Any]) -> str:
    width, lane_h, left = 1000, 28, 140
    total = max(step["summary"]["step_ms"], 1e-6)
    scale = (width - left - 10) / total
    parts = []
    for i, (name, spans) in enumerate(step["lanes"].items()):
        y = 10 + i * (lane_h + 6)
        parts.append(f"<text x='4' y='{y + 18}'>{html.escape(name)}</text>")
        for start, dur in spans:
            x, w, color = left + start * scale, max(dur * scale, 0.5), _COLORS.get(name, "#f1ce63")
            parts.append(
                f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{lane_h}' fill='{color}'>"
                f"<title>{html.escape(name)}: {start:.2f} + {dur:.2f} ms</title></rect>"
            )
    height = 10 + len(step["lanes"]) * (lane_h + 6) + 20
    axis = f"<text x='{left}' y='{height - 4}'>0 ms</text><text x='{width - 80}' y='{height - 4}'>{total:.1f} ms</text>"
    caption = html.escape(f"step {step['summary']['step']}: {total:.1f} ms")
    return f"<p>{caption}</p><svg width='{width}' height='{height}'>{''.join(parts)}{axis}</svg>"
