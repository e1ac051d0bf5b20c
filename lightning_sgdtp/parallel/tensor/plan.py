"""Tensor parallelism: an automatic, printable plan over the module tree, applied with DTensor.

The plan is plain data: ``{module name: style}``, plus what was left replicated and why. Three styles,
all torch's own ``ColwiseParallel`` / ``RowwiseParallel``:

- ``"colwise"``: the weight is split by output features; the output stays a DTensor sharded on its last
  dimension, so the code between this layer and its ``"rowwise"`` partner (head splitting, attention,
  activations) runs on DTensors and keeps its global shapes: an unmodified model stays correct.
- ``"rowwise"``: the weight is split by input features (by vocabulary for an ``nn.Embedding``); the
  partial outputs are summed across the group (one all-reduce) and a plain tensor leaves the module.
- ``"colwise_gather"``: split by output features, output gathered (an LM head: full logits leave the model).

Every style is *correct* for any input (a rowwise layer fed a replicated tensor slices it; DTensor
redistributes what it must); the automatic plan picks the pairs where that costs no extra communication:
column-parallel layers feeding a row-parallel one inside the same module (attention q/k/v or fused qkv ->
output projection; MLP up/gate -> down), the token embedding and the LM head.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sgdtp.parallel.tensor.heads import (
    KV_REPLICATED,
    head_counts,
    replicable_key_value,
    working_sizes,
)
from lightning_sgdtp.parallel.tensor.styles import expert_count, linear_shape

STYLES = ("colwise", "rowwise", "colwise_gather", "experts", "replicate", "sequence")
#: A norm beside a split column -> row pair whose width is not the stream's (Qwen3's ``q_norm`` / ``k_norm``, over
#: each head of the column-parallel q and k; a block's own norms have the stream's width and read it): it reads the
#: pair's DTensor activations, so its weight is a replicated DTensor on the mesh (torch's ``distribute_module``),
#: and so is its gradient. A plain weight there got a DTensor gradient: data parallel fell
#: back to averaging it after backward, and sharding's gathering read of it failed at compile
#: ("local_tensor argument only accepts torch.Tensor but got DTensor", Qwen3 under hybrid + sharding="full").
#: Set by the automatic plan only.
HEAD_NORM = "head_norm"
NORMS = (nn.LayerNorm, nn.RMSNorm)

# Leaf names of linear layers that read the block's input (column-parallel) and write its output (row-parallel).
IN_NAMES = {
    "q", "k", "v", "q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "qkv", "qkv_proj",
    "c_attn", "wqkv", "to_q", "to_k", "to_v", "in_proj", "fc", "fc1", "c_fc", "up_proj", "gate_proj", "w1", "w3",
    "up", "gate", "dense_h_to_4h", "wi", "lin1", "linear1", "w_in", "query_key_value", "gate_up_proj", "w13", "fc_in",
}  # fmt: skip
OUT_NAMES = {
    "proj", "o_proj", "out_proj", "wo", "c_proj", "o", "dense", "to_out", "fc2", "down_proj", "w2", "down",
    "dense_4h_to_h", "lin2", "linear2", "w_out", "fc_out",
}  # fmt: skip
#: Names that read the block's input in one model and write its output in another: LitGPT's SwiGLU MLP is ``fc_1``,
#: ``fc_2`` (gate and up) -> ``proj``; elsewhere ``fc_1`` -> ``fc_2``. Beside a layer named as the output (``proj``)
#: such a layer is an input; otherwise the last of them is the output, if the shapes pair.
EITHER_NAMES = ("fc_1", "fc_2", "linear_1", "linear_2", "dense_1", "dense_2")
TOKEN_EMBEDDING_NAMES = ("tok", "wte", "word", "embed_tokens", "token")
HEAD_NAMES = {"lm_head", "head", "output", "out", "logits", "classifier"}


class TensorPlanError(ValueError):
    """A ``tp_plan`` (or a tensor-parallel size) that cannot be applied. The message names the module and the fix."""


@dataclass
class TensorPlan:
    """Which module is split how (``styles``), and what stays replicated and why (``replicated``)."""

    tp: int
    styles: dict[str, str] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    source: str = "automatic"
    #: Sequence parallel: the blocks whose residual stream is split by sequence (their norms have style
    #: ``"sequence"``), or empty; ``sequence_reason`` says why it is (not) applied.
    sequence_blocks: list[str] = field(default_factory=list)
    sequence_reason: str = ""
    #: Why a module got its style, where the style alone does not say (fused projections, experts).
    notes: dict[str, str] = field(default_factory=dict)
    #: What the plan divides, counted from the module's parameters (:func:`coverage`); empty until measured.
    coverage: dict[str, Any] = field(default_factory=dict)
    #: Attentions whose key/value projections are replicated (``KV_REPLICATED``): ``{module: (key/value heads,
    #: heads after repeating, head width)}``; the module's ``num_key_value_groups`` becomes ``heads / repeated``.
    expanded_kv: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: Query head counts tp does not divide, each with the first attention module that has it (refused at setup:
    #: :func:`check_heads`).
    indivisible_heads: dict[int, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "source": self.source,
            "styles": dict(self.styles),
            "replicated": dict(self.replicated),
            "notes": dict(self.notes),
            "sequence_parallel": {"blocks": list(self.sequence_blocks), "reason": self.sequence_reason},
            "coverage": dict(self.coverage),
        }

    def describe(self) -> list[str]:
        """One line per decision, for rank 0's log."""
        shown = (*STYLES, HEAD_NORM, KV_REPLICATED)
        counts = {s: sum(1 for v in self.styles.values() if v == s) for s in shown if s != "replicate"}
        head = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        lines = [f"tensor-parallel plan ({self.source}, tp={self.tp}): {head or 'nothing sharded'}"]
        for name, style in self.styles.items():
            lines.append(f"  {name}: {style}" + (f" ({self.notes[name]})" if name in self.notes else ""))
        reasons: dict[str, list[str]] = {}
        for name, why in self.replicated.items():
            reasons.setdefault(why, []).append(name)
        for why, names in reasons.items():
            shown = ", ".join(names[:6]) + (f" (+{len(names) - 6} more)" if len(names) > 6 else "")
            lines.append(f"  replicated: {shown}: {why}")
        if self.sequence_reason:
            lines.append(f"  sequence parallel: {self.sequence_reason}")
        c = self.coverage
        if c:
            lines.append(
                f"  tensor parallel splits {c['split_fraction']:.0%} of the parameter bytes: each rank holds"
                f" {c['held_fraction']:.0%} of them (counted from the parameters)"
            )
            if c["block_replicated_fraction"] > 0.5:
                lines.append(
                    f"  WARNING: {c['block_replicated_fraction']:.0%} of the block parameters stay replicated (largest:"
                    f" {c['largest_replicated']}: {self.replicated.get(c['largest_replicated'], '?')}). Name their"
                    " layers in tp_plan, or divide the memory with sharding='full' (parallelism='hybrid') or"
                    " pipeline_stages"
                )
        return lines


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard, a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1].lower()


def _inside(name: str, prefixes: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def auto_plan(module: nn.Module, tp: int, sequence_parallel: bool = False) -> TensorPlan:
    """Find the standard transformer patterns in ``module`` and plan them for a tensor-parallel group of ``tp``.

    Pure: reads names, types and shapes, changes nothing. What it does not understand stays replicated, with
    the reason in ``plan.replicated``. ``sequence_parallel``: also split the residual stream of the block stack by
    sequence where that is correct (see :func:`plan_sequence_parallel`).
    """
    plan = TensorPlan(tp=tp)
    named = dict(module.named_modules())
    opaque = [n for n, m in named.items() if isinstance(m, nn.MultiheadAttention)]
    for name in opaque:
        plan.replicated[name] = (
            "nn.MultiheadAttention keeps q, k and v in one parameter and its head count fixed; DTensor styles"
            " cannot split it by head"
        )
    # A per-head bias computed once and handed to every layer (T5's relative position bias) has all the heads: the
    # attention of every layer of that class must keep all its heads.
    biased = {type(m) for m in named.values() if isinstance(getattr(m, "relative_attention_bias", None), nn.Module)}
    for name, m in named.items():
        if type(m) in biased and not _inside(name, opaque):
            opaque.append(name)
            plan.replicated[name] = (
                "a relative position bias over all heads is computed once and shared by the layers (T5): the heads"
                " of this attention cannot be split"
            )
    # 1. Column -> row pairs inside one parent module (attention, MLP; an expert's MLP too), nn.Linear or Conv1D.
    paired: set[str] = set()
    for parent_name, parent in named.items():
        if _inside(parent_name, opaque):
            continue
        prefix = f"{parent_name}." if parent_name else ""
        shapes = {n: s for n, m in parent.named_children() if (s := linear_shape(m)) is not None}
        ins = [n for n in shapes if n.lower() in IN_NAMES]
        outs = [n for n in shapes if n.lower() in OUT_NAMES]
        either = [n for n in shapes if n.lower() in EITHER_NAMES]
        if either and len(outs) == 1:
            ins += either
        elif len(either) > 1 and not outs:
            ins, outs = ins + either[:-1], [either[-1]]
        if not ins and not outs and isinstance(parent, nn.Sequential):
            ins, outs = _sequential_pair(parent, shapes)
        if not ins or len(outs) != 1:
            continue
        width_in, width = shapes[outs[0]]
        # A fused projection (q, k and v in one layer; gate and up in one) writes more than its partner reads. It is
        # split by output features like the others: its output stays a DTensor, which DTensor gathers where the
        # model splits it into its parts (the weights are divided; the parts are not each split by head).
        fused = [n for n in ins if shapes[n][1] > width_in]
        # Key/value heads that do not divide tp (grouped-query attention with fewer key/value heads than tp;
        # multi-query: one) cannot be split by head. Separate k/v layers are replicated on the mesh (every rank
        # computes every key/value head; its query heads read theirs); a fused projection is still split (its weight
        # divided), and DTensor gathers its output where the model splits it, so the attention between runs whole on
        # each rank (Falcon's multi-query default).
        heads, kv_heads = head_counts(parent, shapes, ins, width_in)
        kv_whole = kv_heads is not None and kv_heads % tp != 0
        key_value = (
            replicable_key_value(parent, shapes, ins, width_in, heads, kv_heads) if kv_whole and not fused else []
        )
        why = None
        if any(shapes[n][0] != width for n in ins):
            why = f"input layers {ins} do not read the width {width} that {outs[0]} writes"
        elif heads is not None and heads % tp:
            why = f"{heads} heads are not divisible by tp={tp}"
            plan.indivisible_heads.setdefault(heads, parent_name)
        elif any(shapes[n][1] % tp for n in ins if n not in key_value) or width_in % tp:
            why = f"feature sizes {[shapes[n][1] for n in ins]} / {width_in} not divisible by tp={tp}"
        elif kv_whole and not fused and not key_value:
            why = f"{kv_heads} key/value heads are not divisible by tp={tp}"
        members = [prefix + n for n in ins + outs]
        paired.update(members)
        if why:
            for n in members:
                plan.replicated[n] = why
            continue
        if key_value:
            assert heads is not None and kv_heads is not None
            # Each rank's query heads must read one key/value head per expanded head: tp of them when kv divides tp
            # (grouped-query attention keeps its groups), else one per query head.
            expanded = tp if tp % kv_heads == 0 else heads
            plan.expanded_kv[parent_name] = (kv_heads, expanded, width_in // heads)
        for n in ins:
            if n in key_value:
                plan.styles[prefix + n] = KV_REPLICATED
                plan.replicated[prefix + n] = (
                    f"{kv_heads} key/value heads do not divide tp={tp}: the key/value projections are whole on every"
                    f" rank, their output repeated to {expanded} heads and split by head (each rank's"
                    f" {heads // tp} query heads read theirs)"
                )
                continue
            plan.styles[prefix + n] = "colwise"
            if n in fused:
                plan.notes[prefix + n] = (
                    f"fused: {shapes[n][1]} outputs for {outs[0]}'s {width_in} inputs; split by output features,"
                    " gathered where the model splits them"
                )
            if n in fused and kv_whole:
                plan.notes[prefix + n] += (
                    f"; {kv_heads} key/value heads, not divisible by tp={tp}: the weight is still split, the attention"
                    " between runs whole on each rank"
                )
        plan.styles[prefix + outs[0]] = "rowwise"
        for n, m in parent.named_children():  # a norm of another width than the stream's: over each head
            own = [p for p in m._parameters.values() if p is not None]
            if _is_norm(m) and own and all(p.shape[-1] != width for p in own):
                plan.styles[prefix + n] = HEAD_NORM
                plan.notes[prefix + n] = "reads the column-parallel activations: weight replicated on the mesh"
    # 2. Token embedding (vocabulary-parallel) and the LM head that produces logits over the same vocabulary.
    embeddings = {n: m for n, m in named.items() if isinstance(m, nn.Embedding) and not _inside(n, opaque)}
    token = None
    if embeddings:
        by_name = [n for n in embeddings if any(k in _leaf(n) for k in TOKEN_EMBEDDING_NAMES)]
        token = by_name[0] if by_name else max(embeddings, key=lambda n: embeddings[n].num_embeddings)
    vocab = embeddings[token].num_embeddings if token else None
    heads = [
        n
        for n, m in named.items()
        if isinstance(m, nn.Linear) and n not in paired and not _inside(n, opaque) and n
        if _leaf(n) in HEAD_NAMES or (vocab is not None and m.out_features == vocab)
    ]
    tied = token is not None and any(named[h].weight is embeddings[token].weight for h in heads)
    for n in embeddings:
        if n != token:
            plan.replicated[n] = "not the token embedding (position/type embeddings are small)"
        elif vocab % tp:
            plan.replicated[n] = f"vocabulary {vocab} not divisible by tp={tp}"
        else:
            plan.styles[n] = "rowwise"
            plan.notes[n] = "vocabulary-parallel: lookup, mask and all-reduce inside the layer"
    for h in heads:
        if named[h].out_features % tp:
            plan.replicated[h] = f"{named[h].out_features} output features not divisible by tp={tp}"
        elif tied and named[h].weight is embeddings[token].weight and plan.styles.get(token) != "rowwise":
            plan.replicated[h] = f"its weight is tied to {token}, which stays replicated"
        else:
            plan.styles[h] = "colwise_gather"
    if tied and token in plan.styles and not any(plan.styles.get(h) == "colwise_gather" for h in heads):
        del plan.styles[token]
        plan.replicated[token] = "its weight is tied to a head that stays replicated"
    # 3. Everything else with parameters of its own stays replicated, each with its reason.
    for n, m in named.items():
        if n in plan.styles or n in plan.replicated or _inside(n, opaque) or not n:
            continue
        if linear_shape(m) is not None:
            plan.replicated[n] = "no column -> row pair found around it"
        elif (experts := expert_count(m)) is not None:
            if experts % tp:
                plan.replicated[n] = f"{experts} experts are not divisible by tp={tp}"
            else:
                plan.styles[n] = "experts"
                plan.notes[n] = f"expert parallel: {experts // tp} of the {experts} whole experts on each rank"
        elif (why := _not_planned(m)) is not None:
            plan.replicated[n] = why
    if sequence_parallel:
        plan_sequence_parallel(module, plan)
    return plan


def check_heads(plan: TensorPlan, world: int) -> None:
    """Refuse a tensor-parallel size that divides no attention's query heads: each rank must hold whole query heads.
    ``world``: the ranks tp may span (the sizes offered divide it and every head count)."""
    if not plan.indivisible_heads:
        return
    counts = sorted(plan.indivisible_heads)
    where = ", ".join(f"{h} heads in {name}" for h, name in plan.indivisible_heads.items())
    sizes = [d for d in working_sizes(counts, world) if world % d == 0]
    raise TensorPlanError(
        f"tensor_parallel_size={plan.tp} does not divide the query heads ({where}): each rank must hold whole query"
        f" heads. Use a tensor_parallel_size that divides {'and '.join(map(str, counts))} and the {world} ranks:"
        f" {sizes}; or pipeline_stages / sharding='full' to divide the memory without splitting heads."
    )


def _sequential_pair(parent: nn.Sequential, shapes: dict[str, tuple[int, int]]) -> tuple[list[str], list[str]]:
    """An MLP written as ``nn.Sequential(Linear, activation, Linear)`` (an expert's, a block's): the two layers as an
    in -> out pair when the second reads what the first writes and writes what it reads."""
    between = [c for c in parent.children() if linear_shape(c) is None]
    if len(shapes) != 2 or any(len(list(c.parameters())) for c in between):
        return [], []
    first, second = shapes
    (a_in, a_out), (b_in, b_out) = shapes[first], shapes[second]
    return ([first], [second]) if a_out == b_in and a_in == b_out else ([], [])


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, NORMS) or "norm" in type(m).__name__.lower()


def _not_planned(m: nn.Module) -> str | None:
    """Why a module with parameters of its own that is not an ``nn.Linear`` stays replicated (None: a norm, small
    and replicated by design, or no parameters of its own)."""
    own = [p for p in m._parameters.values() if p is not None]
    if not own or _is_norm(m):
        return None
    if any(p.ndim == 3 for p in own):
        return (
            "3-D parameters outside transformers' experts convention (num_experts, routing by top_k_index): name"
            " their layers in tp_plan or shard them with sharding='full'"
        )
    return f"{type(m).__name__}: no tensor-parallel style for it"


#: The styles that divide a module's parameters over the tensor-parallel group.
SPLIT_STYLES = ("colwise", "rowwise", "colwise_gather", "experts")


def coverage(module: nn.Module, plan: TensorPlan) -> dict[str, Any]:
    """What ``plan`` divides of ``module`` (pure; tied parameters counted once): ``split_fraction``, the share of
    parameter bytes that are split; ``held_fraction``, the share each rank holds; ``block_replicated_fraction``, the
    share of the block stack's parameter bytes left whole; the largest replicated module."""
    from lightning_sgdtp.parallel.checkpointing import find_block_stack

    found = find_block_stack(module)
    stack = found[0] if found is not None else None
    seen: set[int] = set()
    total = split = block = block_whole = 0
    whole: dict[str, int] = {}
    for name, m in module.named_modules():
        for p in m._parameters.values():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            size = p.numel() * p.element_size()
            total += size
            in_block = stack is not None and (stack == "" or name.startswith(stack + "."))
            block += size if in_block else 0
            if plan.styles.get(name) in SPLIT_STYLES:
                split += size
                continue
            whole[name] = whole.get(name, 0) + size
            block_whole += size if in_block else 0
    total = max(total, 1)
    largest = max((n for n in whole if n in plan.replicated), key=whole.get, default=None)
    return {
        "split_fraction": round(split / total, 4),
        "held_fraction": round((total - split + split / plan.tp) / total, 4),
        "block_replicated_fraction": round(block_whole / block, 4) if block else 0.0,
        "largest_replicated": largest,
    }


def plan_sequence_parallel(module: nn.Module, plan: TensorPlan) -> None:
    """Split the block stack's residual stream by sequence (dim 1) where it is correct; record why (not).

    Correct when every block is fully covered by the plan: each of its linear layers is split (so every
    activation that enters a layer comes from a norm or a row-parallel output, never a replicated layer) and it
    has no ``nn.MultiheadAttention``. Then its norms run on sequence shards (``"sequence"``), column-parallel
    layers all-gather their input, row-parallel layers reduce-scatter their output, and the stream is split when
    it enters the first block and gathered when it leaves the last: code outside the stack sees what it saw.
    """
    from lightning_sgdtp.parallel.checkpointing import find_block_stack

    found = find_block_stack(module)
    if found is None:
        plan.sequence_reason = "not applied: no stack of repeated blocks (nn.ModuleList / nn.Sequential)"
        return
    stack_name, stack = found
    prefix = f"{stack_name}." if stack_name else ""
    blocks = [f"{prefix}{n}" for n, _ in stack.named_children()]
    norms: list[str] = []
    for block_name, block in zip(blocks, stack.children()):
        for n, m in block.named_modules():
            full = f"{block_name}.{n}" if n else block_name
            if isinstance(m, nn.MultiheadAttention):
                plan.sequence_reason = f"not applied: {full} is an nn.MultiheadAttention (replicated)"
                return
            if linear_shape(m) is not None and plan.styles.get(full) not in ("colwise", "rowwise"):
                plan.sequence_reason = f"not applied: {full} is not split, so it would read a sequence shard"
                return
            if isinstance(m, NORMS) and full not in plan.styles:
                norms.append(full)
    if not norms:
        plan.sequence_reason = f"not applied: the blocks of {stack_name or 'the model'} have no LayerNorm/RMSNorm"
        return
    for n in norms:
        plan.styles[n] = "sequence"
    plan.sequence_blocks = blocks
    plan.sequence_reason = (
        f"on: the residual stream of {blocks[0]} .. {blocks[-1]} is split by sequence ({len(norms)} norms)"
    )


def resolve_plan(module: nn.Module, patterns: dict[str, str], tp: int) -> TensorPlan:
    """The user's ``tp_plan`` (glob patterns over module names -> style), checked against ``module``.

    Raises :class:`TensorPlanError` when a pattern matches nothing, a style is unknown, a matched module is
    not an ``nn.Linear`` / ``nn.Embedding``, or a dimension does not divide.
    """
    named = dict(module.named_modules())
    plan = TensorPlan(tp=tp, source="tp_plan")
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise TensorPlanError(f"tp_plan[{pattern!r}] = {style!r}: unknown style. Use one of {STYLES}.")
        matched = [n for n in named if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            examples = ", ".join(n for n, m in named.items() if isinstance(m, (nn.Linear, nn.Embedding)))
            raise TensorPlanError(
                f"tp_plan pattern {pattern!r} matches no module of {type(module).__name__}. Patterns are globs"
                f" over module names (e.g. 'blocks.*.attn.qkv'); the splittable modules are: {examples[:600]}"
            )
        for n in matched:
            m = named[n]
            if style == "replicate":
                plan.styles.pop(n, None)
                plan.replicated[n] = "tp_plan says replicate"
                continue
            if not isinstance(m, (nn.Linear, nn.Embedding)):
                raise TensorPlanError(
                    f"tp_plan[{pattern!r}] matches {n!r}, a {type(m).__name__}: only nn.Linear and nn.Embedding"
                    f" can be split. Make the pattern name the linear layers inside it (e.g. '{n}.*')."
                )
            if isinstance(m, nn.Embedding) and style != "rowwise":
                raise TensorPlanError(
                    f"tp_plan[{pattern!r}] = {style!r} on the embedding {n!r}: embeddings are split by vocabulary,"
                    " use 'rowwise'."
                )
            size, what = _split_size(m, style)
            if size % tp:
                raise TensorPlanError(
                    f"tp_plan[{pattern!r}] = {style!r} on {n!r}: its {what}={size} is not divisible by"
                    f" tensor_parallel_size={tp}. Choose a tensor_parallel_size that divides {size}, or leave"
                    f" {n!r} out of tp_plan (it then stays replicated)."
                )
            plan.styles[n] = style
    for n, m in named.items():
        if isinstance(m, (nn.Linear, nn.Embedding)) and n and n not in plan.styles and n not in plan.replicated:
            plan.replicated[n] = "not in tp_plan"
    return plan


def _split_size(m: nn.Module, style: str) -> tuple[int, str]:
    if isinstance(m, nn.Embedding):
        return m.num_embeddings, "num_embeddings"
    assert isinstance(m, nn.Linear)
    return (m.in_features, "in_features") if style == "rowwise" else (m.out_features, "out_features")


def apply_tensor_parallel(module: nn.Module, plan: TensorPlan, tp_mesh: Any) -> None:
    """Split ``module`` in place per ``plan`` over the 1-D mesh ``tp_mesh`` (torch's ``parallelize_module``).

    Parameters tied before (an embedding and its LM head) are tied again after: both were split the same way
    (by vocabulary: ``Shard(0)``), so they stay one parameter with one gradient.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from lightning_sgdtp.parallel.tensor import dtensor_ops
    from lightning_sgdtp.parallel.tensor.styles import (
        Colwise,
        Conv1DColwise,
        Conv1DRowwise,
        ExpertParallel,
        ReplicatedKeyValue,
        ReplicateOnMesh,
        Rowwise,
        VocabParallelEmbedding,
        is_conv1d,
    )

    dtensor_ops.register()
    named = dict(module.named_modules())
    ties = _tied_parameters(module)
    in_sequence = tuple(f"{b}." for b in plan.sequence_blocks)
    styles: dict[str, Any] = {}
    for name, style in plan.styles.items():
        sequence = name.startswith(in_sequence) if in_sequence else False
        # transformers' Conv1D: the same styles, each parameter split on the other dimension
        col, row = (Conv1DColwise, Conv1DRowwise) if is_conv1d(named[name]) else (Colwise, Rowwise)
        if style == "colwise":
            # In a sequence-parallel block a plain input is a sequence shard; a DTensor input is gathered.
            styles[name] = col(input_layouts=Shard(1) if sequence else Replicate(), use_local_output=False)
        elif style == "colwise_gather":
            styles[name] = col(output_layouts=Replicate())
        elif style == "rowwise":
            # Input declared Replicate: a plain (replicated) input is sliced; a DTensor from a colwise partner is
            # already Shard(-1) and passes as is. Correct for any input. In a sequence-parallel block the partial
            # sums are reduce-scattered by sequence and stay a DTensor for the residual add.
            if sequence:
                styles[name] = row(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
            elif isinstance(named[name], nn.Embedding):  # lookup, mask and all-reduce inside the module
                styles[name] = VocabParallelEmbedding()
            else:
                styles[name] = row(input_layouts=Replicate())
        elif style == "sequence":
            styles[name] = SequenceParallel()
        elif style == "experts":
            styles[name] = ExpertParallel()
        elif style == HEAD_NORM:
            styles[name] = ReplicateOnMesh()
        elif style == KV_REPLICATED:
            styles[name] = ReplicatedKeyValue()
    if styles:
        parallelize_module(module, tp_mesh, styles)
    if plan.sequence_blocks:
        named[plan.sequence_blocks[0]].register_forward_pre_hook(_enter_sequence_shards(tp_mesh))
        named[plan.sequence_blocks[-1]].register_forward_hook(_leave_sequence_shards)
    for owner_name, attr, source_name, source_attr in ties:
        owner, source = named[owner_name], named[source_name]
        setattr(owner, attr, getattr(source, source_attr))


def _enter_sequence_shards(tp_mesh: Any) -> Any:
    """The first block's first input (the replicated residual stream) becomes a DTensor split by sequence."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def hook(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], torch.Tensor) or isinstance(args[0], DTensor):
            return None
        x = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(1)])
        return (x, *args[1:])

    return hook


def _leave_sequence_shards(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """The last block's output is gathered back into a plain, replicated tensor."""
    from torch.distributed.tensor import DTensor, Replicate

    from lightning_sgdtp.parallel.tensor.styles import fresh

    def gather(x: Any) -> Any:
        return fresh(x.redistribute(x.device_mesh, [Replicate()]).to_local()) if isinstance(x, DTensor) else x

    if isinstance(output, tuple):
        return (gather(output[0]), *output[1:])
    return gather(output)


def _tied_parameters(module: nn.Module) -> list[tuple[str, str, str, str]]:
    """(module, attribute) pairs that share a Parameter with an earlier (module, attribute)."""
    first: dict[int, tuple[str, str]] = {}
    ties = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        for attr, p in mod.named_parameters(recurse=False):
            if id(p) in first and first[id(p)] != (mod_name, attr):
                ties.append((mod_name, attr, *first[id(p)]))
            else:
                first.setdefault(id(p), (mod_name, attr))
    return ties
