"""Pipeline parallelism, part one: where the model is cut into stages. Pure planning over the module tree.

The split is plain data (:class:`PipelineSplit`): which blocks of the model's repeated block stack run on which
stage, what runs before the stack (on stage 0) and after it (on the last stage), the per-stage cost it balanced,
and the parameters that end up shared between two stages. Nothing here runs the model, starts processes or
touches ``torch.distributed``, and the module is not modified.

**Which modules run before and after the stack** cannot be known without running the forward, so it is decided by
*registration order*. Walk from the root down to the stack: at every module on that path, the children registered
before the one that leads to the stack run before it (stage 0), those registered after it run after it (the last
stage). A LightningModule that holds the model as one child is therefore looked into (``model.tok_emb`` before,
``model.ln_f`` and the LightningModule's own later children, metrics included, after). Parameters registered
directly on a module of that path (a ViT's ``cls_token``) have no order against its children: they go to stage 0.

**Several stacks of the same block type** (an encoder-decoder such as T5: ``encoder.block`` and ``decoder.block``,
both ``T5Block``) are one sequence of blocks, in registration order, so a cut may fall in either stack. What is
registered between two stacks (the encoder's final norm, the decoder's embedding) is ``between``: it runs after the
block registered before it, on that block's stage, and its parameters count there. Before this, a T5's largest
stack (the decoder's) was the only one, and the whole encoder ran "before the stack" on stage 0 (72% of the
parameters on one of 2 ranks).

**A cut inside a block.** A block whose body is one sequence of layers called in order (T5's ``block.layer``:
self-attention, cross-attention, feed-forward; every parameter of the block inside that sequence) may be cut
between its layers when no cut at a whole block balances the stages: by parameter count only, and only when it
lowers the largest stage's parameters (a tied one counted on each stage that holds it) by at least
:data:`INSIDE_GAIN` of them. Only the block a cut falls in is named by its layers
(``decoder.block.0.layer.0`` on one stage, ``.layer.1`` and ``.layer.2`` on the next, listed in ``cut_blocks``).
A T5 of 2 + 2 tiny blocks: 44% / 63% of the parameter bytes at the best whole-block cut, 54% / 53% cut inside the
decoder's first block.

**Balance.** By parameter count (default): the stack is cut into contiguous groups so that the largest stage cost
is minimal (exact dynamic program), where stage 0 also counts what runs before the stack and the last stage what
runs after it; among equally good cuts, earlier cut points win. A parameter used in two places (a tied embedding
and LM head) counts once, on the first place it is registered in execution order. With ``block_costs`` (one
measured cost per block) the blocks are balanced by those instead; what runs before/after the stack then counts 0.
With ``split_points`` the user names the blocks where each new stage starts.

**Tied parameters** that land on two stages (``tok_emb.weight`` on stage 0, ``lm_head.weight`` on the last) are
reported in ``tied``, not refused: the pipeline must keep the two copies equal by summing their gradients across
the two stages.

**Parameters no stage calls** (MBartForCausalLM's decoder layers keep a cross-attention that only an encoder would
feed) are in no traced stage; they belong to the stage this rule gives their module
(:func:`~lightning_sgdtp.parallel.pipeline.unused.unused_parameters`),
which keeps them: they exist on one rank, are saved in its checkpoint part and, with no gradient, stay unchanged.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_sgdtp.parallel.checkpointing import find_block_stack

BALANCES = ("params", "cost", "split_points")
#: A cut inside a block is taken when it lowers the largest stage's parameters by at least this share of it.
INSIDE_GAIN = 0.05
RULE = (
    "before/after by registration order: what is registered ahead of the stack (at each level down to it) runs on"
    " stage 0, what is registered after it on the last stage, what lies between two stacks on the stage of the block"
    " before it"
)


class PipelineSplitError(ValueError):
    """A model or request the pipeline splitter cannot honour. The message names what to provide."""


class TooManyStagesError(PipelineSplitError):
    """More stages than blocks: ``blocks`` is how many there are (the caller names the options that work)."""

    def __init__(self, message: str, blocks: int) -> None:
        super().__init__(message)
        self.blocks = blocks


@dataclass
class PipelineSplit:
    """Which blocks run on which pipeline stage, and what runs before/after the block stack."""

    stages: int
    #: Qualified name of the block stack ("" when the model itself is the stack); several stacks of one block type
    #: (an encoder's and a decoder's) are joined with " + ", in registration order.
    stack: str
    #: Qualified block names per stage: contiguous, in order, every block exactly once, no stage empty.
    blocks_per_stage: list[list[str]]
    #: Modules (or parameters registered directly on a module above the stack) that run before it: stage 0.
    before: list[str] = field(default_factory=list)
    #: Modules that run after the stack: the last stage.
    after: list[str] = field(default_factory=list)
    #: Modules registered between two block stacks, with the stage of the block registered before each.
    between: dict[str, int] = field(default_factory=dict)
    #: Per stage, the cost that was balanced (parameters, or the given block costs), before/after included.
    cost: list[float] = field(default_factory=list)
    #: "params" | "cost" | "split_points".
    balance: str = "params"
    #: Parameters shared between two stages, (first registered, the other use): keep them equal.
    tied: list[tuple[str, str]] = field(default_factory=list)
    #: Blocks cut between their layers (``blocks_per_stage`` names their layers instead of them).
    cut_blocks: list[str] = field(default_factory=list)

    @property
    def imbalance(self) -> float:
        """Largest stage cost over the mean stage cost (1.0: perfectly balanced)."""
        mean = sum(self.cost) / len(self.cost) if self.cost else 0.0
        return max(self.cost) / mean if mean > 0 else 1.0

    def stage_of(self, module_name: str) -> int:
        """The stage that runs ``module_name`` (a module or parameter name, qualified from the root)."""
        for name in self.before:
            if _inside(module_name, name):
                return 0
        for stage, blocks in enumerate(self.blocks_per_stage):
            for name in blocks:
                if _inside(module_name, name):
                    return stage
        for name in self.after:
            if _inside(module_name, name):
                return self.stages - 1
        for name, stage in self.between.items():
            if _inside(module_name, name):
                return stage
        if any(_inside(name, module_name) for name in self._units()):
            raise PipelineSplitError(
                f"{module_name!r} contains modules of several pipeline stages; ask for one of its children (a block"
                f" of {self.stack or 'the model'}, or one of: {', '.join(self.before + self.after) or 'none'})"
            )
        raise PipelineSplitError(
            f"{module_name!r} is not a module of the split model. Name a block of {self.stack or 'the model'}"
            f" ({blocks_text(self._blocks())}) or one of: {', '.join(self.before + self.after) or 'none'}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": self.stages,
            "balance": self.balance,
            "stack": self.stack,
            "blocks_per_stage": [list(b) for b in self.blocks_per_stage],
            "before": list(self.before),
            "after": list(self.after),
            "between": dict(self.between),
            "cost": [float(c) for c in self.cost],
            "imbalance": round(self.imbalance, 4),
            "tied": [[a, b] for a, b in self.tied],
            "cut_blocks": list(self.cut_blocks),
            "rule": RULE,
        }

    def describe(self) -> list[str]:
        """One line per decision, for rank 0's log."""
        head = (
            f"pipeline split ({self.balance}, {self.stages} stages) of the {len(self.whole_blocks())} blocks of"
            f" {self.stack or 'the model'}: imbalance {self.imbalance:.2f} (largest stage / mean)"
        )
        lines = [head]
        for stage, blocks in enumerate(self.blocks_per_stage):
            parts = []
            if stage == 0 and self.before:
                parts.append(", ".join(self.before))
            parts.append(_range_text(blocks))
            inner = [name for name, s in self.between.items() if s == stage]
            if inner:
                parts.append(f"between the stacks: {', '.join(inner)}")
            if stage == self.stages - 1 and self.after:
                parts.append(", ".join(self.after))
            lines.append(f"  stage {stage}: {' + '.join(parts)} ({self._cost_text(self.cost[stage])})")
        for block in self.cut_blocks:
            layers = [b for b in self._blocks() if _inside(b, block)]
            where = ", ".join(f"{b.rsplit('.', 1)[-1]} on stage {self.stage_of(b)}" for b in layers)
            lines.append(f"  {block} is cut between its layers ({where}): no cut at a whole block balances the stages")
        for first, other in self.tied:
            lines.append(
                f"  tied: {other} (stage {self.stage_of(other)}) is {first} (stage {self.stage_of(first)}): kept"
                " equal, its gradients summed across the two stages"
            )
        lines.append(f"  {RULE}")
        return lines

    def _blocks(self) -> list[str]:
        return [b for blocks in self.blocks_per_stage for b in blocks]

    def whole_blocks(self) -> list[str]:
        """The blocks of the stack, in order, a block cut between its layers named once (as itself)."""
        named = [next((c for c in self.cut_blocks if _inside(b, c)), b) for b in self._blocks()]
        return list(dict.fromkeys(named))

    def in_blocks(self, name: str) -> bool:
        """Whether ``name`` (a module or parameter) lies inside a block of the stack: where it runs is known from
        the split alone; what lies outside (embeddings, norms, head) runs where the traced forward uses it."""
        return any(_inside(name, b) for b in self._blocks())

    def _units(self) -> list[str]:
        return self.before + self._blocks() + list(self.between) + self.after

    def _cost_text(self, cost: float) -> str:
        if self.balance == "cost":
            return f"cost {cost:.4g}"
        return f"{_count_text(cost)} params"


def _inside(name: str, prefix: str) -> bool:
    return prefix == "" or name == prefix or name.startswith(prefix + ".")


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _count_text(n: float) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{int(n)}"


def _range_text(blocks: list[str]) -> str:
    """``encoder.block.0..3, decoder.block.0``: one range per stack the blocks come from."""
    runs: list[list[str]] = []
    for block in blocks:
        if runs and runs[-1][0].rpartition(".")[0] == block.rpartition(".")[0]:
            runs[-1].append(block)
        else:
            runs.append([block])
    return ", ".join(run[0] if len(run) == 1 else f"{run[0]}..{run[-1].rsplit('.', 1)[-1]}" for run in runs)


def blocks_text(blocks: list[str], limit: int = 12) -> str:
    shown = ", ".join(blocks[:limit])
    return shown + (f" (+{len(blocks) - limit} more)" if len(blocks) > limit else "")


def _children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    # Every registration, in order: a module registered under two names is placed under both.
    return [(n, m) for n, m in module._modules.items() if m is not None]


def _block_stacks(module: nn.Module, main: str) -> list[str]:
    """``main`` (the largest stack) and every other ``nn.ModuleList`` / ``nn.Sequential`` of >= 2 modules of the
    same block type, not inside one another, in registration order (an encoder's blocks before a decoder's)."""
    kind = {type(b) for b in module.get_submodule(main).children()}
    stacks: list[str] = []
    for name, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or any(_inside(name, s) for s in stacks):
            continue
        blocks = list(child.children())
        same = len(blocks) >= 2 and {type(b) for b in blocks} == kind
        if name == main or (same and not _inside(main, name)):
            stacks.append(name)
    return stacks


def _walk_units(level: nn.Module, prefix: str, blocks: set[str]) -> list[tuple[str, Any, bool]]:
    """Registration order, looked into only where a block lies below: (name, module or parameter, is a block).
    A module's own parameters come before its children (they have no order against them)."""
    units: list[tuple[str, Any, bool]] = [
        (_join(prefix, n), p, False) for n, p in level._parameters.items() if p is not None
    ]
    for n, child in _children(level):
        name = _join(prefix, n)
        if name in blocks:
            units.append((name, child, True))
        elif any(_inside(b, name) for b in blocks):
            units += _walk_units(child, name, blocks)
        else:
            units.append((name, child, False))
    return units


def _layer_sequence(block: nn.Module) -> list[str]:
    """The layers of a block whose body is one sequence of layers called in order (T5Block.layer), relative to the
    block; [] when the block is anything else (its parameters not all inside one nn.ModuleList / nn.Sequential of
    >= 2 layers)."""
    sequences = [(n, c) for n, c in _children(block) if isinstance(c, (nn.ModuleList, nn.Sequential)) and len(c) >= 2]
    if len(sequences) != 1:
        return []
    name, sequence = sequences[0]
    inside = {id(p) for p in sequence.parameters()}
    if any(id(p) not in inside for p in block.parameters()):
        return []
    return [_join(name, n) for n, _ in _children(sequence)]


def _no_stack_message(module: nn.Module) -> str:
    return (
        "pipeline parallelism needs a stack of repeated blocks (an nn.ModuleList or nn.Sequential of at least two"
        f" modules of the same type) in {type(module).__name__}; none was found. Put your layers in an"
        " nn.ModuleList, or give split points with pipeline_split=[...]: the names of the modules where each stage"
        f" after the first starts, all children of one module (here: {blocks_text([n for n, _ in _children(module)])})"
    )


def _check_stages(stages: Any) -> None:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 2:
        raise PipelineSplitError(
            f"pipeline_stages must be an integer >= 2 (the number of pipeline stages), got {stages!r}. One stage is"
            " no pipeline: leave pipeline_stages unset to train without pipeline parallelism."
        )


def _check_block_costs(block_costs: Any, blocks: list[str], stack: str) -> list[float]:
    try:
        costs = [float(c) for c in block_costs]
    except (TypeError, ValueError):
        raise PipelineSplitError(
            f"block_costs must be a list of {len(blocks)} positive numbers (one per block of {stack or 'the model'}),"
            f" got {block_costs!r}"
        ) from None
    if len(costs) != len(blocks):
        raise PipelineSplitError(
            f"block_costs has {len(costs)} entries but {stack or 'the model'} has {len(blocks)} blocks"
            f" ({blocks_text(blocks)}): give one measured cost per block, in order"
        )
    bad = [(b, c) for b, c in zip(blocks, costs) if not (math.isfinite(c) and c > 0)]
    if bad:
        shown = ", ".join(f"{b}={c!r}" for b, c in bad[:6])
        raise PipelineSplitError(f"block_costs must be finite and positive (a measured time or FLOP count): {shown}")
    return costs


def _split_point_stages(split_points: Any, blocks: list[str], stages: int, where: str) -> list[int]:
    """Indices (into ``blocks``) where stages 1..stages-1 start."""
    valid = f"the blocks of {where} are: {blocks_text(blocks, 24)}"
    if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
        raise PipelineSplitError(
            f"pipeline_split must be a list of module names, got {split_points!r}. Name the block where each stage"
            f" after the first starts; {valid}"
        )
    points = list(split_points)
    if len(points) != stages - 1:
        raise PipelineSplitError(
            f"pipeline_split has {len(points)} split points for {stages} stages: give {stages - 1}, the block where"
            f" each stage after the first starts; {valid}"
        )
    index = {b: i for i, b in enumerate(blocks)}
    starts = []
    for p in points:
        if p not in index:
            raise PipelineSplitError(f"pipeline_split names {p!r}, which is not a block of {where}; {valid}")
        if index[p] == 0:
            raise PipelineSplitError(
                f"pipeline_split names {p!r}, the first block: stage 0 starts there already. Name where stages"
                f" 1..{stages - 1} start; {valid}"
            )
        starts.append(index[p])
    if any(b <= a for a, b in itertools.pairwise(starts)):
        raise PipelineSplitError(f"pipeline_split {points} is not in increasing block order (each name once); {valid}")
    return starts


def _stackless_parent(module: nn.Module, split_points: Any) -> str:
    """Without a block stack: the module whose children the split points name (they must share one parent)."""
    named = dict(module.named_modules())
    if isinstance(split_points, str) or not split_points or not all(isinstance(p, str) for p in split_points):
        raise PipelineSplitError(_no_stack_message(module))
    parents = {p.rsplit(".", 1)[0] if "." in p else "" for p in split_points}
    if len(parents) != 1 or not all(p in named for p in split_points):
        raise PipelineSplitError(
            f"pipeline_split {list(split_points)}: without a stack of repeated blocks in {type(module).__name__} the"
            " split points must be modules that are children of one module (stages are runs of its children);"
            f" the top-level modules are: {blocks_text([n for n, _ in _children(module)])}"
        )
    return parents.pop()


def _partition(costs: list[float], first: float, last: float, stages: int) -> list[int]:
    """Start index of each stage after the first: minimal largest stage cost, earlier cuts on ties (exact DP)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def seg(i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (first if i == 0 else 0.0) + (last if j == n else 0.0)

    # best[k][i]: the smallest largest-stage cost of blocks i..n-1 cut into k stages (the last one ends at n).
    best: list[list[float]] = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    for i in range(n):
        best[1][i] = seg(i, n)
    for k in range(2, stages + 1):
        for i in range(n - k + 1):
            value = math.inf
            for j in range(i + 1, n - k + 2):
                head = seg(i, j)
                if head >= value:
                    break  # seg grows with j: no later cut can do better
                value = min(value, max(head, best[k - 1][j]))
            best[k][i] = value
    target = best[stages][0]
    starts, i = [], 0
    for k in range(stages, 1, -1):
        j = next(j for j in range(i + 1, n - k + 2) if max(seg(i, j), best[k - 1][j]) <= target)
        starts.append(j)
        i = j
    return starts


def plan_pipeline_split(
    module: nn.Module,
    stages: int,
    split_points: list[str] | None = None,
    block_costs: list[float] | None = None,
) -> PipelineSplit:
    """Cut ``module`` into ``stages`` pipeline stages along its repeated block stack. Pure: changes nothing.

    The stack is :func:`~lightning_sgdtp.parallel.checkpointing.find_block_stack`'s (the largest
    ``nn.ModuleList`` / ``nn.Sequential`` of >= 2 same-type modules), joined by every other stack of the same block
    type (an encoder's and a decoder's), in registration order. What runs before and after the blocks is decided
    by registration order (see the module docstring): earlier-registered modules on stage 0, later ones on the
    last stage, at every level from the root down to the stack; what lies between two stacks on the stage of the
    block before it.

    - default: balance by parameter count (stage 0 includes what runs before the stack, the last stage what runs
      after it; a tied parameter counts once, where it is registered first); the largest stage is minimal, and
      among equal splits the earlier cut points win.
    - ``block_costs``: one positive measured cost per block; balance by those (before/after then count 0).
    - ``split_points``: the names of the blocks where stages 1..stages-1 start (``stages - 1`` names, in
      order). Without a block stack, split points that are children of one module split that module's children.

    Raises :class:`PipelineSplitError`, naming what to provide, when there is no stack (and no split points),
    ``stages`` is not an integer >= 2 or exceeds the number of blocks, or the split points / block costs are wrong.
    """
    _check_stages(stages)
    if split_points is not None and block_costs is not None:
        raise PipelineSplitError(
            "give either pipeline_split (where the stages start) or block_costs (to balance by), not both"
        )
    found = find_block_stack(module)
    if found is not None:
        stack_name = found[0]
    elif split_points is not None:
        stack_name = _stackless_parent(module, split_points)
    else:
        raise PipelineSplitError(_no_stack_message(module))
    stacks = _block_stacks(module, stack_name) if found is not None else [stack_name]
    blocks = [(_join(name, n), m) for name in stacks for n, m in _children(module.get_submodule(name))]
    block_names = [n for n, _ in blocks]
    stack_name = " + ".join(stacks)
    where = stack_name or type(module).__name__
    if stages > len(blocks):
        raise TooManyStagesError(
            f"{stages} stages but {where} has {len(blocks)} blocks: use at most {len(blocks)} stages"
            " (every stage needs at least one block)",
            len(blocks),
        )
    costs_given = _check_block_costs(block_costs, block_names, where) if block_costs is not None else None
    split = _split_along(module, stages, blocks, stack_name, split_points, costs_given)
    if split_points is None and costs_given is None:
        split = _cut_inside(module, stages, blocks, stack_name, split) or split
    return split


def _cut_inside(
    module: nn.Module, stages: int, blocks: list[tuple[str, nn.Module]], stack_name: str, whole: PipelineSplit
) -> PipelineSplit | None:
    """The split by parameters with blocks cut between their layers (:func:`_layer_sequence`) where that lowers
    the parameters the largest stage holds by at least INSIDE_GAIN; only the blocks a cut falls in are named by
    their layers. None when no block can be cut or it gains too little."""
    layers = {name: [_join(name, n) for n in _layer_sequence(block)] for name, block in blocks}
    expanded = {name for name, names in layers.items() if names}
    best: PipelineSplit | None = None
    bound = (1.0 - INSIDE_GAIN) * max(_held(module, whole)) if expanded else 0.0
    while expanded:
        units = [
            unit
            for name, block in blocks
            for unit in ([(n, module.get_submodule(n)) for n in layers[name]] if name in expanded else [(name, block)])
        ]
        split = _split_along(module, stages, units, stack_name, None, None)
        if max(_held(module, split)) > bound:
            return best
        # an expanded block whose layers all landed on one stage is named whole again, and the split redone
        whole_again = {b for b in expanded if len({split.stage_of(n) for n in layers[b]}) == 1}
        split.cut_blocks = sorted(expanded - whole_again, key=[n for n, _ in blocks].index)
        best = split
        if not whole_again:
            return best
        expanded -= whole_again
    return best


def stage_parameters(module: nn.Module, split: PipelineSplit) -> list[dict[int, nn.Parameter]]:
    """The parameters each stage holds, by id: a tensor used on two stages (a tied embedding and head) is on both."""
    stages: list[dict[int, nn.Parameter]] = [{} for _ in range(split.stages)]
    for name, p in module.named_parameters(remove_duplicate=False):
        stages[split.stage_of(name)][id(p)] = p
    return stages


def _held(module: nn.Module, split: PipelineSplit) -> list[int]:
    """Parameters each stage holds (:func:`stage_parameters`), counted."""
    return [sum(p.numel() for p in stage.values()) for stage in stage_parameters(module, split)]


def _split_along(
    module: nn.Module,
    stages: int,
    blocks: list[tuple[str, nn.Module]],
    stack_name: str,
    split_points: Any,
    costs_given: list[float] | None,
) -> PipelineSplit:
    """The split of ``module`` along ``blocks`` (the units a cut may fall between, in order)."""
    block_names = [n for n, _ in blocks]
    where = stack_name or type(module).__name__
    # What runs before / between / after the stacks: registration order at every level down to the blocks.
    walk = _walk_units(module, "", set(block_names))
    first_block = next(i for i, (_, _, is_block) in enumerate(walk) if is_block)
    last_block = max(i for i, (_, _, is_block) in enumerate(walk) if is_block)
    before = [(n, o) for n, o, _ in walk[:first_block]]
    after = [(n, o) for n, o, _ in walk[last_block + 1 :]]
    # each unit between two stacks belongs to the block registered before it
    between: list[tuple[str, Any]] = []
    between_block: dict[str, int] = {}
    block = -1
    for n, o, is_block in walk[first_block:last_block]:
        if is_block:
            block += 1
        else:
            between.append((n, o))
            between_block[n] = block

    # Parameter cost per unit, in execution order; a parameter used twice counts where it is registered first.
    units = before + blocks + between + after
    owner: dict[int, tuple[int, str]] = {}
    uses: list[tuple[int, str, int]] = []  # (parameter id, qualified name, unit index)
    unit_params = [0] * len(units)
    order = {n: i for i, (n, _, _) in enumerate(walk)}
    for u in sorted(range(len(units)), key=lambda u: order[units[u][0]]):
        name, obj = units[u]
        if isinstance(obj, nn.Module):
            named = list(obj.named_parameters(prefix=name, remove_duplicate=False))
        else:
            named = [(name, obj)]  # a parameter registered directly on a module above the stack
        for pname, p in named:
            if id(p) not in owner:
                owner[id(p)] = (u, pname)
                unit_params[u] += p.numel()
            uses.append((id(p), pname, u))
    nb, n_before, n_between = len(blocks), len(before), len(between)
    params_before = float(sum(unit_params[:n_before]))
    params_blocks = [float(c) for c in unit_params[n_before : n_before + nb]]
    for i, (name, _) in enumerate(between):  # what runs between two stacks weighs on the block before it
        params_blocks[between_block[name]] += unit_params[n_before + nb + i]
    params_after = float(sum(unit_params[n_before + nb + n_between :]))

    if split_points is not None:
        starts = _split_point_stages(split_points, block_names, stages, where)
        balance = "split_points"
    elif costs_given is not None:
        starts = _partition(costs_given, 0.0, 0.0, stages)
        balance = "cost"
    else:
        starts = _partition(params_blocks, params_before, params_after, stages)
        balance = "params"

    bounds = [0, *starts, nb]
    per_block = costs_given if costs_given is not None else params_blocks
    first, last = (0.0, 0.0) if costs_given is not None else (params_before, params_after)
    cost = [
        float(sum(per_block[bounds[s] : bounds[s + 1]]))
        + (first if s == 0 else 0.0)
        + (last if s == stages - 1 else 0.0)
        for s in range(stages)
    ]

    def block_stage(b: int) -> int:
        return next(s for s in range(stages) if bounds[s] <= b < bounds[s + 1])

    def unit_stage(u: int) -> int:
        if u < n_before:
            return 0
        if u < n_before + nb:
            return block_stage(u - n_before)
        if u < n_before + nb + n_between:
            return block_stage(between_block[units[u][0]])
        return stages - 1

    tied = []
    for pid, pname, u in uses:
        first_unit, first_name = owner[pid]
        if pname != first_name and unit_stage(u) != unit_stage(first_unit):
            tied.append((first_name, pname))

    return PipelineSplit(
        stages=stages,
        stack=stack_name,
        blocks_per_stage=[block_names[bounds[s] : bounds[s + 1]] for s in range(stages)],
        before=[n for n, _ in before],
        after=[n for n, _ in after],
        between={n: block_stage(between_block[n]) for n, _ in between},
        cost=cost,
        balance=balance,
        tied=tied,
    )
