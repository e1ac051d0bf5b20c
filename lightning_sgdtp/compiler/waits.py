"""Two repairs to a sharded graph's collective results, before Inductor sees the graph.

**One ``wait_tensor`` per collective.**
AOTAutograd can leave one functional collective with two ``wait_tensor`` users: transformers' Phi reads one
LayerNorm's output in both its attention and its MLP (a parallel block), and the backward of that sharded
parameter's gather waits on its reduce-scatter twice. Both waits return the same tensor. Inductor's own
``bucket_reduce_scatters_fx`` / ``bucket_all_gathers_fx`` passes (which sharding turns on) assert a single user
("Expected single user for reduce_scatter_tensor_4"), so the compile failed at the first step. This pass keeps
the first wait and points the other waits' users at it: the graph computes the same values.

**One tensor per gradient output.** Phi's attention and MLP output biases (``dense.bias``, ``fc2.bias``) have the
same gradient, so AOTAutograd computes it once and one reduce-scatter (and one wait) serves both: the backward
graph returns one tensor for two parameters. Wrapped as two DTensor gradients over the same local tensor, autograd
keeps each as the parameter's ``.grad`` without a copy, and the next micro-batch's (or accumulation step's)
in-place ``grad += g`` reached both parameters through the shared tensor: each got the second micro-batch's
gradient twice (Phi under ``pipeline_stages=2, sharding="full"``: 1.5x these two gradients, 0.41 relative error
after 4 steps). A repeated graph output is cloned.
"""

from __future__ import annotations

import torch
from torch import fx

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_CLONE = torch.ops.aten.clone.default


def one_wait_per_collective(graph: fx.Graph) -> int:
    """Merge the ``wait_tensor`` users of each node into the first one. Returns how many waits were removed."""
    removed = 0
    for node in list(graph.nodes):
        waits = [user for user in node.users if user.op == "call_function" and user.target is _WAIT]
        for extra in waits[1:]:
            extra.replace_all_uses_with(waits[0])
            graph.erase_node(extra)
            removed += 1
    return removed


def one_tensor_per_output(graph: fx.Graph) -> int:
    """Clone every graph output that is a node already returned at an earlier position. Returns how many."""
    output = graph.output_node()
    returned, seen, cloned = list(output.args[0]), set(), 0
    for i, value in enumerate(returned):
        if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
            continue  # (a graph also returns opaque objects: a process group)
        if value in seen:
            with graph.inserting_before(output):
                copy = graph.call_function(_CLONE, (value,))
            copy.meta = dict(value.meta)
            returned[i] = copy
            cloned += 1
        seen.add(value)
    if cloned:
        output.args = (type(output.args[0])(returned), *output.args[1:])
    return cloned
