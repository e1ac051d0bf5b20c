"""Durable, atomic writes: what the checkpoint writer, the manifest, sharded checkpoints and the compile cache
share."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import IO


def fsync_path(path: Path) -> None:
    """Flush a file, or a folder's entries (make a rename in it durable), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(target: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write`` into ``.NAME.tmp-PID`` next to ``target`` (open for reading too: a seal reads back what was written),
    fsync it, then rename it over ``target``: a crash leaves the previous file whole (and at most a temporary file,
    which a manifest never lists)."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w+b") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
