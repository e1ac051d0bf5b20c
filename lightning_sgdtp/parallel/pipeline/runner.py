"""Pipeline parallelism, part two: run the split model on ``torch.distributed.pipelining``.

The split (:mod:`~lightning_sgdtp.parallel.pipeline.split`) names the block where each stage starts. Torch's own
pipeline frontend (``torch.distributed.pipelining.pipeline``: ``torch.export`` of the LightningModule's
``forward``, cut before those blocks) turns it into stage modules, so whatever code runs before the block stack
(embeddings, positions) lands on stage 0 and whatever runs after it (final norm, head) on the last stage, with
no change to the model. Stage modules keep the LightningModule's parameter names and hold its very parameters:
the optimizer the LightningModule configured steps them, and a checkpoint is keyed as without a pipeline.
A parameter used on two stages (a tied embedding and LM head) is one parameter on each rank that holds either
stage; its gradient is summed over the pipeline group after each step, so the copies stay equal.

**The LightningModule contract** (checked before training, named in the error when broken):

1. ``training_step(batch, batch_idx)`` / ``validation_step`` call ``self(...)`` once, on tensors of the batch
   whose first dimension is the batch size, and compute the loss from its output (a mean over the batch). The
   steps run on the last stage, once per micro-batch, with ``self(...)`` returning that micro-batch's pipeline
   output; ``self.log`` inside them is recorded and, after the schedule, replayed on **every** rank of the
   pipeline: numbers and tensors averaged over the micro-batches, torchmetrics objects as themselves.
2. ``forward`` is traceable by ``torch.export`` (no data-dependent Python control flow), and the block stack
   is found (or ``pipeline_split`` names where the stages start).

A micro-batch shape met for the first time (the last, shorter batch of an epoch; validation, traced in eval
mode) is traced and compiled once more; afterwards it is reused.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_sgdtp.parallel.pipeline.boundaries import make_boundaries_contiguous, send_contiguous
from lightning_sgdtp.parallel.pipeline.carry import carry_stage_inputs
from lightning_sgdtp.parallel.pipeline.contract import (
    Captured,
    LogRecorder,
    PipelineContractError,
    batch_size_of,
    capture_forward_inputs,
    replaced,
)
from lightning_sgdtp.parallel.pipeline.memory import ReleasedStages
from lightning_sgdtp.parallel.pipeline.names import rename_self_nodes
from lightning_sgdtp.parallel.pipeline.schedules import SCHEDULES, check_chunks, micro_batch_count, micro_batch_weights
from lightning_sgdtp.parallel.pipeline.split import RULE, PipelineSplit
from lightning_sgdtp.parallel.pipeline.unused import unused_parameters
from lightning_sgdtp.parallel.sharding import stored_parameter
from lightning_sgdtp.parallel.tensor.plan import local_shard
from lightning_sgdtp.runtime.faults import is_distributed_error
from lightning_sgdtp.sync.comm import all_reduce_flat


def measure_block_costs(module: nn.Module, blocks: Sequence[str], args: tuple, kwargs: dict) -> list[float]:
    """Seconds each block's forward takes on one micro-batch (the best of 3 runs, after one warm-up)."""
    import time

    times: dict[str, list[float]] = {b: [] for b in blocks}
    started: dict[str, float] = {}
    handles = []
    for name in blocks:
        block = module.get_submodule(name)
        handles.append(block.register_forward_pre_hook(lambda *_, n=name: started.__setitem__(n, time.perf_counter())))
        handles.append(
            block.register_forward_hook(lambda *_, n=name: times[n].append(time.perf_counter() - started[n]))
        )
    first = next((t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)), None)
    device = first.device if first is not None else torch.device("cpu")
    # the user's random stream (dropout) left as if nothing had run: a measured split must not change training
    fork = torch.random.fork_rng(devices=[device.index or 0] if device.type != "cpu" else [], device_type=device.type)
    try:
        with torch.no_grad(), fork:
            for _ in range(4):
                module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return [max(min(times[b][1:]), 1e-9) for b in blocks]


def split_batch(batch: Any, size: int, chunks: int) -> list[Any]:
    """``batch`` (any nesting of tuples, lists, dicts) cut into ``chunks`` micro-batches along dim 0 of every
    tensor whose first dimension is ``size``; other leaves are repeated. As the schedules split ``self(...)``'s
    inputs (``torch.tensor_split``), so micro-batch i of the batch and of the inputs are the same samples."""
    leaves, spec = tree_flatten(batch)
    parts = [
        torch.tensor_split(x, chunks) if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == size else None
        for x in leaves
    ]
    return [tree_unflatten([p[i] if p is not None else x for x, p in zip(leaves, parts)], spec) for i in range(chunks)]


# -------------------------------------------------------------------------------------------- stages
def _relink(stage_module: nn.Module, module: nn.Module) -> None:
    """Make the stage module hold the LightningModule's own parameters and buffers (the frontend copies tied
    ones), so the configured optimizer steps them and the two uses of a tied parameter are one tensor."""
    for name, param in list(stage_module.named_parameters(remove_duplicate=False)):
        original = stored_parameter(module, name)
        if param is not original:
            owner, _, leaf = name.rpartition(".")
            stage_module.get_submodule(owner)._parameters[leaf] = original
    for name, buf in list(stage_module.named_buffers(remove_duplicate=False)):
        try:
            original = module.get_buffer(name)
        except AttributeError:
            continue  # a constant the export lifted, not a buffer of the module
        if buf is not original:
            owner, _, leaf = name.rpartition(".")
            stage_module.get_submodule(owner)._buffers[leaf] = original


@contextlib.contextmanager
def _forwards_kept(module: nn.Module) -> Generator[None, None, None]:
    """torch's frontend marks split points by replacing blocks' ``forward``; put them back after tracing."""
    before = {id(m): m.__dict__.get("forward") for m in module.modules()}
    try:
        yield
    finally:
        for m in module.modules():
            if m.__dict__.get("forward") is not before.get(id(m)):
                if before.get(id(m)) is None:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = before[id(m)]
                m.__dict__.pop("_orig_forward", None)


@dataclass
class _Built:
    stages: list[Any]
    schedule: Any
    chunks: int
    ran: bool = False  # a first run that fails is the model's contract failing, named as such


@dataclass
class StepResult:
    """What one pipelined step produced, the same on every rank of the pipeline."""

    loss: float | None
    logs: list[tuple[str, str, Any, tuple, dict]]


class PipelineRunner:
    """This rank's stages of one pipeline and the schedule that runs them.

    Args:
        module: the LightningModule (every rank holds all of it; a stage runs only its part).
        split: the plan (:func:`~lightning_sgdtp.parallel.pipeline.split.plan_pipeline_split`).
        schedule: a key of :data:`SCHEDULES`.
        chunks: micro-batches per step (``pipeline_chunks``).
        group: the pipeline process group (this rank's stages talk to its neighbours in it).
        device: this rank's device.
        prepare: called on each new stage module before its first use (activation checkpointing, compile).
        tracing: the context to trace the module in (with sharding: whole parameters in place of the shards).
    """

    def __init__(
        self,
        module: nn.Module,
        split: PipelineSplit,
        schedule: str,
        chunks: int,
        group: dist.ProcessGroup,
        device: torch.device,
        prepare: Callable[[nn.Module], None] | None = None,
        measure: bool = False,
        on_split: Callable[[PipelineSplit], None] | None = None,
        tracing: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> None:
        self.module = module
        self.split = split
        self.schedule_name = schedule
        self.chunks = chunks
        self.group = group
        self.device = device
        self.prepare = prepare
        self.measure = measure
        self.on_split = on_split
        self.tracing = tracing
        #: Parameter and buffer names per stage, from the traced split (the same on every rank).
        self.names_per_stage: list[set[str]] = []
        self.pp_size = dist.get_world_size(group)
        self.pp_rank = dist.get_rank(group)
        self.num_stages = split.stages
        per_rank = self.num_stages // self.pp_size
        #: Loop placement (as torch's interleaved schedules expect): rank r holds stages r, r + pp, ...
        self.stage_ids = [self.pp_rank + k * self.pp_size for k in range(per_rank)]
        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        self.last_rank = dist.get_global_rank(group, (self.num_stages - 1) % self.pp_size)
        self._built: dict[Any, _Built] = {}
        self._micro_batches: list[Any] = []
        self._hook = "training_step"
        self._batch_idx = 0
        self._scale = 1.0
        self._losses: dict[int, float] = {}
        self._weights: list[float] | None = None
        #: A batch met whose labels hold the ignore index: micro-batch losses weighted by their counted labels.
        self.weighted = False
        self._recorder: LogRecorder | None = None
        self.local_parameters: list[nn.Parameter] = []
        #: Parameters no traced stage uses (every name of each), with the stage that holds them (the split's rule).
        self.unused: dict[str, int] = {}
        self.tied: list[nn.Parameter] = []
        self.holders: dict[int, int] = {}
        self.retraced: list[str] = []
        self.boundaries: list[str] = []  # stage inputs / outputs made contiguous (stage_boundaries)
        self.carried: list[str] = []  # values passed through stages to a later one (stage_carry)
        #: The other stages' parameters: released after the first training trace, or never held (built on meta).
        self.released: ReleasedStages | None = None
        self._released_after_trace = False

    # ------------------------------------------------------------------------------------ building
    def _split_spec(self) -> dict[str, Any]:
        from torch.distributed.pipelining import SplitPoint

        return {blocks[0]: SplitPoint.BEGINNING for blocks in self.split.blocks_per_stage[1:]}

    def _build(self, args: tuple, kwargs: dict, chunks: int) -> _Built:
        from torch.distributed import pipelining

        mb_args, mb_kwargs = _first_chunk(args, chunks), _first_chunk(kwargs, chunks)
        key = (_shapes((mb_args, mb_kwargs)), chunks, self.module.training)
        built = self._built.get(key)
        if built is not None:
            return built
        lent = self.released.lent_for_tracing() if self.released is not None else contextlib.nullcontext()
        with _forwards_kept(self.module), self.tracing(), lent:
            try:
                pipe = pipelining.pipeline(self.module, mb_args=mb_args, mb_kwargs=mb_kwargs or None,
                                           split_spec=self._split_spec())  # fmt: skip
            except Exception as exc:
                cause = str(exc.__cause__ or exc).strip().splitlines()[0][:300]
                raise PipelineContractError(
                    f"torch.export could not trace {type(self.module).__name__}.forward for the pipeline: {cause}."
                    " The forward must be one graph: no data-dependent Python control flow (if/for on tensor"
                    " values), no .item() or .tolist() (see the chained error for the line). Make that code"
                    " depend on shapes only, or train without pipeline_stages."
                ) from exc
        self.boundaries = make_boundaries_contiguous(pipe.split_gm)
        rename_self_nodes(pipe.split_gm)  # BERT's attention.self: FX's generated code would shadow `self`
        # Stage 0 gets the micro-batch, torch's multi-stage schedules send between adjacent stages only, and its
        # backward refuses a value one stage sends to several ("skip connections", 4 stages of a Llama): model inputs
        # and stage outputs go through the stages before the one that reads them.
        self.carried = carry_stage_inputs(pipe.split_gm)
        if pipe.num_stages != self.num_stages:
            raise PipelineContractError(
                f"the traced forward cut into {pipe.num_stages} stages, not {self.num_stages}: the blocks"
                f" {[b[0] for b in self.split.blocks_per_stage[1:]]} must each be called once, in order, by forward."
            )
        if not self.names_per_stage:
            modules = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
            traced = [{n for n, _ in m.named_parameters()} for m in modules]
            # parameters no traced stage calls stay on the stage of their module (the split's rule), not on none
            used = {id(stored_parameter(self.module, n)) for names in traced for n in names}
            self.unused = unused_parameters(self.module, self.split, used)
            for name, stage in self.unused.items():
                traced[stage].add(name)
            self._find_shared(traced)
            # with every other name of the module's own tensor of that name (BERT's decoder.bias is predictions.bias;
            # a stage traced from whole copies of sharded parameters holds other tensors until it is relinked)
            stored = self.module.state_dict(keep_vars=True)
            aliases: dict[int, set[str]] = {}
            for name, tensor in stored.items():
                aliases.setdefault(id(tensor), set()).add(name)
            named = [[*m.named_parameters(), *m.named_buffers()] for m in modules]
            for name, stage in self.unused.items():
                named[stage].append((name, stored_parameter(self.module, name)))
            self.names_per_stage = [set().union(*(aliases.get(id(stored.get(n, t)), {n}) for n, t in s)) for s in named]
        stages = []
        for index in self.stage_ids:
            stage = pipe.build_stage(index, self.device, self.group)
            send_contiguous(stage)
            _relink(stage.submod, self.module)
            if self.prepare is not None:
                self.prepare(stage.submod)
            stages.append(stage)
        del pipe
        if not self.local_parameters:
            unused = [stored_parameter(self.module, n) for n, s in self.unused.items() if s in self.stage_ids]
            held = [*(p for s in stages for p in s.submod.parameters()), *unused]
            self.local_parameters = list({id(p): p for p in held}.values())
            self._check_stages_held(stages)
        schedule = self._schedule(stages, chunks)
        built = _Built(stages, schedule, chunks)
        self._built[key] = built
        self.retraced.append(
            f"{'train' if key[2] else 'eval'} micro-batch {key[0]} x {chunks} ({type(schedule).__name__})"
        )
        return built

    def _check_stages_held(self, stages: list[Any]) -> None:
        """Every parameter this rank's traced stages use has storage here. A model built on the meta device gives a
        rank the matrices outside the block stack by the split's rule (registered before the stack: stage 0; after:
        the last): one the trace runs elsewhere was never allocated on this rank, and is refused by name."""
        names = {id(p): n for n, p in self.module.named_parameters(remove_duplicate=False)}
        missing = sorted(
            {names.get(id(p), n) for s in stages for n, p in s.submod.named_parameters() if local_shard(p).is_meta}
        )
        if missing:
            raise PipelineContractError(
                f"{', '.join(missing[:6])} run on stage(s) {self.stage_ids} of this rank, but the split's rule placed"
                f" them on another stage ({RULE}), and a model built on the meta device allocates a matrix outside"
                " the block stack only on that stage. Register the module in the order forward runs it (before the"
                " block stack if it runs before it), or build the model with its weights (not on meta)."
            )

    def _measure(self, args: tuple, kwargs: dict, chunks: int) -> None:
        """``pipeline_balance="measured"``: time the blocks on this micro-batch, agree (the slowest rank's times),
        split again by those costs."""
        from lightning_sgdtp.parallel.pipeline.split import plan_pipeline_split

        self.measure = False
        blocks = self.split.whole_blocks()  # measured costs balance whole blocks (block_costs is one per block)
        with self.tracing():
            measured = measure_block_costs(
                self.module, blocks, _first_chunk(args, chunks), _first_chunk(kwargs, chunks)
            )
        costs = torch.tensor(measured, dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(costs, op=dist.ReduceOp.MAX)
        # Milliseconds of forward per block (the plan's "cost"), the slowest rank's.
        self.split = plan_pipeline_split(self.module, self.num_stages, block_costs=(costs * 1e3).tolist())
        # Stages traced before (the sanity validation's) were cut by the old split: trace again.
        self._built, self.names_per_stage, self.local_parameters = {}, [], []
        if self.on_split is not None:
            self.on_split(self.split)

    def release_other_stages(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Free the parameters of the other ranks' stages (stage_memory), once, after the first training step's
        schedule (the split is final then: a measured split re-cuts at that step, reading every block)."""
        if self.pp_size > 1 and self.local_parameters and not self._released_after_trace:
            more = ReleasedStages.release(self.module, self.local_parameters, optimizers, self.device)
            self.released = more if self.released is None else self.released.merge(more)
            self._released_after_trace = True

    def share_stages(self) -> None:
        """Give every rank of the pipeline the trained tensors of every stage (each sent by the rank that holds
        it): the released parameters get storage again and the LightningModule is whole on every rank."""
        if self.pp_size == 1 or not self.names_per_stage:
            return
        if self.released is not None:
            self.released.restore()
        state = self.module.state_dict(keep_vars=True)
        sent: set[str] = set()
        for stage, names in enumerate(self.names_per_stage):
            # Sharded over dp: this rank's shards, to the pipeline group's ranks (the same data-parallel index).
            unique = {id(state[n]): state[n] for n in sorted(names - sent) if n in state}  # an alias once
            tensors = [local_shard(t.data) for t in unique.values()]
            sent |= names
            if tensors:
                src = stage % self.pp_size
                dist._broadcast_coalesced(self.group, tensors, 250 * 2**20, src)

    def stage_modules(self) -> list[nn.Module]:
        """This rank's stage modules (of the first traced shape; all shapes share the module's tensors)."""
        built = next(iter(self._built.values()), None)
        return [stage.submod for stage in built.stages] if built is not None else []

    def stage_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` without the entries only other ranks' stages hold (this rank's copy of them is stale)."""
        if not self.names_per_stage:
            return state_dict
        local = set().union(*(self.names_per_stage[i] for i in self.stage_ids))
        others = set().union(*self.names_per_stage) - local
        return {k: v for k, v in state_dict.items() if k not in others}

    def _schedule(self, stages: list[Any], chunks: int) -> Any:
        from torch.distributed import pipelining

        name = SCHEDULES[self.schedule_name]
        if check_chunks(self.schedule_name, chunks, self.pp_size, self.num_stages):
            # A short batch (the last of an epoch) that cannot fill this schedule: all forwards, then all
            # backwards (the same result; more activations alive for this one batch).
            name = "ScheduleLoopedBFS" if self.schedule_name == "interleaved_1f1b" else "ScheduleGPipe"
        cls = getattr(pipelining, name)
        # Gradients are not divided by the micro-batch count at the end (that would also divide what earlier
        # steps of gradient accumulation left): the loss is scaled instead, in `_loss`.
        target = stages if self.schedule_name == "interleaved_1f1b" else stages[0]
        return cls(target, chunks, loss_fn=self._loss, scale_grads=False)

    def _find_shared(self, names_per_stage: list[set[str]]) -> None:
        """Parameters that two stages hold (a tied embedding and head), from the traced split itself."""
        stages_of: dict[int, set[int]] = {}
        for stage, names in enumerate(names_per_stage):
            for name in names:
                stages_of.setdefault(id(stored_parameter(self.module, name)), set()).add(stage)
        shared = {pid for pid, stages in stages_of.items() if len(stages) > 1}
        self.tied = [p for p in self.module.parameters() if id(p) in shared]
        #: How many ranks of the pipeline hold each parameter (1 but for tied ones): the norm counts it once.
        self.holders = {pid: len({s % self.pp_size for s in stages}) for pid, stages in stages_of.items()}

    # ----------------------------------------------------------------------------------------- steps
    def _loss(self, output: Any, index: Tensor) -> Tensor:
        i = int(index.reshape(-1)[0])
        assert self._recorder is not None
        with (
            replaced(self.module, "forward", lambda *a, **k: output),
            replaced(self.module, "log", self._recorder.log),
        ):
            weight = self._weights[i] if self._weights is not None else 1.0
            self._recorder.weight = weight
            out = getattr(self.module, self._hook)(self._micro_batches[i], self._batch_idx)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if loss is None:
            if self._hook == "training_step":
                raise PipelineContractError(
                    "training_step returned no loss: with pipeline parallelism it must return the loss tensor (or a"
                    " dict with 'loss') computed from self(...)'s output."
                )
            return _first_tensor(output).sum() * 0.0
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise PipelineContractError(
                f"{self._hook} returned {type(loss).__name__}; the pipeline needs a scalar loss tensor (mean over the"
                " micro-batch)."
            )
        self._losses[i] = float(loss.detach()) * weight
        return loss * (self._scale * weight)

    def run(self, hook: str, batch: Any, batch_idx: int, scale: float = 1.0) -> StepResult:
        """One step of ``hook`` (``training_step``: forward and backward of every micro-batch, gradients
        accumulated into ``.grad``; ``validation_step``/``test_step``: forward only). The loss and the logs are
        broadcast from the last stage, so every rank of the pipeline returns the same result."""
        args, kwargs = capture_forward_inputs(self.module, hook, batch, batch_idx)
        size = batch_size_of(args, kwargs, hook)
        chunks = micro_batch_count(size, self.chunks)
        if self.measure and hook == "training_step":
            self._measure(args, kwargs, chunks)
        built = self._build(args, kwargs, chunks)
        self._hook, self._batch_idx, self._losses = hook, batch_idx, {}
        self._micro_batches = split_batch(batch, size, chunks) if self.has_last else []
        self._weights = micro_batch_weights(self._micro_batches) if self._micro_batches else None
        self.weighted = self.weighted or self._weights is not None

        self._scale = scale / chunks
        self._recorder = LogRecorder(self.module)
        target = torch.arange(chunks, device=self.device) if self.has_last else None
        losses: list[Tensor] = []
        step = built.schedule.step if hook == "training_step" else built.schedule.eval
        step_args = args if self.has_first else ()
        step_kwargs = kwargs if self.has_first else {}
        try:
            if hook == "training_step":
                step(*step_args, target=target, losses=losses, return_outputs=False, **step_kwargs)
            else:
                with torch.no_grad():
                    step(*step_args, target=target, losses=losses, **step_kwargs)
        except (PipelineContractError, Captured):
            raise
        except Exception as exc:
            if built.ran or is_distributed_error(exc):
                raise
            root: BaseException = exc  # torch's schedule wraps the stage's error: name the original one
            while root.__cause__ is not None:
                root = root.__cause__
            cause = f"{type(root).__name__}: {str(root).strip().splitlines()[0] if str(root).strip() else ''}"[:300]
            raise PipelineContractError(
                f"the traced stages of {type(self.module).__name__} fail at their first run on this rank (stages"
                f" {self.stage_ids}), before any weight changed: {cause}. This model is not supported with"
                " pipeline_stages yet (see docs/model-support.md); train it with parallelism='data', 'tensor' or"
                " 'hybrid'."
            ) from exc
        built.ran = True
        payload: list[Any] = [None]
        if self.has_last:
            mean = math.fsum(self._losses.values()) / len(self._losses) if self._losses else None
            payload = [(mean, self._recorder.summary(), self.weighted)]
        self._recorder = None
        self._micro_batches = []
        if self.pp_size > 1:
            dist.broadcast_object_list(payload, src=self.last_rank, group=self.group)
        loss, logs, self.weighted = payload[0]  # every rank knows whether the losses were weighted
        return StepResult(loss, logs)

    def sum_tied_gradients(self) -> None:
        """A parameter held by two stages got a part of its gradient on each: sum the parts over the pipeline
        group (ranks without it add zeros), so every copy takes the same optimizer step."""
        if not self.tied or self.pp_size == 1:
            return
        local = {id(p) for p in self.local_parameters}
        for p in self.tied:
            if id(p) in local and p.grad is None:
                p.grad = torch.zeros_like(p)
        # Sharded over dp: the pipeline group's ranks share a data-parallel index, so hold the same shard.
        parts = [local_shard(p.grad) if id(p) in local else torch.zeros_like(local_shard(p)) for p in self.tied]
        all_reduce_flat(parts, self.group)


def _first_chunk(tree: Any, chunks: int) -> Any:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(
        [torch.tensor_split(x, chunks)[0] if isinstance(x, Tensor) and x.dim() > 0 else x for x in leaves], spec
    )


def _first_tensor(tree: Any) -> Tensor:
    return next(x for x in tree_flatten(tree)[0] if isinstance(x, Tensor))


def _shapes(tree: Any) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) if isinstance(x, Tensor) else repr(x) for x in tree_flatten(tree)[0])
