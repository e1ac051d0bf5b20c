"""A tiny ``transformers`` Llama and the LightningModule shape around it, for the tests of Hugging Face checkpoints
(reading by shard, writing back, consolidating): the model as ``self.model`` (state dict keys
``model.model.layers...``), with, optionally, a module of the user's own beside it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def llama_config(tie: bool = False, hidden: int = 32) -> object:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


class Wrapper(nn.Module):
    """A LightningModule's shape: the Hugging Face model as ``self.model``; ``head``: a module of its own beside it
    (``value``: not in a Hugging Face checkpoint, neither missing nor a prefix)."""

    def __init__(self, config: object, dtype: torch.dtype | None = None, head: bool = True) -> None:
        import transformers

        super().__init__()
        self.model = transformers.LlamaForCausalLM(config)
        if dtype is not None:
            self.model.to(dtype)
        if head:
            self.value = nn.Linear(config.hidden_size, 1)


def check_export(out: Path, trained: dict[str, torch.Tensor]) -> None:
    """The exported folder loads with ``from_pretrained``: the trained tensors, and the trained model's logits."""
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "exported").eval()
    state = exported.state_dict()
    for key, value in state.items():
        assert torch.equal(value, trained[f"model.{key}"]), key
    mine = transformers.AutoModelForCausalLM.from_config(exported.config).eval()
    mine.load_state_dict({k.removeprefix("model."): v for k, v in trained.items()}, strict=False)
    tokens = torch.randint(0, exported.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, mine(tokens).logits)
