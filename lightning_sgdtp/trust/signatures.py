"""Detached signatures of a manifest: OpenPGP made with ``gpg`` and checked with ``gpgv`` against a keyring,
or, for sites without GnuPG, a PEM key pair (Ed25519, RSA or EC) through the ``cryptography`` package.

We call GnuPG's own tools rather than re-implement OpenPGP: ``gpgv`` is the verifier distributions use for
their packages, and takes exactly a keyring of trusted keys.
"""

from __future__ import annotations

import shutil
import subprocess
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


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise ArtifactVerificationError(cmd[-1], "signature", f"`{cmd[0]}` is not installed (GnuPG); use a PEM key")
    return subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)


def _existing_signature(manifest: Path, name: str) -> Path:
    """The signature file ``name`` next to ``manifest``; refused when there is none (the manifest is unsigned)."""
    signature = manifest.with_name(name)
    if not signature.exists():
        raise ArtifactVerificationError(manifest, "signature", f"there is no {name} (the manifest is unsigned)")
    return signature


def gpg_sign(manifest: Path, key: str, gnupg_home: str | None = None) -> Path:
    """Write ``MANIFEST.sig``, a detached OpenPGP signature made by ``key`` (a key id, fingerprint or email)."""
    out = manifest.with_name(GPG_SIGNATURE)
    home = ["--homedir", gnupg_home] if gnupg_home else []
    cmd = ["gpg", *home, "--batch", "--yes", "--local-user", key, "--output", str(out), "--detach-sign", str(manifest)]
    result = _run(cmd)
    if result.returncode != 0:
        raise RuntimeError(f"sgdtp: gpg could not sign {manifest} with key {key!r}: {result.stderr.strip()}")
    return out


def gpgv_verify(manifest: Path, keyring: Path) -> str:
    """Check ``MANIFEST.sig`` with ``gpgv`` against ``keyring`` (only its keys are trusted). Returns gpgv's report."""
    signature = _existing_signature(manifest, GPG_SIGNATURE)
    result = _run(["gpgv", "--keyring", str(Path(keyring).resolve()), str(signature), str(manifest)])
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        raise ArtifactVerificationError(
            manifest, "signature", f"gpgv did not accept it against keyring {keyring}: {' / '.join(lines[-2:])}"
        )
    return result.stderr.strip()


def pem_sign(manifest: Path, private_key: Path) -> Path:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

    key: Any = serialization.load_pem_private_key(Path(private_key).read_bytes(), password=None)
    data = manifest.read_bytes()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        signature = key.sign(data)
    elif isinstance(key, rsa.RSAPrivateKey):
        signature = key.sign(data, _pss(padding, hashes), hashes.SHA256())
    elif isinstance(key, ec.EllipticCurvePrivateKey):
        signature = key.sign(data, ec.ECDSA(hashes.SHA256()))
    else:
        raise TypeError(f"sgdtp: {private_key}: unsupported key type {type(key).__name__} (use Ed25519, RSA or EC)")
    out = manifest.with_name(PEM_SIGNATURE)
    out.write_bytes(signature)
    return out


def pem_verify(manifest: Path, public_key: Path) -> None:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

    signature_path = _existing_signature(manifest, PEM_SIGNATURE)
    key: Any = serialization.load_pem_public_key(Path(public_key).read_bytes())
    data, signature = manifest.read_bytes(), signature_path.read_bytes()
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, _pss(padding, hashes), hashes.SHA256())
        elif isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        else:
            raise ArtifactVerificationError(manifest, "signature", f"unsupported key type {type(key).__name__}")
    except InvalidSignature as exc:
        raise ArtifactVerificationError(
            manifest, "signature", f"the PEM signature does not match public key {public_key}"
        ) from exc


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
    gpg_key = signing_key.removeprefix("gpg:") if signing_key and signing_key.startswith("gpg:") else None
    pem_key = Path(signing_key) if signing_key and gpg_key is None else None
    return sign_dir(root, gpg_key=gpg_key, pem_key=pem_key, manifest_data=manifest_data)


def verify_dir(root: Path, trusted: Path | None = None, only: list[str] | None = None) -> None:
    """Verify ``root``: the manifest's signature against ``trusted`` (a gpg keyring, or a PEM public key) when
    given, then the size and SHA256 of ``only`` these files (default: all files, and no others)."""
    root = Path(root)
    manifest = read_manifest(root)
    if trusted is not None:
        if is_pem_public_key(Path(trusted)):
            pem_verify(root / MANIFEST, Path(trusted))
        else:
            gpgv_verify(root / MANIFEST, Path(trusted))
    verify_files(root, manifest, only)
