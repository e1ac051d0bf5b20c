"""The graph registry at interpreter exit, in a fresh interpreter (the in-process tests: tests/unit/graph/test_graph.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from helpers.launch import REPO, job_env


def test_handles_are_destroyed_at_interpreter_exit(tmp_path: Path) -> None:
    """atexit hooks run last-registered-first: a hook registered before the import sees the registry's cleanup."""
    script = textwrap.dedent(
        """
        import atexit, json, torch

        def report():
            print(json.dumps({"state": h.state, "live": len(graph.registered()),
                              "resolves": hasattr(torch.ops.sgdtp, "exit_op")}))

        atexit.register(report)
        from lightning_sgdtp import graph
        h = graph.register("exit_op", lambda x: x + 1, None, ["tensor"], ["tensor"])
        assert torch.ops.sgdtp.exit_op(torch.zeros(1)).item() == 1
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        check=False,
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"state": "destroyed", "live": 0, "resolves": False}
