"""The gradient-bucket pass: group a backward graph's gradients into buckets and insert fused async all-reduces.

Two pieces, each testable without processes:

- :func:`plan_buckets` is a pure function over plain data: gradients in the order the backward graph
  produces them, grouped into buckets of at most ``cap_bytes`` (a bucket never mixes dtypes).
- :func:`insert_bucketed_allreduce` rewrites an AOTAutograd backward graph: right after the last gradient
  of a bucket is produced, the bucket's gradients are flattened into one buffer, divided by the world size
  and handed to one functional ``all_reduce`` (asynchronous: it returns at once). The matching
  ``wait_tensor`` is placed just before the graph's output, as late as possible, so the all-reduce runs
  while the rest of backward computes. Waits are then unflattened into the gradient outputs.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.utils._pytree import tree_map_only

from lightning_sgdtp.compiler.bucket_cost import CostModel, node_seconds, plan_measured

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class GradSlot:
    """One parameter gradient as the backward graph produces it."""

    name: str
    numel: int
    dtype: str
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class Bucket:
    """One fused all-reduce: which gradients, how many bytes on the wire."""

    index: int
    params: list[str]
    numel: int
    dtype: str
    wire_dtype: str
    wire_bytes: int


@dataclass
class GraphBuckets:
    """What the bucket pass decided for one compiled backward graph: its parameters and their buckets."""

    graph_id: int
    in_graph_sync: bool
    group: str
    world_size: int
    params: list[str] = field(default_factory=list)
    buckets: list[Bucket] = field(default_factory=list)
    #: Why a graph over a data-parallel group has no in-graph collectives (its gradients go to the fallback).
    fallback: str | None = None
    #: How the boundaries were chosen: ``{"rule": "cap", "cap_bytes": ...}`` or the cost model's prediction.
    sizing: dict[str, Any] | None = None

    @property
    def wire_bytes(self) -> int:
        return sum(b.wire_bytes for b in self.buckets)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["wire_bytes"] = self.wire_bytes
        return d


def plan_buckets(slots: Sequence[GradSlot], cap_bytes: int) -> list[list[int]]:
    """Group gradients (given in production order) into buckets of at most ``cap_bytes``.

    Returns lists of indices into ``slots``. A gradient larger than the cap gets a bucket of its own; a
    change of dtype closes the current bucket. Order is kept: bucket k holds gradients produced before
    those of bucket k+1, so bucket k can be sent while bucket k+1 is still being computed.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, slot in enumerate(slots):
        if current and (current_bytes + slot.nbytes > cap_bytes or slot.dtype != slots[current[0]].dtype):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += slot.nbytes
    if current:
        buckets.append(current)
    return buckets


def _add_node(graph: fx.Graph, fake_mode: Any, target: Any, args: tuple) -> fx.Node:
    """Create a call_function node with the metadata Inductor needs (``val`` under the fake mode)."""
    node = graph.call_function(target, args)
    fake_args = fx.node.map_arg(args, lambda n: n.meta["val"])
    with fake_mode:
        node.meta["val"] = target(*fake_args)
    node.meta["tensor_meta"] = tree_map_only(torch.Tensor, _extract_tensor_metadata, node.meta["val"])
    return node


def _fake_mode_of(graph: fx.Graph) -> Any:
    vals = [n.meta["val"] for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    fake_mode = detect_fake_mode(vals)
    if fake_mode is None:
        raise RuntimeError("sgdtp: the backward graph carries no fake tensors; cannot plan gradient buckets")
    return fake_mode


def insert_bucketed_allreduce(
    gm: fx.GraphModule,
    grad_outputs: dict[int, str],
    *,
    group_name: str,
    world_size: int,
    cap_bytes: int,
    wire_dtype: torch.dtype | None = None,
    graph_id: int = 0,
    overlap: bool = True,
    cost: CostModel | None = None,
) -> GraphBuckets:
    """Insert one fused async all-reduce per bucket into backward graph ``gm`` (in place); return the buckets.

    Args:
        gm: an AOTAutograd backward graph; output ``i`` is the gradient of forward input ``i``.
        grad_outputs: output position -> parameter name, for the outputs to reduce.
        group_name: the process group's name (``ProcessGroup.group_name``), baked into the graph.
        world_size: size of that group; gradients are averaged (divided, then summed).
        cap_bytes: bucket size limit, measured in the gradient's own dtype.
        wire_dtype: dtype on the wire (``torch.bfloat16`` halves bytes); None keeps the gradient's dtype.
        overlap: True: every wait sits just before the output, so each bucket's all-reduce runs while the rest
            of backward computes. False: each wait follows its all-reduce at once (no overlap; a baseline).
        cost: the measured cost model: boundaries chosen by :func:`~lightning_sgdtp.compiler.bucket_cost.plan_measured`
            (``cap_bytes`` then only bounds a bucket); None: at most ``cap_bytes`` per bucket, greedily.
    """
    graph = gm.graph
    out_node = graph.output_node()
    outs = list(out_node.args[0])
    order = {n: i for i, n in enumerate(graph.nodes)}
    fake_mode = _fake_mode_of(graph)

    # A graph node may feed several outputs (tied parameters): reduce it once, route it to all of them.
    positions: dict[fx.Node, list[int]] = {}
    for pos in sorted(grad_outputs):
        node = outs[pos]
        if isinstance(node, fx.Node):
            positions.setdefault(node, []).append(pos)
    produced = sorted(positions, key=order.__getitem__)
    slots = [
        GradSlot(
            name="+".join(grad_outputs[p] for p in positions[n]),
            numel=n.meta["val"].numel(),
            dtype=str(n.meta["val"].dtype).removeprefix("torch."),
            itemsize=n.meta["val"].element_size(),
        )
        for n in produced
    ]
    decided = GraphBuckets(
        graph_id=graph_id,
        in_graph_sync=True,
        group=group_name,
        world_size=world_size,
        params=[grad_outputs[p] for n in produced for p in positions[n]],
    )

    if cost is not None:
        ready, elapsed, at = {}, 0.0, set(produced)
        for n in graph.nodes:
            elapsed += node_seconds(n, cost)
            if n in at:
                ready[n] = elapsed
        measured = plan_measured(
            [ready[n] for n in produced], [s.nbytes for s in slots], [s.dtype for s in slots], elapsed, cost, cap_bytes
        )
        planned, decided.sizing = measured.buckets, measured.describe(cost)
    else:
        planned, decided.sizing = plan_buckets(slots, cap_bytes), {"rule": "cap", "cap_bytes": cap_bytes}

    pending: list[tuple[list[fx.Node], fx.Node, torch.dtype]] = []
    for index, members in enumerate(planned):
        nodes = [produced[i] for i in members]
        grad_dtype = nodes[0].meta["val"].dtype
        anchor = max(nodes, key=order.__getitem__)

        def add(target: Any, args: tuple) -> fx.Node:
            nonlocal anchor
            with graph.inserting_after(anchor):
                anchor = _add_node(graph, fake_mode, target, args)
            return anchor

        # Divide (and cast) each gradient, then concatenate: Inductor writes the pointwise results straight into
        # the bucket, one buffer per bucket. (Dividing the concatenation needed a second, bucket-sized buffer,
        # which the CPU allocator maps and unmaps every step above 32 MiB.) The values are the same either way.
        flat = []
        for n in nodes:
            piece = add(aten.div.Tensor, (add(aten.reshape.default, (n, [-1])), world_size))
            if wire_dtype is not None and wire_dtype != grad_dtype:
                piece = add(prims.convert_element_type.default, (piece, wire_dtype))
            flat.append(piece)
        buf = add(aten.cat.default, (flat,)) if len(flat) > 1 else flat[0]
        collective = add(c10d.all_reduce.default, (buf, "sum", group_name))
        if not overlap:  # wait at once: backward stops until this bucket is reduced
            collective = add(c10d.wait_tensor.default, (collective,))
        pending.append((nodes, collective, grad_dtype))
        numel = sum(slots[i].numel for i in members)
        wire = buf.meta["val"].dtype
        decided.buckets.append(
            Bucket(
                index=index,
                params=[slots[i].name for i in members],
                numel=numel,
                dtype=str(grad_dtype).removeprefix("torch."),
                wire_dtype=str(wire).removeprefix("torch."),
                wire_bytes=numel * wire.itemsize,
            )
        )

    # Waits as late as possible: just before the output, in bucket order (without overlap: already waited).
    new_outs = list(outs)
    for nodes, collective, grad_dtype in pending:
        with graph.inserting_before(out_node):
            reduced = (
                _add_node(graph, fake_mode, c10d.wait_tensor.default, (collective,))
                if collective.target is not c10d.wait_tensor.default
                else collective
            )
            if reduced.meta["val"].dtype != grad_dtype:
                reduced = _add_node(graph, fake_mode, prims.convert_element_type.default, (reduced, grad_dtype))
            sizes = [n.meta["val"].numel() for n in nodes]
            parts = (
                _add_node(graph, fake_mode, aten.split_with_sizes.default, (reduced, sizes)) if len(nodes) > 1 else None
            )
            for i, n in enumerate(nodes):
                piece = _add_node(graph, fake_mode, operator.getitem, (parts, i)) if parts is not None else reduced
                grad = _add_node(graph, fake_mode, aten.view.default, (piece, list(n.meta["val"].shape)))
                for pos in positions[n]:
                    new_outs[pos] = grad
    out_node.args = (tuple(new_outs),)
    graph.lint()
    gm.recompile()
    return decided
