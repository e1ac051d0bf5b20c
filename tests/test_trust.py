"""Signed SHA256 manifests: sign a folder, then flip bytes, truncate, add and remove files, tamper with the
manifest, use a key the keyring does not trust. Each is refused with the file and the failed check named.

GnuPG keys are made in a temporary GNUPGHOME (no passphrase, ed25519, seconds); PEM keys with `cryptography`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from lightning_sgdtp.trust import MANIFEST, ArtifactVerificationError, sign_dir, verify_dir

REPO = Path(__file__).resolve().parents[1]


def _gpg(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["gpg", "--homedir", str(home), "--batch", *args], capture_output=True, check=True)


@pytest.fixture(scope="module")
def gpg_keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | str]:
    """Two signing identities in one GNUPGHOME, and a keyring that trusts only the first."""
    home = tmp_path_factory.mktemp("gnupg")
    home.chmod(0o700)
    for who in ("trusted", "stranger"):
        _gpg(home, "--passphrase", "", "--quick-gen-key", f"{who} <{who}@sgdtp.test>", "ed25519", "sign", "never")
    keyring = home / "trusted.gpg"
    keyring.write_bytes(_gpg(home, "--export", "trusted@sgdtp.test").stdout)
    return {"home": home, "keyring": keyring, "trusted": "trusted@sgdtp.test", "stranger": "stranger@sgdtp.test"}


def _artifact(root: Path) -> Path:
    (root / "shards").mkdir(parents=True)
    (root / "model.ckpt").write_bytes(os.urandom(4096))
    (root / "shards" / "rank0.bin").write_bytes(b"\x00" * 1000)
    (root / "plan.json").write_text(json.dumps({"buckets": 3}))
    return root


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


def test_cli_sign_and_verify(tmp_path: Path, gpg_keys: dict) -> None:
    root = _artifact(tmp_path / "run")
    cli = [sys.executable, "-m", "lightning_sgdtp.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    signed = subprocess.run(
        [*cli, "sign", str(root), "--gpg-key", gpg_keys["trusted"], "--gnupg-home", str(gpg_keys["home"])],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert signed.returncode == 0 and "and signed" in signed.stdout, signed.stderr
    verify = [*cli, "verify", str(root), "--keyring", str(gpg_keys["keyring"])]
    ok = subprocess.run(verify, capture_output=True, text=True, env=env, check=False)
    assert ok.returncode == 0 and "signature and every file verified" in ok.stdout, ok.stderr
    (root / "plan.json").write_text("{}")
    bad = subprocess.run(verify, capture_output=True, text=True, env=env, check=False)
    assert bad.returncode == 1 and "plan.json: size check failed" in bad.stderr, bad.stderr


# ---------------------------------------------------------------------------------------------------------------
# The strategy's checkpoints: written with a manifest (signed with signing_key), verified before torch.load.

CHECKPOINT_JOB = r"""
import os, sys, torch, lightning.pytorch as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_sgdtp import SGDTPStrategy
from lightning_sgdtp.trust import ArtifactVerificationError

root, part = sys.argv[1], sys.argv[2]
kwargs = eval(sys.argv[3])

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

loaded = []
real_load = torch.load
torch.load = lambda *a, **k: loaded.append(a[0]) or real_load(*a, **k)  # records every unpickling
trainer = L.Trainer(
    strategy=SGDTPStrategy(**kwargs), accelerator="cpu", devices=1, max_steps=2 if part == "train" else 4,
    logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_last=True)],
)
data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)
try:
    trainer.fit(Net(), data, ckpt_path=None if part == "train" else os.path.join(root, "ckpt", "last.ckpt"))
    print("RESULT ok", trainer.global_step)
except ArtifactVerificationError as err:
    print("RESULT refused", err.check, os.path.basename(err.path), "unpickled:", len(loaded))
    print(err)
"""


def _job(root: Path, part: str, **kwargs: object) -> str:
    result = subprocess.run(
        [sys.executable, "-c", CHECKPOINT_JOB, str(root), part, repr(kwargs)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))


def test_strategy_checkpoints_are_verified_before_unpickling(tmp_path: Path) -> None:
    assert _job(tmp_path, "train") == "RESULT ok 2"
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert sorted(e["path"] for e in manifest["files"]) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert _job(tmp_path, "resume") == "RESULT ok 4"  # verified, then loaded

    last = tmp_path / "ckpt" / "last.ckpt"
    good = last.read_bytes()
    last.write_bytes(good[: len(good) // 2])
    assert _job(tmp_path, "resume") == "RESULT refused size last.ckpt unpickled: 0"
    last.write_bytes(good[:-9] + bytes([good[-9] ^ 0xFF]) + good[-8:])
    assert _job(tmp_path, "resume") == "RESULT refused SHA256 last.ckpt unpickled: 0"
    last.write_bytes(good)
    (tmp_path / "ckpt" / MANIFEST).unlink()  # a checkpoint that nothing vouches for
    assert _job(tmp_path, "resume") == "RESULT refused manifest ckpt unpickled: 0"
    assert _job(tmp_path, "resume", verify_artifacts=False) == "RESULT ok 4"


def test_signed_checkpoints_need_the_trusted_key(tmp_path: Path) -> None:
    private, public, other = tmp_path / "k.pem", tmp_path / "k.pub.pem", tmp_path / "other.pub.pem"
    key = ed25519.Ed25519PrivateKey.generate()
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    for path, k in ((public, key), (other, ed25519.Ed25519PrivateKey.generate())):
        path.write_bytes(
            k.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
    run = tmp_path / "run"
    assert _job(run, "train", signing_key=str(private)) == "RESULT ok 2"
    assert (run / "ckpt" / f"{MANIFEST}.pem-sig").exists()
    assert _job(run, "resume", trusted_key=str(public)) == "RESULT ok 4"
    assert _job(run, "resume", trusted_key=str(other)) == f"RESULT refused signature {MANIFEST} unpickled: 0"
    unsigned = tmp_path / "unsigned"
    assert _job(unsigned, "train") == "RESULT ok 2"
    assert _job(unsigned, "resume", trusted_key=str(public)) == f"RESULT refused signature {MANIFEST} unpickled: 0"


def test_a_save_never_fails_on_an_unreadable_manifest(tmp_path: Path) -> None:
    """The checkpoint writer rebuilds a broken manifest (listing what it writes) instead of failing the save."""
    from lightning_sgdtp.trust.manifest import record_files

    (tmp_path / MANIFEST).write_text("{not json")
    (tmp_path / "last.ckpt").write_bytes(b"x" * 10)
    manifest = record_files(tmp_path, ["last.ckpt"])
    assert [e["path"] for e in manifest["files"]] == ["last.ckpt"] and manifest["files"][0]["size"] == 10
