"""The one place a technique is applied: :func:`plan_part` decides, :func:`parallelize` applies.

A "part" is what one compiled program runs: the whole LightningModule (the compiled engine) or one pipeline stage
(the pipelined engine splits first, then parallelizes each stage). :func:`plan_part` is pure (it reads the options,
the :class:`~lightning_sgdtp.mesh.dims.ParallelDims` and the module's structure, and changes nothing): its
:class:`PartPlan` is plain data, logged and tested on its own. :func:`parallelize` applies a plan in one fixed
order (torchtitan's ``parallelize_llama``):

1. **tensor parallel** (DTensor, ``parallelize_module``) over ``dims.tp_mesh``: first, because every later step
   must see the split parameters;
2. **context parallel**: the place for it (``dims.cp``; not built yet);
3. **sharding** over the data-parallel ranks (``sharding="full"|"optimizer"``, :mod:`~lightning_sgdtp.parallel.sharding`)
   over ``dims.shard_mesh``: after tensor parallel (a split parameter becomes a 2-D DTensor over ``("dp", "tp")``),
   before compile, so that Dynamo traces each parameter's all-gather and its gradient's reduce-scatter into the
   graphs;
4. **activation checkpointing** of each block (non-reentrant ``checkpoint_wrapper``): after the split, before
   compile, so that Dynamo traces each checkpointed block as one higher-order op and the recomputation stays inside
   the compiled region (the in-graph buckets are planned over the whole backward);
5. **compile** through the ``"sgdtp"`` backend(s): last, with backends made for the part as it now is (its
   parameters' names and DTensors). With ``regional_compile`` each block of the block stack is first marked as a
   nested compile region (:mod:`~lightning_sgdtp.compiler.regions`; plain parameters without checkpointing only);
   the step is still one graph for the backend. A stage's ``forward`` is compiled in place; the LightningModule's
   ``training_step`` is wrapped (:func:`~lightning_sgdtp.engine.step_compile.compile_step`), once per backend.

What a plan asks for and the module already has (fit, then validate, or a second fit) is skipped: the plan is
"what remains to apply", so every trainer function can call the same two functions.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_sgdtp.compiler.artifacts import default_cache_problem
from lightning_sgdtp.compiler.regions import Regions, mark_regions
from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.engine.step_compile import compile_step
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.parallel import TECHNIQUES
from lightning_sgdtp.parallel.checkpointing import block_names, checkpoint_blocks, find_block_stack
from lightning_sgdtp.parallel.pipeline.stage_tensor import hook_stage, hooks_set_aside, recording_hooks
from lightning_sgdtp.parallel.sharding import (
    ShardPlan,
    is_sharded,
    keep_embeddings_whole,
    shard_parameters,
    share_reads,
    whole_for_tracing,
)
from lightning_sgdtp.parallel.technique import Technique
from lightning_sgdtp.parallel.tensor.heads import repeat_key_value_heads
from lightning_sgdtp.parallel.tensor.plan import (
    TensorPlan,
    TensorPlanError,
    apply_tensor_parallel,
    auto_plan,
    check_heads,
    coverage,
    resolve_plan,
)

REGIONAL_OFF = "regional compile: off (regional_compile=False): the step compiles as one graph, each layer on its own"
REGIONAL_ON_MESH = (
    "regional compile: off with tensor parallel or sharding (torch 2.13's nested compile regions have no rule for"
    " DTensor parameters): the step compiles as one graph"
)
REGIONAL_CHECKPOINTED = (
    "regional compile: off with activation_checkpointing (on torch 2.13 a checkpointed region's gradients came out"
    " wrong with the all-reduces in its backward): the step compiles as one graph"
)
REGIONAL_STAGES = (
    "regional compile: not for pipeline stages (a stage is a graph traced by torch.export, which calls no block's"
    " forward to reuse): each stage compiles its own blocks, a 1/stages share of the depth"
)
#: Set (to 1) by the test suite: only then does ``debug_skip_sync`` act (it trains wrong on purpose).
DEBUG_OPTIONS_ENV = "SGDTP_DEBUG_OPTIONS"


@dataclass(frozen=True)
class ShardSettings:
    """The sharding step: ``mode`` ``"full"`` or ``"optimizer"``; the dtypes on the wire; ``reduce``: the
    gradients' reduction in the reads (False only for the ``debug_skip_sync`` controls)."""

    mode: str
    gather_dtype: Any | None = None
    reduce_dtype: Any | None = None
    reduce: bool = True
    #: A pipeline stage: take the reads of the whole module, sharded at setup (its optimizer steps those shards).
    from_whole: bool = False


@dataclass(frozen=True)
class PartPlan:
    """What to apply to one part, and how its gradients are synced. Plain data: ``to_dict()`` is what is logged."""

    #: Tensor parallel (None: none, or applied already).
    tensor_plan: TensorPlan | None = None
    sharding: ShardSettings | None = None
    #: Blocks to wrap for activation checkpointing (those the part holds are wrapped).
    checkpoint: tuple[str, ...] = ()
    #: What is compiled: ``"training_step"`` (the LightningModule's, wrapped), ``"forward"`` (a stage, in place)
    #: or None (nothing: evaluation runs Lightning's own step).
    compile: str | None = None
    #: Gradients averaged over the data-parallel group (False: the ``debug_skip_sync="dp-sync"`` control).
    dp_sync: bool = True
    #: Compiled backwards average in the graph (else after backward: nothing to average, or the control).
    in_graph_sync: bool = True
    #: The backend proves each sharded gradient reduced in its graph.
    prove_shards: bool = True
    #: Measure the link and the device for the bucket plan (``bucket_cap_mb="auto"``; one collective).
    measure_link: bool = False
    #: Who compiles when: ``"node"`` (every rank compiles the same graphs: the first on a node compiles, the others
    #: load), or None (each rank its own graphs, side by side).
    lock_compiles: str | None = None
    #: The compile cache's folder (``config.cache_folder``; None: no cache).
    compile_cache: str | None = None
    #: Clipping by the norm over every shard (``"mesh"``) or every stage (``"pipeline"``); None: Lightning's own.
    clip: str | None = None
    #: Buffers broadcast from the first replica before each step (``broadcast_buffers`` with replicas).
    broadcast_buffers: bool = False
    #: Plain tensors met in the model count as replicated over the mesh (DTensor parameters).
    implicit_replication: bool = False
    #: What ``debug_skip_sync`` switched off (None: nothing).
    skipped: str | None = None
    #: Log lines of the decisions no step below announces.
    notes: tuple[str, ...] = ()
    #: Which part this plan is for: one of :data:`PARTS`.
    part: str = "model"
    #: A pipeline stage of a tensor-parallel module: its traced layers get the whole module's split hooks.
    tensor_from_whole: bool = False
    #: Blocks marked as nested compile regions before compile (``regional_compile``; empty: the step is one graph).
    regions: tuple[str, ...] = ()
    #: What a technique planned through the interface (``Technique.plan``), by its name: the piece its recipe line
    #: applies and its per-step hook runs with (:func:`per_step_hooks`). Empty: today's techniques plan above.
    pieces: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "part": self.part,
            "tensor_parallel": self.tensor_plan.to_dict() if self.tensor_plan is not None else None,
            "sharding": self.sharding.mode if self.sharding is not None else None,
            "activation_checkpointing": list(self.checkpoint),
            "compile": self.compile,
            "dp_sync": self.dp_sync,
            "in_graph_sync": self.in_graph_sync,
            "lock_compiles": self.lock_compiles,
            "compile_cache": self.compile_cache,
            "debug_skip_sync": self.skipped,
            "regional_compile": list(self.regions),
            **({"pieces": {name: repr(piece) for name, piece in self.pieces.items()}} if self.pieces else {}),
        }


@dataclass
class Parallelized:
    """What :func:`parallelize` did: the blocks it wrapped, the sharding it applied, the compiled callables."""

    checkpointed: list[str] = field(default_factory=list)
    #: A stage's layers that run the whole module's tensor-parallel hooks.
    tensor_hooked: list[str] = field(default_factory=list)
    shard_plan: ShardPlan | None = None
    #: ``training_step`` compiled with each backend, in the order given (the compiled engine).
    steps: list[Callable[..., Any]] = field(default_factory=list)
    #: The blocks marked as nested compile regions.
    regions: Regions | None = None
    #: The rank-0 lines of the techniques applied through the interface (:func:`apply_piece`).
    lines: list[str] = field(default_factory=list)

    def describe(self, plan: PartPlan) -> list[str]:
        """One log line per decision applied to the whole module (a stage's blocks are announced per stage)."""
        lines = list(plan.tensor_plan.describe()) if plan.tensor_plan is not None else []
        lines += self.shard_plan.describe() if self.shard_plan is not None else []
        lines += [*plan.notes, *self.lines]
        if self.checkpointed and plan.compile != "forward":
            first, last = self.checkpointed[0], self.checkpointed[-1]
            lines.append(
                f"activation checkpointing on {len(self.checkpointed)} blocks ({first} .. {last}), applied before compile"
            )
        if self.regions is not None:
            lines.append(self.regions.describe())
        return lines


# ----------------------------------------------------------------------------------------------- plan
#: The parts: the LightningModule compiled whole; a pipelined LightningModule before its split (sharded at setup:
#: its optimizer, made from it, must step the shards); one pipeline stage (traced from it at the first step).
PARTS = ("model", "pipelined model", "stage")


def plan_part(
    config: SGDTPConfig,
    dims: ParallelDims,
    module: nn.Module,
    *,
    part: str = "model",
    fitting: bool = True,
    stage_blocks: Sequence[str] = (),
    device_type: str = "cpu",
    step: str = "training_step",
) -> PartPlan:
    """What remains to apply to ``module`` (one of :data:`PARTS`) for ``config`` on ``dims``; ``stage_blocks``: the
    blocks of every stage (for a stage); ``fitting``: ``trainer.fit`` (else evaluation: no checkpointing, and the
    model's step is not compiled); ``step``: the method of the model that is compiled (the Trainer's
    ``training_step``, Fabric's ``_call_impl``: the module's call, its hooks included). Pure: reads, never changes,
    the module."""
    if part not in PARTS:
        raise ValueError(f"part={part!r}: one of {PARTS}")
    stage, whole, pipelined = part == "stage", part == "model", part != "model"
    skipped = _debug_skip_sync(config)
    dp_sync = skipped != "dp-sync"
    tensor_plan = None
    if dims.tp_enabled and not stage and not is_tensor_parallel(module):  # fit, then validate/test: split once
        tensor_plan = _tensor_plan(config, dims.tp, module, device_type, dims.world_size // dims.pp)
    sharding = None
    if config.sharded and (stage or not is_sharded(module)):
        sharding = ShardSettings(
            config.sharding, config.gather_dtype, config.wire_dtype, reduce=skipped is None, from_whole=stage
        )
    checkpoint: tuple[str, ...] = ()
    if config.activation_checkpointing and fitting and part != "pipelined model" and not _checkpointed(module):
        checkpoint = tuple(stage_blocks) if stage else tuple(block_names(module))
    # A pipeline averages in each stage's graphs when it has replicas; the compiled model always plans buckets
    # (with one process the backend finds a group of one and inserts nothing).
    in_graph = dp_sync and (dims.dp_enabled if pipelined else True)
    # Every rank compiles the same graphs when they name the same groups and device: data parallel alone,
    # replicated or sharded over every rank, on CPU. With tensor parallel or shard_size each rank's graphs name its
    # own row of groups (on GPUs its own device too), and the ranks compile side by side.
    same_graphs = not dims.tp_enabled and not dims.hybrid_shard_enabled and device_type == "cpu"
    lock = "node" if dims.dp_enabled and same_graphs else None
    cache = config.cache_folder if whole else None  # pipeline stages: not yet (config refuses a folder with them)
    compile = "forward" if stage else step if whole and fitting else None
    # Regional compile: the compiled model's blocks (a traced pipeline stage calls no block's forward: whole).
    regions: tuple[str, ...] = ()
    # Marked at every fit (teardown gives the blocks their classes back), compiled or not yet.
    # Plain parameters only, and no checkpointing: see compiler/regions.py for what torch 2.13 cannot do.
    on_mesh = dims.tp_enabled or config.sharded or is_tensor_parallel(module)
    regional = config.regional_compile and not config.activation_checkpointing and not on_mesh
    if regional and whole and fitting and find_block_stack(module) is not None:
        regions = tuple(block_names(module))
    notes: tuple[str, ...] = ()
    if whole and compile is not None and not regions:
        if not config.regional_compile:
            notes = (REGIONAL_OFF,)
        elif on_mesh or config.activation_checkpointing:
            notes = (REGIONAL_ON_MESH if on_mesh else REGIONAL_CHECKPOINTED,)
        else:
            notes = (Regions().describe(),)  # no block stack
    elif part == "pipelined model" and config.regional_compile:
        notes = (REGIONAL_STAGES,)
    if whole and config.compile_cache == "auto" and cache is None and default_cache_problem():
        notes += (f"compile cache: {default_cache_problem()}",)
    if skipped is not None and sharding is not None and not stage:
        notes += ("NEGATIVE CONTROL: the sharded parameters' gradients are NOT reduce-scattered",)
    return PartPlan(
        tensor_plan, sharding, checkpoint,
        compile=compile,
        dp_sync=dp_sync, in_graph_sync=in_graph, prove_shards=dp_sync and dims.dp_enabled,  # dp 1: nothing to reduce
        # The measured cost model is recorded in the compile cache (bundles carry it): a warm job plans the same buckets.
        measure_link=config.measured_buckets and dims.dp_enabled and dp_sync,
        lock_compiles=lock if whole else None, compile_cache=str(cache) if cache is not None else None,
        clip="pipeline" if pipelined else "mesh" if dims.on_mesh else None,
        broadcast_buffers=config.broadcast_buffers and dims.dp_enabled,  # over the data-parallel group
        implicit_replication=(whole and dims.on_mesh) or (pipelined and dims.tp_enabled),
        skipped=skipped, notes=notes, part=part, tensor_from_whole=stage and dims.tp_enabled, regions=regions,
        pieces={t.name: piece for t in TECHNIQUES if (piece := t.plan(config, dims, module, part)) is not None},
    )  # fmt: skip


def sync_line(
    config: SGDTPConfig, dims: ParallelDims, plan: PartPlan, accumulate: int, replicated: bool, measured: bool
) -> str:
    """The log line of the gradient-sync decision. ``replicated``: some parameters stayed out of the sharding;
    ``measured``: the buckets are sized by the measured cost model."""
    if plan.part != "model":  # the pipelined engine: each stage over its replicas, once per micro-batch
        if config.sharded:
            return (
                "sharded stages: parameter all-gathers in each stage's compiled forward, gradient reduce-scatters in"
                f" its compiled backward over its data-parallel group of {dims.dp}, once per micro-batch"
            )
        if dims.dp_enabled:
            return (
                f"gradient sync inside each stage's compiled backward, over its data-parallel group of {dims.dp}:"
                f" buckets of <= {config.bucket_cap_bytes / 2**20:g} MiB, once per micro-batch (overlapped with the"
                " next micro-batches' compute)"
            )
        return "one pipeline: no data-parallel gradient sync; activations travel stage to stage"
    if dims.single_process:
        return "one process: nothing to communicate; the step is compiled without collectives"
    if not dims.dp_enabled:
        return "data-parallel group of 1: no gradient all-reduce; tensor-parallel collectives are in the graphs"
    if config.sharded:
        return (
            "sharded parameters: all-gathers in the compiled forward, gradient reduce-scatters in the compiled"
            f" backward, bucketed by Inductor (<= {config.bucket_cap_bytes / 2**20:g} MiB) and scheduled to overlap"
            " compute; each graph's proof that every sharded gradient is reduced is in plan['sharding']"
            + ("; the parameters not sharded keep in-graph all-reduce buckets" if replicated else "")
        )
    if accumulate > 1:
        return (
            f"accumulate_grad_batches={accumulate}: the first {accumulate - 1} micro-batch(es) of a step run graphs"
            " without collectives; at the last one their summed gradients are all-reduced behind its forward and"
            " backward, and its own gradients in its compiled backward (overlap kept)"
        )
    if measured:
        sizing = "sized by the measured cost model"
    else:
        sizing = f"of <= {config.bucket_cap_mb} MiB"
    return (
        f"gradient sync inside the compiled backward: buckets {sizing},"
        f" {'overlapped with backward compute' if config.overlap else 'no overlap scheduling'}"
        + (f", {config.grad_comm_dtype} on the wire (lossy)" if config.grad_comm_dtype else "")
    )


def _debug_skip_sync(config: SGDTPConfig) -> str | None:
    """``debug_skip_sync``, where it may act: under the test suite (``SGDTP_DEBUG_OPTIONS=1``); refused with a
    warning elsewhere (a job that trains wrong on purpose must never run by accident)."""
    skip = config.debug_skip_sync
    if skip is None or os.environ.get(DEBUG_OPTIONS_ENV) == "1":
        return skip
    warnings.warn(
        f"debug_skip_sync={skip!r} is refused: it trains wrong on purpose (a negative control for tests). Set"
        f" {DEBUG_OPTIONS_ENV}=1 to apply it, or remove the option.",
        stacklevel=3,
    )
    return None


def _tensor_plan(config: SGDTPConfig, tp: int, module: nn.Module, device_type: str, ranks: int) -> TensorPlan:
    """The tensor plan of ``module`` over ``tp`` ranks (of the ``ranks`` one stage has), or an error that names the
    sizes that work."""
    # sequence_parallel=None is off on every device: gloo runs its reduce-scatter as a full all-reduce, and NCCL, where
    # it would pay, has never run it (docs/hardware.md). Only sequence_parallel=True turns it on.
    sequence = config.sequence_parallel is True
    try:
        plan = resolve_plan(module, config.tp_plan, tp) if config.tp_plan else auto_plan(module, tp, sequence)
        check_heads(plan, ranks)
    except TensorPlanError as exc:
        raise SGDTPConfigError(str(exc)) from exc
    if config.sequence_parallel and not plan.sequence_blocks:
        raise SGDTPConfigError(
            f"sequence_parallel=True, but for {type(module).__name__} sequence parallel is"
            f" {plan.sequence_reason}. Remove sequence_parallel=True (tensor parallel alone is still applied)."
        )
    if config.sharded:
        keep_embeddings_whole(module, plan)
    if config.sequence_parallel is None and not config.tp_plan:
        plan.sequence_reason = f"off ({_sequence_default_reason(device_type)})"
    plan.coverage = coverage(module, plan)  # what the final plan divides, counted before the split
    return plan


def _sequence_default_reason(device_type: str) -> str:
    """Why ``sequence_parallel=None`` left sequence parallel off on ``device_type`` (the plan's log line)."""
    if device_type == "cuda":
        why = "on CUDA it stays off until a GPU run of benchmarks/gpu_check.py passes (docs/hardware.md)"
    elif device_type == "cpu":
        why = "on CPU gloo runs a reduce-scatter as a full all-reduce"
    else:
        why = f"on {device_type} it has never run (docs/hardware.md)"
    return f"sequence_parallel=None: off; {why}; pass sequence_parallel=True to turn it on"


def _checkpointed(module: nn.Module) -> bool:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(isinstance(m, CheckpointWrapper) for m in module.modules())


# ---------------------------------------------------------------------------------------------- apply
def parallelize(
    part: nn.Module,
    plan: PartPlan,
    dims: ParallelDims,
    backends: Callable[[nn.Module], Sequence[Any]] | Sequence[Any] = (),
    whole: nn.Module | None = None,
) -> Parallelized:
    """Apply ``plan`` to ``part`` in place, in the one fixed order. ``backends``: the ``"sgdtp"`` compilers (or a
    function that makes them for the part as it is after steps 1-4); ``whole``: a stage's whole module (its
    sharded reads)."""
    done = Parallelized()
    # 1. tensor parallel: every later step sees the split parameters
    if plan.tensor_plan is not None:
        # first, and outside the recorded hooks: a pipeline traces it into its stages
        repeat_key_value_heads(part, plan.tensor_plan.expanded_kv, plan.tensor_plan.styles)
        with recording_hooks(part):  # a pipeline's stages, traced later, take the same hooks
            apply_tensor_parallel(part, plan.tensor_plan, dims.tp_mesh)
    elif plan.tensor_from_whole:
        assert whole is not None, "a stage's split layers run the hooks of its whole module's"
        done.tensor_hooked = hook_stage(part, whole)
    # 2. context parallel: here, once built (dims.cp_enabled): `done.lines += apply_piece(CONTEXT, part, plan, dims)`
    # 3. sharding over the data-parallel ranks (2-D with tensor parallel), before compile
    shard = plan.sharding
    if shard is not None and shard.from_whole:
        assert whole is not None, "a stage's sharding reads through its whole module's shards"
        share_reads(part, whole)
    elif shard is not None:
        done.shard_plan = shard_parameters(
            part, shard.mode, dims.shard_mesh, dims.dp_tp_mesh, shard.gather_dtype, shard.reduce_dtype, shard.reduce,
            dims.tp_mesh,
        )  # fmt: skip
    # 4. activation checkpointing of each block the part holds, before compile (each stays one graph)
    if plan.checkpoint:
        done.checkpointed = checkpoint_blocks(part, [list(plan.checkpoint)])
    # 5. compile, last, with backends made for the part as it now is; each block one region first (after
    #    checkpointing: a checkpointed block is one region, its recomputation included)
    if plan.regions:
        done.regions = mark_regions(part, plan.regions)
    if plan.compile is not None:
        made = backends(part) if callable(backends) else backends
        if plan.compile == "forward":
            (backend,) = made
            part.compile(backend=backend)
        else:
            done.steps = [compile_step(getattr(part, plan.compile), backend) for backend in made]
    return done


def apply_piece(technique: Technique, part: nn.Module, plan: PartPlan, dims: ParallelDims) -> list[str]:
    """One recipe line of a technique planned through the interface: its piece of ``plan`` applied to ``part``
    (``Technique.apply``); nothing when it planned none. Returns its rank-0 lines."""
    piece = plan.pieces.get(technique.name)
    return technique.apply(part, piece, dims) if piece is not None else []


@contextlib.contextmanager
def per_step_hooks(plan: PartPlan | None, dims: ParallelDims) -> Iterator[None]:
    """What each training step runs under: every registered technique's ``per_step`` hook for the piece it planned
    (e.g. a batch split by sequence), entered in the order applied."""
    with contextlib.ExitStack() as stack:
        for technique in TECHNIQUES if plan is not None and plan.pieces else ():
            piece = plan.pieces.get(technique.name)
            hook = technique.per_step(piece, dims) if piece is not None else None
            if hook is not None:
                stack.enter_context(hook)
        yield


@contextlib.contextmanager
def tracing(module: nn.Module) -> Iterator[None]:
    """What a pipeline's split traces ``module`` under: its parameters on a mesh (sharded, split by tensor
    parallel) whole (an all-gather per traced shape) and tensor parallel's hooks set aside, so that
    ``torch.export`` sees plain tensors. Nothing to do for a module of plain parameters."""
    with whole_for_tracing(module), hooks_set_aside(module):
        yield


def start_from_rank_0(module: nn.Module, bucket_bytes: int) -> None:
    """Every replica starts from rank 0's weights and buffers, as with DDP; a module on its mesh already (split or
    sharded by an earlier trainer function) keeps its values, and a tensor still on the meta device is left to
    :func:`~lightning_sgdtp.engine.materialize.materialize` (the same values on every rank by construction)."""
    import torch.distributed as dist
    from torch.distributed.utils import _sync_params_and_buffers

    if is_tensor_parallel(module):
        return
    tensors = list({id(t): t.detach() for t in (*module.parameters(), *module.buffers()) if not t.is_meta}.values())
    if tensors:
        _sync_params_and_buffers(dist.group.WORLD, tensors, bucket_bytes, 0)


def to_device(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)``, unless it sits on its mesh already (``module.to`` cannot move DTensor parameters); a
    tensor on the meta device stays there (it gets this rank's storage after the split)."""
    if is_tensor_parallel(module):
        return
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        module._apply(lambda t: t if t.is_meta else t.to(device))
        return
    module.to(device)


def is_tensor_parallel(module: nn.Module) -> bool:
    """Whether the module's parameters live on a mesh already (split by tensor parallel or sharding): it stays
    where it is (``module.to``/``cpu()`` cannot move DTensor parameters) and keeps its own initial values."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())
