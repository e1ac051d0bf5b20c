"""What both engines are handed, and the interface the strategy calls them through.

An engine gets plain inputs (:class:`EngineInputs`: options, the parallel dimensions and their meshes, device, the
report, the fault guard, the preemption agreement), never the strategy; the strategy calls only the methods of
:class:`StepEngine`. An engine decides nothing about the layout itself: it asks
:func:`~lightning_sgdtp.engine.parallelize.plan_part` and applies the plan with
:func:`~lightning_sgdtp.engine.parallelize.parallelize`.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sgdtp.compiler.backend import SGDTPCompiler
from lightning_sgdtp.config import SGDTPConfig
from lightning_sgdtp.engine.optim import OptimizerUpdates
from lightning_sgdtp.engine.parallelize import PartPlan
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.observe.report import PlanReport, size
from lightning_sgdtp.observe.timeline import Timeline, label
from lightning_sgdtp.runtime.faults import FaultGuard
from lightning_sgdtp.runtime.preemption import PreemptionCoordinator
from lightning_sgdtp.sync.grad_sync import GradSync

#: Bucket size of the eager parameter/buffer broadcasts (as DDP's).
BROADCAST_BUCKET_BYTES = 250 * 2**20


def synced_buffers(modules: list[nn.Module]) -> list[Tensor]:
    """The buffers replicas must agree on, each once, as this rank's tensors: the persistent ones (state: BatchNorm
    statistics), not the non-persistent constants (rotary tables, scales: the model recomputes or never changes them,
    and they were made equal with the weights at setup). A DTensor buffer gives its local shard, so DTensor and plain
    buffers never meet in one collective."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, Tensor] = {}
    for module in modules:
        for m in module.modules():
            for name, b in m._buffers.items():
                if b is not None and name not in m._non_persistent_buffers_set:
                    seen.setdefault(id(b), b)
    with torch.no_grad():
        return [b.to_local() if isinstance(b, DTensor) else b for b in seen.values()]


def broadcast_buffers(modules: list[nn.Module], group: Any) -> None:
    """As DDP's ``broadcast_buffers``, over ``group`` (the data-parallel group: the ranks of a tensor-parallel group
    compute the same buffers): every replica takes the group's first rank's :func:`synced_buffers`."""
    from torch.distributed.utils import _sync_params_and_buffers

    local = synced_buffers(modules)
    if local:
        _sync_params_and_buffers(group, local, BROADCAST_BUCKET_BYTES, 0)  # src: the group's rank 0


#: ``clip(parameters, max_norm)``: clipping by the norm over every shard or stage (the precision plugin calls it;
#: the compiled engine's, ``parallel.clipping.clip_grad_norm_``, also takes ``norm_type`` and ``error_if_nonfinite``).
Clip = Callable[[list[Tensor], float], Any]


@dataclass(frozen=True)
class EngineInputs:
    """Everything an engine needs besides the module.

    Args:
        config: the options.
        dims: every parallel dimension, the rank grid and the meshes (built).
        device: this rank's device.
        report: where decisions are logged and graphs announced.
        guard: names the phase of each collective (faults).
        preemption: SLURM's preemption agreement, or None.
        process_group_backend: the backend's name (part of the compile cache's key).
    """

    config: SGDTPConfig
    dims: ParallelDims
    device: torch.device
    report: PlanReport
    guard: FaultGuard
    preemption: PreemptionCoordinator | None = None
    process_group_backend: str | None = None


class StepEngine(ABC):
    """Runs the LightningModule's steps one way. Subclasses: the compiled and the pipelined engine."""

    def __init__(self, module: nn.Module, inputs: EngineInputs) -> None:
        self.module, self.inputs = module, inputs
        self.config, self.dims, self.device = inputs.config, inputs.dims, inputs.device
        self.report, self.guard, self.preemption = inputs.report, inputs.guard, inputs.preemption
        self.compiler: SGDTPCompiler | None = None
        #: The plan of the whole module (the compiled engine's part, or the pipelined module before its split).
        self.part_plan: PartPlan | None = None
        self.shard_plan: Any | None = None
        self.grad_sync: GradSync | None = None
        #: Blocks wrapped for activation checkpointing (names).
        self.checkpointed: list[str] = []
        #: How the optimizers update (fused kernel, compiled step or as configured).
        self.updates = OptimizerUpdates()
        self.timeline: Timeline | None = None
        self._step_number = -1
        #: With sharding: bytes this rank holds after the first optimizer step (parameters, gradients, state).
        self.held: dict[str, int] | None = None
        #: Seconds of the first optimizer step (its compiles included: what a warm compile cache shortens).
        self.first_step_s: float | None = None
        self._first_step_began: float | None = None
        #: What compiling cost until the first optimizer step (:func:`compile_stats`).
        self.compile_stats: dict[str, Any] | None = None
        #: What materializing a meta model (and reading ``pretrained``) did on this rank; None: not done.
        self.materialized: Any | None = None
        #: The line that a model came whole to a layout that divides it was said (once).
        self._said_whole = False

    # ------------------------------------------------------------------------------------------ setup
    @abstractmethod
    def setup(self, fitting: bool, accumulate: int) -> Clip | None:
        """Plan the module's layout and apply it (any trainer function; fitting adds the backend, the gradient sync
        and their log lines). Returns the clipping function, or None for Lightning's."""

    def materialize_part(self, held: Callable[[str], bool] | None = None) -> None:
        """After the split, once: a model built on the meta device gets this rank's part (``held``: the state dict
        keys this rank holds; None: all), and ``pretrained`` is read into it by shard (:mod:`engine.materialize`)."""
        from lightning_sgdtp.engine.materialize import has_meta, materialize

        config = self.config
        if self.materialized is not None:
            return
        if config.pretrained is None and not has_meta(self.module):
            self._say_built_whole()
            return
        with self.guard("setup: materialize and load pretrained weights"):
            self.materialized = materialize(
                self.module, self.device, config.pretrained, config.init_function(), torch.initial_seed(), held
            )
        for line in self.materialized.describe():
            self.report.say(line)

    def _say_built_whole(self) -> None:
        """Once: the model came whole to a layout that divides it (every rank built all of it before the split)."""
        divides = self.dims.tp_enabled or self.dims.pp_enabled or self.config.sharding == "full"
        if not divides or self._said_whole:
            return
        self._said_whole = True
        whole = sum(p.numel() * p.element_size() for p in {id(p): p for p in self.module.parameters()}.values())
        self.report.say(
            f"setup: the model was built whole on every rank ({size(whole)} of parameters each) before the"
            " split, which then freed all but each rank's part: the setup peak is the whole model. To allocate only"
            " each rank's part, build it under trainer.init_module(empty_init=True) (fabric.init_module), or give"
            " pretrained=<a Hugging Face folder> (docs/big-models.md)"
        )

    def setup_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """After Lightning made the optimizers (fitting): their update, and the timeline if asked for."""
        self.updates.install(optimizers, self.config.optimizer_update, self.device, self.report.say)
        if self.config.profile_steps is not None and self.timeline is None:
            folder = lambda: self.report.folder or Path.cwd()
            self.timeline = Timeline(self.config.profile_steps, folder, self.report.rank, self.report.say)

    def sharding_plan(self) -> dict[str, Any] | None:
        """``plan["sharding"]``: the layout, the bytes per rank, the collectives of each graph (None: not sharded)."""
        compilers = [c for c in (self.compiler, getattr(self, "accumulating_compiler", None)) if c is not None]
        graphs = sorted((g for c in compilers for g in c.sharded_graphs.values()), key=lambda g: g["graph_id"])
        parts = [p.to_dict() for p in (self.shard_plan,) if p is not None]
        return {"parts": parts, "collectives_per_graph": graphs, "held_bytes": self.held} if parts else None

    def program(self) -> dict[str, Any]:
        """``plan["step_program"]``: which parts of a training step are compiled, and why any part is not."""
        return {
            "compiled": "forward + backward + the bucketed gradient all-reduces: one graph per region between"
            " graph breaks (the 'graphs' entry)",
            "optimizer_update": self.updates.describe(),
            "eager": "Lightning's loop and hooks between backward and the update (on_after_backward,"
            " on_before_optimizer_step, gradient clipping) and self.log / torchmetrics: user code that must see the"
            " averaged gradients, run as written",
            "timeline": self.timeline.describe() if self.timeline is not None else None,
            "first_step_s": self.first_step_s,
            "graph_cache": graph_cache_counts(),
            "compile": self.compile_stats,
        }

    def plan_token(self) -> tuple:
        """What can change the plan, cheaply: the graphs, the fallback, the sync mode, the timeline; every step of
        the first three (the pipeline and the compile cache settle there)."""
        sync, graphs = self.grad_sync, self.compiler.graphs if self.compiler is not None else []
        return (
            len(graphs),
            len(sync.fallback_params) if sync is not None else -1,
            sync.in_graph if sync is not None else None,
            self.timeline.outputs is not None if self.timeline is not None else None,
            min(self._step_number, 3),
        )

    # ------------------------------------------------------------------------------------------ steps
    def step(self, args: tuple, kwargs: dict, trainer: Any, optimizers: list) -> Any:
        """What the strategy calls for each ``training_step``: the timeline's bookkeeping, then the engine's step."""
        self.begin_step(trainer.global_step if trainer is not None else -1)
        with label("sgdtp: training_step"):
            return self.training_step(args, kwargs, trainer, optimizers)

    def begin_step(self, step: int) -> None:
        """Optimizer step ``step`` begins (at its optimizer call, or at its first ``training_step``; idempotent)."""
        self._step_number = step
        if self._first_step_began is None:
            self._first_step_began = time.perf_counter()
        if self.timeline is not None:
            self.timeline.step_begins(step)

    @abstractmethod
    def training_step(self, args: tuple, kwargs: dict, trainer: Any, optimizers: list) -> Any:
        """One ``training_step``; returns what Lightning expects from it."""

    @abstractmethod
    def eval_step(
        self, hook: str, args: tuple, kwargs: dict, default: Callable[[], Any], context: Callable[[], Any]
    ) -> Any:
        """``validation_step``/``test_step``/``predict_step``; ``default`` runs Lightning's own."""

    def before_backward(self, loss: Tensor) -> None:
        """Lightning's ``pre_backward``."""

    @abstractmethod
    def backward(self, run_backward: Callable[[], None]) -> None:
        """Lightning's backward (``run_backward``) and the gradient sync around it."""

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer, rank: int) -> None:
        """The coverage proof of the step (and what else an engine publishes after it)."""
        if self.first_step_s is None and self._first_step_began is not None:
            self.first_step_s = round(time.perf_counter() - self._first_step_began, 3)
            self.compile_stats = compile_stats(self.compiler)
            self.report.say(describe_compile(self.first_step_s, self.compile_stats))
        if self.grad_sync is not None:
            with label("sgdtp: coverage"):
                self.grad_sync.at_optimizer_step(optimizer)
        if self.shard_plan is not None and self.held is None:  # sharding: what a rank holds, counted once
            from lightning_sgdtp.parallel.sharding import held_bytes

            self.held = held_bytes(self.module, [optimizer])
            mib = {k: f"{v / 2**20:.2f} MiB" for k, v in self.held.items()}
            self.report.say(
                f"sharding: after the first step this rank holds parameters {mib['parameters']}, gradients"
                f" {mib['gradients']}, optimizer state {mib['optimizer_state']} (total {mib['total']}; counted from"
                " the tensors)"
            )
        if self.timeline is not None:
            self.timeline.step_ends(self._step_number)

    @property
    def holds_a_part(self) -> bool:
        """Whether this rank's module holds only its part (a pipeline's released stages): it stays where it is."""
        return False

    def gather_stages(self) -> None:
        """The whole model on every rank (a pipeline's released stages); nothing to do without a pipeline."""

    # ------------------------------------------------------------------------------------ checkpoints
    def local_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``state_dict`` this rank writes into a sharded checkpoint."""
        return state_dict

    def full_state_dict(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state`` completed with what other ranks hold (a collective where anything is missing)."""
        return state

    # ------------------------------------------------------------------------------------------- plan
    @abstractmethod
    def plan(self) -> dict[str, Any]:
        """The engine's part of ``strategy.plan``: tensor_parallel_plan, pipeline, activation_checkpointing, graphs."""

    def implicit_replication(self) -> contextlib.AbstractContextManager:
        """With split parameters, plain tensors met in the model (inputs, buffers, masks, rotary tables) count as
        replicated: they are the same on every rank of a tensor-parallel group (DTensor's implicit replication)."""
        if self.part_plan is None or not self.part_plan.implicit_replication:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()

    def close(self) -> None:
        """Forget the gradient sync (its hooks on the parameters)."""
        if self.grad_sync is not None:
            self.grad_sync.close()

    def teardown(self, barrier: Callable[[str], None]) -> None:
        """End of a trainer function: undo what was installed on the module and the optimizers."""
        self.updates.restore()
        if self.timeline is not None:
            self.timeline.close()


def graph_cache_counts() -> dict[str, int]:
    """This process's Inductor FX-graph cache hits and misses so far (a warm start compiles nothing)."""
    from torch._dynamo.utils import counters

    return {"hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"]}


def compile_stats(compiler: SGDTPCompiler | None) -> dict[str, Any]:
    """What compiling cost this process so far: seconds (Dynamo's frames with their forward compiles, plus the
    backward compiles AOTAutograd runs lazily), graphs captured, graphs with nested regions (regional compile), and
    Inductor's and AOTAutograd's cache hits."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", [])) + sum(
        compilation_time_metrics.get("compile_fx.<locals>.bw_compiler", [])
    )
    return {
        "seconds": round(seconds, 2),
        "graphs": counters["stats"]["unique_graphs"],
        "with_regions": compiler.regions_compiled if compiler is not None else 0,
        **graph_cache_counts(),
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
    }


def describe_compile(first_step_s: float, stats: dict[str, Any]) -> str:
    """Rank 0's line after the first optimizer step."""
    regions = f", {stats['with_regions']} with one region per distinct block" if stats["with_regions"] else ""
    return (
        f"compile: {stats['seconds']:.1f} s of the first optimizer step's {first_step_s:.1f} s; {stats['graphs']}"
        f" graph(s) captured{regions}; Inductor's cache {stats['hits']} hit(s), {stats['misses']} compiled;"
        f" AOTAutograd's cache {stats['aot_hits']} hit(s)"
    )
