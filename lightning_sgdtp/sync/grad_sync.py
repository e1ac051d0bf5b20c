"""``GradSync``: the whole gradient-synchronisation sequence of one optimizer step, for both engines.

Where each gradient is averaged over the data-parallel group:

1. inside a compiled backward graph (the bucket pass, :mod:`lightning_sgdtp.compiler.buckets`), for the
   parameters the ``"sgdtp"`` backend lifted into its graphs (``compiler.graph_param_ids``);
2. after backward, by the ledger's fallback (:mod:`lightning_sgdtp.sync.ledger`), for everything else: eager regions,
   gradients accumulated over micro-batches while sync was off, a pipeline stage's eager parts.

The sequence, in this order:

- **before backward** (compiled engine): walk the autograd graph from the loss, then agree with every rank on
  what the fallback will send and check that all ranks run the same in-graph collectives (one small all-reduce
  that also carries the preemption flag; asynchronous: waited for before backward only when this rank's record
  changed, else after backward);
- **after backward**: the fallback averages what the graphs did not (the pipelined engine classifies its stages'
  gradients here, agrees with its data-parallel replicas, then sums tied weights over the pipeline);
- **at the optimizer step**: close the step and prove that every gradient the optimizer steps was averaged
  exactly once.

``enabled=False`` (the plan's ``debug_skip_sync="dp-sync"``) switches every data-parallel average off (in-graph
buckets, fallback, the coverage proof; tied-weight sums over a pipeline still run): the tests' negative control,
which must then disagree with the reference. It says so on rank 0 in capitals.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sgdtp.compiler.backend import SGDTPCompiler
from lightning_sgdtp.config import SGDTPConfig
from lightning_sgdtp.runtime.preemption import PreemptionCoordinator
from lightning_sgdtp.sync.ledger import AccumulatedSync, Agreement, BackwardRecord, GradLedger, walk_autograd_graph


def plain_gradients(parameters: Iterable[torch.nn.Parameter]) -> None:
    """A replicated (plain) parameter applied to tensor-parallel activations gets a DTensor gradient: partial sums
    over the tensor-parallel group (Qwen3's per-head ``q_norm``, T5's position bias). Sum it into a plain tensor,
    as the parameter is, so that the optimizer can apply it."""
    from torch.distributed.tensor import DTensor

    for p in parameters:
        if isinstance(p.grad, DTensor) and not isinstance(p, DTensor):
            p.grad = p.grad.full_tensor()


class GradSync:
    """Before backward, after backward, at the optimizer step: see the module docstring.

    Args:
        named_parameters: the LightningModule's parameters, in the same order on every rank.
        compiler: the ``"sgdtp"`` backend of this run (which parameters its graphs average; whether compiled
            backwards average in the graph at all, ``compiler.in_graph_sync``: else one fallback sync after the last
            micro-batch, the pipelined engine's accumulation).
        group: the data-parallel process group (None: the world).
        config: the options (bucket size, wire dtype).
        say: logs one line on rank 0.
        preemption: SLURM's preemption agreement, carried by the collectives here.
        accumulation: gradients are accumulated over micro-batches (``accumulate_grad_batches > 1``): the earlier
            micro-batches run graphs without collectives (the engine's second compiler) and their sum is averaged
            during the last.
        enabled: average over the data-parallel group (False: the plan's ``debug_skip_sync="dp-sync"`` control).
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        compiler: SGDTPCompiler,
        group: dist.ProcessGroup | None,
        config: SGDTPConfig,
        say: Callable[[str], None],
        preemption: PreemptionCoordinator | None = None,
        accumulation: bool = False,
        enabled: bool = True,
    ) -> None:
        from lightning_sgdtp.parallel.sharding import MARK

        wire = config.wire_dtype
        named_parameters = list(named_parameters)
        # Sharded parameters are reduced by their own reading (the reduce-scatter in the graph that reads them, proved
        # by the backend at compile time, or DTensor's eager one): not the ledger's to sync.
        self.sharded_ids = frozenset(id(p) for _, p in named_parameters if getattr(p, MARK, False))
        named_parameters = [(n, p) for n, p in named_parameters if id(p) not in self.sharded_ids]
        self.parameters = [p for _, p in named_parameters]
        self.ledger = GradLedger(named_parameters, group, config.bucket_cap_bytes, wire)
        self.compiler = compiler
        self.group = group
        self.say = say
        self.preemption = preemption
        self.enabled = enabled
        self.accumulation = accumulation
        #: Parameters synced by the fallback after a step in which the graphs should have covered them.
        self.fallback_params: list[str] = []
        self._accumulating = False
        #: Micro-batches accumulated since the last optimizer step; their sum in flight at the last micro-batch.
        self._accumulated = False
        self._accumulated_sync: AccumulatedSync | None = None
        #: Since the last optimizer step: a micro-batch ran without sync / one ran with it (to name the mistake of
        #: stepping after accumulation alone).
        self._unsynced_micro_batch = self._synced_micro_batch = False
        self._pending: Agreement | None = None
        self._fingerprint: tuple | None = None
        #: How many backwards waited for the agreement before running (record changed), the rest after.
        self.waits_before_backward = 0
        #: The micro-batch in flight runs eagerly on purpose (:meth:`eager_micro_batch`).
        self._eager = False
        if not self.enabled:
            say(
                "NEGATIVE CONTROL (debug_skip_sync='dp-sync'): no data-parallel gradient averaging at all;"
                " training is WRONG on purpose"
            )

    @property
    def in_graph(self) -> bool:
        return self.compiler.in_graph_sync

    @property
    def accumulating(self) -> bool:
        """Inside a micro-batch that only accumulates (Lightning's ``block_backward_sync``)."""
        return self._accumulating

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no communication on the micro-batches run inside this context."""
        self._accumulating = self._accumulated = self._unsynced_micro_batch = True
        try:
            yield
        finally:
            self._accumulating = False

    def start_of_micro_batch(self) -> None:
        """Before each ``training_step``. At the last micro-batch of an accumulation (in-graph mode), the earlier
        micro-batches' gradients start their all-reduce now, behind this micro-batch's forward and backward."""
        if (
            self._accumulated
            and not self._accumulating
            and self.in_graph
            and self.enabled
            and self.ledger.world_size > 1
            and self.ledger.params
        ):
            self._accumulated = False
            self._accumulated_sync = self.ledger.start_accumulated_sync()

    # --------------------------------------------------------------------------------- compiled engine
    def before_backward(self, loss: Tensor) -> None:
        """Classify the gradients this backward will produce, and agree on them with every rank."""
        if self._accumulating or not self.enabled:
            return
        self._synced_micro_batch = True
        record = walk_autograd_graph(loss, self.compiler.graph_param_ids, self.sharded_ids)
        stop = self.preemption is not None and self.preemption.requested
        self._pending = self.ledger.start_agreement(record, stop=stop)
        # A rank whose record changed (first step, a new graph, a new eager region) waits before backward, so that
        # a rank about to run other in-graph collectives fails here, not in a hang. In the steady state the wait
        # moves after backward: the agreement then rides behind the gradient buckets instead of lining the ranks
        # up before backward (what a blocking all-reduce here cost: a rank barrier every step).
        fingerprint = (frozenset(record.graph), frozenset(record.eager), self.in_graph)
        if fingerprint != self._fingerprint:
            self._fingerprint = fingerprint
            self.waits_before_backward += 1
            self._pending.result()

    def _agreed(self) -> BackwardRecord | None:
        """The agreement of this backward (waited for now if it was not yet); the preemption flag goes with it."""
        if self._pending is None:
            return None
        record, self._pending = self._pending.result(), None
        if self.preemption is not None:
            self.preemption.agree(record.stop)
        return record

    def after_backward(self) -> None:
        """Average what the compiled graphs did not (what the ranks agreed on before backward)."""
        plain_gradients(self.parameters)
        record = self._agreed()
        if self._accumulated_sync is not None:
            accumulated, self._accumulated_sync = self._accumulated_sync, None
            accumulated.finish()
        if record is None:
            return
        # A graph compiled during this backward may have left its gradients to the fallback (every rank alike).
        moved = {i for i in record.graph if i not in self.compiler.graph_param_ids}
        record.graph -= moved
        record.eager |= moved
        synced = self.ledger.sync(record)
        if not self._eager:  # a short batch run eagerly on purpose is not an eager region of the model
            self._note_fallback(synced)
        self._eager = False

    def eager_micro_batch(self) -> None:
        """This micro-batch runs eagerly on purpose (a short batch): its fallback sync is expected, not noted."""
        self._eager = True

    # -------------------------------------------------------------------------------- pipelined engine
    def after_pipeline_backward(self, local_parameters: list[torch.nn.Parameter], sum_tied: Callable[[], None]) -> None:
        """At the last micro-step of an optimizer step (the schedule ran every backward already): the stage's
        gradients no compiled graph averaged, averaged over its data-parallel replicas; then tied parameters
        summed over the pipeline; then the preemption flag agreed over every rank."""
        if self._accumulating:
            return
        if self.enabled:
            graph_ids = self.compiler.graph_param_ids
            # Sharded parameters are reduced by their read (the proof checked it at compile time).
            with_grad = [p for p in local_parameters if p.grad is not None and id(p) not in self.sharded_ids]
            record = BackwardRecord(
                graph={id(p) for p in with_grad if id(p) in graph_ids},
                eager={id(p) for p in with_grad if id(p) not in graph_ids},
            )
            # The replicas of a stage hold the same parameters; the other stages hold others.
            self._note_fallback(self.ledger.sync(self.ledger.agree(record, group=self.group)))
        sum_tied()
        if self.preemption is not None:  # SLURM's signal: every rank learns of it at the same step
            self.preemption.agree_over_world()

    # ---------------------------------------------------------------------------------- optimizer step
    def at_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Close the step; every gradient the optimizer stepped must have been averaged exactly once."""
        self.ledger.end_step()
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        missing = self.ledger.uncovered(stepped)
        only_unsynced = self._unsynced_micro_batch and not self._synced_micro_batch
        self._unsynced_micro_batch = self._synced_micro_batch = False
        if missing and self.enabled and only_unsynced:
            raise RuntimeError(
                f"sgdtp: the optimizer stepped on gradients that were never averaged across ranks ({missing[:5]}):"
                " every backward since the last step ran without gradient sync (fabric.no_backward_sync(model) or"
                " a no_sync() block). Run the last micro-batch of each step with sync on, e.g."
                " `with fabric.no_backward_sync(model, enabled=not is_last_micro_batch):`."
            )
        if missing and self.enabled:
            raise RuntimeError(
                f"sgdtp: the gradients of {missing[:5]} were not averaged across ranks this step. They came"
                " from a backward the strategy did not see (in manual optimization call"
                " self.manual_backward(loss), not loss.backward()) or through an autograd node that hides its"
                " parameters (reentrant activation checkpointing: use use_reentrant=False)."
            )

    def _note_fallback(self, synced: list[str]) -> None:
        new = [n for n in synced if n not in self.fallback_params]
        if new and self.in_graph:
            self.fallback_params.extend(new)
            self.say(
                f"{len(new)} parameter(s) get gradients outside the compiled graphs (eager regions); synced"
                f" after backward by the fallback buckets: {', '.join(new[:8])}" + (" ..." if len(new) > 8 else "")
            )

    def close(self) -> None:
        self.ledger.remove_hooks()

    def describe(self, world_size: int, dp_size: int, pipelined: bool) -> str:
        """``plan["grad_sync"]``."""
        if world_size == 1:
            return "none (one process)"
        if pipelined:
            return "in-graph per micro-batch, each stage over its data-parallel group"
        if self.in_graph and self.accumulation:
            return "in-graph; accumulated micro-batches averaged during the last micro-batch (overlapped)"
        return "in-graph" if self.in_graph else "after-last-micro-batch (gradient accumulation)"
