"""One ``wait_tensor`` per collective, before Inductor's collective bucketing sees the graph.

AOTAutograd can leave one functional collective with two ``wait_tensor`` users: transformers' Phi reads one
LayerNorm's output in both its attention and its MLP (a parallel block), and the backward of that sharded
parameter's gather waits on its reduce-scatter twice. Both waits return the same tensor. Inductor's own
``bucket_reduce_scatters_fx`` / ``bucket_all_gathers_fx`` passes (which sharding turns on) assert a single user
("Expected single user for reduce_scatter_tensor_4"), so the compile failed at the first step. This pass keeps
the first wait and points the other waits' users at it: the graph computes the same values.
"""

from __future__ import annotations

import torch
from torch import fx

_WAIT = torch.ops._c10d_functional.wait_tensor.default


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
