"""Hugging Face ``*.safetensors`` checkpoints in one process (checkpoint/huggingface.py): headers and the index of a
folder ``transformers`` wrote, plain reads of slices against slicing the whole tensor, names matched to a module's
state dict (prefix, missing, unexpected, misshaped, tied), output files by size, and a write read back by
``from_pretrained``. Loading into a split model: tests/unit/engine/test_materialize.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_sgdtp import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.checkpoint import huggingface as hf

transformers = pytest.importorskip("transformers")
from helpers.hf import Wrapper, llama_config


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, Path, Path]:
    """A tiny Llama with known weights, saved as one file and as several files with their index."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config())
    one, several = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("several")
    model.save_pretrained(one)
    model.save_pretrained(several, max_shard_size="20KB")
    return model, one, several


def test_headers_of_one_file_and_of_several_files_with_their_index(saved: tuple[nn.Module, Path, Path]) -> None:
    model, one, several = saved
    assert [f.name for f in hf.files_of(one)] == ["model.safetensors"]
    assert len(hf.files_of(several)) > 2 and (several / hf.INDEX).is_file()
    expected = {k: (tuple(t.shape), t.dtype) for k, t in model.state_dict().items()}
    for folder in (one, several):
        index = hf.read_index(folder)
        assert {k: (s.shape, s.dtype) for k, s in index.items()} == expected
    # each name in the file the index names, at an offset past the header
    index = hf.read_index(several)
    files = json.loads((several / hf.INDEX).read_text())["weight_map"]
    assert {k: s.file.name for k, s in index.items()} == files
    assert len({s.file for s in index.values()}) == len(hf.files_of(several))
    one_file = hf.files_of(one)[0]
    assert hf.read_header(one_file) == hf.read_index(one_file)  # a file named directly
    assert all(8 < s.start < one_file.stat().st_size for s in hf.read_header(one_file).values())


class CountingFile:
    """An open file that counts its reads."""

    def __init__(self, f: object) -> None:
        self.f, self.reads = f, 0

    def seek(self, offset: int) -> int:
        return self.f.seek(offset)

    def read(self, n: int) -> bytes:
        self.reads += 1
        return self.f.read(n)


def sliced(path: Path, name: str, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    stored = hf.read_index(path)[name]
    with open(stored.file, "rb", buffering=0) as raw:
        f = CountingFile(raw)
        return hf.read_slice(f, stored, offsets, lengths), f.reads


def test_read_slice_equals_slicing_the_whole_tensor(
    saved: tuple[nn.Module, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, one, _ = saved
    whole = load_file(one / "model.safetensors")
    embed = whole["model.embed_tokens.weight"]  # [96, 32]
    # whole rows (a column-parallel shard, dim 0): one read
    got, reads = sliced(one, "model.embed_tokens.weight", (10, 0), (20, 32))
    assert torch.equal(got, embed[10:30]) and reads == 1
    # a dim-1 slice (a row-parallel shard): whole rows a chunk at a time, 7 rows (896 bytes) per read
    monkeypatch.setattr(hf, "READ_CHUNK_BYTES", 7 * 32 * 4)
    got, reads = sliced(one, "model.embed_tokens.weight", (3, 8), (40, 16))
    assert torch.equal(got, embed[3:43, 8:24]) and reads == 6  # ceil(40 / 7)
    monkeypatch.setattr(hf, "READ_CHUNK_BYTES", 1)  # smaller than a row: one row per read
    got, reads = sliced(one, "model.embed_tokens.weight", (0, 31), (5, 1))
    assert torch.equal(got, embed[0:5, 31:32]) and reads == 5
    # a 1-D tensor
    norm = "model.layers.1.input_layernorm.weight"
    assert torch.equal(sliced(one, norm, (8,), (16,))[0], whole[norm][8:24])
    # bf16, a 3-D tensor sliced along its last dimension, a scalar
    torch.manual_seed(1)
    tensors = {"w": torch.randn(6, 5, 4).bfloat16(), "s": torch.tensor(2.5, dtype=torch.bfloat16)}
    save_file(tensors, tmp_path / "x.safetensors")
    assert hf.read_index(tmp_path)["w"].dtype == torch.bfloat16
    got, _ = sliced(tmp_path, "w", (1, 0, 1), (4, 5, 2))
    assert got.dtype == torch.bfloat16 and torch.equal(got, tensors["w"][1:5, :, 1:3])
    assert torch.equal(sliced(tmp_path, "w", (2, 0, 0), (3, 5, 4))[0], tensors["w"][2:5])
    assert torch.equal(sliced(tmp_path, "s", (), ())[0], tensors["s"])


def meta_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return module.state_dict(keep_vars=True)


def shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {n: s.shape for n, s in hf.read_index(path).items()}


def test_match_finds_the_prefix_of_a_wrapper_and_ties(saved: tuple[nn.Module, Path, Path], tmp_path: Path) -> None:
    _, one, _ = saved
    with torch.device("meta"):
        wrapped, bare = Wrapper(llama_config()), transformers.LlamaForCausalLM(llama_config())
    m = hf.match(meta_state(wrapped), shapes(one), optional=["model.model.rotary_emb.inv_freq"])
    assert m.prefix == "model." and m.keys["lm_head.weight"] == "model.lm_head.weight"
    assert len(m.keys) == len(shapes(one)) and not (m.missing or m.unexpected or m.misshaped)
    assert m.problem(one) is None
    assert hf.match(meta_state(bare), shapes(one)).prefix == ""
    # tied: the file has the embedding once (save_pretrained drops the head's name); the head is not missing
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(llama_config(tie=True)).save_pretrained(tmp_path)
    assert "lm_head.weight" not in shapes(tmp_path)
    with torch.device("meta"):
        tied = Wrapper(llama_config(tie=True))
    assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight
    m = hf.match(meta_state(tied), shapes(tmp_path))
    assert m.prefix == "model." and m.missing == [] and m.problem(tmp_path) is None


def test_match_names_every_tensor_that_does_not_fit_and_the_fix(saved: tuple[nn.Module, Path, Path]) -> None:
    _, one, _ = saved
    with torch.device("meta"):
        wrapped = Wrapper(llama_config())
    stored = shapes(one)
    del stored["model.layers.0.mlp.up_proj.weight"]
    stored["model.layers.0.mlp.extra.weight"] = (4, 4)
    stored["model.norm.weight"] = (33,)
    m = hf.match(meta_state(wrapped), stored)
    assert m.prefix == "model."
    assert m.missing == ["model.model.layers.0.mlp.up_proj.weight"]
    assert m.unexpected == ["model.layers.0.mlp.extra.weight"]
    assert m.misshaped == [("model.norm.weight", (33,), (32,))]
    text = m.problem("/ckpt")
    assert text is not None and text.startswith("pretrained='/ckpt' does not fit the model")
    for part in (
        "(the checkpoint's names read under 'model.')",
        "missing from the checkpoint: model.model.layers.0.mlp.up_proj.weight",
        "in the checkpoint, not in the model: model.layers.0.mlp.extra.weight",
        "different shapes: model.norm.weight [33] in the checkpoint, [32] in the model",
        "Build the model from the same configuration as the checkpoint (config.json beside it)",
    ):
        assert part in text
    # buffers the model computes may be absent when optional; a name matching `ignored` may have no place
    assert hf.match(meta_state(wrapped), shapes(one)).missing == []  # persistent=False: not in the state dict
    m = hf.match(meta_state(wrapped), {**shapes(one), "model.layers.0.self_attn.rotary.x": (2,)}, ignored=r"rotary")
    assert m.unexpected == []
    # a long list is cut, with the count of the rest
    m = hf.match({f"w{i}": torch.empty(1, device="meta") for i in range(11)}, {})
    assert "w7 and 3 more" in (m.problem("/ckpt") or "")


def test_output_files_by_size_and_export_names() -> None:
    sizes = {"a": 4, "b": 4, "c": 4, "big": 20, "d": 1}
    assert hf.file_indices(sizes, file_bytes=8) == {"a": 1, "b": 1, "c": 2, "big": 3, "d": 4}
    assert hf.file_indices({"big": 20, "d": 1}, file_bytes=8) == {"big": 1, "d": 2}  # no empty first file
    assert set(hf.file_indices(sizes).values()) == {1}
    emb, head, gone = torch.zeros(2), torch.ones(2), torch.empty(2, device="meta")
    state = {"model.emb": emb, "model.head": emb, "model.x": head, "model.gone": gone, "other": head}
    assert hf.export_names(state, "model.") == {"emb": emb, "x": head}  # a tie once, under its first name
    assert list(hf.export_names(state, "model.", keep_meta=True)) == ["emb", "x", "gone"]


def test_files_of_refuses_a_folder_without_safetensors(tmp_path: Path) -> None:
    with pytest.raises(hf.PretrainedError, match=r"pretrained='.*': no \*\.safetensors file there\. Give the folder"):
        hf.files_of(tmp_path)
    with pytest.raises(hf.PretrainedError, match="no \\*.safetensors file there"):
        hf.files_of(tmp_path / "absent")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SGDTPConfigError, match="no \\*.safetensors file there"):
        SGDTPConfig(pretrained=str(tmp_path))
    with pytest.raises(SGDTPConfigError, match=r"pretrained='/nonexistent': no \*\.safetensors file there"):
        SGDTPConfig(pretrained="/nonexistent")
    with pytest.raises(SGDTPConfigError, match="give the path of a Hugging Face checkpoint folder"):
        SGDTPConfig(pretrained=3)  # type: ignore[arg-type]
    save_file({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    assert SGDTPConfig(pretrained=tmp_path).pretrained == str(tmp_path)  # type: ignore[arg-type]
    assert hf.files_of(tmp_path / "model.safetensors") == [tmp_path / "model.safetensors"]


def test_find_hf_model() -> None:
    with torch.device("meta"):
        wrapped = Wrapper(llama_config())
    assert hf.find_hf_model(wrapped) == ("model.", wrapped.model)
    assert hf.find_hf_model(wrapped.model) == ("", wrapped.model)
    assert hf.find_hf_model(nn.Sequential(nn.Linear(2, 2))) is None


def test_save_pretrained_in_one_process_is_read_by_from_pretrained(
    saved: tuple[nn.Module, Path, Path], tmp_path: Path
) -> None:
    model, _, _ = saved
    tensors = hf.export_names(model.state_dict(), "")
    sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    out = hf.save_pretrained(tensors, sizes, tmp_path / "out", rank=0, barrier=lambda: None, config=model.config)
    assert not (out / ".sharded").exists() and (out / "config.json").is_file() and (out / hf.INDEX).is_file()
    back = transformers.LlamaForCausalLM.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
