"""GnuPG identities and a small artifact folder, for the tests of signed manifests (unit and CLI)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


def gpg(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["gpg", "--homedir", str(home), "--batch", *args], capture_output=True, check=True)


def make_gpg_keys(home: Path) -> dict[str, Path | str]:
    """Two signing identities in one GNUPGHOME (no passphrase, ed25519, seconds), and a keyring that trusts only
    the first."""
    home.chmod(0o700)
    for who in ("trusted", "stranger"):
        gpg(home, "--passphrase", "", "--quick-gen-key", f"{who} <{who}@sgdtp.test>", "ed25519", "sign", "never")
    keyring = home / "trusted.gpg"
    keyring.write_bytes(gpg(home, "--export", "trusted@sgdtp.test").stdout)
    return {"home": home, "keyring": keyring, "trusted": "trusted@sgdtp.test", "stranger": "stranger@sgdtp.test"}


@contextlib.contextmanager
def gpg_identities(home: Path) -> Iterator[dict[str, Path | str]]:
    """:func:`make_gpg_keys` for the duration of a fixture; then the gpg-agent that signing started for ``home`` is
    stopped (left alone, each test session leaves agents running after it)."""
    try:
        yield make_gpg_keys(home)
    finally:
        subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], capture_output=True, check=False)


def make_artifact(root: Path) -> Path:
    """A folder to sign: a random checkpoint, a file in a subfolder, a small JSON file."""
    (root / "shards").mkdir(parents=True)
    (root / "model.ckpt").write_bytes(os.urandom(4096))
    (root / "shards" / "rank0.bin").write_bytes(b"\x00" * 1000)
    (root / "plan.json").write_text(json.dumps({"buckets": 3}))
    return root


def make_pem_keys(folder: Path, name: str) -> tuple[Path, Path]:
    """An Ed25519 key pair as PEM files: (private, public)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    key = ed25519.Ed25519PrivateKey.generate()
    private, public = folder / f"{name}.pem", folder / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public
