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
``find_unused_parameters`` semantics). The all-reduce is asynchronous: a rank whose record is the same as at its
last step waits for it only after backward (no rank barrier before backward in the steady state).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sgdtp.parallel.tensor.plan import local_shard
from lightning_sgdtp.sync.comm import PendingAllReduce, all_reduce_flat, start_all_reduce_flat

COMPILED_NODE = "CompiledFunctionBackward"


class Sync(str, enum.Enum):
    GRAPH = "graph"  # averaged inside a compiled backward graph
    FALLBACK = "fallback"  # averaged after backward by the ledger's buckets
    ACCUMULATED = "accumulated"  # earlier micro-batches' sum, averaged during the last micro-batch


@dataclass
class BackwardRecord:
    """How each parameter reached by one backward gets its gradient averaged."""

    graph: set[int] = field(default_factory=set)
    eager: set[int] = field(default_factory=set)
    # Set by `agree` when any rank asked to stop (preemption): every rank learns it in the same step.
    stop: bool = False


def walk_autograd_graph(
    loss: Tensor, graph_param_ids: set[int], ignore: frozenset[int] = frozenset()
) -> BackwardRecord:
    """Classify the edges into parameter leaves reachable from ``loss``.

    An edge from a ``CompiledFunctionBackward`` node into a parameter the sgdtp compiler lifted into its
    graphs is reduced in the graph; every other edge into a parameter is eager. Parameters in ``ignore`` (sharded:
    their reading reduces their gradient, in a graph or eagerly) are not classified.
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
            elif id(variable) in ignore:
                continue
            elif compiled and id(variable) in graph_param_ids:
                record.graph.add(id(variable))
            else:
                record.eager.add(id(variable))
    return record


@dataclass
class Agreement:
    """An agreement all-reduce in flight (:meth:`GradLedger.start_agreement`)."""

    ledger: GradLedger
    flags: Tensor
    graph: set[int]
    work: dist.Work | None
    _result: BackwardRecord | None = None

    def result(self) -> BackwardRecord:
        """Wait for the all-reduce (once) and decide; raises if ranks are about to run different graphs."""
        if self._result is None:
            if self.work is not None:
                with torch.profiler.record_function("sgdtp: wait"):
                    self.work.wait()
            self._result = self.ledger._decide(self.flags, self.graph)
        return self._result


@dataclass
class AccumulatedSync:
    """The earlier micro-batches' gradients being averaged (:meth:`GradLedger.start_accumulated_sync`)."""

    params: list[torch.nn.Parameter]
    grads: list[Tensor]
    pending: PendingAllReduce
    present: Tensor

    def finish(self) -> None:
        """Wait, then add the averaged earlier sum to what the last micro-batch left in ``.grad``."""
        self.pending.wait()
        for p, g, used in zip(self.params, self.grads, self.present.tolist()):
            if used == 0:  # no rank had a gradient for it
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


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
        # Every parameter, trainable or not now: a callback may unfreeze one later (fine-tuning).
        self.params = list({id(p): (n, p) for n, p in named_parameters}.values())
        self.index = {id(p): i for i, (_, p) in enumerate(self.params)}
        self.group = group
        self.cap_bytes = cap_bytes
        self.wire_dtype = wire_dtype
        self.step_counts: Counter[tuple[str, Sync]] = Counter()
        self.last_step: dict[str, list[str]] = {}
        self.fallback_bytes_last_step = 0
        self.graph_bytes_last_step = 0
        self._fallback_bytes = 0
        self._graph_bytes = 0
        self._touched: set[int] = set()
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda t: self._touched.add(id(t)))
            for _, p in self.params
            if p.requires_grad
        ]

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _flags(self, ids: set[int]) -> torch.Tensor:
        flags = torch.zeros(len(self.params), dtype=torch.int32)
        for pid in ids:
            if pid not in self.index:
                raise RuntimeError(
                    "sgdtp: a parameter that was not in the module at setup received a gradient. Create all"
                    " parameters before trainer.fit (in __init__ or configure_model), not during training."
                )
            flags[self.index[pid]] = 1
        return flags

    def agree(
        self,
        record: BackwardRecord,
        stop: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> BackwardRecord:
        """Before backward: make every rank agree on what the fallback will send, and check that every rank
        is about to run the same in-graph collectives. One small all-reduce of three bitmaps (MAX).

        ``stop``: this rank wants the job to stop (a preemption signal); the result's ``stop`` is the OR over
        ranks, carried by the same all-reduce, so the ranks agree on it at no extra cost.
        ``group``: the ranks that agree (default: every rank, so that a stop request reaches all of them; a
        pipeline stage agrees with its data-parallel replicas only, which hold the same parameters).
        """
        return self.start_agreement(record, stop, group).result()

    def start_agreement(
        self,
        record: BackwardRecord,
        stop: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> Agreement:
        """:meth:`agree`, issued asynchronously: the all-reduce starts now, :meth:`Agreement.result` waits for it.

        Every rank issues it at the same point (it is a collective); when each rank waits is its own choice. The
        strategy waits at once only when this rank's record changed (a new graph, a new eager parameter), so
        that a mismatch is caught before backward; otherwise the wait moves after backward, where the gradient
        buckets have lined the ranks up anyway, and the agreement costs no rank barrier.
        """
        graph = record.graph
        eager_flags, graph_flags = self._flags(record.eager), self._flags(graph)
        both = torch.cat([eager_flags, graph_flags, -graph_flags, torch.tensor([int(stop)], dtype=torch.int32)])
        work = None
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True)
        return Agreement(self, both, graph, work)

    def _decide(self, both: Tensor, graph: set[int]) -> BackwardRecord:
        n = len(self.params)
        union, graph_max, graph_min = both[:n], both[n : 2 * n], -both[2 * n : 3 * n]
        differ = (graph_max != graph_min).nonzero().flatten().tolist()
        if differ:
            names = [self.params[i][0] for i in differ[:5]]
            raise RuntimeError(
                f"sgdtp: ranks are about to run different compiled backward graphs (parameters {names} are in a"
                " compiled graph on some ranks only), so their in-graph all-reduces would not match. This comes"
                " from control flow that differs between ranks (a data-dependent branch around a graph break)."
                " Make the branch the same on every rank, or move it into a torch.compiler.disable'd function"
                " (its gradients are then synced after backward)."
            )
        return BackwardRecord(
            graph=set(graph),
            eager={id(self.params[i][1]) for i in union.nonzero().flatten().tolist()},
            stop=bool(both[-1] > 0),
        )

    def sync(self, agreed: BackwardRecord) -> list[str]:
        """After backward: average the gradients the ranks agreed on in :meth:`agree`. Returns their names."""
        for pid in agreed.graph:
            name, p = self.params[self.index[pid]]
            self.step_counts[(name, Sync.GRAPH)] += 1
            if self.world_size > 1:  # a data-parallel group of one sends nothing
                numel = local_shard(p).numel()
                self._graph_bytes += numel * (self.wire_dtype.itemsize if self.wire_dtype else p.element_size())
        chosen = [self.params[self.index[pid]] for pid in sorted(agreed.eager, key=self.index.__getitem__)]
        for name, _ in chosen:
            self.step_counts[(name, Sync.FALLBACK)] += 1
        if chosen and self.world_size > 1:
            self._all_reduce_mean([p for _, p in chosen])
        return [n for n, _ in chosen]

    def _all_reduce_mean(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # A split parameter (DTensor) is averaged shard by shard: its local part, over the data-parallel group.
        grads = [local_shard(p.grad) for p in params]
        self._fallback_bytes += all_reduce_flat(
            grads, self.group, divide_by=self.world_size, cap_bytes=self.cap_bytes, wire_dtype=self.wire_dtype
        )

    def start_accumulated_sync(self) -> AccumulatedSync:
        """Gradient accumulation, at the start of the last micro-batch: take the gradients the earlier micro-batches
        accumulated out of ``.grad`` and start averaging them (asynchronous; the last micro-batch's forward and
        backward run meanwhile, and its own gradients are averaged in its graphs). Every trainable parameter is
        sent, zeros where a rank has no gradient: every rank issues the same collectives without agreeing first."""
        chosen = [(n, p) for n, p in self.params if p.requires_grad]
        taken = []
        # Which ranks had a gradient, summed along: a parameter no rank used keeps no gradient (as with DDP).
        present = torch.tensor([float(p.grad is not None) for _, p in chosen], device=chosen[0][1].device)
        for name, p in chosen:
            taken.append(p.grad if p.grad is not None else torch.zeros_like(p))
            p.grad = None
            self.step_counts[(name, Sync.ACCUMULATED)] += 1
        pending = start_all_reduce_flat(
            [local_shard(g) for g in taken] + [present],
            self.group,
            divide_by=self.world_size,
            cap_bytes=self.cap_bytes,
            wire_dtype=self.wire_dtype,
        )
        self._fallback_bytes += pending.sent
        return AccumulatedSync([p for _, p in chosen], taken, pending, present)

    def end_step(self) -> dict[str, list[str]]:
        """Close the optimizer step: record how each parameter was synced, reset."""
        summary: dict[str, list[str]] = {}
        for (name, how), count in sorted(self.step_counts.items()):
            summary.setdefault(name, []).extend([how.value] * count)
        self.last_step = summary
        self.fallback_bytes_last_step, self.graph_bytes_last_step = self._fallback_bytes, self._graph_bytes
        self.step_counts.clear()
        self._fallback_bytes = self._graph_bytes = 0
        return summary

    def uncovered(self, params: Iterable[torch.nn.Parameter] | None = None) -> list[str]:
        """Parameters (of ``params``, default all) whose gradient was accumulated during the last closed step
        but never averaged: should be empty."""
        wanted = {id(p) for p in params} if params is not None else set(self.index)
        missing = [n for n, p in self.params if id(p) in wanted and id(p) in self._touched and n not in self.last_step]
        self._touched.clear()
        return missing

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
