"""The compile cache on a node of GPUs (issue 45, item 8), without a GPU: Inductor's and AOTAutograd's keys hold
the device index, so two ranks on ``cuda:0`` and ``cuda:1`` never share a compiled graph; the plan then locks no
compile (no rank waits for a graph it cannot use) and rank 0 says so; and global rank 0's bundle copy survives the
other ranks still writing into the node's folder beside it.

The CUDA inputs are FakeTensors on a fake ``cuda:N`` device (FakeTensorMode makes them on a CPU-only build): what a
CUDA rank's compile hashes, built the way it builds it. No real GPU ran any of this."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn
from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler
from torch._inductor.codecache import (
    FxGraphCachePickler,
    compiled_fx_graph_hash,
    extract_tensor_metadata_for_cache_key,
)
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sgdtp.compiler import cache
from lightning_sgdtp.compiler.cache import LOCK, CompileCache, node_compiles
from lightning_sgdtp.config import SGDTPConfig
from lightning_sgdtp.engine.parallelize import plan_part
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.mesh.topology import detect
from lightning_sgdtp.trust import verify_dir


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _on(device: str, mode: FakeTensorMode) -> torch.Tensor:
    with mode:
        return torch.empty(4, 8, device=device)


def _doubling() -> fx.GraphModule:
    """``x * 2``: a graph as Inductor gets it (a plain GraphModule)."""
    graph = fx.Graph()
    graph.output(graph.call_function(torch.mul, (graph.placeholder("x"), 2)))
    return fx.GraphModule(nn.Module(), graph)


def _inductor_key(gm: fx.GraphModule, *inputs: torch.Tensor) -> str:
    """Inductor's FX graph cache key (``FxGraphCache``'s, from ``compiled_fx_graph_hash``)."""
    return compiled_fx_graph_hash(gm, list(inputs), {}, [])[0]


def test_inductors_key_holds_the_device_index_not_only_its_type() -> None:
    mode = FakeTensorMode()
    gm = _doubling()
    rank0, rank1, rank1_again = _on("cuda:0", mode), _on("cuda:1", mode), _on("cuda:1", mode)
    assert extract_tensor_metadata_for_cache_key(rank1).device == torch.device("cuda", 1)  # the index is kept
    assert _inductor_key(gm, rank0) != _inductor_key(gm, rank1), "cuda:0 and cuda:1: two entries, no shared hit"
    assert _inductor_key(gm, rank1) == _inductor_key(gm, rank1_again), "the same index: the same entry"
    # AOTAutograd's key (autograd_cache_key's pickler) keeps the index too.
    assert AOTAutogradCachePickler(gm).get_hash(rank0) != AOTAutogradCachePickler(gm).get_hash(rank1)
    # Torch has a normalization (index -> 0) but only for its SPMD check (fx_passes/spmd_check.py), not in the keys.
    agnostic = [FxGraphCachePickler(gm, device_id_agnostic=True).get_hash(t) for t in (rank0, rank1)]
    assert agnostic[0] == agnostic[1] and _inductor_key(gm, rank0) != _inductor_key(gm, rank1)


def test_the_graphs_code_names_the_index_so_normalizing_inputs_would_not_do() -> None:
    """A factory call in the graph carries its device in the code that is hashed (and Inductor's wrapper code enters
    ``_DeviceGuard(index)``): normalizing the inputs' metadata alone would give one key to two different programs."""

    def graph_on(index: int) -> fx.GraphModule:
        graph = fx.Graph()
        x = graph.placeholder("x")
        ones = graph.call_function(torch.ones, (4, 8), {"device": torch.device("cuda", index)})
        graph.output(graph.call_function(torch.add, (x, ones)))
        return fx.GraphModule(nn.Module(), graph)

    mode = FakeTensorMode()
    on0, on1 = graph_on(0), graph_on(1)
    assert "index=1" in on1.code and "index=1" not in on0.code
    same_input = _on("cuda:0", mode)
    assert _inductor_key(on0, same_input) != _inductor_key(on1, same_input)
    hashes = [FxGraphCachePickler(g, device_id_agnostic=True).get_hash(g) for g in (on0, on1)]
    assert hashes[0] != hashes[1], "torch's own normalization leaves the graph's code as it is"


def _dims(config: SGDTPConfig, per_node: int) -> ParallelDims:
    return ParallelDims.resolve(config, per_node, per_node, 1, detect("cpu", per_node, 1))


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_no_rank_waits_for_a_graph_it_cannot_use_and_rank_0_says_so(device_type: str) -> None:
    """Data parallel on one node of 8: the plan locks compiles on CPU (the keys are equal, the others wait and hit)
    and not on GPUs (each rank's key holds its own index: a lock would only serialize compiles with no hit)."""
    config = SGDTPConfig(compile_cache="/tmp/unused")
    plan = plan_part(config, _dims(config, 8), Double(), device_type=device_type)
    locked = plan.lock_compiles == "node"
    assert locked == (device_type == "cpu")
    device = torch.device(device_type, 1) if device_type == "cuda" else torch.device("cpu")
    line = node_compiles(device, locked, warm=False, devices_per_node=8)
    assert line is not None
    if device_type == "cuda":
        assert "no node lock on cuda" in line and "device index (cuda:1 here)" in line and "none waits" in line
    else:
        assert f"under the node lock ({LOCK}), the other 7 wait, then load it from" in line
    warm = node_compiles(device, locked, warm=True, devices_per_node=8)
    assert warm is not None and "no compile lock" in warm and ("cuda:1" in warm) == (device_type == "cuda")
    assert node_compiles(device, locked, warm=False, devices_per_node=1) is None  # one rank a node: nothing to share
    if device_type == "cpu":
        assert "the other waits, then loads it from" in (
            node_compiles(device, True, warm=False, devices_per_node=2) or ""
        )


def test_the_bundle_copy_survives_ranks_still_writing_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPUs the ranks compile unlocked: when global rank 0 publishes, another rank may be renaming a finished
    entry into place (its temporary name vanishes) or writing one. The bundle holds the finished files, not the
    temporaries, and the copy does not fail."""
    local = tmp_path / "local"
    for rel in ("fxgraph/ab/entry", "aotautograd/cd/entry", "triton/0/kernel.json", "fxgraph/ef/renamed-away"):
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_text(rel)
    (local / "fxgraph/ab/.4242.140001.tmp").write_text("half")  # Inductor's write_atomic, mid-write
    (local / LOCK).write_text("")
    copy = shutil.copy2

    def racing_copy(src: Any, dest: Any, **kwargs: Any) -> Any:
        if Path(src).name == "renamed-away":
            Path(src).unlink()  # its writer moved it between the walk and the copy
        return copy(src, dest, **kwargs)

    monkeypatch.setattr(cache.shutil, "copy2", racing_copy)
    store = CompileCache(tmp_path / "root", {"k": 1}, local_dir=local)
    message = store.publish()
    assert message is not None and message.startswith("compile cache: wrote bundle")
    files = sorted(p.relative_to(store.bundle).as_posix() for p in store.bundle.rglob("*") if p.is_file())
    assert [f for f in files if not f.startswith("SGDTP-")] == [
        "aotautograd/cd/entry",
        "fxgraph/ab/entry",
        "triton/0/kernel.json",
    ]
    verify_dir(store.bundle, trusted=None)
