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

How a block is marked: its class is swapped for a subclass of it whose ``forward`` is the marked original
(``type(block)`` keeps its name and ``isinstance`` holds; FSDP2's ``fully_shard`` swaps classes the same way). The
marked function is the one class attribute shared by every block of that class: Dynamo reuses a region by the
function and by the block passed as ``self``. Marking a bound method per instance instead silently reused the first
block's parameters for every layer on torch 2.13 (found while building this; the numerics tests would catch it).

torch 2.13's Inductor, on CPU, computed wrong gradients for a step with nested regions unless its buffer reuse is
off (the example GPT: 1e2 instead of 1e-8 against eager, nondeterministic): the backend switches
``allow_buffer_reuse`` off for graphs that hold ``invoke_subgraph`` calls (:func:`holds_regions`).

Only for plain parameters: with tensor parallel or sharding (DTensor parameters) torch 2.13 fails to compile a region
("There was no rule registered for HOP invoke_subgraph and subclass FunctionalTensor", or "'FakeTensor' object has
no attribute 'redistribute'"): those steps compile whole (:data:`~lightning_sgdtp.engine.parallelize.REGIONAL_ON_MESH`).
Not with activation checkpointing either: a region inside a checkpoint gave eager's gradients in one process but wrong ones
(1.4 relative, from the second block down) once the bucketed all-reduces were in the backward, with or without
overlap scheduling; a marked checkpoint wrapper broke the graph around every layer. Checkpointed models compile
whole (:data:`~lightning_sgdtp.engine.parallelize.REGIONAL_CHECKPOINTED`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

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
        forward = torch.compiler.nested_compile_region(cls.forward)
        _marked_classes[cls] = type(
            cls.__name__, (cls,), {"forward": forward, MARKED: cls, "__module__": cls.__module__}
        )
    return _marked_classes[cls]


def mark_regions(module: nn.Module, blocks: tuple[str, ...] | list[str]) -> Regions:
    """Mark each module named in ``blocks`` (the block stack's blocks) as a nested compile region, in place. Blocks
    marked already are kept."""
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
