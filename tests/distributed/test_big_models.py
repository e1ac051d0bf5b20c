"""Models bigger than one device (issue 44): built on the meta device, each rank materializing its part, pretrained
weights read by shard from a Hugging Face folder, saved back to one (``jobs/zoo.py`` with ``"pretrained"``).

Each parity cell: the zoo model's initial weights written with ``save_pretrained``; the reference trains them in
one process; the ranks build the LightningModule under ``trainer.init_module(empty_init=True)`` (meta) and the
strategy reads the folder (``pretrained=``) after the split. Same tolerances as the zoo (``test_model_zoo.py``):
first-step gradients < 1e-4 relative, 4 AdamW steps' update < 1e-3 relative. What the mode is for is checked too:
the rank-0 line says what each rank allocated, and a rank holds its share after fit. With ``"export"``, the
strategy's ``save_pretrained`` writes the trained model back; ``from_pretrained`` loads it and gives the trained
model's logits.

The large-model memory figures are a benchmark (``benchmarks/setup_memory.py``), not a test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.hf import check_export
from helpers.launch import JOBS, assert_parity, job_env, parity_result, run_python, tiered

REL_TOL, GRAD_TOL = 1e-3, 1e-4
PP = {"pipeline_stages": 2, "pipeline_chunks": 4}
WEIGHTS = {"pretrained": True, "export": True}
CELLS: dict[str, dict[str, Any]] = {
    # the default tier's cell: a pipeline rank allocates and reads its stage only, and the export joins the stages
    "llama_pipeline": {"model": "llama", "devices": 2, "dp": 1, "sgdtp": PP, **WEIGHTS},
    "llama_data": {"model": "llama", "devices": 2, "dp": 2, "sgdtp": {}, **WEIGHTS},
    "llama_sharded": {"model": "llama", "devices": 2, "dp": 2, "sgdtp": {"sharding": "full"}, **WEIGHTS},
    "llama_tensor": {"model": "llama", "devices": 2, "dp": 1, "sgdtp": {"parallelism": "tensor"}, **WEIGHTS},
    # 3-D: 2 stages x 2 replicas x 2 tensor-parallel ranks
    "llama_3d": {
        "model": "llama",
        "devices": 8,
        "dp": 2,
        "sgdtp": {**PP, "parallelism": "hybrid", "tensor_parallel_size": 2},
        **WEIGHTS,
    },
    # another family: GPT-NeoX's fused query_key_value split by tensor parallel, and its stages sharded
    "neox_tensor": {"model": "neox", "devices": 2, "dp": 1, "sgdtp": {"parallelism": "tensor"}, **WEIGHTS},
    "neox_pipeline_sharded": {"model": "neox", "devices": 4, "dp": 2, "sgdtp": {**PP, "sharding": "full"}, **WEIGHTS},
    # tied embedding and head on two stages, buffers (the embedding scale, rotary tables)
    "gemma2_pipeline": {"model": "gemma2", "devices": 2, "dp": 1, "sgdtp": PP, "layers": 4, **WEIGHTS},
    # a module registered after the block stack and run before it (MBart's embedding LayerNorm), and parameters no
    # stage calls (its cross-attention without an encoder)
    "mbart_pipeline": {"model": "mbart", "devices": 2, "dp": 1, "sgdtp": PP, "batch": 8, **WEIGHTS},
}
SLOW = set(CELLS) - {"llama_pipeline"}
_RESULTS: dict[str, dict] = {}


@pytest.mark.parametrize("name", tiered(list(CELLS), SLOW))
def test_pretrained_by_shard_trains_like_one_process(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    cell = CELLS[name]
    r = parity_result(_RESULTS, "zoo.py", name, cell, tmp_path_factory.mktemp(name))
    assert_parity(name, r, GRAD_TOL, REL_TOL)
    # the weights came from the folder, by shard, into a model that was on meta
    assert "materialized on meta: this rank allocated its part" in r["log"] and "read by shard" in r["log"], r["log"]
    check = json.loads((r["out"] / "init_check.json").read_text())
    assert check["nonfinite"] == [] and check["meta_left"] == [] and check["differ"] == [], check
    held, whole = r["info"]["held"], r["info"]["whole_parameter_bytes"]
    if cell["dp"] == 1 or "sharding" in cell["sgdtp"]:  # divided: about half (a quarter with 3-D) per rank
        assert all(h["parameters"] <= 0.6 * whole for h in held), (held, whole)
    check_export(r["out"], r["sgdtp"])


def test_a_meta_model_from_scratch_is_initialized_alike_on_every_rank(tmp_path: Path) -> None:
    """Built on meta, no checkpoint: each rank initializes its part. Nothing is left empty, on meta or not finite,
    and every tensor not split (norms, rotary tables, and the key/value projections of this multi-query Llama: one
    key/value head for tp 2, replicated) is the same on every rank; it trains."""
    scenario = {"model": "llama_mq", "devices": 2, "dp": 1, "sgdtp": {"parallelism": "tensor"}, "meta": True}
    scenario.update(reference="none", steps=2)
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    rc, log, _, timed_out = run_python([str(JOBS / "zoo.py"), str(tmp_path)], job_env(), timeout=300)
    assert rc == 0 and not timed_out, log[-4000:]
    check = json.loads((tmp_path / "init_check.json").read_text())
    assert check["replicated_checked"] > 0, check
    assert check["nonfinite"] == [] and check["meta_left"] == [] and check["differ"] == [], check
    assert "initialized (" in log and "read by shard" not in log, log[-3000:]
    assert "kv_replicated" in log and "1 key/value heads do not divide tp=2" in log, log[-3000:]


@pytest.mark.parametrize("how", [{"reshape": "model.layers.1.mlp.up_proj.weight"}, {"drop": "lm_head.weight"}])
def test_a_checkpoint_that_does_not_fit_is_refused_before_any_step(tmp_path: Path, how: dict[str, str]) -> None:
    scenario = {"model": "llama", "devices": 2, "dp": 2, "sgdtp": {}, "pretrained": True, "corrupt": how}
    scenario.update(reference="none", steps=2)
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    rc, log, _, timed_out = run_python([str(JOBS / "zoo.py"), str(tmp_path)], job_env(), timeout=180)
    assert rc != 0 and not timed_out, log[-3000:]
    (name,) = how.values()
    assert name in log and "does not fit the model" in log, log[-3000:]
    assert ("different shapes" if "reshape" in how else "missing from the checkpoint") in log, log[-3000:]
    assert "graph 0 captured" not in log and "compile:" not in log, log[-3000:]  # refused at setup, before a step


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


@pytest.mark.slow
def test_fabric_builds_on_meta_and_reads_pretrained_by_shard(tmp_path: Path) -> None:
    """Fabric: ``fabric.init_module(empty_init=True)``, the optimizer made from the meta parameters, ``fabric.setup``
    shards and reads the weights; the first loss is the one of the same weights in one process, training moves it,
    the export loads."""
    import transformers

    rc, log, _, timed_out = run_python([str(JOBS / "fabric_meta.py"), str(tmp_path)], job_env(), timeout=300)
    assert rc == 0 and not timed_out, log[-4000:]
    result = json.loads((tmp_path / "fabric_meta.json").read_text())
    assert result["meta"] and abs(result["losses"][0] - result["reference"]) < 1e-5, result
    assert result["losses"][1] < result["losses"][0], result
    assert "materialized on meta" in log and "read by shard" in log, log[-3000:]
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").config.num_hidden_layers == 2
