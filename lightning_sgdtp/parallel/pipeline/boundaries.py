"""What crosses a pipeline stage boundary must be sendable: dense, contiguous tensors.

``torch.distributed.pipelining`` (torch 2.13) keeps the exact strides the trace recorded: a stage whose output is
a view (a transpose, an ``expand``, a slice: Llama's ``hidden_states`` after ``o_proj``, GPT-2's after the head
merge, the rotary ``cos``/``sin`` every layer receives) gets a receive buffer made by ``torch.empty_strided`` with
those strides, and sends the view itself. Both gloo and NCCL refuse non-contiguous tensors in ``isend``/``irecv``
("input tensor has to be contiguous"), so an unchanged ``transformers`` model failed at its first step.

Two small changes make every boundary contiguous, consistently on both sides:

- :func:`make_boundaries_contiguous` edits the traced stage graphs before the stages are built: each stage
  output that is not contiguous goes through ``.contiguous()`` (the forward send, and the metadata the next stage's
  backward receive buffer is made from), and each stage input is declared contiguous (the forward receive
  buffer);
- :func:`send_contiguous` wraps a stage's send builders, so that a *gradient* sent backward (whose strides autograd
  chooses at run time) is made contiguous too, as is anything else a send is given.

A copy is made only for a tensor that is not contiguous already (``Tensor.contiguous`` returns the tensor itself
otherwise), so models whose boundaries are dense pay nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import fx


def _is_strided_view(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and not val.is_contiguous()


def make_boundaries_contiguous(split_gm: fx.GraphModule) -> list[str]:
    """Make the inputs and outputs of every stage submodule (``submod_<i>`` of torch's split graph) contiguous.
    Returns what was changed (``"submod_1 input hidden_states"``), for the plan."""
    changed: list[str] = []
    for name, stage in split_gm.named_children():
        if not (name.startswith("submod_") and isinstance(stage, fx.GraphModule)):
            continue
        graph = stage.graph
        for node in graph.nodes:
            if node.op == "placeholder" and _is_strided_view(node.meta.get("val")):
                node.meta["val"] = node.meta["val"].contiguous()
                changed.append(f"{name} input {node.name}")
        changed += _dense_outputs(name, stage)
    return changed


def _dense_outputs(name: str, stage: fx.GraphModule) -> list[str]:
    """Put ``.contiguous()`` between each strided stage output and the output node."""
    graph, changed = stage.graph, []
    output = next(n for n in reversed(graph.nodes) if n.op == "output")

    def dense(arg: Any) -> Any:
        if not (isinstance(arg, fx.Node) and _is_strided_view(arg.meta.get("val"))):
            return arg
        with graph.inserting_before(output):
            copy = graph.call_method("contiguous", (arg,))
        copy.meta = {**arg.meta, "val": arg.meta["val"].contiguous()}
        changed.append(f"{name} output {arg.name}")
        return copy

    output.args = fx.node.map_aggregate(output.args, dense)
    stage.recompile()
    return changed


def send_contiguous(stage: Any) -> None:
    """Wrap ``stage.get_fwd_send_ops`` / ``get_bwd_send_ops`` so that every tensor they send is contiguous."""
    for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
        build = getattr(stage, name)
        setattr(stage, name, _dense_sends(build))


def _dense_sends(build: Callable[[int], list[dist.P2POp]]) -> Callable[[int], list[dist.P2POp]]:
    @functools.wraps(build)
    def wrapped(chunk_id: int) -> list[dist.P2POp]:
        ops = build(chunk_id)
        return [
            op
            if op.tensor.is_contiguous()
            else dist.P2POp(op.op, op.tensor.contiguous(), group=op.group, tag=op.tag, group_peer=op.group_peer)
            for op in ops
        ]

    return wrapped
