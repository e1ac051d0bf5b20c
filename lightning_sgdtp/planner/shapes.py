"""Named model shapes for ``sgdtp plan``: published configurations built on the meta device (no memory, no
weights), with the sequence length and samples per rank of the runs they are compared with in docs/planner.md.

The Llama 3 shapes are Meta's published configurations (``config.json`` of Meta-Llama-3-8B, 3-70B and 3.1-405B on
the Hugging Face hub: widths, layers, heads, key/value heads, MLP widths, vocabulary), built with
``transformers.LlamaForCausalLM``: the planner reads the same module a user would train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class Shape:
    """A named model: its configuration, and the sequence length and samples per rank it is planned for."""

    config: dict[str, Any]
    tokens: int
    batch: int
    what: str


_LLAMA3 = {
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
SHAPES = {
    "llama3-8b": Shape(
        {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
        8192, 1, "Llama 3 8B (Meta-Llama-3-8B)",
    ),
    "llama3-70b": Shape(
        {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
        8192, 1, "Llama 3 70B (Meta-Llama-3-70B)",
    ),
    "llama3-405b": Shape(
        {**_LLAMA3, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
         "num_attention_heads": 128},
        8192, 1, "Llama 3.1 405B (Meta-Llama-3.1-405B)",
    ),
}  # fmt: skip


def build(name: str) -> nn.Module:
    """The named model on the meta device (``transformers`` is needed for the Llama shapes)."""
    import torch

    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:  # pragma: no cover - transformers is in the test extras
        raise ImportError(f"the named shape {name!r} is a transformers Llama: pip install transformers") from e
    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**SHAPES[name].config))
