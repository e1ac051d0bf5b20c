"""Proof, at compile time, that every sharded parameter's gradient is reduced in the compiled backward.

A sharded parameter's gradient must leave the backward graph through a collective over the data-parallel group:
a ``reduce_scatter_tensor`` (split parameters) or an ``all_reduce`` (parameters kept whole), followed only by
element-wise or view operations (the average's division, a dtype cast, a reshape, the wait). We walk each such
gradient output back through those operations; a gradient that reaches anything else first (a matmul, a
placeholder) was not reduced, and the compile fails naming the parameter, before any step runs with it.

This is the ledger's "exactly once" for sharded parameters: the ledger itself cannot see a reduction that DTensor
put into the graph, and a missing one would train silently wrong (each rank stepping its shard with its own
local gradient).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import fx

REDUCTIONS = {"reduce_scatter_tensor", "all_reduce", "all_reduce_", "reduce_scatter_tensor_coalesced"}
#: Operations a reduced gradient may pass through on its way out (one tensor input that carries it).
PASS_THROUGH = {
    "wait_tensor", "view", "reshape", "_unsafe_view", "clone", "contiguous", "div", "mul", "_to_copy",
    "convert_element_type", "permute", "t", "transpose", "squeeze", "unsqueeze", "expand", "slice", "split",
    "getitem", "alias", "detach", "as_strided", "copy", "add", "cat", "split_with_sizes", "narrow",
}  # fmt: skip


class UnreducedGradientError(RuntimeError):
    """A sharded parameter's gradient leaves a compiled backward without a data-parallel reduction."""


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def reduced(node: Any, limit: int = 64) -> bool:
    """Whether ``node`` (a backward output) is produced by a reduction through pass-through operations only.
    ``add``/``cat`` (a parameter used twice: its two reduced contributions summed; a flattened bucket) need every
    tensor input reduced."""
    if not isinstance(node, fx.Node) or limit == 0:
        return False
    if node.op != "call_function":
        return False
    name = _op_name(node)
    if name in REDUCTIONS:
        return True
    if name not in PASS_THROUGH:
        return False
    inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if name in ("add", "cat"):
        return bool(inputs) and all(reduced(a, limit - 1) for a in inputs)
    return bool(inputs) and reduced(inputs[0], limit - 1)


def gradient_positions(graph: fx.Graph, inputs: int) -> list[int] | None:
    """Where each graph input's gradient starts among the backward's outputs, read from the outputs themselves.

    AOTAutograd flattens a gradient by its own type, not its input's: a DTensor gradient is two outputs (its local
    tensor, then its mesh, an opaque placeholder), even for a plain input (a pipeline stage's rotary tables, read
    with tensor-parallel activations, get DTensor gradients). Counting the inputs' leaves then misplaces every later
    parameter. Here each output that is not a tensor (a mesh) belongs to the gradient before it. None when the
    grouping does not give one gradient per input."""
    starts: list[int] = []
    for position, out in enumerate(graph.output_node().args[0]):
        leaf = isinstance(out, fx.Node) and not isinstance(out.meta.get("val"), torch.Tensor)
        if not (leaf and starts):  # a tensor or None starts the next input's gradient
            starts.append(position)
    return starts if len(starts) == inputs else None


def check_sharded_gradients(graph: fx.Graph, outputs: dict[int, str], graph_id: int) -> dict[str, Any]:
    """Check every ``outputs`` entry (backward output index -> parameter name); raise if one is not reduced.
    Returns what the graph communicates, for the plan."""
    results = graph.output_node().args[0]
    missing = [name for i, name in sorted(outputs.items()) if results[i] is not None and not reduced(results[i])]
    if missing:
        raise UnreducedGradientError(
            f"sgdtp: in compiled backward graph {graph_id} the gradient of sharded parameter(s) {missing[:5]} is not"
            " reduced over the data-parallel group (no reduce-scatter / all-reduce feeds it): each rank would step its"
            " shard with its own gradient. This is a bug in the sharding (or a parameter read that bypasses it, e.g."
            " module._parameters[...] used directly): please report it with the model."
        )
    return {
        "graph_id": graph_id,
        "sharded_gradients": len(outputs),
        "proved_reduced": len(outputs),
        "collectives_in_backward": dict(Counter(_op_name(n) for n in graph.nodes if _is_collective(n))),
    }


def count_collectives(graph: fx.Graph) -> dict[str, int]:
    return dict(Counter(_op_name(n) for n in graph.nodes if _is_collective(n)))


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and "c10d_functional" in str(node.target) and _op_name(node) != "wait_tensor"
