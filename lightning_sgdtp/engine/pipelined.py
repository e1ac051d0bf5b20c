"""The pipelined engine: split the LightningModule into stages, prepare each stage the way the compiled engine
prepares the whole module (:func:`~lightning_sgdtp.engine.prepare.prepare_part`: activation checkpointing, then
compile through the ``"sgdtp"`` backend over the stage's data-parallel group), and run them under a schedule of
``torch.distributed.pipelining`` (:class:`~lightning_sgdtp.parallel.pipeline.PipelineRunner`).

Setup, in order: the LightningModule contract checked; the split planned (plain data, logged); the backend and
its :class:`~lightning_sgdtp.grad_sync.GradSync` over the stage's data-parallel group; the runner, which traces
and prepares the stages at the first step (and again for each new micro-batch shape).

One training step: Lightning's ``zero_grad`` (deferred here: the schedule runs backward inside
``training_step``), the stage buffers broadcast over the replicas, the schedule (forward and backward of every
micro-batch, each stage's gradients averaged in its compiled backward), the logs replayed on every rank; then at
Lightning's backward call, what no graph averaged, the tied-weight sums and the coverage proof.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.utils import _sync_params_and_buffers

from lightning_sgdtp.compiler.backend import SGDTPCompiler
from lightning_sgdtp.config import NotAvailableYetError, SGDTPConfigError
from lightning_sgdtp.engine.base import BROADCAST_BUCKET_BYTES, EngineInputs, StepEngine
from lightning_sgdtp.engine.prepare import PartPreparation, prepare_part
from lightning_sgdtp.grad_sync import GradSync, missed_reduce_scatter
from lightning_sgdtp.parallel.clipping import clip_pipeline_grad_norm_
from lightning_sgdtp.parallel.pipeline import PipelineRunner, check_pipeline_contract, replay_logs, stages_per_rank
from lightning_sgdtp.parallel.pipeline_split import PipelineSplit, PipelineSplitError, plan_pipeline_split
from lightning_sgdtp.parallel.sharding import ShardPlan, is_sharded, share_reads, whole_for_tracing


class PipelinedStep(StepEngine):
    """Runs the LightningModule's steps through this rank's pipeline stages (mesh: ``("pp", "dp")``)."""

    def __init__(self, module: nn.Module, inputs: EngineInputs) -> None:
        super().__init__(module, inputs)
        self.runner: PipelineRunner | None = None
        self.split: PipelineSplit | None = None
        self._zero_grad: Callable[..., Any] | None = None
        self.shard_plan: ShardPlan | None = None

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    @property
    def stages(self) -> int:
        """Stages of one pipeline (several per rank with the interleaved schedule)."""
        return self.layout.pp * stages_per_rank(self.config.pipeline_schedule, self.config.pipeline_stages_per_rank)

    # ------------------------------------------------------------------------------------------- setup
    def parallelize(self) -> Callable[[list[Tensor], float], None]:
        """Plan the split, make the stage compiler, its gradient sync and this rank's runner. Returns the
        clipping function by the norm over every stage."""
        module, config = self.module, self.config
        # The schedule runs backward inside training_step; Lightning zeroes gradients after training_step and
        # before backward. Its zero_grad is therefore deferred to us: run before the schedule, at the first
        # micro-step of each accumulation window, as Lightning would have.
        if "optimizer_zero_grad" not in module.__dict__:
            self._zero_grad = module.optimizer_zero_grad
            module.optimizer_zero_grad = _zero_grad_done_by_strategy
        if self.runner is None:
            check_pipeline_contract(module)
            try:
                split = plan_pipeline_split(module, self.stages, split_points=config.pipeline_split)
            except PipelineSplitError as exc:
                raise SGDTPConfigError(str(exc)) from exc
            if config.sharded and not is_sharded(module):
                # Before the optimizer exists (it steps the shards), over this stage's replicas; every rank shards
                # the whole module (its copies of the other stages are stale shards). The stages traced later
                # get the same reads (share_reads).
                self.shard_plan = prepare_part(module, self._sharding(self.mesh["dp"], None)).shard_plan
                for line in self.shard_plan.describe():
                    self.report.say(line)
            names = {id(p): n for n, p in module.named_parameters()}
            self.compiler = SGDTPCompiler(config, group=self.dp_group, param_names=names, on_graph=self.report.announce)
            self.grad_sync = GradSync(
                module.named_parameters(),
                self.compiler,
                self.dp_group,
                config,
                self.layout.dp > 1,
                self.report.say,
                self.preemption,
            )
            if self.shard_plan is not None and missed_reduce_scatter():
                module._sgdtp_read.reduce = False  # the negative control: the proof must fail the first compile
                self.report.say("NEGATIVE CONTROL: the sharded parameters' gradients are NOT reduce-scattered")
            self.report.count_breaks_from_now()
            self.runner = PipelineRunner(
                module,
                split,
                config.pipeline_schedule,
                config.pipeline_micro_batches(self.layout.pp),
                self.mesh["pp"].get_group(),
                self.device,
                prepare=self._prepare_stage,
                measure=config.pipeline_balance == "measured",
                on_split=self._on_split,
                tracing=(lambda: whole_for_tracing(module)) if self.shard_plan is not None else contextlib.nullcontext,
            )
            self._on_split(split)
            _leave_cleanly_at_exit()
        runner = self.runner
        return lambda params, max_norm: clip_pipeline_grad_norm_(params, max_norm, runner.group, runner.holders)

    def _on_split(self, split: PipelineSplit) -> None:
        self.split = split
        for line in split.describe():
            self.report.say(line)
        if split.balance == "cost":
            self.report.say(
                "  pipeline_balance='measured': a block's cost is its forward time in ms (the slowest rank's)"
            )

    def _prepare_stage(self, stage: nn.Module) -> None:
        """The same per-part preparation as the compiled engine's: activation checkpointing, then compile."""
        assert self.split is not None and self.compiler is not None
        if self.shard_plan is not None:
            share_reads(stage, self.module)
        blocks = [b for stage_blocks in self.split.blocks_per_stage for b in stage_blocks]
        how = PartPreparation(
            checkpoint=blocks if self.config.activation_checkpointing else None, backend=self.compiler
        )
        wrapped = prepare_part(stage, how).checkpointed
        if wrapped and wrapped[0] not in self.checkpointed:  # once per stage, not per traced shape
            self.checkpointed = sorted({*self.checkpointed, *wrapped})
            self.report.say(
                f"activation checkpointing on {len(wrapped)} block(s) of a stage ({wrapped[0]} .. {wrapped[-1]})"
            )

    def setup_training(self, accumulate: int) -> None:
        if self.shard_plan is not None:
            self.report.say(
                "sharded stages: parameter all-gathers in each stage's compiled forward, gradient reduce-scatters in"
                f" its compiled backward over its data-parallel group of {self.layout.dp}, once per micro-batch"
            )
        elif self.layout.dp > 1:
            self.report.say(
                f"gradient sync inside each stage's compiled backward, over its data-parallel group of"
                f" {self.layout.dp}: buckets of <= {self.config.bucket_cap_bytes / 2**20:g} MiB, once per micro-batch"
                " (overlapped with the next micro-batches' compute)"
            )
        else:
            self.report.say("one pipeline: no data-parallel gradient sync; activations travel stage to stage")

    # ------------------------------------------------------------------------------------------- steps
    def training_step(self, args: tuple, kwargs: dict, trainer: Any, optimizers: list) -> Tensor:
        batch, batch_idx = _batch_and_index(args, kwargs)
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0 and self._zero_grad is not None:
            for optimizer in optimizers:
                self._zero_grad(trainer.current_epoch, batch_idx, optimizer)
        if self.config.broadcast_buffers and self.layout.dp > 1:
            self._broadcast_stage_buffers()
        loss = self.run("training_step", batch, batch_idx, scale=1.0 / accumulate)
        return torch.tensor(loss, device=self.device)

    def run(self, hook: str, batch: Any, batch_idx: int, scale: float = 1.0) -> float | None:
        """One schedule of ``hook``; what ``self.log`` recorded on the last stage is logged on every rank."""
        assert self.runner is not None
        seen = len(self.runner.retraced)
        with self.guard(hook):
            result = self.runner.run(hook, batch, batch_idx, scale=scale)
        for traced in self.runner.retraced[seen:]:
            self.report.say(f"pipeline stages traced and compiled for {traced}")
        if self.runner.retraced[seen:] and self.runner.boundaries:
            self.report.say(
                f"pipeline: {len(self.runner.boundaries)} stage boundary tensor(s) are views (e.g."
                f" {self.runner.boundaries[0]}): sent and received contiguous (send/recv need dense tensors)"
            )
        replay_logs(self.module, result.logs, self.device)
        return result.loss

    def eval_step(
        self, hook: str, args: tuple, kwargs: dict, default: Callable[[], Any], context: Callable[[], Any]
    ) -> None:
        """Validation and test through the pipeline (forward only); what they log is logged on every rank."""
        if hook == "predict_step":
            raise NotAvailableYetError(
                "predict with pipeline parallelism is not available yet (the outputs exist on the last stage only)."
                " Consolidate the checkpoint (sgdtp consolidate DIR model.ckpt) and predict with strategy='sgdtp'"
                " without pipeline_stages."
            )
        with context():
            self.run(hook, *_batch_and_index(args, kwargs))

    def _broadcast_stage_buffers(self) -> None:
        """As DDP's broadcast_buffers, per stage: the first pipeline's buffers go to the stage's replicas."""
        assert self.runner is not None
        buffers = [b for stage in self.runner.stage_modules() for b in stage.buffers()]
        if buffers:
            with self.guard("broadcast_buffers"):
                _sync_params_and_buffers(self.dp_group, buffers, BROADCAST_BUCKET_BYTES, 0)  # src: group rank 0

    def backward(self, run_backward: Callable[[], None]) -> None:
        """At the last micro-step of an optimizer step: what no graph averaged, tied sums (``run_backward`` is not
        called: the schedule ran backward already; Lightning's hooks around it still run)."""
        assert self.runner is not None and self.grad_sync is not None
        with self.guard("pipeline gradient sync"):
            self.grad_sync.after_pipeline_backward(self.runner.local_parameters, self.runner.sum_tied_gradients)

    def on_train_end(self) -> None:
        """After fit every rank holds the whole trained model, as with data parallel."""
        if self.runner is not None:
            with self.guard("share stages"):
                self.runner.share_stages()

    # ------------------------------------------------------------------------------------- checkpoints
    def local_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The entries this rank's stages hold (its copy of the other stages is stale during training)."""
        return self.runner.stage_state_dict(state_dict) if self.runner is not None else state_dict

    def full_state_dict(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` with every stage's tensors taken from the rank that holds it (a collective)."""
        if self.runner is None:
            return state
        local = {k: v.detach().cpu() for k, v in self.runner.stage_state_dict(state).items()}
        parts: list[Any] = [None] * self.layout.pp
        with self.guard("full_state_dict"):
            dist.all_gather_object(parts, local, group=self.runner.group)
        merged = {k: v for part in parts for k, v in part.items()}
        return {k: merged.get(k, v.detach().cpu()).to(v.device) for k, v in state.items()}

    # -------------------------------------------------------------------------------------------- plan
    def plan(self) -> dict[str, Any]:
        runner = self.runner
        return {
            "tensor_parallel_plan": None,
            "pipeline": {
                "pp_size": self.layout.pp,
                "dp_size": self.layout.dp,
                "schedule": self.config.pipeline_schedule,
                "chunks": self.config.pipeline_micro_batches(self.layout.pp),
                "split": self.split.to_dict() if self.split is not None else None,
                "stages_of_rank_0": runner.stage_ids if runner is not None and dist.get_rank() == 0 else None,
                "traced": list(runner.retraced) if runner is not None else [],
                "contiguous_boundaries": list(runner.boundaries) if runner is not None else [],
            },
            "activation_checkpointing": list(self.checkpointed),
            "sharding": self.sharding_plan([self.shard_plan] if self.shard_plan is not None else []),
            "graphs": [g.to_dict() for g in self.compiler.graphs] if self.compiler else [],
        }

    def teardown(self, barrier: Callable[[str], None]) -> None:
        super().teardown(barrier)
        # Pipeline sends may still be in flight on a neighbour: gloo aborts if a peer leaves mid-transfer.
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                barrier("pipeline teardown")
        if self._zero_grad is not None:
            self.module.__dict__.pop("optimizer_zero_grad", None)
            self._zero_grad = None


def _batch_and_index(args: tuple, kwargs: dict) -> tuple[Any, int]:
    """``(batch, batch_idx)`` of a step hook's arguments, as Lightning passes them."""
    batch = args[0] if args else kwargs.get("batch")
    return batch, args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)


def _zero_grad_done_by_strategy(*args: Any, **kwargs: Any) -> None:
    """Lightning's zero_grad between training_step and backward, with pipeline parallelism: the strategy has
    already zeroed before the schedule (which ran the backward inside training_step)."""


_EXIT_HOOK: list[bool] = []


def _leave_cleanly_at_exit() -> None:
    """Once per process: at exit, meet the peers, then destroy the process group while Python is still alive.

    After pipeline training, gloo's worker threads can still hold finished asynchronous work (point-to-point
    sends and receives) when the interpreter shuts down; freeing it then aborts the process (SIGABRT,
    "terminate called without an active exception") after a successful run, about one run in ten here. Torch does
    not do this itself (pytorch/pytorch#179291, abandoned). The barrier is bounded: a peer that is gone or busy
    elsewhere costs at most 30 s, and any failure is ignored (the run is over)."""
    if _EXIT_HOOK:
        return
    _EXIT_HOOK.append(True)

    def leave() -> None:
        if not dist.is_initialized():
            return
        with contextlib.suppress(Exception):
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=30))
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    atexit.register(leave)
