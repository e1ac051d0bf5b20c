"""Verified artifacts: SHA256 manifests of a directory, signed with GnuPG (checked with ``gpgv``) or a PEM key.

A checkpoint is code and data that a job will trust (``torch.load`` unpickles it). ``sign_dir`` writes
``SGDTP-MANIFEST.json`` (path, size and SHA256 of every file) and optionally a detached signature of it;
``verify_dir`` checks the signature first, then every file against the manifest, and raises
:class:`ArtifactVerificationError` naming the file and the check that failed. A one-file checkpoint keeps its
manifest inside (``seal_file``, ``verify_file``: :mod:`lightning_sgdtp.trust.sealed`), so that its folder lists
only checkpoints.
"""

from lightning_sgdtp.trust.manifest import (
    MANIFEST,
    ArtifactVerificationError,
    build_manifest,
    read_manifest,
    verify_files,
    write_manifest,
)
from lightning_sgdtp.trust.sealed import seal_file, verify_file
from lightning_sgdtp.trust.signatures import GPG_SIGNATURE, PEM_SIGNATURE, sign_dir, verify_dir

__all__ = [
    "GPG_SIGNATURE",
    "MANIFEST",
    "PEM_SIGNATURE",
    "ArtifactVerificationError",
    "build_manifest",
    "read_manifest",
    "seal_file",
    "sign_dir",
    "verify_dir",
    "verify_file",
    "verify_files",
    "write_manifest",
]
