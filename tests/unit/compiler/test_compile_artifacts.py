"""What compiled artifacts are keyed by and how they are written (lightning_sgdtp/compiler/artifacts.py), in this
process: the plugin's source hash, truncated compiler output, the cache-folder check, and Inductor's cache hits."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_sgdtp.compiler import artifacts, backend
from lightning_sgdtp.compiler.artifacts import (
    PACKAGE,
    PLUGIN_FINGERPRINT,
    CacheFolderError,
    CompileLock,
    check_cache_folders,
    is_complete,
    source_fingerprint,
)
from lightning_sgdtp.compiler.bucket_cost import CostModel
from lightning_sgdtp.compiler.buckets import Bucket, GraphBuckets


def test_an_edited_plugin_source_changes_the_fingerprint(tmp_path: Path) -> None:
    copy = tmp_path / "lightning_sgdtp"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_fingerprint(copy) == PLUGIN_FINGERPRINT, "the same source, the same fingerprint"
    target = copy / "compiler" / "buckets.py"
    target.write_text(target.read_text() + "\n# an edit that changes no behaviour\n")
    assert source_fingerprint(copy) != PLUGIN_FINGERPRINT, "any edit, not only a new version string"


def test_truncated_compiler_output_is_recognised(tmp_path: Path) -> None:
    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    whole = library.read_bytes()
    assert is_complete(library)
    for cut in (len(whole) - 1, len(whole) // 2, len(whole) // 10, 63, 3, 0):
        part = tmp_path / f"cut-{cut}.so"
        part.write_bytes(whole[:cut])
        assert not is_complete(part), f"{cut} of {len(whole)} bytes taken for whole"
    header = tmp_path / "prefix.h.gch"
    header.write_bytes(b"gpch-not-an-elf-file")
    assert is_complete(header) and not is_complete(tmp_path / "missing.so")


def test_a_cache_folder_that_cannot_be_written_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert check_cache_folders(tmp_path / "bundles") == [tmp_path / "inductor", tmp_path / "bundles"]
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocked / "inductor"))  # a folder under a file: never writable
    with pytest.raises(
        CacheFolderError, match=r"a-file/inductor \(TORCHINDUCTOR_CACHE_DIR\).*TORCHINDUCTOR_CACHE_DIR="
    ):
        check_cache_folders(None)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with pytest.raises(CacheFolderError, match=r"a-file/bundles \(compile_cache\).*SGDTPStrategy\(compile_cache="):
        check_cache_folders(blocked / "bundles")


def test_the_bucket_boundaries_enter_the_backward_key() -> None:
    def graph(*buckets: list[str]) -> GraphBuckets:
        made = [Bucket(i, list(b), 1, "torch.float32", "torch.float32", 4) for i, b in enumerate(buckets)]
        return GraphBuckets(0, True, "0", 2, [p for b in buckets for p in b], made)

    assert backend.bucket_salt(graph(["a", "b"], ["c"])) == backend.bucket_salt(graph(["a", "b"], ["c"]))
    assert backend.bucket_salt(graph(["a", "b"], ["c"])) != backend.bucket_salt(graph(["a"], ["b", "c"]))


def _compile_once(cost: CostModel | None) -> dict[str, int]:
    """Compile a small model's forward and backward with the sgdtp backend in a fresh Dynamo; Inductor's FX-graph
    cache hits and misses of that compile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiler = backend.SGDTPCompiler(settings=backend.CompileSettings(cost=cost))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    torch.compile(model, backend=compiler)(torch.randn(4, 8)).sum().backward()
    return {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss")}


def test_same_model_and_plugin_share_graphs_an_edited_plugin_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the session's Inductor cache (tests/conftest.py: its precompiled header is shared with the other tests);
    the model is this test's own, so its first compile misses."""
    from torch._inductor import config as inductor_config

    assert inductor_config.fx_graph_cache, "Inductor's FX-graph cache is on (its default): what this test reads"
    one = CostModel(latency_s=3.1e-5, seconds_per_byte=2.2e-10, flops_per_s=4.4e10, bytes_per_s=5.5e9)
    other = CostModel(latency_s=4.7e-5, seconds_per_byte=1.9e-10, flops_per_s=3.8e10, bytes_per_s=6.1e9)
    assert _compile_once(one) == {"hit": 0, "miss": 2}  # forward and backward compiled
    # another job measures other timings: same graphs, same plugin -> every graph from the cache
    assert _compile_once(other) == {"hit": 2, "miss": 0}
    # the plugin's source edited (its fingerprint changes): nothing compiled by the old source is reused
    monkeypatch.setattr(backend, "PLUGIN_FINGERPRINT", "0123456789abcdef")
    assert _compile_once(other) == {"hit": 0, "miss": 2}
    assert artifacts.PLUGIN_FINGERPRINT == PLUGIN_FINGERPRINT


def test_the_compile_lock_is_exclusive_reentrant_and_bounded(tmp_path: Path) -> None:
    """One compile at a time; a leader that hangs delays the others at most ``wait_s``, then they compile beside it."""
    import threading
    import time

    path = tmp_path / "sgdtp-compile-tp0.lock"
    holder, waiter = CompileLock(path), CompileLock(path, wait_s=0.3)
    seen: list[tuple[str, float]] = []

    def wait() -> None:
        begin = time.monotonic()
        with waiter():
            seen.append(("waiter in", time.monotonic() - begin))

    with holder(), holder():  # re-entrant in one process
        thread = threading.Thread(target=wait)
        thread.start()
        thread.join(5)
        seen.append(("holder out", 0.0))
    (what, waited), _ = seen
    assert what == "waiter in" and 0.25 < waited < 3, seen  # gave up waiting after wait_s, while the holder held it
    with waiter():  # free again: taken at once
        pass


def test_followers_wait_for_the_leader_then_load_side_by_side(tmp_path: Path) -> None:
    """The leader compiles holding the lock; the ranks that found it held wait for it, then run together (each
    load from the cache beside the others), not one after another: the last one is not a load per rank late."""
    import threading
    import time

    path = tmp_path / "sgdtp-compile.lock"
    inside: list[tuple[str, float, float]] = []

    def follower(name: str) -> None:
        with CompileLock(path, wait_s=30)():
            begin = time.monotonic()
            time.sleep(0.5)  # a load from the cache
            inside.append((name, begin, time.monotonic()))

    with CompileLock(path)():  # the leader
        threads = [threading.Thread(target=follower, args=(n,)) for n in ("a", "b", "c")]
        for t in threads:
            t.start()
        time.sleep(0.3)
        assert not inside, "a follower ran while the leader compiled"
    for t in threads:
        t.join(10)
    assert len(inside) == 3, inside
    first_end = min(end for _, _, end in inside)
    assert all(begin < first_end for _, begin, _ in inside), f"the followers took turns: {inside}"
