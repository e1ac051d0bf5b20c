"""The pipelined engine: split the LightningModule into stages, parallelize each stage the way the compiled engine
parallelizes the whole module (:func:`~lightning_sgdtp.engine.parallelize.parallelize`: its sharded reads,
activation checkpointing, then compile through the ``"sgdtp"`` backend over the stage's data-parallel group), and
run them under a schedule of ``torch.distributed.pipelining`` (:class:`~lightning_sgdtp.parallel.pipeline.runner.PipelineRunner`).

Setup, in order: the LightningModule contract checked; the split planned (plain data, logged); with sharding, the
whole module sharded over each stage's replicas (its part plan: the optimizer Lightning makes next steps those
shards, and the stages are traced from it only at the first step); the backend and its
:class:`~lightning_sgdtp.sync.grad_sync.GradSync` over the stage's data-parallel group; the runner, which traces and
parallelizes the stages at the first step (and again for each new micro-batch shape).

One training step: Lightning's ``zero_grad`` (deferred here: the schedule runs backward inside
``training_step``), the stage buffers broadcast over the replicas, the schedule (forward and backward of every
micro-batch, each stage's gradients averaged in its compiled backward), the logs replayed on every rank; then at
Lightning's backward call, what no graph averaged, the tied-weight sums and the coverage proof.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_sgdtp.compiler.backend import CompileSettings, SGDTPCompiler
from lightning_sgdtp.config import NotAvailableYetError, SGDTPConfigError
from lightning_sgdtp.engine.base import EngineInputs, StepEngine, broadcast_buffers
from lightning_sgdtp.engine.parallelize import parallelize, plan_part, sync_line, tracing
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.parallel.clipping import clip_pipeline_grad_norm_
from lightning_sgdtp.parallel.pipeline.contract import check_pipeline_contract, replay_logs
from lightning_sgdtp.parallel.pipeline.memory import ReleasedStages
from lightning_sgdtp.parallel.pipeline.runner import PipelineRunner
from lightning_sgdtp.parallel.pipeline.split import (
    PipelineSplit,
    PipelineSplitError,
    TooManyStagesError,
    plan_pipeline_split,
    stage_parameters,
)
from lightning_sgdtp.parallel.pipeline.stage_tensor import match_gradient_layouts
from lightning_sgdtp.parallel.pipeline.unused import unused_line
from lightning_sgdtp.runtime import shutdown
from lightning_sgdtp.sync.grad_sync import GradSync


class PipelinedStep(StepEngine):
    """Runs the LightningModule's steps through this rank's pipeline stages (mesh: ``("pp", "dp")``)."""

    def __init__(self, module: nn.Module, inputs: EngineInputs) -> None:
        super().__init__(module, inputs)
        self.runner: PipelineRunner | None = None
        self.split: PipelineSplit | None = None
        self._zero_grad: Callable[..., Any] | None = None
        self._said_weighted = False
        self._said_unused = False
        self.tensor_hooked: list[str] = []

    # ------------------------------------------------------------------------------------------- setup
    def setup(self, fitting: bool, accumulate: int) -> Callable[[list[Tensor], float], None]:
        """Plan the split, the whole module's part (sharding), make the stage compiler, its gradient sync and this
        rank's runner; fitting: the sync's log line. Returns the clipping function by the norm over every stage."""
        module, config, dims = self.module, self.config, self.dims
        # The schedule runs backward inside training_step; Lightning zeroes gradients after training_step and
        # before backward. Its zero_grad is therefore deferred to us: run before the schedule, at the first
        # micro-step of each accumulation window, as Lightning would have.
        if "optimizer_zero_grad" not in module.__dict__:
            self._zero_grad = module.optimizer_zero_grad
            module.optimizer_zero_grad = _zero_grad_done_by_strategy
        if self.runner is None:
            check_pipeline_contract(module)
            try:
                split = plan_pipeline_split(module, dims.stages, split_points=config.pipeline_split)
            except TooManyStagesError as exc:
                raise SGDTPConfigError(too_many_stages(str(exc), exc.blocks, config, dims)) from exc
            except PipelineSplitError as exc:
                raise SGDTPConfigError(str(exc)) from exc
            self.part_plan = plan = plan_part(
                config, dims, module, part="pipelined model", device_type=self.device.type
            )
            # Before the optimizer exists (it steps the shards), over each stage's replicas: every rank shards the
            # whole module (its copies of the other stages are stale shards); the stages traced later read through
            # the same shards.
            done = parallelize(module, plan, dims)
            self.shard_plan = done.shard_plan
            for line in done.describe(plan):
                self.report.say(line)
            names = {id(p): n for n, p in module.named_parameters()}
            settings = CompileSettings(in_graph_sync=plan.in_graph_sync, prove_shards=plan.prove_shards)
            self.compiler = SGDTPCompiler(config, dims.dp_group, names, self.report.announce, settings=settings)
            self.grad_sync = GradSync(
                module.named_parameters(), self.compiler, dims.dp_group, config, self.report.say, self.preemption,
                enabled=plan.dp_sync,
            )  # fmt: skip
            self.report.count_breaks_from_now()
            self.runner = PipelineRunner(
                module,
                split,
                config.pipeline_schedule,
                dims.micro_batches,
                dims.pp_group,
                self.device,
                prepare=self._parallelize_stage,
                measure=config.pipeline_balance == "measured",
                on_split=self._on_split,
                tracing=lambda: tracing(module),
            )
            self._on_split(split)
            self._materialize_stages(split)
            _leave_cleanly_at_exit()
        if fitting:
            assert self.part_plan is not None
            self.report.say(sync_line(config, dims, self.part_plan, accumulate, False, False))
        runner = self.runner
        return lambda params, max_norm: clip_pipeline_grad_norm_(params, max_norm, runner.group, runner.holders)

    def _materialize_stages(self, split: PipelineSplit) -> None:
        """A model built on the meta device: this rank allocates (and loads or initializes) its stages' parameters
        only, by the split's rule (``stage_parameters``: a tied embedding and head on both stages; what is
        registered before the block stack on stage 0, after it on the last), and the vectors outside the block stack
        on every rank (norms, biases: the trace decides their stage, and MBart runs its embedding LayerNorm,
        registered after the layers, on stage 0), released after the first trace where no traced stage of this rank
        uses them; the others' blocks and matrices (embeddings, head) are never allocated here. A matrix the trace
        finds on another stage than the rule's is refused then, named (``PipelineRunner._check_stages_held``)."""
        from lightning_sgdtp.engine.materialize import has_meta

        assert self.runner is not None
        if not has_meta(self.module):
            return self.materialize_part()
        if self.config.pipeline_balance == "measured":
            raise SGDTPConfigError(
                "pipeline_balance='measured' times every block's forward on each rank, which needs the whole model,"
                " and this model was built on the meta device (each rank holds its stages only). Use"
                " pipeline_balance='params' (the default), or build the model with its weights."
            )
        stages = stage_parameters(self.module, split)
        mine = {i for s in self.runner.stage_ids for i in stages[s]}
        outside = self.module.named_parameters(remove_duplicate=False)
        mine |= {id(p) for name, p in outside if not split.in_blocks(name) and p.dim() <= 1}
        state = self.module.state_dict(keep_vars=True)
        params = {id(p) for p in self.module.parameters()}
        self.materialize_part(lambda key: key not in state or id(state[key]) not in params or id(state[key]) in mine)
        never = ReleasedStages.never_held(self.module, self.device)  # released from the start, lent to traces
        self.runner.released = never if never.slots else None

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """The parameters this rank never held (a model built on meta) are not stepped here."""
        if self.runner is not None and self.runner.released is not None:
            self.runner.released.drop_from(optimizers)
        super().setup_optimizers(optimizers)

    def _on_split(self, split: PipelineSplit) -> None:
        self.split = split
        for line in split.describe():
            self.report.say(line)
        if split.balance == "cost":
            self.report.say(
                "  pipeline_balance='measured': a block's cost is its forward time in ms (the slowest rank's)"
            )

    def _parallelize_stage(self, stage: nn.Module) -> None:
        """A traced stage's part plan, applied: the whole module's sharded reads, activation checkpointing, compile."""
        assert self.split is not None and self.compiler is not None
        blocks = [b for stage_blocks in self.split.blocks_per_stage for b in stage_blocks]
        plan = plan_part(self.config, self.dims, stage, part="stage", stage_blocks=blocks, device_type=self.device.type)
        done = parallelize(stage, plan, self.dims, backends=[self.compiler], whole=self.module)
        hooked, wrapped = done.tensor_hooked, done.checkpointed
        if hooked and hooked[0] not in self.tensor_hooked:  # once per stage, not per traced shape
            self.tensor_hooked = sorted({*self.tensor_hooked, *hooked})
            self.report.say(
                f"tensor parallel in a stage: {len(hooked)} traced layer(s) ({hooked[0]} .. {hooked[-1]}) split over"
                f" the stage's tensor-parallel group of {self.dims.tp}, with the whole module's parameters and hooks"
            )
        if wrapped and wrapped[0] not in self.checkpointed:  # once per stage, not per traced shape
            self.checkpointed = sorted({*self.checkpointed, *wrapped})
            self.report.say(
                f"activation checkpointing on {len(wrapped)} block(s) of a stage ({wrapped[0]} .. {wrapped[-1]})"
            )

    # ------------------------------------------------------------------------------------------- steps
    def training_step(self, args: tuple, kwargs: dict, trainer: Any, optimizers: list) -> Tensor:
        batch, batch_idx = _batch_and_index(args, kwargs)
        accumulate = trainer.accumulate_grad_batches
        if batch_idx % accumulate == 0 and self._zero_grad is not None:
            for optimizer in optimizers:
                self._zero_grad(trainer.current_epoch, batch_idx, optimizer)
        if self.part_plan is not None and self.part_plan.broadcast_buffers:
            self._broadcast_stage_buffers()
        loss = self.run("training_step", batch, batch_idx, scale=1.0 / accumulate)
        assert self.runner is not None
        self.runner.release_other_stages(optimizers)  # a rank holds only its stages from here on
        return torch.tensor(loss, device=self.device)

    def run(self, hook: str, batch: Any, batch_idx: int, scale: float = 1.0) -> float | None:
        """One schedule of ``hook``; what ``self.log`` recorded on the last stage is logged on every rank."""
        assert self.runner is not None
        seen = len(self.runner.retraced)
        with self.guard(hook), self.implicit_replication():
            result = self.runner.run(hook, batch, batch_idx, scale=scale)
        for traced in self.runner.retraced[seen:]:
            self.report.say(f"pipeline stages traced and compiled for {traced}")
        if self.runner.retraced[seen:] and self.runner.boundaries:
            self.report.say(
                f"pipeline: {len(self.runner.boundaries)} stage boundary tensor(s) are views (e.g."
                f" {self.runner.boundaries[0]}): sent and received contiguous (send/recv need dense tensors)"
            )
        if self.runner.retraced[seen:] and self.runner.carried:
            self.report.say(
                f"pipeline: {len(self.runner.carried)} value(s) a later stage reads are carried through the stages"
                f" between (e.g. {self.runner.carried[0]}): stage 0 gets the micro-batch, and the interleaved"
                " schedule sends between adjacent stages only"
            )
        if self.runner.retraced[seen:] and self.runner.unused and not self._said_unused:
            self._said_unused = True
            self.report.say(unused_line(self.module, self.runner.unused))
        if self.runner.weighted and not self._said_weighted:
            self._said_weighted = True
            self.report.say(
                "pipeline: the batch's labels hold -100 (padding): each micro-batch's loss weighs its share of the"
                " labels that are not -100, so the step is the one of training without the pipeline for a loss that"
                " is a mean over those labels (cross_entropy's default)"
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
        with self.guard("broadcast_buffers"):
            broadcast_buffers(list(self.runner.stage_modules()), self.dims.dp_group)

    def backward(self, run_backward: Callable[[], None]) -> None:
        """At the last micro-step of an optimizer step: what no graph averaged, tied sums (``run_backward`` is not
        called: the schedule ran backward already; Lightning's hooks around it still run)."""
        assert self.runner is not None and self.grad_sync is not None
        with self.guard("pipeline gradient sync"):
            match_gradient_layouts(self.runner.local_parameters)
            self.grad_sync.after_pipeline_backward(self.runner.local_parameters, self.runner.sum_tied_gradients)

    @property
    def holds_a_part(self) -> bool:
        return self.runner is not None and self.runner.released is not None and bool(self.runner.released.slots)

    def gather_stages(self) -> None:
        """Every rank gets the whole trained model (the other stages' parameters, from the ranks that hold them):
        what ``SGDTPStrategy.gather_pipeline_stages()`` asks for. A collective over the pipeline group."""
        if self.runner is not None:
            with self.guard("gather pipeline stages"):
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
        parts: list[Any] = [None] * self.dims.pp
        with self.guard("full_state_dict"):
            dist.all_gather_object(parts, local, group=self.runner.group)
        merged = {k: v for part in parts for k, v in part.items()}
        # a released parameter (meta: another rank's stage) comes from its holder, onto this rank's device
        return {
            k: (merged[k] if k in merged else v.detach().cpu()).to(self.device if v.is_meta else v.device)
            for k, v in state.items()
        }

    # -------------------------------------------------------------------------------------------- plan
    def plan(self) -> dict[str, Any]:
        runner = self.runner
        tensor_plan = self.part_plan.tensor_plan if self.part_plan is not None else None
        return {
            "tensor_parallel_plan": tensor_plan.to_dict() if tensor_plan is not None else None,
            "tensor": dict(tensor_plan.coverage) if tensor_plan is not None else None,
            "pipeline": {
                "pp_size": self.dims.pp,
                "dp_size": self.dims.dp,
                "tp_size": self.dims.tp,
                "tensor_parallel_layers": list(self.tensor_hooked),
                "schedule": self.config.pipeline_schedule,
                "chunks": self.dims.micro_batches,
                "split": self.split.to_dict() if self.split is not None else None,
                "stages_of_rank_0": runner.stage_ids if runner is not None and dist.get_rank() == 0 else None,
                "traced": list(runner.retraced) if runner is not None else [],
                "contiguous_boundaries": list(runner.boundaries) if runner is not None else [],
                "carried": list(runner.carried) if runner is not None else [],
                # this rank's parameter bytes, counted from the tensors: its stages held, the others' released
                "held_bytes": runner.released.to_dict() if runner is not None and runner.released else None,
            },
            "activation_checkpointing": list(self.checkpointed),
            "sharding": self.sharding_plan(),
            "graphs": [g.to_dict() for g in self.compiler.graphs] if self.compiler else [],
            "part_plan": self.part_plan.to_dict() if self.part_plan is not None else None,
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
    """Once per process: at exit, meet the peers, then destroy the process group while Python is still alive
    (:func:`~lightning_sgdtp.runtime.shutdown.leave_process_group`). After pipeline training, gloo's worker threads
    can still hold finished asynchronous work (point-to-point sends and receives) when the interpreter shuts down;
    freeing it then aborts the process (SIGABRT, "terminate called without an active exception") after a successful
    run, about one run in ten here. Torch does not do this itself (pytorch/pytorch#179291, abandoned)."""
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(shutdown.leave_process_group)


def too_many_stages(message: str, blocks: int, config: Any, dims: ParallelDims) -> str:
    """The refusal of more stages than blocks, with the ``pipeline_stages`` that work on these ranks."""
    per_rank = dims.stages // dims.pp
    ranks = dims.world_size
    working = [p for p in range(2, ranks + 1) if ranks % p == 0 and p * per_rank <= blocks]
    what = f"pipeline_stages={dims.pp}"
    if per_rank > 1:
        what += f" with pipeline_schedule={config.pipeline_schedule!r} ({per_rank} stages per rank)"
    fix = f"pipeline_stages in {working}" if working else "fewer ranks per pipeline, or no pipeline_stages"
    if per_rank > 1 and blocks >= dims.pp:
        fix += f", or pipeline_schedule='1f1b' (one stage per rank: pipeline_stages={dims.pp} works)"
    return f"{what}: {message}. On {ranks} ranks: {fix}."
