"""Compile once (issue 42), without processes: which batch runs eagerly, the default compile cache's folder, its
bound, and what ``sgdtp doctor`` says of it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from lightning_sgdtp.compiler import artifacts
from lightning_sgdtp.compiler.artifacts import CACHE_ENV, default_cache_folder
from lightning_sgdtp.compiler.cache import bundles, evict
from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.engine.compiled import batch_shapes, is_short_batch
from lightning_sgdtp.observe.doctor import compile_cache_facts, compile_cache_row


def test_only_the_epochs_short_batch_runs_eagerly() -> None:
    first = batch_shapes(((torch.zeros(32, 128), torch.zeros(32, 128)), 0), {})
    assert first == ((32, 128), (32, 128))  # the batch index is not a tensor
    short = batch_shapes(((torch.zeros(7, 128), torch.zeros(7, 128)), 51), {})
    assert is_short_batch(short, first)
    assert not is_short_batch(first, first)  # the same batch: compiled
    assert not is_short_batch(((32, 64), (32, 64)), first)  # a new sequence length: Dynamo's to handle
    assert not is_short_batch(((40, 128), (40, 128)), first)  # a longer batch
    assert not is_short_batch(((7, 128),), first)  # another structure
    assert not is_short_batch((), ())


def test_the_default_cache_folder_its_switch_and_an_unwritable_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert default_cache_folder() == tmp_path / "cache" and (tmp_path / "cache").is_dir()
    for off in ("off", "0", "false", "none"):
        monkeypatch.setenv(CACHE_ENV, off)
        assert default_cache_folder() is None
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_folder() == tmp_path / "xdg" / "lightning_sgdtp" / "compile"  # the platform's cache dir
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a-file" / "cache"))
    artifacts._warned.clear()
    with pytest.warns(UserWarning, match="cannot be written.*compiling without it"):
        assert default_cache_folder() is None
    assert default_cache_folder() is None  # warned once
    assert "cannot be written" in artifacts.default_cache_problem()  # and said again on rank 0 (the plan's note)
    assert compile_cache_row(compile_cache_facts()).verdict == "ok"  # doctor: never a failure


def test_the_option_auto_a_folder_or_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert SGDTPConfig().compile_cache == "auto" and SGDTPConfig().cache_folder == tmp_path
    assert SGDTPConfig(compile_cache=False).cache_folder is None
    assert SGDTPConfig(compile_cache="/shared/c").cache_folder == Path("/shared/c")
    assert SGDTPConfig(pipeline_stages=2).cache_folder is None  # pipeline stages: not the default cache
    with pytest.raises(SGDTPConfigError, match="compile_cache_max_gb"):
        SGDTPConfig(compile_cache_max_gb="big")


def _bundle(root: Path, name: str, size: int, age: float) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "artifact").write_bytes(b"x" * size)
    stamp = time.time() - age
    os.utime(folder, (stamp, stamp))
    return folder


def test_the_least_recently_used_bundles_go_first_and_never_the_new_one(tmp_path: Path) -> None:
    _bundle(tmp_path, "old", 400, age=300)
    _bundle(tmp_path, "used", 400, age=100)
    _bundle(tmp_path, "new", 400, age=200)  # written now, by this job (its folder's time may be older)
    (tmp_path / ".KEY.tmp-1").mkdir()  # a bundle being written by another job: not a bundle yet
    assert [b.name for b in bundles(tmp_path)] == ["old", "new", "used"]
    removed = evict(tmp_path, max_bytes=900, keep="new")
    assert [b.name for b in removed] == ["old"] and sorted(b.name for b in bundles(tmp_path)) == ["new", "used"]
    assert [b.name for b in evict(tmp_path, max_bytes=100, keep="new")] == ["used"]
    assert [b.name for b in bundles(tmp_path)] == ["new"]
    facts = {"folder": str(tmp_path), "bundles": 1, "bytes": 400}
    assert "rm -rf" in compile_cache_row(facts).fix and "SGDTP_COMPILE_CACHE=off" in compile_cache_row(facts).fix
