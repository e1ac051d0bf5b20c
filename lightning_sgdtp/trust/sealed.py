"""Seals: the manifest of a one-file checkpoint kept inside the file, so that a checkpoint folder lists the
checkpoints and nothing else (what ``ddp`` writes there), and a copy of the one file (``cp``, ``rsync``) keeps its
hashes and signature.

``torch.save`` writes a zip archive: records ``ARCHIVE/data.pkl``, ``ARCHIVE/data/0``, ..., then the zip's directory.
``torch.load`` reads the records it names (``data.pkl``, ``data/N``, ``.format_version``, ``byteorder``,
``.storage_alignment``: torch 2.13's ``serialization._load``) and no other; its reader requires every record to be
under ``ARCHIVE/``. A seal is up to three more records there, after torch's (:func:`seal`):

- ``ARCHIVE/.sgdtp/SGDTP-MANIFEST.json``: the size and SHA256 of the bytes before the seal (every record torch
  wrote, headers included), and the directory entry of each of those records (name, offset, sizes, CRC): a changed
  directory cannot point a name at other bytes;
- ``ARCHIVE/.sgdtp/SGDTP-MANIFEST.json.sig`` / ``.pem-sig``: its detached signature (gpg, PEM), as beside a folder's
  manifest.

:func:`verify_file` reads the zip's directory and the seal (the end of the file), checks the signature and the
directory, then hashes the bytes before the seal: one read of the file, as hashing the whole file did, and nothing is
unpickled. A checkpoint written before seals is checked against the ``SGDTP-MANIFEST.json`` beside it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path
from typing import IO, Any

from lightning_sgdtp.trust.durable import write_atomically
from lightning_sgdtp.trust.manifest import MANIFEST, ArtifactVerificationError, read_manifest
from lightning_sgdtp.trust.signatures import (
    GPG_SIGNATURE,
    PEM_SIGNATURE,
    check_signature,
    sign_bytes,
    sign_dir,
    verify_dir,
)

SEAL_DIR = ".sgdtp"
FORMAT = "sgdtp-seal/1"
_NO_TIME = (1980, 1, 1, 0, 0, 0)  # the seal's records carry no time: a checkpoint seals to the same bytes


def _seal_names(archive: zipfile.ZipFile) -> dict[str, str]:
    """Where the seal's records go: under the archive's folder, which torch's reader takes from the first record."""
    first = archive.infolist()[0].filename if archive.infolist() else ""
    if "/" not in first:
        raise ValueError(f"{archive.filename or 'the file'} is not a torch.save archive (no ARCHIVE/ folder)")
    prefix = first.split("/")[0]
    return {name: f"{prefix}/{SEAL_DIR}/{name}" for name in (MANIFEST, GPG_SIGNATURE, PEM_SIGNATURE)}


def _entry(info: zipfile.ZipInfo) -> dict[str, Any]:
    """What the zip's directory says about a record: where its header is and what reading it yields."""
    return {
        "name": info.filename,
        "offset": info.header_offset,
        "size": info.file_size,
        "stored": info.compress_size,
        "crc": info.CRC,
        "method": info.compress_type,
        "flags": info.flag_bits,
    }


def _sha256_head(f: IO[bytes], size: int, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    f.seek(0)
    while size > 0 and (block := f.read(min(chunk, size))):
        digest.update(block)
        size -= len(block)
    return digest.hexdigest()


def seal(f: IO[bytes], gpg_key: str | None = None, gnupg_home: str | None = None, pem_key: Path | None = None) -> None:
    """Append a seal (signed with a key when given) to the ``torch.save`` archive in ``f``, a file open for reading
    and writing; a seal it has already is replaced."""
    if not zipfile.is_zipfile(f):  # append mode would add a zip archive after whatever the file holds
        raise ValueError("not a torch.save archive (not a zip file): nothing to seal")
    f.seek(0)
    with zipfile.ZipFile(f, "a") as archive:
        names = _seal_names(archive)
        old = [i for i in archive.infolist() if i.filename in names.values()]
        records = [i for i in archive.infolist() if i.filename not in names.values()]
        if old:
            _forget(archive, old, records)
        end = archive.start_dir  # where the directory starts: zipfile appends there, right after torch's records
        manifest = {
            "format": FORMAT,
            "size": end,
            "sha256": _sha256_head(f, end),
            "records": list(map(_entry, records)),
        }
        data = json.dumps(manifest, indent=1).encode()
        for name, content in {MANIFEST: data, **sign_bytes(data, gpg_key, gnupg_home, pem_key)}.items():
            archive.writestr(zipfile.ZipInfo(names[name], date_time=_NO_TIME), content)


def _forget(archive: zipfile.ZipFile, old: list[zipfile.ZipInfo], records: list[zipfile.ZipInfo]) -> None:
    """Drop the seal ``old`` (the archive's last records): the next record is written where it began, and zipfile
    writes a new directory on close and cuts off what followed (its append mode; no public API removes a record)."""
    start = min(i.header_offset for i in old)
    if any(i.header_offset > start for i in records):
        raise ValueError("records were added after the seal; save the checkpoint again with torch.save")
    for info in old:
        archive.filelist.remove(info)
        del archive.NameToInfo[info.filename]
    archive.start_dir = start
    archive._didModify = True


def seal_file(
    path: Path, gpg_key: str | None = None, gnupg_home: str | None = None, pem_key: Path | None = None
) -> None:
    """Seal a ``torch.save`` file written without one, or seal it again (another key): a sealed copy beside it, then
    a rename, so that a crash leaves the file as it was."""
    path = Path(path)

    def write(f: IO[bytes]) -> None:
        with open(path, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 24)
        seal(f, gpg_key, gnupg_home, pem_key)

    write_atomically(path, write)


def is_sealed(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(set(_seal_names(archive).values()) & set(archive.namelist()))
    except (OSError, ValueError, zipfile.BadZipFile):
        return False


def is_torch_archive(path: Path) -> bool:
    """A ``torch.save`` file (a zip archive with ``ARCHIVE/data.pkl``): what a one-file checkpoint is."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") and name.count("/") == 1 for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def verify_file(path: Path, trusted: Path | None = None) -> None:
    """Refuse a one-file checkpoint that its seal (or, written before seals, the ``SGDTP-MANIFEST.json`` beside it)
    does not vouch for, with the signature checked against ``trusted`` (a gpg keyring or a PEM public key) when
    given. Raises :class:`ArtifactVerificationError`; nothing is unpickled."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactVerificationError(path, "presence", "there is no such file")
    damage = None
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        damage = exc
    else:
        with archive:
            try:
                names = _seal_names(archive)
            except ValueError:  # a zip archive, not torch's
                names = {}
            if set(names.values()) & set(archive.namelist()):
                return _verify_seal(path, archive, names, trusted)
    if (path.parent / MANIFEST).is_file():  # the previous layout: the folder's manifest lists the file
        return verify_dir(path.parent, trusted=trusted, only=[path.name])
    if damage is not None and _begins_as_zip(path):
        raise ArtifactVerificationError(
            path, "archive", f"it begins as a zip archive but does not end as one ({damage}): truncated, or changed"
        )
    raise ArtifactVerificationError(
        path,
        "manifest",
        f"it carries no seal (another tool wrote it) and no {MANIFEST} beside it lists it. If you trust it, run"
        f" `sgdtp sign {path}`; for a checkpoint you do not want verified, pass SGDTPStrategy(verify_artifacts=False).",
    )


def _begins_as_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _verify_seal(path: Path, archive: zipfile.ZipFile, names: dict[str, str], trusted: Path | None) -> None:
    infos = archive.infolist()
    if len({i.filename for i in infos}) != len(infos):
        raise ArtifactVerificationError(path, "archive", "two records have the same name (torch.load may read either)")
    present = set(archive.namelist())
    if names[MANIFEST] not in present:
        raise ArtifactVerificationError(path, "manifest", f"its seal has no {MANIFEST}")
    try:
        data = archive.read(names[MANIFEST])
        signatures = {n: archive.read(names[n]) for n in (GPG_SIGNATURE, PEM_SIGNATURE) if names[n] in present}
    except (zipfile.BadZipFile, OSError) as exc:
        raise ArtifactVerificationError(path, "archive", f"its seal is not readable ({exc})") from exc
    if trusted is not None:
        check_signature(data, signatures, Path(trusted), path)
    try:
        manifest = json.loads(data)
        well_formed = isinstance(manifest["size"], int) and isinstance(manifest["sha256"], str)
        sealed = {e["name"]: e for e in manifest["records"]} if manifest["format"] == FORMAT and well_formed else None
    except (ValueError, TypeError, KeyError):
        sealed = None
    if sealed is None:
        raise ArtifactVerificationError(path, "manifest", f"its seal is not a {FORMAT} manifest")
    records = {i.filename: _entry(i) for i in infos if i.filename not in names.values()}
    for name, entry in records.items():
        if name not in sealed:
            raise ArtifactVerificationError(path, "manifest", f"the record {name} was added after sealing")
        if entry != sealed[name]:
            raise ArtifactVerificationError(
                path,
                "manifest",
                f"the zip directory's entry of {name} is not the sealed one: {entry} != {sealed[name]}",
            )
    if missing := sorted(set(sealed) - set(records)):
        raise ArtifactVerificationError(path, "presence", f"the sealed record {missing[0]} is missing")
    size, sealed_size = path.stat().st_size, manifest["size"]
    if size < sealed_size or any(i.header_offset < sealed_size for i in infos if i.filename in names.values()):
        raise ArtifactVerificationError(path, "size", f"{size} bytes, the seal covers {sealed_size} (truncated?)")
    with open(path, "rb") as f:
        digest = _sha256_head(f, sealed_size)
    if digest != manifest["sha256"]:
        raise ArtifactVerificationError(
            path, "SHA256", f"{digest}, the seal says {manifest['sha256']} (the content was changed)"
        )


def retire_manifest(folder: Path) -> None:
    """Remove the previous layout's ``SGDTP-MANIFEST.json`` (and its signatures) from a checkpoint folder once no
    file it lists is there unsealed any more (each removed, or written again with a seal). Until then it stays: it
    vouches for the checkpoints written before seals."""
    folder = Path(folder)
    if not (folder / MANIFEST).is_file():
        return
    try:
        listed = [folder / e["path"] for e in read_manifest(folder)["files"]]
    except (ArtifactVerificationError, KeyError, TypeError):
        return  # not readable: left as it is
    if any(p.is_file() and not is_sealed(p) for p in listed):
        return
    for stale in [folder / MANIFEST, *folder.glob(f"{MANIFEST}.*")]:
        stale.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ `sgdtp sign` / `verify`
def checkpoint_files(folder: Path) -> list[Path] | None:
    """The files of ``folder`` when every one is a one-file checkpoint (what ``ModelCheckpoint`` writes; a previous
    layout's manifest and unfinished writes aside), else None."""
    entries = [
        p
        for p in sorted(Path(folder).iterdir())
        if not p.name.startswith(MANIFEST) and not (p.name.startswith(".") and ".tmp-" in p.name)
    ]
    return entries if entries and all(p.is_file() and is_torch_archive(p) for p in entries) else None


def sign_path(
    path: Path, gpg_key: str | None = None, gnupg_home: str | None = None, pem_key: Path | None = None
) -> list[Path]:
    """Seal a one-file checkpoint, or each file of a folder of them (the previous layout's manifest then goes); any
    other folder (sharded checkpoint, compile cache, exported model) gets ``SGDTP-MANIFEST.json``. Returns what was
    written."""
    path = Path(path)
    if path.is_file() and not is_torch_archive(path):
        raise ValueError(f"{path} is not a torch.save file: sign the folder it is in (`sgdtp sign {path.parent}`)")
    files = [path] if path.is_file() else checkpoint_files(path) if path.is_dir() else None
    if files is None:
        return [sign_dir(path, gpg_key=gpg_key, gnupg_home=gnupg_home, pem_key=pem_key)]
    for file in files:
        seal_file(file, gpg_key, gnupg_home, pem_key)
    retire_manifest(files[0].parent)
    return files


def verify_path(path: Path, trusted: Path | None = None) -> None:
    """Verify a one-file checkpoint, each file of a folder of them, or any other folder against its
    ``SGDTP-MANIFEST.json`` (every file, and no other)."""
    path = Path(path)
    if path.is_file():
        return verify_file(path, trusted)
    files = checkpoint_files(path) if path.is_dir() else None
    if files is None:
        return verify_dir(path, trusted=trusted)
    for file in files:
        verify_file(file, trusted)
    return None
