"""A compile cache shared by the ranks of a node and by later jobs: ``SGDTPStrategy(compile_cache="path")``.

Compiling the step takes minutes on every rank of every job (on CPU most of it is the C++ compiler). Inductor
already caches what it compiled, on local disk, keyed by the graph (our collectives included) and its config.
This module adds three things on top of that cache, without touching its format:

- **One compile per node.** The ranks of a node share one Inductor cache folder, and every compile of the
  ``"sgdtp"`` backend runs under an exclusive file lock in it: the first rank compiles, the others wait, then
  find the result in the cache (the lock is taken per compile, never across a collective). With data parallel
  alone on CPU only: on a GPU Inductor's key holds the device index, so the ranks of a node compile side by side,
  unlocked, each its own graphs into the shared folder (:func:`node_compiles`).
- **Bundles.** After the first optimizer step, global rank 0 copies that folder to ``path/KEY/``, atomically
  (temporary name, fsync, rename), with a SHA256 manifest, signed with ``signing_key`` when set. ``KEY`` is a hash
  of what makes the artifacts valid: torch version and build, Python, platform, device kind, the parallel layout,
  the options that change the compiled graphs, the process-group backend and names, and the LightningModule's code
  (:func:`key_fields`).
- **Warm starts.** A later job with the same key verifies the bundle (and its signature against ``trusted_key``)
  before copying it into its local cache. A bundle that fails verification, or a key with no bundle, is ignored
  with a log line, and the job compiles from scratch: a bundle is used whole or not at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_sgdtp.compiler.artifacts import PLUGIN_FINGERPRINT, CompileLock
from lightning_sgdtp.compiler.backend import PASS_VERSION
from lightning_sgdtp.config import SGDTPConfig
from lightning_sgdtp.parallel import TECHNIQUES
from lightning_sgdtp.trust import ArtifactVerificationError, verify_dir
from lightning_sgdtp.trust.durable import fsync_path, write_atomically
from lightning_sgdtp.trust.signatures import sign_with

LOCK = "sgdtp-compile.lock"
LOADED = "sgdtp-bundle-loaded"
FIELDS = "SGDTP-CACHE-KEY.json"
GRAPHS = "sgdtp-plans"  # the recorded graphs' folder (its name predates GraphBuckets; kept for existing caches)
# Not artifacts: Inductor's lock files, our own lock and marker.
_SKIP = {"locks", LOCK, LOADED}
# The options of the plugin itself that change the compiled graphs; each technique adds its own (``graph_fields``).
_OWN_GRAPH_OPTIONS = ("parallelism", "bucket_cap_mb", "grad_comm_dtype", "overlap", "regional_compile")


def graph_options() -> tuple[str, ...]:
    """The options that change the compiled graphs (part of the key): the plugin's and every registered
    technique's ``graph_fields``."""
    return _OWN_GRAPH_OPTIONS + tuple(f for t in TECHNIQUES for f in t.graph_fields)


def __getattr__(name: str) -> Any:
    if name == "GRAPH_OPTIONS":  # read when asked for: a technique registered later is in it
        return graph_options()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def key_fields(
    module: torch.nn.Module,
    config: SGDTPConfig,
    *,
    in_graph_sync: bool,
    device: torch.device,
    world_size: int,
    num_nodes: int,
    devices_per_node: int,
    rank_grid: list[list[int]] | None,
    process_group_backend: str | None,
    tensor_parallel_plan: dict | None,
) -> dict[str, Any]:
    """What makes compiled artifacts valid, as plain data (:func:`cache_key` hashes it): the bucket pass's
    version and the plugin's source hash, torch, Python, platform, device kind, the parallel layout, the
    process-group backend and names, the options in :func:`graph_options`, and the module's code and parameter shapes.
    The field names are those of the bundles already written: ``"plan"`` holds the graph options."""
    cls = type(module)
    try:
        source = Path(inspect.getsourcefile(cls) or "").read_bytes()
    except (OSError, TypeError):
        source = b""
    options = config.to_dict()
    return {
        # The bucket pass's version and a hash of the plugin's whole source: a bundle of another build never loads.
        "sgdtp": f"{PASS_VERSION}+{PLUGIN_FINGERPRINT}",
        "torch": torch.__version__,
        "python": sys.implementation.cache_tag,
        "platform": sysconfig.get_platform(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "layout": {"world_size": world_size, "num_nodes": num_nodes, "devices": devices_per_node, "mesh": rank_grid},
        "backend": process_group_backend,
        "groups": [dist.group.WORLD.group_name] if dist.is_available() and dist.is_initialized() else [],
        "tensor_parallel_plan": tensor_parallel_plan,
        "plan": {k: options[k] for k in graph_options()} | {"in_graph_sync": in_graph_sync},
        "module": f"{cls.__module__}.{cls.__qualname__}",
        "module_source_sha256": hashlib.sha256(source).hexdigest(),
        # The same code with other sizes compiles other graphs: a bundle is for these parameters only.
        "parameters_sha256": hashlib.sha256(
            json.dumps([(n, list(p.shape), str(p.dtype)) for n, p in module.named_parameters()]).encode()
        ).hexdigest(),
    }


def node_compiles(device: torch.device, locked: bool, warm: bool, devices_per_node: int) -> str | None:
    """Rank 0's line on how the ranks of a node share their compiles (None with one rank a node).

    ``locked``: the plan's node lock is on (``lock_compiles == "node"``: data parallel alone, on CPU). On an
    accelerator it is off: Inductor's FX graph key and AOTAutograd's key hold each input's ``torch.device`` with its
    index, and the compiled code names that index (``torch/_inductor/codecache.py``, ``FxGraphCachePickler``;
    docs/compile-cache.md), so ranks on ``cuda:0`` and ``cuda:1`` never hit each other's entries. A lock would only
    make them wait for a graph they cannot use: each compiles its own, side by side, into the node's folder."""
    if devices_per_node <= 1:
        return None
    others = (
        "the other waits, then loads" if devices_per_node == 2 else f"the other {devices_per_node - 1} wait, then load"
    )
    if warm:
        own = f" (those of its device, {device}: Inductor's key holds the index)" if device.index is not None else ""
        return f"compile cache: a warm start, no compile lock: every rank takes its graphs{own} from the bundle at once"
    if locked:
        return (
            f"compiles: the {devices_per_node} ranks of a node compile each graph once: the first compiles it under"
            f" the node lock ({LOCK}), {others} it from the cache"
        )
    if device.type != "cpu":
        return (
            f"compiles: no node lock on {device.type}: Inductor's cache key holds the device index ({device} here), so"
            f" the {devices_per_node} ranks of a node share no compiled graph; each compiles its own side by side, none"
            " waits on another"
        )
    return (
        f"compiles: no node lock: each rank's graphs name its own process groups; the {devices_per_node} ranks of a"
        " node compile side by side"
    )


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
        max_bytes: int | None = None,
        own_folder: bool = False,
    ) -> None:
        self.root, self.fields = Path(root), fields
        self.key = cache_key(fields)
        self.bundle = self.root / self.key
        self.trusted_key, self.signing_key = trusted_key, signing_key
        #: The bound of ``root`` (:func:`evict`), checked when a bundle is written.
        self.max_bytes = max_bytes
        # The default cache (own_folder) keeps Inductor's folder to itself, one per key: a TORCHINDUCTOR_CACHE_DIR of
        # the user's, shared with other work, would be copied whole into the bundle.
        env_dir = None if own_folder else os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        self.local_dir = Path(local_dir or env_dir or Path(tempfile.gettempdir()) / f"sgdtp-inductor-{self.key[:16]}")
        self.warm = False
        self.rejected = False  # the bundle failed verification: this job replaces it
        self._graphs: tuple[int, list[dict[str, Any]]] = (-1, [])  # (folder mtime, graphs) read last
        self._lock = CompileLock(self.local_dir / LOCK)

    # ----------------------------------------------------------------------------------------------- lock
    def lock(self) -> contextlib.AbstractContextManager:
        """Exclusive across the processes of this node; re-entrant within one (a compile inside a compile)."""
        return self._lock()

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
                    _place(src, self.local_dir / rel)
            (self.local_dir / LOADED).write_text(self.key)
            self.warm = True
            with contextlib.suppress(OSError):
                os.utime(self.bundle)  # used now: evicted last
            return f"compile cache: bundle {self.key} verified and loaded into {self.local_dir}"

    # --------------------------------------------------------------------------------------------- graphs
    def record_graph(self, graph: dict[str, Any]) -> None:
        """Keep what the bucket pass decided for a graph (``GraphBuckets.to_dict()``) next to its artifacts: a
        rank (or a later job) that takes the compiled graph from the cache does not run the pass, and reads it
        from here instead."""
        folder = self.local_dir / GRAPHS
        folder.mkdir(parents=True, exist_ok=True)
        data = json.dumps(graph, sort_keys=True).encode()
        write_atomically(folder / f"{graph['graph_id']}.json", lambda f: f.write(data))

    def recorded_graphs(self) -> list[dict[str, Any]]:
        """The graphs recorded on this node. Asked every optimizer step: the files are read again only when the
        folder changed (a rank recorded a new graph), else this is one ``stat``."""
        folder = self.local_dir / GRAPHS
        mtime = folder.stat().st_mtime_ns if folder.is_dir() else -1
        if mtime != self._graphs[0]:
            files = sorted(folder.glob("*.json"), key=lambda p: int(p.stem)) if mtime != -1 else []
            self._graphs = (mtime, [json.loads(p.read_text()) for p in files])
        return self._graphs[1]

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
                _copy_artifacts(self.local_dir, tmp)
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
        size = _size(self.bundle)
        evicted = evict(self.root, self.max_bytes, keep=self.key) if self.max_bytes is not None else []
        return f"compile cache: wrote bundle {self.bundle} ({files} files, {size / 2**20:.1f} MiB)" + (
            f"; evicted {len(evicted)} least recently used bundle(s) to stay under {self.max_bytes / 2**30:g} GiB"
            if evicted
            else ""
        )


def _copy_artifacts(src_root: Path, dest_root: Path) -> None:
    """Copy the node's cache folder into a bundle: not the lock files and marker (``_SKIP``), nor a file under a
    temporary name (a dot first: Inductor's ``write_atomic``, the staged C++ builds), nor a file or folder that
    vanished meanwhile. On GPUs the ranks of a node compile side by side, without the lock that this copy holds
    (:func:`node_compiles`), so another rank may still be writing into the folder when global rank 0 publishes."""
    for folder, dirs, files in os.walk(src_root):  # a folder removed while walked is skipped (os.walk ignores errors)
        dirs[:] = sorted(d for d in dirs if d not in _SKIP)
        rel = Path(folder).relative_to(src_root)
        for name in files:
            if name in _SKIP or name.startswith("."):
                continue
            (dest_root / rel).mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):  # renamed or removed by its writer since the walk saw it
                shutil.copy2(Path(folder) / name, dest_root / rel / name)


def _place(src: Path, dest: Path) -> None:
    """Copy ``src`` to ``dest`` under a temporary name, then rename it into place: a new file, never the old one
    rewritten. A compiled library another job (or an earlier fit of this process) has loaded from ``dest`` stays
    mapped, whole (copying over it in place crashed that process with SIGSEGV). A ``dest`` of the same size and
    time is left as it is."""
    try:
        there, here = dest.stat(), src.stat()
        if there.st_size == here.st_size and int(there.st_mtime) == int(here.st_mtime):
            return
    except OSError:
        pass
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = dest.with_name(f".{dest.name}.loading-{os.getpid()}")
    shutil.copy2(src, staging)
    os.replace(staging, dest)


def bundles(root: Path) -> list[Path]:
    """The bundles in a compile cache folder, least recently used first (their folders' modification times)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def evict(root: Path, max_bytes: int, keep: str | None = None) -> list[Path]:
    """Remove the least recently used bundles of ``root`` until it holds at most ``max_bytes`` (never ``keep``).
    A bundle another job is loading at that moment is only missed by it: that job compiles."""
    present = bundles(root)
    total = sum(_size(b) for b in present)
    removed = []
    for bundle in present:
        if total <= max_bytes:
            break
        if bundle.name == keep:
            continue
        size = _size(bundle)
        shutil.rmtree(bundle, ignore_errors=True)
        total -= size
        removed.append(bundle)
    return removed


def _fsync_tree(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        fsync_path(path)
