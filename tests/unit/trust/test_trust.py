"""Signed SHA256 manifests: sign a folder, then flip bytes, truncate, add and remove files, tamper with the
manifest, use a key the keyring does not trust. Each is refused with the file and the failed check named.

GnuPG keys are made in a temporary GNUPGHOME (no passphrase, ed25519, seconds); PEM keys with `cryptography`.
The `sgdtp sign` / `sgdtp verify` commands: tests/integration/test_cli.py; one-file checkpoints, which keep their
manifest inside: tests/unit/trust/test_sealed.py; the strategy's checkpoints, verified before unpickling:
tests/distributed/test_checkpoints_and_resume.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from helpers.signing import gpg_identities
from helpers.signing import make_artifact as _artifact

from lightning_sgdtp.trust import MANIFEST, ArtifactVerificationError, sign_dir, verify_dir


@pytest.fixture(scope="module")
def gpg_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path | str]]:
    """Two signing identities in one GNUPGHOME, and a keyring that trusts only the first."""
    with gpg_identities(tmp_path_factory.mktemp("gnupg")) as keys:
        yield keys


def _refused(root: Path, trusted: Path | None, check: str, name: str) -> str:
    with pytest.raises(ArtifactVerificationError) as info:
        verify_dir(root, trusted=trusted)
    assert info.value.check == check and info.value.path.endswith(name), str(info.value)
    return str(info.value)


def test_gpg_signed_folder_verifies_and_every_tampering_is_refused(tmp_path: Path, gpg_keys: dict) -> None:
    root = _artifact(tmp_path / "ckpt")
    sign_dir(root, gpg_key=gpg_keys["trusted"], gnupg_home=str(gpg_keys["home"]))
    keyring = gpg_keys["keyring"]
    verify_dir(root, trusted=keyring)

    data = (root / "model.ckpt").read_bytes()
    (root / "model.ckpt").write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # one bit
    assert "(the content was changed)" in _refused(root, keyring, "SHA256", "model.ckpt")
    (root / "model.ckpt").write_bytes(data[:2048])
    assert "truncated" in _refused(root, keyring, "size", "model.ckpt")
    (root / "model.ckpt").write_bytes(data)
    verify_dir(root, trusted=keyring)

    (root / "extra.py").write_text("import os")
    assert "added after signing" in _refused(root, keyring, "manifest", "extra.py")
    (root / "extra.py").unlink()
    (root / "shards" / "rank0.bin").unlink()
    assert "missing" in _refused(root, keyring, "presence", "rank0.bin")


def test_gpg_signature_checks(tmp_path: Path, gpg_keys: dict) -> None:
    root = _artifact(tmp_path / "a")
    sign_dir(root)  # a manifest, no signature
    assert "unsigned" in _refused(root, gpg_keys["keyring"], "signature", MANIFEST)
    verify_dir(root)  # hashes only: fine without a keyring

    sign_dir(root, gpg_key=gpg_keys["stranger"], gnupg_home=str(gpg_keys["home"]))
    assert "gpgv did not accept it" in _refused(root, gpg_keys["keyring"], "signature", MANIFEST)

    sign_dir(root, gpg_key=gpg_keys["trusted"], gnupg_home=str(gpg_keys["home"]))
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["files"][0]["sha256"] = "0" * 64  # rewrite the manifest to match a forged file: the signature breaks
    (root / MANIFEST).write_text(json.dumps(manifest))
    _refused(root, gpg_keys["keyring"], "signature", MANIFEST)


@pytest.mark.parametrize("kind", ["ed25519", "rsa", "ec"])
def test_pem_signature_fallback(tmp_path: Path, kind: str) -> None:
    def pair(name: str) -> tuple[Path, Path]:
        key = {
            "ed25519": lambda: ed25519.Ed25519PrivateKey.generate(),
            "rsa": lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048),
            "ec": lambda: ec.generate_private_key(ec.SECP256R1()),
        }[kind]()
        private, public = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub.pem"
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        return private, public

    (mine, my_public), (_, other_public) = pair("mine"), pair("other")
    root = _artifact(tmp_path / "art")
    sign_dir(root, pem_key=mine)
    verify_dir(root, trusted=my_public)
    assert "does not match public key" in _refused(root, other_public, "signature", MANIFEST)
    (root / "plan.json").write_text(json.dumps({"buckets": 4}))
    _refused(root, my_public, "SHA256", "plan.json")
