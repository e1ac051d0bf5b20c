"""The compiled engine: the LightningModule's ``training_step`` compiled whole (data, tensor and hybrid parallel).

At setup (:meth:`CompiledStep.parallelize`, then :meth:`CompiledStep.setup_training`), in this order:

1. the tensor-parallel plan (automatic, or ``tp_plan``) applied over the mesh's ``tp`` dimension (any trainer
   function: validation and test run on the split module too);
2. activation checkpointing of each block, before compile (fitting only);
3. bookkeeping (``self.log``, torchmetrics' ``Metric.forward``) set to run eagerly;
4. the ``"sgdtp"`` backend over the data-parallel group and the :class:`~lightning_sgdtp.grad_sync.GradSync`
   that completes it; the compile cache, when asked for.

Each step then calls the compiled ``training_step``: Dynamo captures it, the backend puts the bucketed gradient
all-reduces into its backward graph, and Lightning's backward call runs through :meth:`CompiledStep.backward`.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._inductor.runtime.cache_dir_utils import cache_dir
from torch.distributed.utils import _sync_params_and_buffers

from lightning_sgdtp import compile_cache
from lightning_sgdtp.compiler import bucket_cost
from lightning_sgdtp.compiler.artifacts import CompileLock, cost_model_folder
from lightning_sgdtp.compiler.backend import SGDTPCompiler
from lightning_sgdtp.compiler.bucket_cost import CostModel
from lightning_sgdtp.config import SGDTPConfigError
from lightning_sgdtp.engine.base import BROADCAST_BUCKET_BYTES, EngineInputs, StepEngine
from lightning_sgdtp.engine.prepare import PartPreparation, is_tensor_parallel, prepare_part
from lightning_sgdtp.engine.step_compile import compile_step, restore_bookkeeping, run_bookkeeping_eagerly
from lightning_sgdtp.grad_sync import GradSync, missed_reduce_scatter
from lightning_sgdtp.parallel.checkpointing import block_names
from lightning_sgdtp.parallel.clipping import clip_grad_norm_
from lightning_sgdtp.parallel.sharding import ShardPlan, is_sharded, keep_embeddings_whole
from lightning_sgdtp.parallel.tensor import TensorPlan, TensorPlanError, auto_plan, resolve_plan
from lightning_sgdtp.timeline import label


class CompiledStep(StepEngine):
    """Runs the LightningModule's steps compiled through the ``"sgdtp"`` backend (mesh: ``("dp", "tp")`` or None)."""

    def __init__(self, module: nn.Module, inputs: EngineInputs) -> None:
        super().__init__(module, inputs)
        self.tensor_plan: TensorPlan | None = None
        self.shard_plan: ShardPlan | None = None
        self.cache: compile_cache.CompileCache | None = None
        self._steps: dict[str, Callable] = {}
        self._compiled_for: tuple[int, bool] | None = None
        self._cache_published = False
        self._cost: CostModel | None = None
        #: With gradient accumulation: the backend of the micro-batches that only accumulate (no collectives).
        self.accumulating_compiler: SGDTPCompiler | None = None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh["dp"].get_group() if self.mesh is not None else None

    # ------------------------------------------------------------------------------------------- setup
    def parallelize(self) -> Callable[[list[Tensor], float], None] | None:
        """Tensor parallel (once per module). Returns the clipping function by the norm over every shard (None
        without tensor parallel: Lightning's own clipping is right)."""
        if self.mesh is None:
            return None
        if self.layout.tp > 1 and not is_tensor_parallel(self.module):  # fit, then validate/test: split once
            self.tensor_plan = self._tensor_plan()
            prepare_part(self.module, PartPreparation(tensor_plan=self.tensor_plan, tp_mesh=self.mesh["tp"]))
            for line in self.tensor_plan.describe():
                self.report.say(line)
        if self.config.sharded and not is_sharded(self.module):
            # hybrid sharding (shard_size): split over ("dp_replicate", "dp_shard"); else over dp
            dp_mesh = self.layout.build_shard_mesh(self.device.type) or self.mesh["dp"]
            self.shard_plan = prepare_part(self.module, self._sharding(dp_mesh, self.mesh)).shard_plan
            for line in self.shard_plan.describe():
                self.report.say(line)
        return lambda params, max_norm: clip_grad_norm_(params, max_norm)

    def _tensor_plan(self) -> TensorPlan:
        module, config, tp = self.module, self.config, self.layout.tp
        # Sequence parallel by default where its collectives are cheap: NCCL's reduce-scatter; gloo's is an all-reduce.
        sequence = config.sequence_parallel if config.sequence_parallel is not None else self.device.type == "cuda"
        try:
            plan = resolve_plan(module, config.tp_plan, tp) if config.tp_plan else auto_plan(module, tp, sequence)
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
            why = plan.sequence_reason or "off"
            plan.sequence_reason = f"{why} (sequence_parallel=None: on with CUDA devices, off on CPU)"
        return plan

    def setup_training(self, accumulate: int) -> None:
        """Activation checkpointing, eager bookkeeping, the backend and its gradient sync, the compile cache."""
        module, config, say = self.module, self.config, self.report.say
        if config.activation_checkpointing and not self.checkpointed:
            self.checkpointed = prepare_part(module, PartPreparation(checkpoint=block_names(module))).checkpointed
            say(
                f"activation checkpointing on {len(self.checkpointed)} blocks"
                f" ({self.checkpointed[0]} .. {self.checkpointed[-1]}), applied before compile"
            )
        run_bookkeeping_eagerly(module)
        # A new compiler (a new backend object, so Dynamo compiles afresh) for a new module or a new sync mode:
        # graphs compiled for another module or without collectives must never be reused.
        key = (id(module), accumulate > 1)
        if self.compiler is None or self._compiled_for != key:
            self.close()
            self._compiled_for = key
            names = {id(p): n for n, p in module.named_parameters()}
            self.compiler = SGDTPCompiler(config, group=self.dp_group, param_names=names, on_graph=self._on_graph)
            self.grad_sync = GradSync(
                module.named_parameters(), self.compiler, self.dp_group, config, True, say, self.preemption,
                accumulation=accumulate > 1,
            )  # fmt: skip
            if self.shard_plan is not None and (not self.grad_sync.enabled or missed_reduce_scatter()):
                # The negative controls: no sharded gradient reduced; with no-dp-sync the proof is off too (training
                # must then be wrong), with no-reduce-scatter it stays on (the compile must fail, naming them).
                self.module._sgdtp_read.reduce = False
                self.compiler.prove_shards = self.grad_sync.enabled
                say("NEGATIVE CONTROL: the sharded parameters' gradients are NOT reduce-scattered")
            if accumulate > 1:
                # The micro-batches that only accumulate run graphs compiled without collectives (a second backend
                # object: Dynamo keeps both graphs and guards on which backend runs).
                self.accumulating_compiler = SGDTPCompiler(
                    config, self.dp_group, names, self._on_graph, graph_ids=self.compiler.graph_ids
                )
                self.accumulating_compiler.in_graph_sync = False
                self.accumulating_compiler.prove_shards = self.compiler.prove_shards
            self.report.count_breaks_from_now()
            # A measured plan's boundaries are part of the graphs' cache key, and its figures are recorded in the
            # node's Inductor cache folder: with the compile cache, whose bundles later jobs on other nodes reuse,
            # buckets are capped at 25 MiB instead, the same on every node.
            measured = config.measured_buckets and config.compile_cache is None
            if measured and self.layout.dp > 1 and self.grad_sync.enabled:
                self.compiler.cost = self._cost_model()
        if config.compile_cache is not None:
            self._setup_compile_cache(accumulate == 1)
        elif self.layout.dp > 1 and self.layout.tp == 1 and config.shard_size is None and self.device.type == "cpu":
            # Every rank compiles the same graphs (the same device, the same groups in every collective): turns.
            self._share_compiles()
        self._say_sync(accumulate)

    def _share_compiles(self) -> None:
        """Data parallel alone (replicated or sharded over every rank): every rank compiles the same graphs. On a
        node the first to reach a compile holds a file lock in Inductor's cache folder while it compiles; the others
        wait for it, then take the graph from the cache side by side instead of compiling it again at once. A
        follower waits at most a quarter of ``collective_timeout`` (then compiles beside the leader): the lock never
        makes a rank reach the first collective a timeout late. With tensor parallel or shard_size the graphs name
        each rank's own row of groups, and on GPUs each rank's own device: they differ, and the ranks compile side
        by side as before."""
        lock = CompileLock(Path(cache_dir()) / "sgdtp-compile.lock", self.config.collective_timeout / 4)
        for compiler in filter(None, (self.compiler, self.accumulating_compiler)):
            compiler.compile_lock = lock

    def _cost_model(self) -> CostModel:
        """The link and the device measured once per engine (a collective over the data-parallel group)."""
        if self._cost is None:
            layout, backend = self.layout, self.inputs.process_group_backend
            key = f"{backend}-{self.device.type}-{layout.world_size}r-{layout.num_nodes}n-dp{layout.dp}-{socket.gethostname()}"
            with self.guard("measuring the link"):
                self._cost, recorded = bucket_cost.measure_once(self.dp_group, self.device, cost_model_folder(), key)
            c = self._cost.describe()
            self.report.say(
                f"{'measured' if recorded is None else f'measured by an earlier job ({recorded})'}: all-reduce"
                f" {c['all_reduce_latency_us']} us + {c['all_reduce_bandwidth_GBps']} GB/s on the data-parallel"
                f" group, compute {c['compute_GFLOPs']} GFLOP/s, memory {c['memory_GBps']} GB/s (slowest rank); bucket"
                " boundaries chosen per backward graph from these"
            )
        return self._cost

    def _say_sync(self, accumulate: int) -> None:
        say, layout, config = self.report.say, self.layout, self.config
        if layout.world_size == 1:
            say("one process: nothing to communicate; the step is compiled without collectives")
        elif layout.dp == 1:
            say("data-parallel group of 1: no gradient all-reduce; tensor-parallel collectives are in the graphs")
        elif self.shard_plan is not None:
            say(
                "sharded parameters: all-gathers in the compiled forward, gradient reduce-scatters in the compiled"
                f" backward, bucketed by Inductor (<= {config.bucket_cap_bytes / 2**20:g} MiB) and scheduled to overlap"
                " compute; each graph's proof that every sharded gradient is reduced is in plan['sharding']"
                + (
                    "; the parameters not sharded keep in-graph all-reduce buckets"
                    if self.shard_plan.replicated
                    else ""
                )
            )
        elif accumulate == 1:
            if self.compiler is not None and self.compiler.cost is not None:
                sizing = "sized by the measured cost model"
            elif config.measured_buckets:
                sizing = "of <= 25 MiB (bucket_cap_mb='auto' with compile_cache: a measured plan would change the key)"
            else:
                sizing = f"of <= {config.bucket_cap_mb} MiB"
            say(
                f"gradient sync inside the compiled backward: buckets {sizing},"
                f" {'overlapped with backward compute' if config.overlap else 'no overlap scheduling'}"
                + (f", {config.grad_comm_dtype} on the wire (lossy)" if config.grad_comm_dtype else "")
            )
        else:
            say(
                f"accumulate_grad_batches={accumulate}: the first {accumulate - 1} micro-batch(es) of a step run graphs"
                " without collectives; at the last one their summed gradients are all-reduced behind its forward and"
                " backward, and its own gradients in its compiled backward (overlap kept)"
            )

    def _setup_compile_cache(self, in_graph: bool) -> None:
        """Key the bundle by what makes compiled artifacts valid; load it if it verifies; lock compiles."""
        assert self.compiler is not None and self.config.compile_cache is not None
        layout = self.layout
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
            Path(self.config.compile_cache), fields, self.config.trusted_key, self.config.signing_key
        )
        self.report.say(cache.prepare())
        self.cache = cache
        for compiler in filter(None, (self.compiler, self.accumulating_compiler)):
            compiler.compile_lock = cache.lock
            compiler.aot_cache = True

    def _on_graph(self, graph: Any) -> None:
        if self.cache is not None:
            self.cache.record_graph(graph.to_dict())
        self.report.announce(graph)

    # ------------------------------------------------------------------------------------------- steps
    def implicit_replication(self) -> contextlib.AbstractContextManager:
        """With split parameters, plain tensors met in the model (inputs, buffers, masks, rotary tables) count as
        replicated: they are the same on every rank of a tensor-parallel group (DTensor's implicit replication)."""
        if self.mesh is None:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()

    def training_step(self, args: tuple, kwargs: dict, trainer: Any, optimizers: list) -> Any:
        """The compiled ``training_step`` (``trainer``, ``optimizers``: what the pipelined engine needs)."""
        with self.guard("training_step"):
            if self.grad_sync is not None:  # the last micro-batch of an accumulation sends the earlier ones' sum
                self.grad_sync.start_of_micro_batch()
            if self.config.broadcast_buffers:
                with label("sgdtp: broadcast buffers"):
                    self._broadcast_buffers()
            with self.implicit_replication():
                return self._compiled("training_step")(*args, **kwargs)

    def eval_step(
        self, hook: str, args: tuple, kwargs: dict, default: Callable[[], Any], context: Callable[[], Any]
    ) -> Any:
        """Validation, test and predict run Lightning's own step (``default``), uncompiled, on the split module."""
        with self.implicit_replication():
            return default()

    def _compiled(self, hook: str) -> Callable:
        sync = self.grad_sync
        compiler = self.accumulating_compiler if sync is not None and sync.accumulating else None
        compiler = compiler or self.compiler
        step = self._steps.get((hook, id(compiler)))
        if step is None:
            step = self._steps[(hook, id(compiler))] = compile_step(getattr(self.module, hook), compiler)
        return step

    def _broadcast_buffers(self) -> None:
        """As DDP's ``broadcast_buffers``: every replica takes rank 0's buffers (BatchNorm statistics)."""
        buffers = list(self.module.buffers())
        if buffers and self.layout.world_size > 1:
            _sync_params_and_buffers(dist.group.WORLD, buffers, BROADCAST_BUCKET_BYTES, 0)

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
            "sharding": self.sharding_plan([self.shard_plan] if self.shard_plan is not None else []),
            "pipeline": None,
            "activation_checkpointing": list(self.checkpointed),
            "graphs": graphs,
        }

    def close(self) -> None:
        """Forget the compiled steps and the gradient sync (a new fit compiles afresh)."""
        self._steps.clear()
        self.accumulating_compiler = None
        super().close()

    def teardown(self, barrier: Callable[[str], None]) -> None:
        super().teardown(barrier)
        self._steps.clear()
        restore_bookkeeping(self.module)
