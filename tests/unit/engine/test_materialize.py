"""A model built on the meta device, given storage and values in one process (engine/materialize.py): read from a
Hugging Face folder (every tensor equal to the saved one, the same Parameter objects, ties kept, a dtype converted),
or initialized module by module under seeds from the job's seed (deterministic; transformers' ``_init_weights``,
``reset_parameters``, or ``init_weights``); a checkpoint that does not fit refused before anything is allocated or
read. DTensor shards and pipeline stages on several ranks: the distributed tests; the reader: test_huggingface.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from lightning_sgdtp import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.checkpoint import huggingface as hf
from lightning_sgdtp.engine.materialize import MaterializeError, has_meta, materialize

transformers = pytest.importorskip("transformers")
from helpers.hf import Wrapper, llama_config

CPU = torch.device("cpu")


def on_meta(tie: bool = False) -> Wrapper:
    with torch.device("meta"):
        return Wrapper(llama_config(tie))


def saved_model(folder: Path, tie: bool = False) -> nn.Module:
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(llama_config(tie))
    model.save_pretrained(folder)
    return model


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_pretrained_fills_every_tensor_and_keeps_the_parameters(tmp_path: Path, tie: bool) -> None:
    ref = saved_model(tmp_path, tie)
    wrapped = on_meta(tie)
    before = dict(wrapped.named_parameters(remove_duplicate=False))
    wrapped.model.model.norm.weight.mark = "kept"  # an attribute on a parameter (a sharded parameter's mark)
    assert has_meta(wrapped)

    done = materialize(wrapped, CPU, pretrained=tmp_path)

    assert not has_meta(wrapped)
    after = dict(wrapped.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[n] is p for n, p in before.items())
    assert isinstance(wrapped.model.lm_head.weight, nn.Parameter) and wrapped.model.lm_head.weight.requires_grad
    assert wrapped.model.model.norm.weight.mark == "kept"
    assert (wrapped.model.lm_head.weight is wrapped.model.model.embed_tokens.weight) == tie
    for name, tensor in ref.state_dict().items():
        assert torch.equal(wrapped.model.state_dict()[name], tensor), name
    # the rotary table is computed (not in the file), equal to a freshly built model's
    fresh = transformers.LlamaForCausalLM(llama_config(tie)).model.rotary_emb
    rotary = wrapped.model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, fresh.inv_freq) and torch.equal(rotary.original_inv_freq, fresh.inv_freq)
    # the wrapper's own module is not in the checkpoint: initialized, not garbage
    assert torch.isfinite(wrapped.value.weight).all() and wrapped.value.weight.abs().sum() > 0
    files = len(hf.read_index(tmp_path))
    assert (done.loaded, done.initialized, done.left) == (files, 4, 0)  # rotary: 2 buffers; value: weight, bias
    assert done.allocated == files + 4 and sorted(set(done.modules)) == ["Linear", "LlamaRotaryEmbedding"]
    assert f"read by shard from {tmp_path}" in done.describe()[0]


def test_a_bf16_model_reads_an_fp32_checkpoint(tmp_path: Path) -> None:
    ref = saved_model(tmp_path)
    assert {s.dtype for s in hf.read_index(tmp_path).values()} == {torch.float32}
    wrapped = on_meta().to(torch.bfloat16)
    materialize(wrapped, CPU, pretrained=tmp_path)
    for name, tensor in ref.named_parameters():
        got = wrapped.model.get_parameter(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, tensor.to(torch.bfloat16)), name


def test_held_leaves_the_other_stages_on_meta(tmp_path: Path) -> None:
    ref = saved_model(tmp_path)
    wrapped = on_meta()
    done = materialize(wrapped, CPU, pretrained=tmp_path, held=lambda key: ".layers.1." not in key)
    other = dict(wrapped.model.model.layers[1].named_parameters())
    assert done.left == len(other) == 9 and all(p.is_meta for p in other.values())
    assert has_meta(wrapped) and "9 of other stages left unallocated" in done.describe()[0]
    for name, tensor in ref.state_dict().items():
        if ".layers.1." not in name:
            assert torch.equal(wrapped.model.state_dict()[name], tensor), name


def rewritten(source: Path, folder: Path, change: dict[str, torch.Tensor | None]) -> Path:
    tensors = load_file(source / "model.safetensors")
    for name, tensor in change.items():
        tensors.pop(name) if tensor is None else tensors.__setitem__(name, tensor)
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model.layers.1.mlp.down_proj.weight": None}, "missing from the checkpoint: model.model.layers.1.mlp"),
        ({"model.norm.weight": torch.ones(33)}, "different shapes: model.norm.weight [33] in the checkpoint, [32]"),
        ({"model.layers.0.extra": torch.ones(2)}, "in the checkpoint, not in the model: model.layers.0.extra"),
    ],
    ids=["missing", "misshaped", "unexpected"],
)
def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_allocated_or_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: dict, named: str
) -> None:
    saved_model(tmp_path / "good")
    folder = rewritten(tmp_path / "good", tmp_path / "bad", change)

    def never(*args: object) -> None:
        raise AssertionError("read before the checkpoint was checked")

    monkeypatch.setattr(hf, "load", never)
    monkeypatch.setattr(hf, "read_slice", never)
    wrapped = on_meta()
    with pytest.raises(hf.PretrainedError, match="does not fit the model") as refused:
        materialize(wrapped, CPU, pretrained=folder)
    assert named in str(refused.value) and "Build the model from the same configuration" in str(refused.value)
    assert all(t.is_meta for t in (*wrapped.parameters(), *wrapped.buffers()))


def test_from_scratch_a_transformers_model_uses_its_init_weights_deterministically() -> None:
    def built(seed: int) -> tuple[Wrapper, dict[str, torch.Tensor]]:
        wrapped = on_meta()
        done = materialize(wrapped, CPU, seed=seed)
        assert done.loaded == 0 and done.source is None and done.initialized == done.allocated
        return wrapped, state(wrapped)

    wrapped, first = built(3)
    assert not has_meta(wrapped)
    for name, tensor in [*first.items(), *((n, b) for n, b in wrapped.named_buffers())]:
        assert torch.isfinite(tensor).all(), name
        if name.endswith(("proj.weight", "embed_tokens.weight")):
            assert tensor.abs().sum() > 0, name
            assert 0.01 < tensor.std() < 0.03, name  # transformers' initializer_range 0.02, not reset_parameters'
        if name == "value.weight":  # outside the transformers model: its own reset_parameters (kaiming uniform)
            assert tensor.std() > 0.05, name
    assert torch.equal(first["model.model.norm.weight"], torch.ones(32))
    fresh = transformers.LlamaForCausalLM(llama_config()).model.rotary_emb.inv_freq
    assert torch.equal(wrapped.model.model.rotary_emb.inv_freq, fresh)
    again, other = built(3)[1], built(4)[1]
    assert all(torch.equal(again[k], t) for k, t in first.items())
    assert not torch.equal(other["model.model.embed_tokens.weight"], first["model.model.embed_tokens.weight"])
    # each module has its own seed: two layers of one shape differ
    assert not torch.equal(
        first["model.model.layers.0.mlp.up_proj.weight"], first["model.model.layers.1.mlp.up_proj.weight"]
    )
    # tied: one tensor, initialized once
    tied = on_meta(tie=True)
    materialize(tied, CPU)
    assert tied.model.lm_head.weight is tied.model.model.embed_tokens.weight and not has_meta(tied)


def plain() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def test_from_scratch_a_plain_torch_model_uses_reset_parameters() -> None:
    model = plain()
    weight = model[1].weight
    done = materialize(model, CPU, seed=1)
    assert model[1].weight is weight and not has_meta(model)
    assert done.initialized == 7 and sorted(set(done.modules)) == ["Embedding", "LayerNorm", "Linear"]
    assert model[1].weight.abs().max() <= 8**-0.5 and model[1].weight.abs().sum() > 0  # kaiming_uniform(a=sqrt(5))
    assert model[3].weight.abs().max() <= 16**-0.5 and model[0].weight.std() > 0.5  # the embedding N(0, 1)
    assert torch.equal(model[2].weight, torch.ones(16)) and torch.equal(model[2].bias, torch.zeros(16))
    again, other = plain(), plain()
    materialize(again, CPU, seed=1)
    materialize(other, CPU, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
    assert not torch.equal(other[1].weight, model[1].weight)


def test_init_weights_is_used_when_given() -> None:
    seen = []

    def ones(module: nn.Module) -> None:
        seen.append(type(module).__name__)
        for p in module.parameters(recurse=False):
            p.fill_(1.0)

    model = plain()
    materialize(model, CPU, init_weights=ones)
    assert seen == ["Embedding", "Linear", "LayerNorm", "Linear"]
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())


def test_an_init_function_that_leaves_a_tensor_untouched_is_refused() -> None:
    """The host copies start as NaN: a tensor the initialization did not write is caught, named, never trained."""

    def weights_only(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.fill_(0.5)  # the bias is forgotten

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(MaterializeError, match=r"init_weights left \['bias'\] uninitialized"):
        materialize(model, CPU, init_weights=weights_only)


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


def test_a_module_nobody_can_initialize_is_named_with_the_fix() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(MaterializeError, match=r"1 \(Scale\) was built on the meta device and its tensors \['gain'\]"):
        materialize(model, CPU)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(MaterializeError, match=r"Give the strategy init_weights=fn .* pretrained=\.\.\."):
        materialize(model, CPU)
    with torch.device("meta"):
        alone = Scale()
    with pytest.raises(MaterializeError, match=r"^the model \(Scale\)"):
        materialize(alone, CPU)


def test_init_weights_option() -> None:
    import os.path

    assert SGDTPConfig(init_weights="os.path:join").init_function() is os.path.join
    assert SGDTPConfig(init_weights=print).init_function() is print and SGDTPConfig().init_function() is None
    with pytest.raises(SGDTPConfigError, match=r"init_weights=3: give a function fn\(module\) .* 'package.module:fu"):
        SGDTPConfig(init_weights=3)
    with pytest.raises(SGDTPConfigError, match="init_weights='os.path': give a function"):
        SGDTPConfig(init_weights="os.path")
    with pytest.raises(SGDTPConfigError, match="init_weights='os.path:nothing' cannot be imported"):
        SGDTPConfig(init_weights="os.path:nothing").init_function()
    with pytest.raises(SGDTPConfigError, match=r"pretrained='/nonexistent': no \*\.safetensors file there"):
        SGDTPConfig(pretrained="/nonexistent")


def test_transformers_renamings_apply_and_a_converted_layout_is_refused(tmp_path: Path) -> None:
    """GPT-NeoX's checkpoints name the head ``embed_out`` (transformers renames it ``lm_head`` while loading): read
    by its model name. Mixtral's store each expert alone (transformers stacks them): refused, with the one-time
    conversion that makes a folder readable by shard."""
    import transformers

    small = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    small["num_attention_heads"] = 4
    neox = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**small))
    neox.save_pretrained(tmp_path / "neox")
    with torch.device("meta"):
        built = transformers.GPTNeoXForCausalLM(neox.config)
    materialize(built, CPU, pretrained=tmp_path / "neox")
    assert all(torch.equal(a, b) for a, b in zip(neox.state_dict().values(), built.state_dict().values()))

    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(**small, num_local_experts=2))
    mixtral.save_pretrained(tmp_path / "mixtral")
    with torch.device("meta"):
        built = transformers.MixtralForCausalLM(mixtral.config)
    with pytest.raises(hf.PretrainedError, match="save_original_format=False"):
        materialize(built, CPU, pretrained=tmp_path / "mixtral")
    mixtral.save_pretrained(tmp_path / "stacked", save_original_format=False)
    materialize(built, CPU, pretrained=tmp_path / "stacked")
    assert all(torch.equal(a, b) for a, b in zip(mixtral.state_dict().values(), built.state_dict().values()))
