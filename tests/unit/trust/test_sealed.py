"""One-file checkpoints carry their manifest inside: ModelCheckpoint's folder lists what ``ddp`` writes there (the
``.ckpt`` files, nothing else), and every checkpoint is still verified (hashes, signature) before anything is unpickled.

The saves go through the strategy's checkpoint IO (``AtomicCheckpointIO``: what ``ModelCheckpoint`` calls through the
Trainer), in the order ModelCheckpoint calls it; every ``torch.load`` is recorded, so a refusal proves nothing was
unpickled. Folder checkpoints (sharded, compile caches) keep ``SGDTP-MANIFEST.json`` inside: tests/unit/trust/test_trust.py.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.signing import gpg_identities, make_pem_keys

from lightning_sgdtp.cli import main
from lightning_sgdtp.frontends.trainer import AtomicCheckpointIO
from lightning_sgdtp.trust import MANIFEST, ArtifactVerificationError, sign_dir

SEALED = f".sgdtp/{MANIFEST}"  # the seal's manifest record, under the archive's folder


@pytest.fixture(scope="module")
def gpg_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path | str]]:
    with gpg_identities(tmp_path_factory.mktemp("gnupg")) as keys:
        yield keys


@pytest.fixture
def unpickled(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every torch.load call (Lightning's loading goes through it)."""
    calls: list[str] = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: calls.append(str(f)) or real(f, *a, **k))
    return calls


def _checkpoint(step: int) -> dict:
    return {"state_dict": {"w": torch.full((64, 64), float(step))}, "global_step": step, "optimizer_states": []}


def _refused(checkpoint_io: AtomicCheckpointIO, path: Path, check: str) -> str:
    with pytest.raises(ArtifactVerificationError) as info:
        checkpoint_io.load_checkpoint(path)
    assert info.value.check == check and Path(info.value.path) == path, str(info.value)
    return str(info.value)


def _flip(path: Path, offset: int) -> bytes:
    good = path.read_bytes()
    path.write_bytes(good[:offset] + bytes([good[offset] ^ 1]) + good[offset + 1 :])
    return good


def _seal_records(path: Path) -> list[str]:
    return sorted(n.split("/", 1)[1] for n in zipfile.ZipFile(path).namelist() if "/.sgdtp/" in n)


def test_model_checkpoint_folder_lists_only_the_checkpoints_each_verified_before_unpickling(
    tmp_path: Path, unpickled: list[str]
) -> None:
    checkpoint_io, dirpath = AtomicCheckpointIO(), tmp_path / "ckpt"
    # ModelCheckpoint(save_top_k=1, save_last=True) over two epochs: the best, last, the new best, the old one removed
    checkpoint_io.save_checkpoint(_checkpoint(2), dirpath / "epoch=0-step=2.ckpt")
    checkpoint_io.save_checkpoint(_checkpoint(2), dirpath / "last.ckpt")
    checkpoint_io.save_checkpoint(_checkpoint(4), dirpath / "epoch=1-step=4.ckpt")
    checkpoint_io.remove_checkpoint(dirpath / "epoch=0-step=2.ckpt")
    checkpoint_io.save_checkpoint(_checkpoint(4), dirpath / "last.ckpt")
    assert sorted(os.listdir(dirpath)) == ["epoch=1-step=4.ckpt", "last.ckpt"]  # what ddp's folder lists
    last = dirpath / "last.ckpt"
    assert _seal_records(last) == [SEALED]  # the hashes are inside the file
    assert checkpoint_io.load_checkpoint(last)["global_step"] == 4 and len(unpickled) == 1

    weights = last.read_bytes().index(struct.pack("<f", 4.0) * 64)  # the tensor's bytes, a record torch.load reads
    good = _flip(last, weights + 1000)
    assert "(the content was changed)" in _refused(checkpoint_io, last, "SHA256")
    last.write_bytes(good[: len(good) // 2])
    assert "truncated" in _refused(checkpoint_io, last, "archive")
    last.write_bytes(good)
    with zipfile.ZipFile(last, "a") as archive:  # a record added after the save (torch.load would read data.pkl)
        archive.writestr(f"{archive.namelist()[0].split('/')[0]}/extra.pkl", b"\x80\x04N.")
    assert "added after sealing" in _refused(checkpoint_io, last, "manifest")
    torch.save(_checkpoint(4), last)  # a checkpoint nothing vouches for (another tool wrote it)
    assert "sgdtp sign" in _refused(checkpoint_io, last, "manifest")
    assert len(unpickled) == 1  # none of the refused ones was unpickled
    assert AtomicCheckpointIO(verify=False).load_checkpoint(last)["global_step"] == 4


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("weights_only", [True, False])
def test_torch_load_ignores_the_seal(tmp_path: Path, mmap: bool, weights_only: bool) -> None:
    """torch 2.13 reads the records it names (data.pkl, data/N, byteorder, ...) and no other, in a file or mapped."""
    AtomicCheckpointIO().save_checkpoint(_checkpoint(3), tmp_path / "last.ckpt")
    loaded = torch.load(tmp_path / "last.ckpt", mmap=mmap, weights_only=weights_only)
    assert torch.equal(loaded["state_dict"]["w"], _checkpoint(3)["state_dict"]["w"]) and loaded["global_step"] == 3
    with open(tmp_path / "last.ckpt", "rb") as f:  # a file object, as fsspec gives Lightning
        assert torch.load(io.BytesIO(f.read()), weights_only=weights_only)["global_step"] == 3


@pytest.mark.parametrize("kind", ["pem", "gpg"])
def test_signed_checkpoints_need_the_trusted_key(
    tmp_path: Path, kind: str, gpg_keys: dict, monkeypatch: pytest.MonkeyPatch, unpickled: list[str]
) -> None:
    if kind == "pem":
        (mine, trusted), (theirs, _) = make_pem_keys(tmp_path, "mine"), make_pem_keys(tmp_path, "theirs")
        signing_key, other_key = str(mine), str(theirs)
    else:
        monkeypatch.setenv("GNUPGHOME", str(gpg_keys["home"]))
        trusted, signing_key = gpg_keys["keyring"], f"gpg:{gpg_keys['trusted']}"
        other_key = f"gpg:{gpg_keys['stranger']}"
    resume = AtomicCheckpointIO(trusted_key=str(trusted))
    last = tmp_path / "ckpt" / "last.ckpt"
    AtomicCheckpointIO(signing_key=signing_key).save_checkpoint(_checkpoint(2), last)
    assert os.listdir(last.parent) == ["last.ckpt"]
    assert _seal_records(last) == sorted([SEALED, f"{SEALED}.{'pem-sig' if kind == 'pem' else 'sig'}"])
    assert resume.load_checkpoint(last)["global_step"] == 2
    AtomicCheckpointIO(signing_key=other_key).save_checkpoint(_checkpoint(2), last)
    _refused(resume, last, "signature")
    AtomicCheckpointIO().save_checkpoint(_checkpoint(2), last)
    assert "unsigned" in _refused(resume, last, "signature")
    assert len(unpickled) == 1


def test_a_checkpoint_folder_of_the_previous_layout_still_verifies_loads_and_migrates(tmp_path: Path) -> None:
    """The previous version wrote SGDTP-MANIFEST.json (and its signature) beside the checkpoints."""
    private, public = make_pem_keys(tmp_path, "key")
    dirpath = tmp_path / "ckpt"
    dirpath.mkdir()
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):
        torch.save(_checkpoint(2), dirpath / name)
    sign_dir(dirpath, pem_key=private)
    checkpoint_io = AtomicCheckpointIO(trusted_key=str(public), signing_key=str(private))
    assert checkpoint_io.load_checkpoint(dirpath / "epoch=0-step=2.ckpt")["global_step"] == 2
    good = _flip(dirpath / "last.ckpt", 200)
    _refused(checkpoint_io, dirpath / "last.ckpt", "SHA256")
    (dirpath / "last.ckpt").write_bytes(good)

    checkpoint_io.save_checkpoint(_checkpoint(4), dirpath / "last.ckpt")  # the run resumes into the same folder
    assert checkpoint_io.load_checkpoint(dirpath / "last.ckpt")["global_step"] == 4  # sealed: the seal decides
    assert checkpoint_io.load_checkpoint(dirpath / "epoch=0-step=2.ckpt")["global_step"] == 2  # still the old manifest
    checkpoint_io.remove_checkpoint(dirpath / "epoch=0-step=2.ckpt")  # the old manifest vouches for nothing left
    assert os.listdir(dirpath) == ["last.ckpt"]


def test_a_save_never_fails_on_an_unreadable_manifest_of_the_previous_layout(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text("{not json")
    AtomicCheckpointIO().save_checkpoint(_checkpoint(1), tmp_path / "last.ckpt")
    assert AtomicCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 1


def test_sgdtp_sign_and_verify_seal_one_file_checkpoints(
    tmp_path: Path, gpg_keys: dict, capsys: pytest.CaptureFixture
) -> None:
    """`sgdtp sign` seals the files of a checkpoint folder (or one file) in place of a manifest beside them."""
    dirpath = tmp_path / "ckpt"
    dirpath.mkdir()
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):
        torch.save(_checkpoint(2), dirpath / name)  # written by another tool: no seal
    keyring, home = str(gpg_keys["keyring"]), str(gpg_keys["home"])
    assert main(["verify", str(dirpath)]) == 1
    assert main(["sign", str(dirpath), "--gpg-key", str(gpg_keys["trusted"]), "--gnupg-home", home]) == 0
    assert sorted(os.listdir(dirpath)) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert main(["verify", str(dirpath), "--keyring", keyring]) == 0
    assert main(["verify", str(dirpath / "last.ckpt"), "--keyring", keyring]) == 0
    assert torch.load(dirpath / "last.ckpt", weights_only=True)["global_step"] == 2
    capsys.readouterr()

    assert main(["sign", str(dirpath / "last.ckpt"), "--gpg-key", str(gpg_keys["stranger"]), "--gnupg-home", home]) == 0
    assert main(["verify", str(dirpath), "--keyring", keyring]) == 1  # signed again, by a key the keyring lacks
    assert "last.ckpt: signature check failed" in capsys.readouterr().err
    assert _seal_records(dirpath / "last.ckpt") == [SEALED, f"{SEALED}.sig"]  # the seal replaced, not added to
