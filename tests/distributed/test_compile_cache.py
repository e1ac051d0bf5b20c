"""The compile cache, on by default: one rank per node compiles while the other waits; two jobs started together on
one folder both train; a later job starts warm from the verified bundle, with the same parameters; a tampered or
corrupted bundle is ignored, never half-used; an unwritable default folder only warns.

Each job gets a fresh, empty Inductor cache folder (TORCHINDUCTOR_CACHE_DIR), as a job on a new node has; the
jobs report the FX-graph and AOTAutograd cache hits and misses of each rank (the proof); what the cache did with
the bundle (wrote, loaded, rejected) is only in the log so far (TEST_CHANGES.md: wanted plan["compile_cache"]).

Also here: Inductor's own caches, filled by a plain compile, never give sgdtp a backward without collectives.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers.launch import run_job

JOB = "compile_cache.py"


def _job(cache: Path | str, out: Path, name: str, tmp: Path | None = None, **env: str) -> tuple[str, list[dict]]:
    """A 2-rank job on a fresh "node" (its own, empty, Inductor cache folder, and temporary folder ``tmp``, where
    the default cache keeps the node's copy). ``cache`` ``"auto"``: no option, the default cache."""
    tmp = tmp or out / f"tmp-{name}"
    tmp.mkdir(parents=True, exist_ok=True)
    inductor = str(out / f"inductor-{name}")
    result = run_job(JOB, str(cache), str(out), name, TORCHINDUCTOR_CACHE_DIR=inductor, TMPDIR=str(tmp), **env)
    stats = [json.loads((out / f"{name}-{rank}.json").read_text()) for rank in (0, 1)]
    return result.stdout, stats


def _equal(out: Path, a: str, b: str) -> bool:
    pa, pb = torch.load(out / f"{a}.pt"), torch.load(out / f"{b}.pt")
    return all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    """Two cold jobs started together on one default cache folder (no option: SGDTP_COMPILE_CACHE names the folder,
    as a user's platform cache folder would be), then a warm job that loads the bundle they wrote."""
    tmp_path = tmp_path_factory.mktemp("compile-cache")
    cache, out = tmp_path / "cache", tmp_path / "out"
    default = {"SGDTP_COMPILE_CACHE": str(cache)}
    with ThreadPoolExecutor(2) as pool:
        twice = {"SGDTP_TEST_FIT_TWICE": "1"}  # "beside" fits again in its process: the bundle is there by then
        jobs = [
            pool.submit(_job, "auto", out, name, **default, **(twice if name == "beside" else {}))
            for name in ("cold", "beside")
        ]
        (log, cold), (beside_log, _) = (job.result() for job in jobs)
    # log wording (the bundle's fate is not in the plan yet): a cold start compiles and writes the bundle
    logs = log + beside_log
    assert logs.count("this job compiles and writes it") == 2 and "compile cache: wrote bundle" in logs, logs[-3000:]
    graphs = [s["fxgraph_cache_hit"] + s["fxgraph_cache_miss"] for s in cold]
    # Each graph (forward, backward) was compiled once on the node: by whichever rank came first, while the
    # other waited and then took it from the node's cache.
    assert graphs[0] == graphs[1] >= 2 and sum(s["fxgraph_cache_miss"] for s in cold) == graphs[0], cold
    assert _equal(out, "cold", "beside"), "two jobs started together on one cache folder both train, the same"
    # The second fit loaded the bundle into the folder whose compiled libraries the first fit still had mapped: a copy
    # over them in place ended that process with SIGSEGV (found by benchmarks/dp_throughput.py's two fits a worker).
    assert _equal(out, "cold", "beside-again"), "a second fit in the same process trains the same"
    (bundle,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert (bundle / "SGDTP-MANIFEST.json").exists() and (bundle / "SGDTP-CACHE-KEY.json").exists()

    log, warm = _job("auto", out, "warm", **default)
    assert "verified and loaded" in log and "taken from the compile cache" in log, log[-3000:]
    assert all(s["fxgraph_cache_miss"] == 0 and s["autograd_cache_hit"] > 0 for s in warm), warm
    assert all(s["graphs"] == cold[0]["graphs"] for s in warm), (warm, cold)  # the plan is reported all the same
    assert _equal(out, "cold", "warm"), "a warm start must train exactly like a cold one"
    assert "compile: " in log and "AOTAutograd's cache" in log, "rank 0 says what compiling cost"
    return cache, out, cold


@pytest.mark.covers("data", "compile cache")
def test_cold_then_warm(warmed: tuple[Path, Path, list[dict]]) -> None:
    """One compile per node, a bundle written after the first step, a later job warm from it (asserted above)."""
    cache, _, cold = warmed
    assert len([p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]) == 1 and cold


def test_a_corrupted_bundle_is_ignored_with_a_warning_and_rebuilt(warmed: tuple[Path, Path, list[dict]]) -> None:
    """A bundle whose recorded graph was cut short: the job says so, trains the same, and writes a new bundle. (The
    node's own copy, from the cold job, stays: the job compiles no more than that node would.)"""
    cache, out, _ = warmed
    (bundle,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    victim = next((bundle / "sgdtp-plans").glob("*.json"))
    victim.write_bytes(victim.read_bytes()[:5])
    log, _ = _job("auto", out, "corrupted", tmp=out / "tmp-cold", SGDTP_COMPILE_CACHE=str(cache))
    assert "ignored" in log and "compiling from scratch" in log and victim.name in log, log[-3000:]
    assert "compile cache: wrote bundle" in log and _equal(out, "cold", "corrupted")


def test_an_unwritable_default_folder_trains_with_a_warning(warmed: tuple[Path, Path, list[dict]]) -> None:
    _, out, _ = warmed
    blocker = out / "a-file"
    blocker.write_text("")
    log, _ = _job("auto", out, "unwritable", tmp=out / "tmp-cold", SGDTP_COMPILE_CACHE=str(blocker / "cache"))
    assert "sgdtp: compile cache: the default compile cache" in log and "compiling without it" in log, log[-3000:]
    assert "wrote bundle" not in log and "verified" not in log and _equal(out, "cold", "unwritable")


@pytest.mark.slow  # the bundle's manifest check itself: tests/unit/trust/test_trust.py; trust in the default run: checkpoints
def test_a_tampered_bundle_is_ignored_replaced_and_warm_again(warmed: tuple[Path, Path, list[dict]]) -> None:
    cache, out, _ = warmed
    (bundle,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    victim = max((p for p in bundle.rglob("*.so")), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    log, tampered = _job(cache, out, "tampered")
    assert "ignored" in log and "SHA256 check failed" in log and victim.name in log, log[-3000:]
    assert sum(s["fxgraph_cache_miss"] for s in tampered) > 0 and all(s["autograd_cache_hit"] == 0 for s in tampered)
    assert _equal(out, "cold", "tampered")
    assert "compile cache: wrote bundle" in log, "the rejected bundle is replaced by this job's"
    assert [p.name for p in cache.iterdir() if ".rejected-" in p.name], "and kept aside, for inspection"
    log, rewarmed = _job(cache, out, "rewarmed")
    assert "verified and loaded" in log and all(s["fxgraph_cache_miss"] == 0 for s in rewarmed), log[-3000:]


def test_compile_cache_never_returns_a_backward_without_collectives(tmp_path: Path) -> None:
    """Plain Inductor compiles the model first and fills AOTAutograd's cache; sgdtp must not reuse it."""
    run_job("cache_pollution.py", str(tmp_path))
    info = json.loads((tmp_path / "cache.json").read_text())
    assert info["autograd_cache_saved"] >= 1, "the plain compile did not fill the cache: the test proves nothing"
    assert sum(info["local_differs"]) >= 3, "ranks must see different gradients, else syncing proves nothing"
    assert info["synced"] and all(info["synced"]), info
