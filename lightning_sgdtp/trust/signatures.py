"""Detached signatures of a manifest: OpenPGP made with ``gpg`` and checked with ``gpgv`` against a keyring,
or, for sites without GnuPG, a PEM key pair (Ed25519, RSA or EC) through the ``cryptography`` package.

We call GnuPG's own tools rather than re-implement OpenPGP: ``gpgv`` is the verifier distributions use for
their packages, and takes exactly a keyring of trusted keys.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from lightning_sgdtp.trust.manifest import (
    MANIFEST,
    ArtifactVerificationError,
    read_manifest,
    verify_files,
    write_manifest,
)

GPG_SIGNATURE = f"{MANIFEST}.sig"
PEM_SIGNATURE = f"{MANIFEST}.pem-sig"


def _run(cmd: list[str], data: bytes | None = None) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise ArtifactVerificationError(cmd[0], "signature", f"`{cmd[0]}` is not installed (GnuPG); use a PEM key")
    return subprocess.run(cmd, input=data, capture_output=True, check=False, timeout=120)


def _stderr(result: subprocess.CompletedProcess) -> str:
    return result.stderr.decode(errors="replace").strip()


# ------------------------------------------------------------------------------------------ bytes
def gpg_sign_bytes(data: bytes, key: str, gnupg_home: str | None = None) -> bytes:
    """A detached OpenPGP signature of ``data`` made by ``key`` (a key id, fingerprint or email)."""
    home = ["--homedir", gnupg_home] if gnupg_home else []
    result = _run(["gpg", *home, "--batch", "--yes", "--local-user", key, "--output", "-", "--detach-sign"], data)
    if result.returncode != 0:
        raise RuntimeError(f"sgdtp: gpg could not sign with key {key!r}: {_stderr(result)}")
    return result.stdout


def gpgv_check(data: bytes, signature: bytes, keyring: Path, what: Path | str) -> str:
    """Check ``signature`` of ``data`` with ``gpgv`` against ``keyring`` (only its keys are trusted); refusals name
    ``what``. Returns gpgv's report."""
    with tempfile.TemporaryDirectory(prefix="sgdtp-gpgv-") as tmp:
        (Path(tmp) / "signature").write_bytes(signature)
        cmd = ["gpgv", "--keyring", str(Path(keyring).resolve()), str(Path(tmp) / "signature"), "-"]
        result = _run(cmd, data)
    if result.returncode != 0:
        lines = [line for line in _stderr(result).splitlines() if line.strip()]
        raise ArtifactVerificationError(
            what, "signature", f"gpgv did not accept it against keyring {keyring}: {' / '.join(lines[-2:])}"
        )
    return _stderr(result)


def pem_sign_bytes(data: bytes, private_key: Path) -> bytes:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

    key: Any = serialization.load_pem_private_key(Path(private_key).read_bytes(), password=None)
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, _pss(padding, hashes), hashes.SHA256())
    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    raise TypeError(f"sgdtp: {private_key}: unsupported key type {type(key).__name__} (use Ed25519, RSA or EC)")


def pem_check(data: bytes, signature: bytes, public_key: Path, what: Path | str) -> None:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

    key: Any = serialization.load_pem_public_key(Path(public_key).read_bytes())
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, _pss(padding, hashes), hashes.SHA256())
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        else:
            raise ArtifactVerificationError(what, "signature", f"unsupported key type {type(key).__name__}")
    except InvalidSignature as exc:
        raise ArtifactVerificationError(
            what, "signature", f"the PEM signature does not match public key {public_key}"
        ) from exc


def sign_bytes(
    data: bytes, gpg_key: str | None = None, gnupg_home: str | None = None, pem_key: Path | None = None
) -> dict[str, bytes]:
    """The detached signatures of a manifest's bytes, by the name they are kept under (none without a key)."""
    signatures = {}
    if gpg_key:
        signatures[GPG_SIGNATURE] = gpg_sign_bytes(data, gpg_key, gnupg_home)
    if pem_key:
        signatures[PEM_SIGNATURE] = pem_sign_bytes(data, Path(pem_key))
    return signatures


def check_signature(data: bytes, signatures: dict[str, bytes], trusted: Path, what: Path | str) -> None:
    """Refuse ``data`` (a manifest) unless its signature of ``trusted``'s kind (a gpg keyring, a PEM public key)
    is among ``signatures`` and verifies; refusals name ``what``."""
    name = PEM_SIGNATURE if is_pem_public_key(Path(trusted)) else GPG_SIGNATURE
    if name not in signatures:
        raise ArtifactVerificationError(what, "signature", f"there is no {name} (the manifest is unsigned)")
    if name == PEM_SIGNATURE:
        pem_check(data, signatures[name], Path(trusted), what)
    else:
        gpgv_check(data, signatures[name], Path(trusted), what)


def signing_keys(signing_key: str | None) -> tuple[str | None, Path | None]:
    """The strategy's ``signing_key`` form (``"gpg:KEY"``, a PEM private key's path, or None) as (gpg key, PEM key)."""
    gpg_key = signing_key.removeprefix("gpg:") if signing_key and signing_key.startswith("gpg:") else None
    return gpg_key, (Path(signing_key) if signing_key and gpg_key is None else None)


# ------------------------------------------------------------------------------------------ files
def gpg_sign(manifest: Path, key: str, gnupg_home: str | None = None) -> Path:
    """Write ``MANIFEST.sig``, a detached OpenPGP signature made by ``key`` (a key id, fingerprint or email)."""
    out = manifest.with_name(GPG_SIGNATURE)
    out.write_bytes(gpg_sign_bytes(manifest.read_bytes(), key, gnupg_home))
    return out


def pem_sign(manifest: Path, private_key: Path) -> Path:
    out = manifest.with_name(PEM_SIGNATURE)
    out.write_bytes(pem_sign_bytes(manifest.read_bytes(), private_key))
    return out


def _pss(padding: Any, hashes: Any) -> Any:
    return padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


def is_pem_public_key(path: Path) -> bool:
    return Path(path).read_bytes().lstrip().startswith(b"-----BEGIN PUBLIC KEY-----")


def sign_dir(
    root: Path,
    gpg_key: str | None = None,
    gnupg_home: str | None = None,
    pem_key: Path | None = None,
    manifest_data: dict[str, Any] | None = None,
) -> Path:
    """Write the manifest of ``root`` (``manifest_data``, or every file) and, with a key, its detached signature.
    Returns the manifest's path."""
    manifest = write_manifest(Path(root), manifest_data)
    if gpg_key:
        gpg_sign(manifest, gpg_key, gnupg_home)
    if pem_key:
        pem_sign(manifest, Path(pem_key))
    return manifest


def sign_with(root: Path, signing_key: str | None, manifest_data: dict[str, Any] | None = None) -> Path:
    """:func:`sign_dir` with the strategy's ``signing_key`` form: ``"gpg:KEY"``, a PEM private key's path, or None
    (manifest only)."""
    gpg_key, pem_key = signing_keys(signing_key)
    return sign_dir(root, gpg_key=gpg_key, pem_key=pem_key, manifest_data=manifest_data)


def verify_dir(root: Path, trusted: Path | None = None, only: list[str] | None = None) -> None:
    """Verify ``root``: the manifest's signature against ``trusted`` (a gpg keyring, or a PEM public key) when
    given, then the size and SHA256 of ``only`` these files (default: all files, and no others)."""
    root = Path(root)
    manifest = read_manifest(root)
    if trusted is not None:
        signatures = {n: (root / n).read_bytes() for n in (GPG_SIGNATURE, PEM_SIGNATURE) if (root / n).is_file()}
        check_signature((root / MANIFEST).read_bytes(), signatures, Path(trusted), root / MANIFEST)
    verify_files(root, manifest, only)
