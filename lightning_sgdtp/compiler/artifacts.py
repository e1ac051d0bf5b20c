"""What the compiled artifacts depend on, and how they are written: safe to share between jobs, safe to kill.

Two faults hit users through Inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, or ``compile_cache``):

- **Graphs of another plugin version.** Our bucket pass changes the graphs Inductor caches; a cache entry made by
  an older copy of the plugin must never be reused by a newer one (a pipeline run once failed with "Output
  gradient: None" after an upgrade). :data:`PLUGIN_FINGERPRINT` hashes every source file of the installed package,
  so any edit (not only a new version string) changes the compile caches' keys.
- **A build killed mid-write.** Inductor's C++ builder writes each ``.so`` (and ``.o``) in place, and skips the
  build when the file exists: a SIGKILL during the build (a timeout, ``scancel``, preemption) left a truncated file
  that every later job loaded and failed on ("file too short"). :func:`install_atomic_builds` makes Inductor's
  ``CppBuilder.build`` write under a staging name and rename the whole file into place, and its build step
  (``codecache._worker_compile_cpp``, under Inductor's own file lock) remove and rebuild a target it finds
  truncated: one left by an older version or another tool.

Written by hand, not taken from a library: torch has no switch for either (its ``write_atomic`` covers the Python
and graph files, not the compiler's output), and the fix is a few lines around Inductor's own build call.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
import threading
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent.parent


def source_fingerprint(package: Path = PACKAGE) -> str:
    """SHA256 (16 hex digits) of every ``.py`` and ``.json`` file of ``package``, with their relative paths."""
    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".json") and p.is_file()):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


#: The installed plugin's source, hashed once per process (~100 files, a few ms): part of every compile-cache key.
PLUGIN_FINGERPRINT = source_fingerprint()


# --------------------------------------------------------------------------------------------- atomic builds
def is_complete(path: str | os.PathLike) -> bool:
    """Is this compiler output whole? An ELF file (``.so``, ``.o``) holds its section header table at the end: a
    file shorter than where that table ends was cut off mid-write. Other files: whole when not empty."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    if size == 0:
        return False
    if head[:4] != b"\x7fELF":
        return not b"\x7fELF".startswith(head)  # (a file cut inside the ELF magic is an ELF cut short)
    if len(head) < (64 if head[4:5] == b"\x02" else 52):
        return False
    order = "<" if head[5] == 1 else ">"
    if head[4] == 2:  # 64-bit
        (shoff,) = struct.unpack_from(order + "Q", head, 0x28)
        shentsize, shnum = struct.unpack_from(order + "HH", head, 0x3A)
    else:
        (shoff,) = struct.unpack_from(order + "I", head, 0x20)
        shentsize, shnum = struct.unpack_from(order + "HH", head, 0x2E)
    return size >= shoff + shentsize * shnum


def staged_build(builder: Any) -> None:
    """``CppBuilder.build`` with the output written under a staging name in the same folder, then renamed into
    place: whatever Inductor builds (kernels, their objects, its ISA probe) exists under its name only whole."""
    from torch._inductor import cpp_builder

    target = builder.get_target_file_path()
    command = builder.get_command_line()
    staging = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.building-{os.getpid()}")
    staged = command.replace(f"-o {target}", f"-o {staging}")
    if staged == command or getattr(builder, "_use_relative_path", False):
        return _INDUCTOR_BUILD(builder)  # a command line we do not recognise: Inductor's own build
    # The folders of Inductor's own build, then its compile command with the staging name as the output.
    cpp_builder._create_if_dir_not_exist(builder._output_dir)
    tmp_dir = os.path.join(builder._output_dir, f"{builder._name}_{cpp_builder._BUILD_TEMP_DIR}")
    cpp_builder._create_if_dir_not_exist(tmp_dir)
    try:
        cpp_builder.run_compile_cmd(staged, cwd=tmp_dir)
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.remove(staging)
        cpp_builder._remove_dir(tmp_dir)


def build_atomically(lock_path: str, cpp_builders: Sequence[Any]) -> None:
    """Inductor's ``_worker_compile_cpp`` (same lock, same skip of a target that exists), except that a truncated
    target, left by a build killed before this fix, is removed and built again."""
    from torch._inductor.codecache import LOCK_TIMEOUT
    from torch.utils._filelock import FileLock

    with FileLock(lock_path, timeout=LOCK_TIMEOUT):
        for builder in cpp_builders:
            target = builder.get_target_file_path()
            if os.path.exists(target) and not is_complete(target):
                os.remove(target)
            if not os.path.exists(target):
                builder.build()


_INDUCTOR_BUILD: Any = None


def install_atomic_builds() -> None:
    """Route Inductor's C++ builds through :func:`staged_build` and :func:`build_atomically` (idempotent; this
    process: Inductor builds CPU kernels on threads of the compiling process)."""
    global _INDUCTOR_BUILD
    from torch._inductor import codecache, cpp_builder

    if _INDUCTOR_BUILD is None:
        _INDUCTOR_BUILD = cpp_builder.CppBuilder.build
        cpp_builder.CppBuilder.build = staged_build
    codecache._worker_compile_cpp = build_atomically


# --------------------------------------------------------------------------------------------- compile lock
class CompileLock:
    """One compile at a time per graph across the processes of a node; re-entrant within one (a compile inside a
    compile).

    Ranks that compile the same graphs (data-parallel replicas) arrive at each compile at about the same time. The
    first to take the lock compiles, holding it. Each one that finds it held waits for it (at most ``wait_s``), lets
    it go at once and compiles then: the graph is in the cache, and the followers load it side by side, so the last
    of them reaches the first collective a cache load after the leader, not one load per rank after it. Never held
    across a collective, so it cannot deadlock the ranks; a holder that dies releases it (flock).
    """

    def __init__(self, path: Path, wait_s: float | None = None) -> None:
        self.path, self.wait_s = path, wait_s
        self._depth = threading.local()

    @contextlib.contextmanager
    def __call__(self) -> Generator[None, None, None]:
        depth = getattr(self._depth, "n", 0)
        if depth:
            self._depth.n = depth + 1
            try:
                yield
            finally:
                self._depth.n -= 1
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                leader = True
            except BlockingIOError:
                leader = False
                if self._wait(f):
                    fcntl.flock(f, fcntl.LOCK_UN)  # the leader is done: compile beside the other followers
            self._depth.n = 1
            try:
                yield
            finally:
                self._depth.n = 0
                if leader:
                    fcntl.flock(f, fcntl.LOCK_UN)

    def _wait(self, f: Any) -> bool:
        """Wait for the leader to let go, at most ``wait_s`` (None: as long as it takes). A leader that hangs never
        hangs the others past that bound: they then compile without waiting (the same graph twice, never a wrong
        one)."""
        if self.wait_s is None:
            fcntl.flock(f, fcntl.LOCK_EX)
            return True
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)


# ------------------------------------------------------------------------------------------- cache folders
def cost_model_folder() -> Path:
    """Where the measured cost models are recorded for later jobs (``bucket_cost.measure_once``): beside the
    compiled graphs whose bucket boundaries they decide, in Inductor's cache folder."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "sgdtp-cost-models"


class CacheFolderError(OSError):
    """A folder the compiled artifacts go to cannot be written: raised at setup, before any training."""


#: The environment variable that moves the default compile cache (a folder) or turns it off (``off``).
CACHE_ENV = "SGDTP_COMPILE_CACHE"
CACHE_OFF = ("", "0", "off", "false", "no", "none")
_warned: dict[str, str] = {}


def platform_cache_root() -> Path:
    """The platform's per-user cache directory: ``$XDG_CACHE_HOME`` or ``~/.cache`` (Linux), ``~/Library/Caches``
    (macOS), ``%LOCALAPPDATA%`` (Windows)."""
    import sys

    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches"
    if os.name == "nt":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def default_cache_folder() -> Path | None:
    """The compile cache a job uses with no option (``compile_cache="auto"``): ``$SGDTP_COMPILE_CACHE`` (a folder, or
    ``off``), else ``lightning_sgdtp/compile`` in :func:`platform_cache_root`. None when it is off, or when the folder
    cannot be written: then a warning (once per process; :func:`default_cache_problem` says it again for the rank-0
    log) and the job compiles without the cache; never an error."""
    folder = _default_folder()
    if folder is None:
        return None
    try:
        _probe(folder)
    except OSError as err:
        if str(folder) not in _warned:
            _warned[str(folder)] = (
                f"the default compile cache {folder} cannot be written ({err.strerror or err}); compiling without"
                f" it. Set {CACHE_ENV} to a writable folder, or {CACHE_ENV}=off to silence this."
            )
            import warnings

            warnings.warn(f"sgdtp: {_warned[str(folder)]}", stacklevel=2)
        return None
    _warned.pop(str(folder), None)
    return folder


def default_cache_problem() -> str | None:
    """Why the default compile cache is not used although it is on (its folder cannot be written), or None."""
    folder = _default_folder()
    return _warned.get(str(folder)) if folder is not None else None


def _default_folder() -> Path | None:
    """Where the default compile cache is (not checked): ``$SGDTP_COMPILE_CACHE``, or the platform's cache directory;
    None when the variable turns it off."""
    env = os.environ.get(CACHE_ENV)
    if env is not None and env.strip().lower() in CACHE_OFF:
        return None
    return Path(env) if env else platform_cache_root() / "lightning_sgdtp" / "compile"


def _probe(folder: Path) -> None:
    """Create ``folder`` and write (then remove) a file in it; raises OSError when that fails."""
    probe = folder / f".sgdtp-write-probe-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"")
    probe.unlink()


def check_cache_folders(compile_cache: str | os.PathLike | None) -> list[Path]:
    """Create and write a probe file in every folder this job's compiles write to: Inductor's cache
    (``TORCHINDUCTOR_CACHE_DIR``, else its default under the temporary folder) and, with ``compile_cache``, that
    folder. Returns the folders; raises :class:`CacheFolderError` naming the folder and the fix."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    inductor_fix = (
        "Point TORCHINDUCTOR_CACHE_DIR at a writable local folder (export TORCHINDUCTOR_CACHE_DIR=/tmp/$USER-inductor)"
    )
    folders = [
        (Path(env or default_cache_dir()), "TORCHINDUCTOR_CACHE_DIR" if env else "Inductor's default", inductor_fix)
    ]
    if compile_cache is not None:
        fix = "Pass SGDTPStrategy(compile_cache=...) a folder every node can write (a shared file system), or drop it"
        folders.append((Path(compile_cache), "compile_cache", fix))
    for folder, what, fix in folders:
        try:
            _probe(folder)
        except OSError as err:
            raise CacheFolderError(
                f"the compile cache folder {folder} ({what}) cannot be written ({err.strerror or err}); compiled"
                f" graphs are written there before the first step. {fix}."
            ) from err
    return [folder for folder, _, _ in folders]
