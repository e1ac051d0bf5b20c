"""Attention heads under tensor parallel: how many an attention has, and its key/value heads when tp does not divide
them.

Each rank must hold whole query heads, so tp must divide every attention's query heads (``plan.check_heads`` refuses
other sizes at setup; ``parallelism="hybrid"``'s automatic size is the largest that divides them). Key/value heads
may be fewer (grouped-query attention: Qwen2.5-1.5B has 2, Llama 3 70B 8 for tp 16; multi-query: 1). Then the key and
value projections are replicated (:data:`KV_REPLICATED`, ``styles.ReplicatedKeyValue``), their output repeated to a
head count tp divides (:func:`repeat_key_value_heads`) and split by head, and the attention's
``num_key_value_groups`` drops to match: the attention computes what it computed, split by head as any other.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: The style of the key and value projections of an attention whose key/value heads tp does not divide (grouped-query
#: attention with fewer key/value heads than tp, multi-query): weights replicated on the mesh, output repeated and
#: split by head, while the query heads and the output projection are split as usual (styles.ReplicatedKeyValue).
#: Set by the automatic plan only.
KV_REPLICATED = "kv_replicated"
#: Attributes that give an attention's head width (transformers 5 keeps no head counts on the module: the counts are
#: its projections' widths over it).
HEAD_DIM_ATTRS = ("head_dim", "head_size")
HEAD_COUNT_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nhead", "heads")
KV_HEAD_COUNT_ATTRS = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")


def count(module: nn.Module, attrs: tuple[str, ...] = HEAD_COUNT_ATTRS) -> int | None:
    """The first of ``attrs`` that ``module`` has as a positive int (a head count, a head width), or None."""
    for attr in attrs:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def head_counts(
    parent: nn.Module, shapes: dict[str, tuple[int, int]], ins: list[str], width_in: int
) -> tuple[int | None, int | None]:
    """``(query heads, key/value heads)`` of an attention module (None where unknown): its attributes (``num_heads``,
    ``num_key_value_heads``, ...), else its projections' widths over its head width (transformers 5: ``head_dim``;
    ``width_in``: what the output projection reads, every query head; a key/value projection writes ``kv x head_dim``),
    else its ``config`` (a fused projection). A module without head attributes is not an attention: (None, None)."""
    heads, kv = count(parent), count(parent, KV_HEAD_COUNT_ATTRS)
    head_dim = count(parent, HEAD_DIM_ATTRS)
    if head_dim is None or (heads is not None and kv is not None):
        return heads, kv if kv is not None or heads is None else heads
    config = getattr(parent, "config", None)
    if heads is None:
        heads = width_in // head_dim if width_in % head_dim == 0 else getattr(config, "num_attention_heads", None)
    narrow = {shapes[n][1] for n in ins if shapes[n][1] < width_in}
    if kv is None and len(narrow) == 1 and (width := narrow.pop()) % head_dim == 0:
        kv = width // head_dim
    if kv is None:
        kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv


def replicable_key_value(
    parent: nn.Module,
    shapes: dict[str, tuple[int, int]],
    ins: list[str],
    width_in: int,
    heads: int | None,
    kv_heads: int,
) -> list[str]:
    """The key and value projections of an attention whose key/value heads tp does not divide, when they can be
    replicated: separate layers (each ``kv_heads x head_dim`` wide) of an attention that repeats them by its
    ``num_key_value_groups`` (transformers' convention, which the repeat changes). Else none (the pair stays whole)."""
    if (
        heads is None
        or heads % kv_heads
        or width_in % heads
        or not isinstance(getattr(parent, "num_key_value_groups", None), int)
    ):
        return []
    narrow = [n for n in ins if shapes[n][1] < width_in]
    return narrow if narrow and all(shapes[n][1] == kv_heads * (width_in // heads) for n in narrow) else []


def repeat_key_value_heads(
    module: nn.Module, expanded: dict[str, tuple[int, int, int]], styles: dict[str, str]
) -> None:
    """Before the split, for each attention in ``expanded`` (a tensor plan's ``expanded_kv``; ``styles``: its
    styles): its key and value projections' outputs repeated from ``kv`` heads to ``repeated`` (a forward hook on
    each: exact, every repeated head a copy), and its ``num_key_value_groups`` set to ``heads / repeated``: the
    attention computes what it computed, with a head count tp divides. Not a tensor-parallel hook: a pipeline traces
    it into its stages (each stage's projection runs it)."""
    named = dict(module.named_modules())
    for name, (kv, repeated, head_dim) in expanded.items():
        attention = named[name]
        prefix = f"{name}." if name else ""
        heads = attention.num_key_value_groups * kv
        for layer, style in styles.items():
            if style == KV_REPLICATED and layer.startswith(prefix) and "." not in layer[len(prefix) :]:
                named[layer].register_forward_hook(_repeat_heads(kv, repeated // kv, head_dim))
        attention.num_key_value_groups = heads // repeated


def _repeat_heads(kv: int, times: int, head_dim: int) -> Any:
    def hook(mod: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        *lead, _ = out.shape
        return out.view(*lead, kv, 1, head_dim).expand(*lead, kv, times, head_dim).reshape(*lead, kv * times * head_dim)

    return hook


def working_sizes(counts: list[int], limit: int) -> list[int]:
    """The sizes up to ``limit`` that divide every one of ``counts``."""
    return [d for d in range(1, limit + 1) if all(c % d == 0 for c in counts)]
