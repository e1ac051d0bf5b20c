"""The gradient ledger: every gradient is reduced once per optimizer step, and we can prove it.

Compiled backward graphs average the gradients of the parameters that are inputs of the graph (the
in-graph buckets). Some gradient contributions do not come out of a compiled graph: parameters used in
eager regions (``torch.compiler.disable``, code Dynamo skips, a graph break that runs eagerly) or the
gradients accumulated over micro-batches while sync was off. The ledger finds them and syncs them.

How it finds them: before backward it walks the autograd graph from the loss. Every edge into a
parameter's ``AccumulateGrad`` node either leaves a compiled sgdtp graph (``CompiledFunctionBackward``
of a graph that lifted the parameter: reduced in the graph) or an eager autograd node (not reduced).
Parameters with at least one eager edge are synced after backward by the fallback: bucketed async
all-reduces of their whole ``.grad``. That is exact even for a parameter used both in a graph and
eagerly: averaging is idempotent on the part that is already averaged, so
``avg(avg(g_graph) + g_eager) = avg(g_graph) + avg(g_eager)``.

Ranks must issue the same collectives. Which parameters need the fallback can differ between ranks
(data-dependent control flow, a parameter unused on one rank only), so the ranks first agree on the
union with one tiny all-reduce of a bitmap; a rank without a gradient contributes zeros (DDP's
``find_unused_parameters`` semantics).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

COMPILED_NODE = "CompiledFunctionBackward"


class Sync(str, enum.Enum):
    GRAPH = "graph"  # averaged inside a compiled backward graph
    FALLBACK = "fallback"  # averaged after backward by the ledger's buckets


@dataclass
class BackwardRecord:
    """How each parameter reached by one backward gets its gradient averaged."""

    graph: set[int] = field(default_factory=set)
    eager: set[int] = field(default_factory=set)


def walk_autograd_graph(loss: Tensor, graph_param_ids: set[int]) -> BackwardRecord:
    """Classify the edges into parameter leaves reachable from ``loss``.

    An edge from a ``CompiledFunctionBackward`` node into a parameter the sgdtp compiler lifted into its
    graphs is reduced in the graph; every other edge into a parameter is eager.
    """
    record = BackwardRecord()
    if loss.grad_fn is None:
        return record
    seen: set = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        compiled = type(node).__name__ == COMPILED_NODE
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is None:
                stack.append(nxt)
            elif compiled and id(variable) in graph_param_ids:
                record.graph.add(id(variable))
            else:
                record.eager.add(id(variable))
    return record


class GradLedger:
    """Tracks, per optimizer step, how each parameter's gradient was averaged, and syncs the rest.

    Args:
        named_parameters: the trainable parameters, in the same order on every rank.
        group: the data-parallel process group (None: world).
        cap_bytes: bucket size of the fallback all-reduces.
        wire_dtype: dtype on the wire (None: the gradient's dtype).
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        group: dist.ProcessGroup | None = None,
        cap_bytes: int = 25 * 2**20,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.index = {id(p): i for i, (_, p) in enumerate(self.params)}
        self.group = group
        self.cap_bytes = cap_bytes
        self.wire_dtype = wire_dtype
        self.step_counts: Counter[tuple[str, Sync]] = Counter()
        self.last_step: dict[str, list[str]] = {}
        self.fallback_bytes_last_step = 0
        self._fallback_bytes = 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def sync(self, record: BackwardRecord, everything: bool = False) -> list[str]:
        """After a backward: average what the graphs did not. Returns the names synced here.

        ``everything=True`` syncs all gradients (used after the last micro-batch of an accumulation,
        when the graphs ran without collectives).
        """
        if everything:
            local = {id(p) for _, p in self.params if p.grad is not None}
            graph: set[int] = set()
        else:
            local, graph = record.eager, record.graph
        for pid in graph - local:
            self.step_counts[(self.params[self.index[pid]][0], Sync.GRAPH)] += 1
        flags = torch.zeros(len(self.params), dtype=torch.int32)
        for pid in local:
            if pid in self.index:
                flags[self.index[pid]] = 1
        if self.world_size > 1:
            dist.all_reduce(flags, group=self.group)  # union over ranks: every rank sends the same buckets
        chosen = [self.params[i] for i in flags.nonzero().flatten().tolist()]
        for name, p in chosen:
            if id(p) in graph:
                self.step_counts[(name, Sync.GRAPH)] += 1
            self.step_counts[(name, Sync.FALLBACK)] += 1
        if chosen and self.world_size > 1:
            self._all_reduce_mean([p for _, p in chosen])
        return [n for n, _ in chosen]

    def _all_reduce_mean(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buckets: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in params:
            nbytes = p.grad.numel() * p.grad.element_size()
            if not buckets or size + nbytes > self.cap_bytes or p.grad.dtype != buckets[-1][0].grad.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        world = self.world_size
        inflight = []
        for bucket in buckets:  # issue all, then wait: buckets travel back to back
            flat = torch.cat([p.grad.reshape(-1) for p in bucket]).div_(world)
            wire = flat.to(self.wire_dtype) if self.wire_dtype is not None else flat
            self._fallback_bytes += wire.numel() * wire.element_size()
            inflight.append((bucket, flat, wire, dist.all_reduce(wire, group=self.group, async_op=True)))
        for bucket, flat, wire, work in inflight:
            work.wait()
            if wire is not flat:
                flat.copy_(wire)
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n

    def end_step(self) -> dict[str, list[str]]:
        """Close the optimizer step: record how each parameter was synced, check coverage, reset."""
        summary: dict[str, list[str]] = {}
        for (name, how), count in sorted(self.step_counts.items()):
            summary.setdefault(name, []).extend([how.value] * count)
        self.last_step = summary
        self.fallback_bytes_last_step = self._fallback_bytes
        self.step_counts.clear()
        self._fallback_bytes = 0
        return summary

    def uncovered(self) -> list[str]:
        """Parameters that have a gradient but were not averaged in the last closed step (should be empty)."""
        return [n for n, p in self.params if p.grad is not None and n not in self.last_step]
