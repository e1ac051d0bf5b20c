"""Regional compilation: each distinct block of the model's block stack compiled once, stamped out for every layer.

Compiling a training step whole traces, lowers and builds every layer of a transformer again, so the compile grows
with depth (the example GPT, one process: 16 layers take well over twice the time of 4). torch's
``torch.compiler.nested_compile_region`` marks a function whose trace is reused: Dynamo traces the first block,
checks that the next one is the same (parameters of the same shapes, the same code), and emits one
``invoke_subgraph`` call per layer to one shared subgraph, which AOTAutograd and Inductor compile once. The step is
still ONE forward and ONE backward graph for the ``"sgdtp"`` backend: every parameter is an input of the outer graph,
its gradient an output of the backward (``getitem`` of the block's ``invoke_subgraph``), so the bucket pass sees
every gradient and plans its buckets over the whole backward as before (a bucket closes at a block's end at the
earliest: the block's gradients come out together).

How a block is marked: its class is swapped for a subclass of it whose ``forward`` calls the marked original
(``type(block)`` keeps its name and ``isinstance`` holds; FSDP2's ``fully_shard`` swaps classes the same way). The
marked function is made once per class, shared by every block of that class: Dynamo reuses a region by the
function and by the block passed as ``self``. Marking a bound method per instance instead silently reused the first
block's parameters for every layer on torch 2.13 (found while building this; the numerics tests would catch it).

torch 2.13's Inductor, on CPU, computed wrong gradients for a step with nested regions unless its buffer reuse is
off (the example GPT: 1e2 instead of 1e-8 against eager, nondeterministic): the backend switches
``allow_buffer_reuse`` off for graphs that hold ``invoke_subgraph`` calls (:func:`holds_regions`).

Inputs that are views of one tensor (GPT-J's sin and cos: two halves of one ``embed_positions`` row, passed to every
layer) are cloned at the region's boundary, all but the first of each group, in the outer graph (one rank-0 line per
block class says which): ``invoke_subgraph`` is not desugared by AOTAutograd, so its functionalization assumes no
input aliases another, and Dynamo refuses to form one whose inputs share storage ("Encountered aliasing during higher
order op tracing", torch/_dynamo/output_graph.py ``SubgraphTracer.has_aliasing``; torch's own hint: ``.clone()``).
Views are found by their ``_base`` (what Dynamo's fake tensors keep): a copy that shares storage without being a view
(``.detach()``, ``.data``) still fails, and so does a block returning one of its inputs (input-to-output aliasing).

Only for plain parameters: with tensor parallel or sharding (DTensor parameters) torch 2.13 fails to compile a region
("There was no rule registered for HOP invoke_subgraph and subclass FunctionalTensor", or "'FakeTensor' object has
no attribute 'redistribute'"): those steps compile whole (:data:`~lightning_sgdtp.engine.parallelize.REGIONAL_ON_MESH`).
Not with activation checkpointing either: a region inside a checkpoint gave eager's gradients in one process but wrong ones
(1.4 relative, from the second block down) once the bucketed all-reduces were in the backward, with or without
overlap scheduling; a marked checkpoint wrapper broke the graph around every layer. Checkpointed models compile
whole (:data:`~lightning_sgdtp.engine.parallelize.REGIONAL_CHECKPOINTED`).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

log = logging.getLogger("lightning.pytorch.sgdtp")

#: The attribute that marks a class made here (the original class is its base).
MARKED = "_sgdtp_region_of"
#: Inductor settings for a graph with regions (see the module docstring).
REGION_PATCHES = {"allow_buffer_reuse": False}


@dataclass(frozen=True)
class Regions:
    """What :func:`mark_regions` did: the blocks marked and how many distinct classes they are (what compiles)."""

    blocks: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()

    def describe(self) -> str:
        if not self.blocks:
            return "regional compile: no block stack to mark; the step compiles as one graph"
        return (
            f"regional compile: {len(self.blocks)} blocks ({self.blocks[0]} .. {self.blocks[-1]}) compiled as"
            f" {len(self.classes)} region(s) ({', '.join(self.classes)}), reused for every layer inside the one"
            " compiled step (regional_compile=False: each layer compiled on its own)"
        )


_marked_classes: dict[type, type] = {}


def _marked_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``forward`` is a nested compile region (one per class, made once)."""
    if getattr(cls, MARKED, None) is not None:
        return cls
    if cls not in _marked_classes:
        region = torch.compiler.nested_compile_region(cls.forward)
        owner, names = cls.__name__, _positional_names(cls.forward)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():  # eagerly the region is a plain call: nothing to separate
                args, kwargs = separate_aliased_inputs(owner, args, kwargs, names)
            return region(self, *args, **kwargs)

        functools.update_wrapper(forward, cls.forward, updated=())
        _marked_classes[cls] = type(
            cls.__name__, (cls,), {"forward": forward, MARKED: cls, "__module__": cls.__module__}
        )
    return _marked_classes[cls]


def _positional_names(forward: Any) -> tuple[str, ...]:
    """The names of ``forward``'s positional parameters after ``self`` (for the log line; none if not inspectable)."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in positional)


def separate_aliased_inputs(
    owner: str, args: tuple, kwargs: dict[str, Any], names: tuple[str, ...] = ()
) -> tuple[tuple, dict[str, Any]]:
    """``args`` and ``kwargs`` of a region's call with every tensor that views the same tensor as an earlier one (or
    is it) replaced by a clone, so that no two inputs of the region share storage. Tuples, lists and dicts are looked
    into (and rebuilt only where something was cloned); nothing aliased: the very same objects back. Traced by
    Dynamo (``_base`` and ``is`` are decided on the fake tensors while tracing; the clones are nodes of the outer
    graph). ``owner``: the block class, ``names``: its positional parameters' names, for the log line."""
    seen: list[torch.Tensor] = []
    aliased: list[str] = []

    def find(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            root = value if value._base is None else value._base
            if any(root is other for other in seen):
                aliased.append(path)
            else:
                seen.append(root)
        elif type(value) in (tuple, list):
            for i, item in enumerate(value):
                find(item, f"{path}[{i}]")
        elif type(value) is dict:
            for key, item in value.items():
                find(item, f"{path}[{key!r}]")

    where = [names[i] if i < len(names) else f"argument {i}" for i in range(len(args))]
    for i, arg in enumerate(args):
        find(arg, where[i])
    for key, arg in kwargs.items():
        find(arg, key)
    if not aliased:
        return args, kwargs
    _say_aliases(owner, tuple(aliased))
    todo = set(aliased)

    def rebuild(value: Any, path: str) -> Any:
        if path in todo:
            return value.clone()
        if type(value) in (tuple, list) and any(p.startswith(path + "[") for p in todo):
            return type(value)(rebuild(item, f"{path}[{i}]") for i, item in enumerate(value))
        if type(value) is dict and any(p.startswith(path + "[") for p in todo):
            return {key: rebuild(item, f"{path}[{key!r}]") for key, item in value.items()}
        return value

    return (
        tuple(rebuild(arg, where[i]) for i, arg in enumerate(args)),
        {key: rebuild(arg, key) for key, arg in kwargs.items()},
    )


#: (block class, inputs cloned) already said since the last :func:`mark_regions`: one line, not one per layer.
_said_aliases: set[tuple[str, tuple[str, ...]]] = set()


@torch.compiler.assume_constant_result  # Dynamo runs it while tracing (constant arguments) instead of tracing it
def _say_aliases(owner: str, paths: tuple[str, ...]) -> bool:
    if (owner, paths) not in _said_aliases:
        _said_aliases.add((owner, paths))
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not distributed or torch.distributed.get_rank() == 0:
            log.info(
                f"sgdtp: regional compile: {owner}'s input(s) {', '.join(paths)} view the same tensor as an earlier"
                " input: cloned at the region's boundary (torch's invoke_subgraph takes no aliased inputs)"
            )
    return True


def mark_regions(module: nn.Module, blocks: tuple[str, ...] | list[str]) -> Regions:
    """Mark each module named in ``blocks`` (the block stack's blocks) as a nested compile region, in place. Blocks
    marked already are kept."""
    _said_aliases.clear()
    found = [name for name, _ in module.named_modules() if name in set(blocks)]
    classes: list[str] = []
    for name in found:
        block = module.get_submodule(name)
        block.__class__ = _marked_class(type(block))
        base = getattr(type(block), MARKED).__name__
        if base not in classes:
            classes.append(base)
    return Regions(tuple(found), tuple(classes))


def unmark_regions(module: nn.Module) -> None:
    """Give every marked block its own class back (teardown)."""
    for m in module.modules():
        original = getattr(type(m), MARKED, None)
        if original is not None:
            m.__class__ = original


def holds_regions(gm: fx.GraphModule) -> bool:
    """Whether a captured graph calls nested compile regions (``invoke_subgraph``)."""
    target = torch.ops.higher_order.invoke_subgraph
    return any(n.op == "call_function" and n.target is target for n in gm.graph.nodes)
