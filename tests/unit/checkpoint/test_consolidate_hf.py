"""A sharded checkpoint made a Hugging Face folder in one process (checkpoint/sharded.py ``consolidate_hf``,
``sgdtp consolidate DIR --hf OUT``): a tiny Llama inside a LightningModule-like wrapper, saved with DCP in the
strategy's layout, written as ``*.safetensors`` and their index, loaded by ``from_pretrained``: the same state dict
and the same logits; several files, bf16 and tied embeddings; one tensor read at a time; the prefix found or given;
a config of another model refused; the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from lightning_sgdtp.checkpoint import huggingface as hf
from lightning_sgdtp.checkpoint import sharded
from lightning_sgdtp.cli import main
from lightning_sgdtp.trust import sign_dir

transformers = pytest.importorskip("transformers")
from helpers.hf import Wrapper, llama_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def save_sharded(
    root: Path, dtype: torch.dtype = torch.float32, tie: bool = False, head: bool = False
) -> tuple[Wrapper, Path, Path]:
    """The wrapper, its DCP checkpoint in the strategy's layout (model under ``state_dict``, an optimizer beside it)
    and a folder with the Hugging Face ``config.json``."""
    torch.manual_seed(0)
    wrapper = Wrapper(llama_config(tie), dtype, head).eval()
    folder, config = root / "step.ckpt", root / "hf-config"
    optimizer = {"state": {"model.lm_head.weight": {"exp_avg": torch.ones(3)}}}
    dcp.save({sharded.MODEL_KEY: wrapper.state_dict(), "optimizer_0": optimizer}, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 3}, folder / sharded.META)
    wrapper.model.config.save_pretrained(config)
    return wrapper, folder, config


def assert_loads_as(out: Path, model: nn.Module, dtype: torch.dtype) -> None:
    """``from_pretrained(out)`` has ``model``'s state dict, bitwise, in ``dtype``, and its logits."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    expected, got = model.state_dict(), loaded.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == dtype and torch.equal(got[name], tensor), name
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


SCENARIOS = {
    # name: (dtype, tie_word_embeddings, file_bytes)
    "fp32-one-file": (torch.float32, False, 2 * 2**30),
    "bf16-several-files": (torch.bfloat16, False, 8_000),  # the largest tensor (embeddings) is 6,144 bytes
    "tied-embeddings": (torch.float32, True, 2 * 2**30),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_from_pretrained_loads_the_trained_model(
    tmp_path: Path, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dtype, tie, file_bytes = SCENARIOS[scenario]
    wrapper, folder, config = save_sharded(tmp_path, dtype, tie)
    loads: list[list[str]] = []
    real_load = dcp.load

    def counting_load(state: dict, **kwargs: object) -> None:
        loads.append(list(state))
        real_load(state, **kwargs)

    monkeypatch.setattr(dcp, "load", counting_load)
    out = sharded.consolidate_hf(folder, tmp_path / "hf", config=config, file_bytes=file_bytes)

    expected = wrapper.model.state_dict()
    assert loads == [[f"state_dict.model.{n}"] for n in expected]  # one tensor at a time, each once
    index = json.loads((out / hf.INDEX).read_text())
    assert list(index["weight_map"]) == list(expected)  # the model's order; tied: both names
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    names = sorted(set(index["weight_map"].values()))
    files = len(names)
    assert (files > 2) == (file_bytes < 2**20)
    assert names == [f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(1, files + 1)]
    assert sorted(f.name for f in out.iterdir()) == sorted([*names, hf.INDEX, "config.json"])  # no temporary file
    stored = hf.read_index(out)  # every file's header: the names the index gives it, shapes, dtypes
    assert {n: s.file.name for n, s in stored.items()} == index["weight_map"]
    assert {n: (s.shape, s.dtype) for n, s in stored.items()} == {
        n: (tuple(t.shape), t.dtype) for n, t in expected.items()
    }
    assert all(s.start % 8 == 0 for s in stored.values())
    for name in names:  # each file within file_bytes (a tensor larger alone would have its own)
        assert sum(math.prod(s.shape) * s.dtype.itemsize for s in hf.read_header(out / name).values()) <= file_bytes
    assert_loads_as(out, wrapper.model, dtype)


def test_a_second_export_into_the_same_folder_leaves_no_file_of_the_first(tmp_path: Path) -> None:
    wrapper, folder, config = save_sharded(tmp_path)
    out = tmp_path / "hf"
    sharded.consolidate_hf(folder, out, config=config, file_bytes=8_000)
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(out)  # model.safetensors: read before an index
    sharded.consolidate_hf(folder, out, config=config)
    assert sorted(f.name for f in out.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert_loads_as(out, wrapper.model, torch.float32)


def test_the_prefix_found_from_the_config_given_or_shared_by_every_name(tmp_path: Path) -> None:
    wrapper, folder, config = save_sharded(tmp_path, head=True)  # value.weight beside model.*: no shared prefix
    tensors = sharded.model_tensors(folder)
    assert "value.weight" in tensors and not any(k.startswith("optimizer") for k in tensors)
    expected = list(wrapper.model.state_dict())

    out = sharded.consolidate_hf(folder, tmp_path / "found", config=config)  # the prefix under which names fit
    assert list(json.loads((out / hf.INDEX).read_text())["weight_map"]) == expected
    assert_loads_as(out, wrapper.model, torch.float32)

    for prefix in ("model.", "model"):  # given, with or without its dot; no config: no config.json
        out = sharded.consolidate_hf(folder, tmp_path / f"given-{prefix}", prefix=prefix)
        assert list(json.loads((out / hf.INDEX).read_text())["weight_map"]) == expected
        assert not (out / "config.json").exists()

    only_llama = {k: v for k, v in tensors.items() if not k.startswith("value.")}
    assert list(sharded.hf_names(only_llama).values()) == expected  # "model." shared by every key
    assert list(sharded.hf_names(tensors).values()) == list(tensors)  # nothing shared: names as they are
    with pytest.raises(ValueError, match=r"no model tensor under the prefix 'encoder\.'.*\['model\.', 'value\.'\]"):
        sharded.hf_names(tensors, "encoder.")


def test_a_config_of_another_model_is_refused_with_what_does_not_fit(tmp_path: Path) -> None:
    _, folder, _ = save_sharded(tmp_path)
    other = tmp_path / "other"
    wider = llama_config(hidden=64)
    wider.num_hidden_layers = 3
    wider.save_pretrained(other)
    with pytest.raises(ValueError) as refused:
        sharded.consolidate_hf(folder, tmp_path / "hf", config=other)
    message = str(refused.value)
    assert "missing from the checkpoint: model.layers.2." in message
    assert "different shapes: model.embed_tokens.weight [96, 32] (the model: [96, 64])" in message
    assert "Give the config the model was trained with" in message
    assert not (tmp_path / "hf").exists()  # refused before anything is written
    with pytest.raises(FileNotFoundError, match="config.json: no such file"):
        sharded.consolidate_hf(folder, tmp_path / "hf", config=tmp_path)
    with pytest.raises(FileNotFoundError, match="not a sharded checkpoint folder"):
        sharded.consolidate_hf(tmp_path, tmp_path / "hf")


def test_cli_consolidate_hf(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wrapper, folder, config = save_sharded(tmp_path)
    out = tmp_path / "hf"
    command = ["consolidate", str(folder), "--hf", str(out), "--config", str(config)]
    assert main([*command, "--no-verify"]) == 0  # no manifest in the folder
    total = sum(t.numel() * t.element_size() for t in wrapper.model.state_dict().values())
    printed = capsys.readouterr().out.strip()
    assert printed == (
        f"wrote {out}: 21 tensors in 1 safetensors files, {total} bytes, and model.safetensors.index.json;"
        " config.json copied"
    )
    assert_loads_as(out, wrapper.model, torch.float32)

    assert main(command) == 1  # verified first: no manifest
    assert "SGDTP-MANIFEST.json" in capsys.readouterr().err
    sign_dir(folder)
    assert main(command) == 0
    assert main(["consolidate", str(folder), "--hf", str(out), "--no-verify"]) == 0  # no config: prefix shared
    assert "no config.json: copy one in, or give --config" in capsys.readouterr().out

    assert main(["consolidate", str(folder), "--no-verify"]) == 2  # neither OUTPUT nor --hf
    assert main(["consolidate", str(folder), str(tmp_path / "x.ckpt"), "--hf", str(out), "--no-verify"]) == 2
    assert main(["consolidate", str(folder), str(tmp_path / "x.ckpt"), "--prefix", "model."]) == 2
    assert "--config and --prefix go with --hf OUT" in capsys.readouterr().err
    assert main([*command, "--no-verify", "--prefix", "encoder."]) == 1
    assert "no model tensor under the prefix 'encoder.'" in capsys.readouterr().err
