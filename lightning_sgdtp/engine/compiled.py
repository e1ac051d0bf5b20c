"""The compiled engine: the LightningModule's ``training_step`` compiled whole (data, tensor and hybrid parallel).

At setup (:meth:`CompiledStep.setup`), once per trainer function: the module's :class:`PartPlan`
(:func:`~lightning_sgdtp.engine.parallelize.plan_part`) applied by
:func:`~lightning_sgdtp.engine.parallelize.parallelize` (tensor parallel, sharding, activation checkpointing when
fitting, then ``training_step`` compiled with the ``"sgdtp"`` backends made for the module as it then is: one, and
with gradient accumulation a second without collectives); bookkeeping (``self.log``, torchmetrics'
``Metric.forward``) set to run eagerly; the :class:`~lightning_sgdtp.sync.grad_sync.GradSync` that completes the
backends; the compile cache, when asked for.

Each step then calls the compiled ``training_step``: Dynamo captures it, the backend puts the bucketed gradient
all-reduces into its backward graph, and Lightning's backward call runs through :meth:`CompiledStep.backward`.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch._inductor.runtime.cache_dir_utils import cache_dir

from lightning_sgdtp.compiler import bucket_cost
from lightning_sgdtp.compiler import cache as compile_cache
from lightning_sgdtp.compiler.artifacts import CompileLock, cost_model_folder
from lightning_sgdtp.compiler.backend import CompileSettings, SGDTPCompiler
from lightning_sgdtp.compiler.bucket_cost import CostModel
from lightning_sgdtp.compiler.regions import unmark_regions
from lightning_sgdtp.engine.base import Clip, EngineInputs, StepEngine, broadcast_buffers
from lightning_sgdtp.engine.parallelize import PartPlan, parallelize, per_step_hooks, plan_part, sync_line
from lightning_sgdtp.engine.step_compile import compile_step, restore_bookkeeping, run_bookkeeping_eagerly
from lightning_sgdtp.observe.timeline import label
from lightning_sgdtp.parallel.clipping import clip_grad_norm_
from lightning_sgdtp.parallel.tensor.plan import TensorPlan
from lightning_sgdtp.sync.grad_sync import GradSync


def batch_shapes(args: tuple, kwargs: dict) -> tuple[tuple[int, ...], ...]:
    """The shapes of the tensors a step is called with, in order."""
    from torch.utils._pytree import tree_leaves

    return tuple(tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor))


def is_short_batch(shapes: tuple[tuple[int, ...], ...], first: tuple[tuple[int, ...], ...]) -> bool:
    """Whether ``shapes`` are those of ``first`` with fewer rows (the leading dimension) and nothing else changed:
    an epoch's last batch. Any other change (a longer batch, a new sequence length) is Dynamo's to handle."""
    if not shapes or len(shapes) != len(first):
        return False
    same_rest = all(len(a) == len(b) and a[1:] == b[1:] for a, b in zip(shapes, first))
    return same_rest and all(a[:1] <= b[:1] for a, b in zip(shapes, first)) and shapes != first


class CompiledStep(StepEngine):
    """Runs the LightningModule's steps compiled through the ``"sgdtp"`` backend (its whole module one part)."""

    def __init__(self, module: nn.Module, inputs: EngineInputs) -> None:
        super().__init__(module, inputs)
        self.tensor_plan: TensorPlan | None = None
        self.cache: compile_cache.CompileCache | None = None
        #: ``training_step`` compiled with each backend: [the synced one, the accumulating one (if any)].
        self._steps: list[Callable] = []
        self._compiled_for: tuple[int, bool] | None = None
        self._cache_published = False
        self._cost: CostModel | None = None
        self._step_name = "training_step"
        #: With gradient accumulation: the backend of the micro-batches that only accumulate (no collectives).
        self.accumulating_compiler: SGDTPCompiler | None = None
        #: The shapes of the first compiled batch's tensors (a shorter one runs eagerly: :meth:`_step_for`).
        self._batch_shapes: tuple[tuple[int, ...], ...] | None = None
        self._said_short = False

    # ------------------------------------------------------------------------------------------- setup
    def setup(self, fitting: bool, accumulate: int, step: str = "training_step") -> Clip | None:
        """The module's plan, applied once (what is applied already is skipped: fit, then validate). ``step``: the
        method compiled (Fabric's ``_call_impl``). Returns the clipping function by the norm over every shard (None
        for Lightning's own, with replicas alone)."""
        module, say = self.module, self.report.say
        plan = plan_part(self.config, self.dims, module, fitting=fitting, device_type=self.device.type, step=step)
        self._step_name = step
        # A new pair of backends (new objects, so Dynamo compiles afresh) for a new module or a new sync mode: graphs
        # compiled for another module or without collectives must never be reused.
        key = (id(module), accumulate > 1)
        if plan.compile is not None and self.compiler is not None and self._compiled_for == key:
            plan = dataclasses.replace(plan, compile=None)
        self.part_plan = plan
        if fitting:  # under Fabric, self.log forwards to fabric.log: kept, eagerly
            run_bookkeeping_eagerly(module, keep_logging=step != "training_step")
        done = parallelize(module, plan, self.dims, backends=lambda part: self._backends(plan, accumulate))
        self.materialize_part()  # a meta model: this rank's part, after the split and before the sync is built
        self.tensor_plan = plan.tensor_plan or self.tensor_plan
        self.shard_plan = done.shard_plan or self.shard_plan
        self.checkpointed = done.checkpointed or self.checkpointed
        for line in done.describe(plan):
            say(line)
        if done.steps:
            self._steps, self._compiled_for = done.steps, key
            self.grad_sync = GradSync(
                module.named_parameters(), self.compiler, self.dims.dp_group, self.config, say, self.preemption,
                accumulation=accumulate > 1, enabled=plan.dp_sync,
            )  # fmt: skip
            self.report.count_breaks_from_now()
        if fitting:
            replicated = self.shard_plan is not None and bool(self.shard_plan.replicated)
            measured = self.compiler is not None and self.compiler.cost is not None
            say(sync_line(self.config, self.dims, plan, accumulate, replicated, measured))
        return clip_grad_norm_ if plan.clip == "mesh" else None

    def _backends(self, plan: PartPlan, accumulate: int) -> list[SGDTPCompiler]:
        """The ``"sgdtp"`` backends for the module as parallelized (its parameters' names and DTensors): the one
        that syncs and, with accumulation, the one of the micro-batches that only accumulate. Their settings are
        fixed here: the measured cost model, the compile lock, the compile cache."""
        self.close()
        module, config = self.module, self.config
        names = {id(p): n for n, p in module.named_parameters()}
        settings = CompileSettings(in_graph_sync=plan.in_graph_sync, prove_shards=plan.prove_shards)
        lock, warm = None, False
        if plan.compile_cache is not None:  # first: Inductor's folder (and the recorded cost model) move into it
            cache = self._setup_compile_cache(Path(plan.compile_cache), accumulate == 1)
            settings = dataclasses.replace(settings, aot_cache=True)
            lock, warm = cache.lock, cache.warm
        elif plan.lock_compiles == "node":
            lock = CompileLock(Path(cache_dir()) / "sgdtp-compile.lock", config.collective_timeout / 4)
        if plan.lock_compiles == "node" and not warm:
            # Every rank compiles the same graphs: the first on a node compiles, the others wait for it (at most
            # collective_timeout/4, then compile beside it) and load side by side (compiler/artifacts.CompileLock).
            # A warm bundle holds the graphs already: every rank loads them at once, nobody waits.
            settings = dataclasses.replace(settings, compile_lock=lock)
        # Said on rank 0: whether the ranks of a node share compiles, and why not on GPUs (Inductor's key holds the
        # device index: each rank compiles its own graphs, side by side).
        line = compile_cache.node_compiles(self.device, plan.lock_compiles == "node", warm, self.dims.devices_per_node)
        if line is not None:
            self.report.say(line)
        if plan.measure_link:
            settings = dataclasses.replace(settings, cost=self._cost_model())
        self.compiler = SGDTPCompiler(config, self.dims.dp_group, names, self._on_graph, settings=settings)
        if accumulate == 1:
            return [self.compiler]
        return [self.compiler, self._accumulating_backend()]

    def _accumulating_backend(self) -> SGDTPCompiler:
        """The backend of the micro-batches that only accumulate: the synced one's, without collectives (a second
        backend object: Dynamo keeps both graphs and guards on which backend runs)."""
        assert self.compiler is not None
        sync = self.compiler
        self.accumulating_compiler = SGDTPCompiler(
            self.config, sync.group, sync.param_names, self._on_graph, graph_ids=sync.graph_ids,
            settings=dataclasses.replace(sync.settings, in_graph_sync=False),
        )  # fmt: skip
        return self.accumulating_compiler

    def add_accumulating_step(self) -> None:
        """Fabric's first ``no_backward_sync``: the step compiled for the micro-batches that only accumulate (the
        Trainer knows ``accumulate_grad_batches`` at setup, and made it there). Idempotent."""
        if self.accumulating_compiler is not None or not self._steps:
            return
        self._steps.append(compile_step(getattr(self.module, self._step_name), self._accumulating_backend()))
        if self.grad_sync is not None:
            self.grad_sync.accumulation = True

    def _cost_model(self) -> CostModel:
        """The link and the device measured once per engine (a collective over the data-parallel group)."""
        if self._cost is None:
            dims, backend = self.dims, self.inputs.process_group_backend
            key = (
                f"{backend}-{self.device.type}-{dims.world_size}r-{dims.num_nodes}n-dp{dims.dp}-{socket.gethostname()}"
            )
            with self.guard("measuring the link"):
                self._cost, recorded = bucket_cost.measure_once(dims.dp_group, self.device, cost_model_folder(), key)
            c = self._cost.describe()
            self.report.say(
                f"{'measured' if recorded is None else f'measured by an earlier job ({recorded})'}: all-reduce"
                f" {c['all_reduce_latency_us']} us + {c['all_reduce_bandwidth_GBps']} GB/s on the data-parallel"
                f" group, compute {c['compute_GFLOPs']} GFLOP/s, memory {c['memory_GBps']} GB/s (slowest rank); bucket"
                " boundaries chosen per backward graph from these"
            )
        return self._cost

    def _setup_compile_cache(self, folder: Path, in_graph: bool) -> compile_cache.CompileCache:
        """Key the bundle by what makes compiled artifacts valid; load it if it verifies."""
        layout = self.dims
        fields = compile_cache.key_fields(
            self.module,
            self.config,
            in_graph_sync=in_graph,
            device=self.device,
            world_size=layout.world_size,
            num_nodes=layout.num_nodes,
            devices_per_node=layout.devices_per_node,
            rank_grid=layout.grid,
            process_group_backend=self.inputs.process_group_backend,
            tensor_parallel_plan=self.tensor_plan.to_dict() if self.tensor_plan is not None else None,
        )
        cache = compile_cache.CompileCache(
            folder, fields, self.config.trusted_key, self.config.signing_key,
            max_bytes=int(self.config.compile_cache_max_gb * 2**30), own_folder=self.config.compile_cache == "auto",
        )  # fmt: skip
        self.report.say(cache.prepare())
        self.cache = cache
        return cache

    def _on_graph(self, graph: Any) -> None:
        if self.cache is not None:
            self.cache.record_graph(graph.to_dict())
        self.report.announce(graph)

    # ------------------------------------------------------------------------------------------- steps
    def training_step(self, args: tuple, kwargs: dict, trainer: Any, optimizers: list) -> Any:
        """The compiled ``training_step`` (``trainer``, ``optimizers``: what the pipelined engine needs)."""
        with self.guard("training_step"):
            if self.grad_sync is not None:  # the last micro-batch of an accumulation sends the earlier ones' sum
                self.grad_sync.start_of_micro_batch()
            if self.part_plan is not None and self.part_plan.broadcast_buffers:
                with label("sgdtp: broadcast buffers"):
                    broadcast_buffers([self.module], self.dims.dp_group)
            with self.implicit_replication(), per_step_hooks(self.part_plan, self.dims):
                return self._step_for(args, kwargs)(*args, **kwargs)

    def _step_for(self, args: tuple, kwargs: dict) -> Callable:
        """The compiled step, or the eager one for a short batch: a batch with fewer rows than the first (the
        epoch's last) would make Dynamo compile the whole step again, for one batch an epoch. It runs eagerly
        instead, its gradients averaged after backward by the ledger's fallback buckets, the same numbers."""
        rows = batch_shapes(args, kwargs)
        if self._batch_shapes is None:
            self._batch_shapes = rows
        elif is_short_batch(rows, self._batch_shapes):
            if not self._said_short:
                self._said_short = True
                self.report.say(
                    f"a short batch ({rows[0][0]} rows, not {self._batch_shapes[0][0]}: the epoch's last) runs eagerly,"
                    " its gradients averaged after backward (fallback buckets): no second compile for one batch"
                )
            if self.grad_sync is not None:
                self.grad_sync.eager_micro_batch()
            return getattr(self.module, self._step_name)
        return self._compiled("training_step")

    def eval_step(
        self, hook: str, args: tuple, kwargs: dict, default: Callable[[], Any], context: Callable[[], Any]
    ) -> Any:
        """Validation, test and predict run Lightning's own step (``default``), uncompiled, on the split module."""
        with self.implicit_replication():
            return default()

    def _compiled(self, hook: str) -> Callable:
        """The compiled ``training_step``: the one without collectives inside an accumulation's early micro-batches."""
        sync = self.grad_sync
        return self._steps[-1] if sync is not None and sync.accumulating else self._steps[0]

    def before_backward(self, loss: Tensor) -> None:
        if self.grad_sync is not None:
            with self.guard("backward"), label("sgdtp: before backward"):
                self.grad_sync.before_backward(loss)

    def backward(self, run_backward: Callable[[], None]) -> None:
        """Lightning's backward (``run_backward``), then what the graphs did not average."""
        with self.guard("backward"):
            with self.implicit_replication():
                run_backward()
            if self.grad_sync is not None:
                with label("sgdtp: after backward"):
                    self.grad_sync.after_backward()

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer, rank: int) -> None:
        """The coverage proof; the compile cache is published once, after the first step (every graph of the
        step is compiled then)."""
        super().after_optimizer_step(optimizer, rank)
        if self.cache is not None and rank == 0 and not self._cache_published:
            self._cache_published = True
            message = self.cache.publish()
            if message:
                self.report.say(message)

    # -------------------------------------------------------------------------------------------- plan
    def plan(self) -> dict[str, Any]:
        """The engine's part of ``strategy.plan``."""
        compilers = filter(None, (self.compiler, self.accumulating_compiler))
        graphs = sorted((g.to_dict() for c in compilers for g in c.graphs), key=lambda d: d["graph_id"])
        if self.cache is not None:  # graphs taken from the cache did not run the pass: their recorded plan
            merged = {d["graph_id"]: d for d in self.cache.recorded_graphs()}
            merged.update({d["graph_id"]: d for d in graphs})
            graphs = [merged[k] for k in sorted(merged)]
        return {
            "tensor_parallel_plan": self.tensor_plan.to_dict() if self.tensor_plan is not None else None,
            "tensor": dict(self.tensor_plan.coverage) if self.tensor_plan is not None else None,
            "sharding": self.sharding_plan(),
            "pipeline": None,
            "activation_checkpointing": list(self.checkpointed),
            "graphs": graphs,
            "part_plan": self.part_plan.to_dict() if self.part_plan is not None else None,
        }

    def close(self) -> None:
        """Forget the compiled steps and the gradient sync (a new fit compiles afresh)."""
        self._steps.clear()
        self.accumulating_compiler = None
        super().close()

    def teardown(self, barrier: Callable[[str], None]) -> None:
        super().teardown(barrier)
        restore_bookkeeping(self.module)
        unmark_regions(self.module)  # the user's classes back (a pickled model must find them)
