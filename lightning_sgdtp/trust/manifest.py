"""SHA256 manifests: what a directory held when it was written or signed, file by file."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_sgdtp.trust.durable import write_atomically

MANIFEST = "SGDTP-MANIFEST.json"
FORMAT = "sgdtp-manifest/1"


class ArtifactVerificationError(RuntimeError):
    """An artifact failed verification. The message names the file and the check that failed."""

    def __init__(self, path: Path | str, check: str, detail: str) -> None:
        self.path, self.check = str(path), check
        super().__init__(f"sgdtp: refusing {path}: {check} check failed: {detail}")


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _is_listed(name: str) -> bool:
    """Manifests and signatures describe the files; temporary files of an atomic write are not artifacts yet."""
    return not (name.startswith(MANIFEST) or (name.startswith(".") and ".tmp-" in name))


def _entry(root: Path, rel: str) -> dict[str, Any]:
    stat = (root / rel).stat()
    return {"path": rel, "size": stat.st_size, "sha256": sha256_file(root / rel), "mtime_ns": stat.st_mtime_ns}


def _listed_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and _is_listed(p.name))


def build_manifest(root: Path, entries: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The manifest of every file under ``root``. ``entries``: already known ones (path -> entry), reused when
    their size and modification time still match, so that a checkpoint folder is not hashed again per save."""
    root = Path(root)
    files = []
    for path in _listed_files(root):
        rel = path.relative_to(root).as_posix()
        stat = path.stat()
        known = (entries or {}).get(rel)
        if known and known["size"] == stat.st_size and known.get("mtime_ns") == stat.st_mtime_ns:
            files.append(known)
            continue
        files.append(_entry(root, rel))
    return {"format": FORMAT, "files": files}


def write_manifest(root: Path, manifest: dict[str, Any] | None = None) -> Path:
    """Write ``SGDTP-MANIFEST.json`` atomically (temporary file, fsync, rename); drop signatures it outdates."""
    root = Path(root)
    if manifest is None:
        old = read_manifest(root) if (root / MANIFEST).exists() else {"files": []}
        manifest = build_manifest(root, {e["path"]: e for e in old["files"]})
    target = root / MANIFEST
    write_atomically(target, lambda f: f.write(json.dumps(manifest, indent=1, sort_keys=True).encode()))
    for stale in root.glob(f"{MANIFEST}.*"):
        stale.unlink(missing_ok=True)  # a signature of the previous manifest would no longer verify
    return target


def read_manifest(root: Path) -> dict[str, Any]:
    path = Path(root) / MANIFEST
    if not path.exists():
        raise ArtifactVerificationError(
            root,
            "manifest",
            f"there is no {MANIFEST} (the folder was never signed). If you trust its files, run `sgdtp sign {root}`;"
            " for a checkpoint you do not want verified, pass SGDTPStrategy(verify_artifacts=False).",
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactVerificationError(path, "manifest", f"it is not readable JSON ({exc})") from exc
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), list):
        raise ArtifactVerificationError(path, "manifest", f"it is not a {FORMAT} manifest")
    return manifest


def verify_files(root: Path, manifest: dict[str, Any], only: Iterable[str] | None = None) -> None:
    """Check sizes and SHA256 of the listed files (``only``: these relative paths; else all, and no extras)."""
    root = Path(root)
    entries = {e["path"]: e for e in manifest["files"]}
    wanted = list(only) if only is not None else sorted(entries)
    for rel in wanted:
        path, entry = root / rel, entries.get(rel)
        if entry is None:
            raise ArtifactVerificationError(
                path, "manifest", f"{MANIFEST} does not list this file (added after signing)"
            )
        if not path.is_file():
            raise ArtifactVerificationError(path, "presence", "the file is listed in the manifest but missing")
        size = path.stat().st_size
        if size != entry["size"]:
            raise ArtifactVerificationError(
                path, "size", f"{size} bytes, the manifest says {entry['size']} (truncated or appended to)"
            )
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise ArtifactVerificationError(
                path, "SHA256", f"{digest}, the manifest says {entry['sha256']} (the content was changed)"
            )
    if only is None:
        extra = [rel for p in _listed_files(root) if (rel := p.relative_to(root).as_posix()) not in entries]
        if extra:
            raise ArtifactVerificationError(root / extra[0], "manifest", "the file was added after signing")
