"""The timeline (option ``profile_steps``): recording in one process, and the breakdown of a trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_sgdtp.observe.timeline import (
    CLOSURE_LABEL,
    OPTIMIZER_LABEL,
    Timeline,
    breakdown,
    label,
    labelled,
    render_html,
)


def test_records_the_steps_asked_for_and_writes_trace_breakdown_and_page(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters())
    lines: list[str] = []
    timeline = Timeline((2, 3), lambda: tmp_path, rank=0, say=lines.append)
    for step in range(6):
        timeline.step_begins(step)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = model(torch.randn(32, 64)).square().mean()
            loss.backward()
            return loss

        with label(OPTIMIZER_LABEL):
            opt.step(labelled(closure, CLOSURE_LABEL))
        timeline.step_ends(step)
    folder = tmp_path / "sgdtp_timeline"
    assert sorted(p.name for p in folder.iterdir()) == [
        "rank0.steps.json",
        "rank0.trace.json",
        "timeline.html",
    ]
    steps = json.loads((folder / "rank0.steps.json").read_text())
    assert [s["summary"]["step"] for s in steps] == ["2", "3"]  # only the steps asked for
    for s in steps:
        summary = s["summary"]
        assert 0 < summary["forward_backward_ms"] < summary["step_ms"]
        assert 0 < summary["optimizer_update_ms"] < summary["step_ms"]
        assert summary["exposed_comm_ms"] == 0 and summary["hidden"] is None  # one process: no communication
    page = (folder / "timeline.html").read_text()
    assert "Breakdown per step" in page and "<svg" in page and "rank0.trace.json" in page
    assert "timeline of steps 2..3" in lines[0]
    assert timeline.describe()["html"].endswith("timeline.html")


def test_the_page_reads_only_whole_files_of_the_other_ranks(tmp_path: Path) -> None:
    """Rank 0 writes the page while rank 1 may be writing its breakdown (a race seen on a loaded CI machine: rank 0
    read an empty ``rank1.steps.json``). A rank's files appear under their names only when whole (staged, renamed):
    a staging file is never read."""
    (tmp_path / ".rank1.steps.json.tmp-999").write_text('[{"summary": {"st')  # rank 1, mid-write
    page = render_html(tmp_path, [])
    assert "Breakdown per step" in page
    (tmp_path / "rank1.steps.json").write_text("")  # what the old direct write_text exposed: an empty file
    with pytest.raises(json.JSONDecodeError):
        render_html(tmp_path, [])


def ev(name: str, ts: float, dur: float, tid: int = 1, dims: list | None = None) -> dict:
    e = {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if dims is not None:
        e["args"] = {"Input Dims": [dims]}
    return e


def test_breakdown_of_a_trace_with_two_buckets() -> None:
    """Times in us. A 100 ms step: closure 0-80 ms, two buckets launched at 40 and 60 ms, on the wire (thread 2)
    40-70 and 70-85 ms; the main thread waits 80-85 ms; the update runs 85-100 ms."""
    events = [
        ev("sgdtp: step 7", 0, 100_000),
        ev(OPTIMIZER_LABEL, 0, 100_000),
        ev(CLOSURE_LABEL, 0, 80_000),
        ev("_c10d_functional::all_reduce_", 40_000, 100, dims=[1000]),
        ev("_c10d_functional::all_reduce_", 60_000, 100, dims=[10]),
        ev("gloo:all_reduce", 40_050, 30_000, tid=2, dims=[1000]),
        ev("gloo:all_reduce", 70_050, 15_000, tid=2, dims=[10]),
        ev("_c10d_functional::wait_tensor", 79_000, 1_000, dims=[1000]),
        ev("_c10d_functional::wait_tensor", 80_000, 5_000, dims=[10]),
        ev("sgdtp: after backward", 85_000, 500),
    ]
    (step,) = breakdown(events)
    s = step["summary"]
    assert s["step"] == "7" and s["step_ms"] == 100
    assert s["forward_backward_ms"] == 80 and s["optimizer_update_ms"] == 20
    assert s["exposed_comm_ms"] == 6 and s["comm_busy_ms"] == 45
    assert s["hidden"] == pytest.approx(1 - 6 / 45)
    assert s["strategy_ms"] == pytest.approx(0.5)
    first, second = step["buckets"]
    assert (first["elements"], first["wire_start_ms"], first["wire_end_ms"]) == ([1000], 40.05, 70.05)
    assert (second["wait_start_ms"], second["wait_end_ms"]) == (80, 85)
