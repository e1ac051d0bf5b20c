"""``compile_cache``: Inductor's compile cache written by another torch build (stale) or by another user (foreign),
or a cache directory that every user can write to (cache pollution). Public: ``sgdtp diagnose`` without a TARGET
runs :func:`check_compile_cache` alone.

Inductor loads compiled code (``.py``, ``.so``) from its cache directory: ``TORCHINDUCTOR_CACHE_DIR``, else
``<tmp>/torchinductor_<user>``. Every check writes a marker file, ``.lightning_sgdtp_cache.json``, into a healthy
cache directory that has none, naming the torch build, Python and uid that use it. A later check reports the
directory as stale when the marker names another build, and as foreign when the directory or any file in it
belongs to another uid, or the directory is writable by everyone.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from lightning_sgdtp.diagnose.context import DiagnoseContext
from lightning_sgdtp.diagnose.report import CheckResult, Finding
from lightning_sgdtp.trust.durable import write_atomically

CACHE_MARKER = ".lightning_sgdtp_cache.json"
_MAX_CACHE_ENTRIES = 50_000


def cache_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: ``cache_dir``, else ``TORCHINDUCTOR_CACHE_DIR``, else Inductor's default."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser().absolute()
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()).absolute()


def cache_identity() -> dict[str, Any]:
    """What the marker records: the builds that must match for a cache's entries to be this process's."""
    triton = None
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            triton = version(dist)
            break
    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "triton": triton,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_compile_cache(
    cache_dir: str | os.PathLike[str] | None = None, *, uid: int | None = None, write_marker: bool = True
) -> list[Finding]:
    """Findings about Inductor's compile cache: stale (another torch build) or foreign (another user's files).

    Args:
        cache_dir: the directory (default: ``TORCHINDUCTOR_CACHE_DIR``, else Inductor's default).
        uid: whose cache it should be (default: this process's effective uid).
        write_marker: write ``.lightning_sgdtp_cache.json`` into a healthy directory that has none.
    """
    path = cache_path(cache_dir)
    uid = os.geteuid() if uid is None else uid
    me = _user(uid)
    per_user = f"export TORCHINDUCTOR_CACHE_DIR=$HOME/.cache/torchinductor/torch-{torch.__version__}"
    if not path.exists():
        return [
            Finding(
                "compile_cache",
                "info",
                f"no compile cache yet at {path}; torch.compile creates it at the first compile",
                "nothing to do",
                details={"path": str(path)},
            )
        ]
    findings: list[Finding] = []
    st = path.stat()
    if st.st_uid != uid:
        findings.append(
            Finding(
                "compile_cache",
                "error",
                f"the compile cache {path} belongs to {_user(st.st_uid)} (uid {st.st_uid}), not to {me}: Inductor"
                " loads compiled code from it, and cannot write its own entries there",
                f"use a cache directory of your own: {per_user}",
                details={"path": str(path), "owner_uid": st.st_uid, "uid": uid},
            )
        )
    if st.st_mode & 0o002:
        findings.append(
            Finding(
                "compile_cache",
                "warning",
                f"the compile cache {path} is writable by every user (mode {oct(st.st_mode & 0o7777)}): anyone can put"
                " code there that torch.compile will load",
                f"chmod 700 {path}, or use a cache directory of your own: {per_user}",
                details={"path": str(path), "mode": oct(st.st_mode & 0o7777)},
            )
        )
    foreign: dict[int, list[str]] = defaultdict(list)
    total, truncated = 0, False
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            total += 1
            if total > _MAX_CACHE_ENTRIES:
                truncated = True
                break
            full = os.path.join(root, name)
            with contextlib.suppress(OSError):
                owner = os.lstat(full).st_uid
                if owner != uid:
                    foreign[owner].append(full)
        if truncated:
            break
    if foreign:
        count = sum(len(v) for v in foreign.values())
        owners = ", ".join(f"{_user(u)} (uid {u}): {len(v)}" for u, v in sorted(foreign.items()))
        examples = [p for v in foreign.values() for p in v][:5]
        findings.append(
            Finding(
                "compile_cache",
                "error",
                f"{count} of {total}{'+' if truncated else ''} entries in the compile cache {path} belong to other"
                f" users ({owners}), e.g. {examples[0]}. Inductor loads compiled code (.so, .py) from this"
                " directory: another user's entries can be wrong for this build, or planted",
                f"remove them (rm -rf {path}; the cache is rebuilt at the next compile), or give every user and job"
                f" its own directory: {per_user}",
                details={
                    "path": str(path),
                    "foreign": {str(u): len(v) for u, v in foreign.items()},
                    "examples": examples,
                },
            )
        )
    marker = path / CACHE_MARKER
    mine = cache_identity()
    if marker.exists():
        try:
            recorded = json.loads(marker.read_text())
            if not isinstance(recorded, dict):
                raise TypeError("not a JSON object")
        except (OSError, ValueError, TypeError) as e:
            findings.append(
                Finding(
                    "compile_cache",
                    "warning",
                    f"the cache marker {marker} is unreadable ({e})",
                    f"delete it (rm {marker}); the next diagnose writes a new one",
                    details={"path": str(path)},
                )
            )
        else:
            diff = {k: (recorded.get(k), v) for k, v in mine.items() if k in recorded and recorded.get(k) != v}
            if diff:
                what = ", ".join(f"{k} {old} (this process: {new})" for k, (old, new) in diff.items())
                findings.append(
                    Finding(
                        "compile_cache",
                        "warning",
                        f"stale compile cache {path}: it was filled by another build ({what}). Its entries are dead"
                        " weight at best; entries keyed without the full build (custom ops, patched or nightly"
                        " builds of one version) can be wrong",
                        f"remove it (rm -rf {path}), or use one cache directory per torch build: {per_user}",
                        details={"path": str(path), "recorded": recorded, "current": mine},
                    )
                )
            if recorded.get("uid") not in (None, uid):
                findings.append(
                    Finding(
                        "compile_cache",
                        "error",
                        f"the compile cache {path} was set up by {recorded.get('user')} (uid {recorded.get('uid')}),"
                        f" not {me}",
                        f"use a cache directory of your own: {per_user}",
                        details={"path": str(path), "recorded": recorded},
                    )
                )
    if not findings:
        wrote = False
        if not marker.exists() and write_marker:
            with contextlib.suppress(OSError):
                record = {**mine, "uid": uid, "user": me, "written_by": "lightning_sgdtp.diagnose"}
                write_atomically(marker, lambda f: f.write(json.dumps(record).encode()))
                wrote = True
        findings.append(
            Finding(
                "compile_cache",
                "info",
                f"compile cache {path}: {total} entries, all {me}'s"
                + ("; wrote the version marker" if wrote else (", same torch build" if marker.exists() else "")),
                "nothing to do",
                details={"path": str(path), "entries": total, "marker": str(marker) if marker.exists() else None},
            )
        )
    return findings


def check(ctx: DiagnoseContext) -> CheckResult:
    """:func:`check_compile_cache` on the context's cache directory; ``stats``: ``cache_dir``."""
    path = cache_path(ctx.cache_dir)
    return CheckResult(check_compile_cache(path, write_marker=ctx.write_cache_marker), {"cache_dir": str(path)})
