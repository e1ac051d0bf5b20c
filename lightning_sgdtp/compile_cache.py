"""A compile cache shared by the ranks of a node and by later jobs: ``SGDTPStrategy(compile_cache="path")``.

Compiling the step takes minutes on every rank of every job (on CPU most of it is the C++ compiler). Inductor
already caches what it compiled, on local disk, keyed by the graph (our collectives included) and its config.
This module adds three things on top of that cache, without touching its format:

- **One compile per node.** The ranks of a node share one Inductor cache folder, and every compile of the
  ``"sgdtp"`` backend runs under an exclusive file lock in it: the first rank compiles, the others wait, then
  find the result in the cache (the lock is taken per compile, never across a collective).
- **Bundles.** After the first optimizer step, global rank 0 copies that folder to ``path/KEY/``, atomically
  (temporary name, fsync, rename), with a SHA256 manifest, signed with ``signing_key`` when set. ``KEY`` is a hash
  of what makes the artifacts valid: torch version and build, Python, platform, device kind, the parallel layout,
  the communication plan's settings, the process-group backend and names, and the LightningModule's code.
- **Warm starts.** A later job with the same key verifies the bundle (and its signature against ``trusted_key``)
  before copying it into its local cache. A bundle that fails verification, or a key with no bundle, is ignored
  with a log line, and the job compiles from scratch: a bundle is used whole or not at all.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

from lightning_sgdtp._fs import fsync_path
from lightning_sgdtp.trust import ArtifactVerificationError, verify_dir
from lightning_sgdtp.trust.signatures import sign_with

LOCK = "sgdtp-compile.lock"
LOADED = "sgdtp-bundle-loaded"
FIELDS = "SGDTP-CACHE-KEY.json"
# Not artifacts: Inductor's lock files, our own lock and marker.
_SKIP = {"locks", LOCK, LOADED}


def cache_key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:32]


class CompileCache:
    """The node-local Inductor cache folder, its compile lock, and the bundle at ``root/KEY``."""

    def __init__(
        self,
        root: Path,
        fields: dict[str, Any],
        trusted_key: str | None = None,
        signing_key: str | None = None,
        local_dir: Path | None = None,
    ) -> None:
        self.root, self.fields = Path(root), fields
        self.key = cache_key(fields)
        self.bundle = self.root / self.key
        self.trusted_key, self.signing_key = trusted_key, signing_key
        env_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        self.local_dir = Path(local_dir or env_dir or Path(tempfile.gettempdir()) / f"sgdtp-inductor-{self.key[:16]}")
        self.warm = False
        self.rejected = False  # the bundle failed verification: this job replaces it
        self._plans: tuple[int, list[dict[str, Any]]] = (-1, [])  # (folder mtime, plans) read last
        self._depth = threading.local()

    # ----------------------------------------------------------------------------------------------- lock
    @contextlib.contextmanager
    def lock(self) -> Generator[None, None, None]:
        """Exclusive across the processes of this node; re-entrant within one (a compile inside a compile)."""
        depth = getattr(self._depth, "n", 0)
        if depth:
            self._depth.n = depth + 1
            try:
                yield
            finally:
                self._depth.n -= 1
            return
        self.local_dir.mkdir(parents=True, exist_ok=True)
        with open(self.local_dir / LOCK, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            self._depth.n = 1
            try:
                yield
            finally:
                self._depth.n = 0
                fcntl.flock(f, fcntl.LOCK_UN)

    # ---------------------------------------------------------------------------------------------- start
    def prepare(self) -> str:
        """Point Inductor at the node's cache folder and load the bundle into it if one verifies. Before any
        compile, on every rank. Returns what happened, for the log."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.local_dir)
        with self.lock():
            if (self.local_dir / LOADED).exists():
                self.warm = True
                return f"compile cache: bundle {self.key} verified and loaded into {self.local_dir} (by another rank)"
            if not self.bundle.is_dir():
                return f"compile cache: no bundle {self.key} in {self.root} yet; this job compiles and writes it"
            try:
                verify_dir(self.bundle, trusted=Path(self.trusted_key) if self.trusted_key else None)
            except ArtifactVerificationError as err:
                self.rejected = True
                return (
                    f"compile cache: bundle {self.key} ignored ({err}); compiling from scratch, and this job replaces"
                    " it (the rejected one is kept as .KEY.rejected-PID)"
                )
            for src in self.bundle.rglob("*"):
                rel = src.relative_to(self.bundle)
                if src.is_file() and not src.name.startswith("SGDTP-"):
                    (self.local_dir / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, self.local_dir / rel)
            (self.local_dir / LOADED).write_text(self.key)
            self.warm = True
            return f"compile cache: bundle {self.key} verified and loaded into {self.local_dir}"

    # ---------------------------------------------------------------------------------------------- plans
    def record_plan(self, plan: dict[str, Any]) -> None:
        """Keep a graph's communication plan next to its artifacts: a rank (or a later job) that takes the
        compiled graph from the cache does not run the pass, and reads the plan from here instead."""
        folder = self.local_dir / "sgdtp-plans"
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"{plan['graph_id']}.json"
        tmp = folder / f".{plan['graph_id']}.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(plan, sort_keys=True))
        os.replace(tmp, target)

    def recorded_plans(self) -> list[dict[str, Any]]:
        """The plans recorded on this node. Asked every optimizer step: the files are read again only when the
        folder changed (a rank recorded a new graph), else this is one ``stat``."""
        folder = self.local_dir / "sgdtp-plans"
        mtime = folder.stat().st_mtime_ns if folder.is_dir() else -1
        if mtime != self._plans[0]:
            files = sorted(folder.glob("*.json"), key=lambda p: int(p.stem)) if mtime != -1 else []
            self._plans = (mtime, [json.loads(p.read_text()) for p in files])
        return self._plans[1]

    # -------------------------------------------------------------------------------------------- publish
    def publish(self) -> str | None:
        """Copy the node's cache folder to ``root/KEY`` with a (signed) manifest, atomically. Global rank 0, after
        the first optimizer step. None when there is nothing to do (warm start, or the bundle exists)."""
        if self.warm or (self.bundle.exists() and not self.rejected):
            return None
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{self.key}.tmp-", dir=self.root))
        try:
            with self.lock():
                for src in self.local_dir.rglob("*"):
                    rel = src.relative_to(self.local_dir)
                    if src.is_file() and not (set(rel.parts) & _SKIP):
                        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(src, tmp / rel)
            (tmp / FIELDS).write_text(json.dumps(self.fields, indent=1, sort_keys=True, default=str))
            sign_with(tmp, self.signing_key)
            _fsync_tree(tmp)
            if self.rejected and self.bundle.exists():
                os.rename(self.bundle, self.root / f".{self.key}.rejected-{os.getpid()}")
            try:
                os.rename(tmp, self.bundle)  # atomic; fails if another job published the same key first
            except OSError:
                return None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        files = sum(1 for p in self.bundle.rglob("*") if p.is_file())
        size = sum(p.stat().st_size for p in self.bundle.rglob("*") if p.is_file())
        return f"compile cache: wrote bundle {self.bundle} ({files} files, {size / 2**20:.1f} MiB)"


def _fsync_tree(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        fsync_path(path)
