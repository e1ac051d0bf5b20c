"""``SGDTPStrategy``: Lightning glue. Decide, then delegate.

This is the only module of the package that imports Lightning; ``_registration`` derives the twin for
projects that ``import pytorch_lightning`` from this very source (as Lightning derives its own mirror).
Loops, callbacks, logging and checkpoint files stay Lightning's; we own four things:

1. processes: one per device, a process group per the cluster environment (like ``DDPStrategy``);
2. the step: ``training_step`` runs through ``torch.compile`` with the ``SGDTPCompiler`` backend, which
   averages parameter gradients inside the compiled backward, bucketed and overlapped;
3. the ledger: what the graphs did not average (eager regions, accumulated micro-batches) is averaged
   after backward, and every optimizer step proves that every gradient was covered;
4. the plan: every decision is logged once on rank 0 and kept as data (``strategy.plan``, and
   ``sgdtp_plan.json`` next to the logs).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import sys
import sysconfig
import uuid
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.utils import _sync_module_states, _sync_params_and_buffers
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sgdtp import rendezvous, topology
from lightning_sgdtp import sharded_checkpoint as sharded
from lightning_sgdtp._fs import fsync_path, write_atomically
from lightning_sgdtp.compile_cache import CompileCache
from lightning_sgdtp.compiler.backend import PLAN_VERSION, SGDTPCompiler
from lightning_sgdtp.compiler.buckets import Bucket, GraphPlan
from lightning_sgdtp.config import NotAvailableYetError, SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.faults import Liveness, RankLostError, is_distributed_error
from lightning_sgdtp.ledger import BackwardRecord, GradLedger, walk_autograd_graph
from lightning_sgdtp.mesh import ParallelDims, PipelineDims
from lightning_sgdtp.parallel.checkpointing import (
    apply_activation_checkpointing,
    checkpoint_blocks,
    find_block_stack,
    no_block_stack_message,
)
from lightning_sgdtp.parallel.clipping import clip_grad_norm_, clip_pipeline_grad_norm_
from lightning_sgdtp.parallel.pipeline import PipelineRunner, check_pipeline_contract, replay_logs, stages_per_rank
from lightning_sgdtp.parallel.pipeline import StepResult as PipelineStepResult
from lightning_sgdtp.parallel.pipeline_split import PipelineSplit, PipelineSplitError, plan_pipeline_split
from lightning_sgdtp.parallel.tensor import (
    TensorPlan,
    TensorPlanError,
    apply_tensor_parallel,
    auto_plan,
    resolve_plan,
)
from lightning_sgdtp.preemption import Preempted, PreemptionSignal, requeue_slurm_job
from lightning_sgdtp.resume import ResumableLoader
from lightning_sgdtp.trust import verify_dir
from lightning_sgdtp.trust.manifest import record_files
from lightning_sgdtp.trust.signatures import sign_with

# A child of Lightning's logger: shown wherever Lightning's own info lines are, silenced with them.
log = logging.getLogger("lightning.pytorch.sgdtp")

PLAN_FILENAME = "sgdtp_plan.json"
# The options that change the compiled graphs (part of the compile cache's key).
PLAN_FIELDS = (
    "parallelism",
    "bucket_cap_mb",
    "grad_comm_dtype",
    "overlap",
    "activation_checkpointing",
    "tensor_parallel_size",
    "tp_plan",
    "sequence_parallel",
)
SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file, fsync, then rename: a crash mid-save leaves the previous file whole.

    It also keeps ``SGDTP-MANIFEST.json`` in each checkpoint folder (size and SHA256 of the checkpoints it wrote),
    signed with ``signing_key`` when given, and, with ``verify``, checks a checkpoint against it (and its signature
    against ``trusted_key``) before ``torch.load`` unpickles anything.
    """

    def __init__(self, verify: bool = True, trusted_key: str | None = None, signing_key: str | None = None) -> None:
        super().__init__()
        self.verify, self.trusted_key, self.signing_key = verify, trusted_key, signing_key

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        target = Path(path)
        if "://" in str(path):  # remote filesystems: fsspec's own semantics
            return super().save_checkpoint(checkpoint, path, storage_options)
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, lambda f: torch.save(checkpoint, f))
        # What saves killed mid-write left behind (never a file Lightning would load: the name does not match).
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
        fsync_path(target.parent)
        self._record(target)
        return None

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        super().remove_checkpoint(path)
        if "://" not in str(path):
            self._record(Path(path))

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if self.verify and "://" not in str(path):
            target = Path(path)
            verify_dir(target.parent, trusted=Path(self.trusted_key) if self.trusted_key else None, only=[target.name])
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def _record(self, target: Path) -> None:
        """Update (and sign) the folder's manifest for the file just written or removed."""
        sign_with(target.parent, self.signing_key, record_files(target.parent, [target.name]))


class SGDTPStrategy(ParallelStrategy):
    """Data-parallel training with the step compiled and gradient communication inside the compiled backward.

    ``Trainer(strategy="sgdtp")`` or ``Trainer(strategy=SGDTPStrategy(bucket_cap_mb=25, ...))``. Every option
    is a field of :class:`~lightning_sgdtp.config.SGDTPConfig` (see ``docs/options.md``); the design documents'
    ``options={"distributed": {"plugin": "sgdtp", "strategy": "data"}}`` is accepted too, and explicit
    keyword arguments win over it.
    """

    strategy_name = "sgdtp"

    def __init__(
        self,
        parallelism: str | None = None,
        bucket_cap_mb: float | None = None,
        grad_comm_dtype: str | None = None,
        overlap: bool | None = None,
        activation_checkpointing: bool | None = None,
        broadcast_buffers: bool | None = None,
        collective_timeout: float | None = None,
        rendezvous_timeout: float | None = None,
        verify_artifacts: bool | None = None,
        trusted_key: str | None = None,
        signing_key: str | None = None,
        compile_cache: str | None = None,
        pipeline_chunks: int | None = None,
        pipeline_stages: int | None = None,
        pipeline_schedule: str | None = None,
        pipeline_split: list[str] | None = None,
        pipeline_balance: str | None = None,
        pipeline_stages_per_rank: int | None = None,
        tensor_parallel_size: Any | None = None,
        tp_plan: dict[str, str] | None = None,
        sequence_parallel: bool | None = None,
        options: dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        given = {
            "parallelism": parallelism,
            "bucket_cap_mb": bucket_cap_mb,
            "grad_comm_dtype": grad_comm_dtype,
            "overlap": overlap,
            "activation_checkpointing": activation_checkpointing,
            "broadcast_buffers": broadcast_buffers,
            "collective_timeout": collective_timeout,
            "rendezvous_timeout": rendezvous_timeout,
            "verify_artifacts": verify_artifacts,
            "trusted_key": trusted_key,
            "signing_key": signing_key,
            "compile_cache": compile_cache,
            "pipeline_chunks": pipeline_chunks,
            "pipeline_stages": pipeline_stages,
            "pipeline_schedule": pipeline_schedule,
            "pipeline_split": pipeline_split,
            "pipeline_balance": pipeline_balance,
            "pipeline_stages_per_rank": pipeline_stages_per_rank,
            "tensor_parallel_size": tensor_parallel_size,
            "tp_plan": tp_plan,
            "sequence_parallel": sequence_parallel,
        }
        # Validate first: a bad option fails here, in the launching process, before anything is spawned.
        self._config = SGDTPConfig.from_options(options, **{k: v for k, v in given.items() if v is not None})
        if process_group_backend is not None and process_group_backend not in dist.Backend.backend_list:
            raise SGDTPConfigError(
                f"process_group_backend={process_group_backend!r} is not a torch.distributed backend. Use one of"
                f" {dist.Backend.backend_list}, or leave it None (nccl on GPUs, gloo on CPU)."
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io
            or AtomicCheckpointIO(self._config.verify_artifacts, self._config.trusted_key, self._config.signing_key),
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._compiler: SGDTPCompiler | None = None
        self._ledger: GradLedger | None = None
        self._compiled_steps: dict[str, Callable] = {}
        self._sync_enabled = True
        self._record: BackwardRecord | None = None
        self._checkpointed_blocks: list[str] | None = None
        self._graph_breaks: dict[str, int] = {}
        self._breaks_at_setup: dict[str, int] = {}
        self._written_plan: str | None = None
        self._plan_dir: Path | None = None
        self._fallback_params: list[str] = []
        self._compiled_for: tuple[int, bool] | None = None
        self._liveness: Liveness | None = None
        self._compile_cache: CompileCache | None = None
        self._cache_published = False
        self._announced: set[int] = set()
        self._preemption: PreemptionSignal | None = None
        self._stop_agreed = False
        # The mesh (tensor / hybrid): sizes, the rank grid, this rank's place in it, the plan applied.
        self._dims: ParallelDims | None = None
        self._layout: list[list[int]] | None = None
        self._mesh: Any | None = None
        self._dp_rank = 0
        self._tp_plan: TensorPlan | None = None
        # A checkpoint's model and optimizer states were loaded by the strategy itself (sharded or resharded).
        self._states_loaded = False
        # Pipeline parallel: sizes (pp x dp), the split (plain data), this rank's stages and schedule.
        self._pipe_dims: PipelineDims | None = None
        self._pipe_split: PipelineSplit | None = None
        self._pipeline: PipelineRunner | None = None
        self._zero_grad: Callable[..., Any] | None = None

    # ----------------------------------------------------------------------------------------- properties
    @property
    def config(self) -> SGDTPConfig:
        return self._config

    @property
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_lm")

    @_lightning_module.setter
    def _lightning_module(self, module: pl.LightningModule | None) -> None:
        # Lightning assigns the module here before it spawns any process: the earliest place to refuse a
        # compiled module with our own message (Lightning's generic one comes right after).
        if module is not None:
            _check_not_compiled(module)
            wants_ac = self._config.activation_checkpointing and self._checkpointed_blocks is None
            if wants_ac and find_block_stack(module) is None:
                raise SGDTPConfigError(no_block_stack_message(module))
        self.__dict__["_lm"] = module

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def dp_size(self) -> int:
        if self._pipe_dims is not None:
            return self._pipe_dims.dp
        return self._dims.dp if self._dims is not None else self.num_nodes * self.num_processes

    @property
    def device_mesh(self) -> Any | None:
        """The 2-D ``DeviceMesh``: (``"dp"``, ``"tp"``) for ``parallelism="tensor"``/``"hybrid"``, (``"pp"``,
        ``"dp"``) with pipeline parallelism; None for data parallel alone."""
        return self._mesh

    @property
    def _dp_group(self) -> dist.ProcessGroup | None:
        return self._mesh["dp"].get_group() if self._mesh is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Sized by the data-parallel group: the ranks of one tensor-parallel group read the same batches.
        rank = self._dp_rank if self._mesh is not None else self.global_rank
        return {"num_replicas": self.dp_size, "rank": rank}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Load into the model as it is laid out for training (split across ranks, optimizers created).
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self._states_loaded

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def ledger(self) -> GradLedger | None:
        return self._ledger

    @property
    def plan(self) -> dict[str, Any]:
        """Everything the plugin decided, as plain data (also written to ``sgdtp_plan.json`` next to the logs)."""
        compiler, ledger = self._compiler, self._ledger
        graphs = [p.to_dict() for p in compiler.plans] if compiler else []
        if self._compile_cache is not None:  # graphs taken from the cache did not run the pass: their recorded plan
            merged = {d["graph_id"]: d for d in self._compile_cache.recorded_plans()}
            merged.update({d["graph_id"]: d for d in graphs})
            graphs = [merged[k] for k in sorted(merged)]
        in_graph = ledger.graph_bytes_last_step if ledger else 0
        fallback = ledger.fallback_bytes_last_step if ledger else 0
        return {
            "parallelism": self._config.parallelism,
            "world_size": self.world_size,
            "dp_size": self.dp_size,
            "tp_size": self._dims.tp if self._dims is not None else 1,
            "mesh_layout": self._layout,
            "tensor_parallel_plan": self._tp_plan.to_dict() if self._tp_plan is not None else None,
            "pipeline": self._pipeline_plan(),
            "num_nodes": self.num_nodes,
            "process_group_backend": self._process_group_backend,
            "config": self._config.to_dict(),
            "grad_sync": (
                "none (one process)"
                if self.world_size == 1
                else "in-graph per micro-batch, each stage over its data-parallel group"
                if self._pipe_dims is not None
                else "in-graph"
                if compiler is None or compiler.in_graph_sync
                else "after-last-micro-batch (gradient accumulation)"
            ),
            "activation_checkpointing": self._checkpointed_blocks or [],
            "graphs": graphs,
            "graph_breaks": dict(self._graph_breaks),
            "fallback_params": list(self._fallback_params),
            "last_step_sync": dict(ledger.last_step) if ledger else {},
            "bytes_per_step": {"in_graph": in_graph, "fallback": fallback, "total": in_graph + fallback},
        }

    def _pipeline_plan(self) -> dict[str, Any] | None:
        if self._pipe_dims is None:
            return None
        runner = self._pipeline
        return {
            "pp_size": self._pipe_dims.pp,
            "dp_size": self._pipe_dims.dp,
            "schedule": self._config.pipeline_schedule,
            "chunks": self._config.chunks_for(self._pipe_dims.pp),
            "split": self._pipe_split.to_dict() if self._pipe_split is not None else None,
            "stages_of_rank_0": runner.stage_ids if runner is not None and self.global_rank == 0 else None,
            "traced": list(runner.retraced) if runner is not None else [],
        }

    # ---------------------------------------------------------------------------------------- processes
    @override
    def _configure_launcher(self) -> None:
        self._check_precision()
        if self._layer_sync is not None:
            raise NotAvailableYetError(
                "Trainer(sync_batchnorm=True) is not available yet with the sgdtp strategy (SyncBatchNorm's"
                " forward collectives are not in the compiled step). Remove sync_batchnorm=True (buffers are still"
                " broadcast from rank 0 each step, as broadcast_buffers=True), or use strategy='ddp'."
            )
        assert self.cluster_environment is not None
        if self._config.pipelined:  # sizes that cannot work fail here, before any process starts
            dims = PipelineDims.resolve(
                self._config.pipeline_stages, self.num_nodes * self.num_processes, self.num_nodes
            )
            self._config._check_pipeline_sizes(dims.pp)
        if self._config.parallelism != "data":
            ParallelDims.resolve(
                self._config.parallelism,
                self._config.tensor_parallel_size,
                self.num_nodes * self.num_processes,
                self.num_processes,
                None,
            )
        # Always, as DDPStrategy: with processes started by SLURM or torchrun the launcher starts nothing, but it
        # checks devices / num_nodes against the launcher's tasks before anything else happens.
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _check_precision(self) -> None:
        plugin = self.precision_plugin
        if type(plugin) not in (Precision, MixedPrecision, HalfPrecision):
            raise SGDTPConfigError(
                f"precision plugin {type(plugin).__name__} is not supported by the sgdtp strategy. Use"
                f" Trainer(precision=...) with one of {', '.join(SUPPORTED_PRECISION)}."
            )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        env = self.cluster_environment
        assert env is not None
        expected = self.num_nodes * self.num_processes
        if env.world_size() != expected:
            raise SGDTPConfigError(
                f"the launcher ({type(env).__name__}) started {env.world_size()} processes, but Trainer(devices="
                f"{self.num_processes}, num_nodes={self.num_nodes}) asks for {expected}. Make devices x num_nodes"
                " equal the launcher's total tasks (SLURM: --nodes x --ntasks-per-node; torchrun: --nnodes x"
                " --nproc-per-node)."
            )
        requeue = isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None
        if requeue and self._preemption is None:
            # Installed before Lightning's signal connector runs: it sees a handler and adds none of its own.
            self._preemption = PreemptionSignal(env.requeue_signal)
            self._preemption.install()
        if not dist.is_initialized():
            log.info(
                f"Initializing distributed: GLOBAL_RANK: {self.global_rank}, MEMBER: {self.global_rank + 1}/{expected}"
            )
            rendezvous.init_process_group(
                env.main_address,
                env.main_port,
                self.global_rank,
                expected,
                self._process_group_backend,
                collective_timeout=self._config.collective_timeout,
                rendezvous_timeout=self._config.rendezvous_timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,
            )
        if expected > 1 and self._liveness is None:
            # One key per job run: heartbeats of an earlier attempt (torchrun restarts reuse the store) never count.
            key = [uuid.uuid4().hex]
            dist.broadcast_object_list(key, src=0)
            self._liveness = Liveness(
                env.main_address, env.main_port, self.global_rank, expected, key[0], self._config.collective_timeout
            )
            self._liveness.start()
        if self._config.pipelined and self._mesh is None:
            self._setup_pipeline_mesh()
        elif self._config.parallelism != "data" and self._mesh is None:
            self._setup_mesh()

    def _setup_pipeline_mesh(self) -> None:
        dims = PipelineDims.resolve(self._config.pipeline_stages, self.world_size, self.num_nodes)
        self._mesh = dims.build_mesh(self.root_device.type)
        self._pipe_dims, self._layout = dims, dims.layout()
        self._dp_rank = dims.coordinates(self.global_rank)[0]
        per_rank = stages_per_rank(self._config.pipeline_schedule, self._config.pipeline_stages_per_rank)
        self._say(
            f"pipeline: {dims.dp} pipeline(s) of {dims.pp} ranks ({dims.pp * per_rank} stages,"
            f" {self._config.pipeline_schedule}, {self._config.chunks_for(dims.pp)} micro-batches per step); stage"
            f" groups (rows, data parallel inside each) {self._layout}"
            + ("; pipelines run across nodes" if self.num_nodes > 1 and dims.pp == self.num_nodes else "")
        )

    def _setup_mesh(self) -> None:
        """Sizes from the topology, tensor-parallel groups on the fastest links, the 2-D ``DeviceMesh``."""
        device_type = self.root_device.type
        topo = topology.detect(device_type, self.num_processes, self.num_nodes)
        dims = ParallelDims.resolve(
            self._config.parallelism, self._config.tensor_parallel_size, self.world_size, self.num_processes, topo
        )
        layout = dims.layout(topo)
        self._mesh = dims.build_mesh(device_type, layout)
        self._dims, self._layout = dims, layout
        self._dp_rank = dims.coordinates(layout, self.global_rank)[0]
        self._say(f"topology: {topo.describe()}")
        self._say(
            f"mesh dp={dims.dp} x tp={dims.tp}: tensor-parallel groups {layout} (rows, each inside one node);"
            f" data parallel across rows"
            + (
                " (tensor_parallel_size='auto': one fast-link island)"
                if self._config.tensor_parallel_size in (None, "auto")
                else ""
            )
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # -------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # Every replica starts from rank 0's weights and buffers, as with DDP.
        if not _is_split(self.model):
            _sync_module_states(self.model, _group.WORLD, 250 * 2**20, src=0, params_and_buffers_to_ignore=set())
        if self._pipe_dims is not None:
            self._setup_pipeline()
        elif self._mesh is not None:
            self._apply_tensor_parallel()
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_training(trainer)
            self.setup_optimizers(trainer)
            if self._preemption is not None and not any(
                isinstance(c, _PreemptionCheckpoint) for c in trainer.callbacks
            ):
                trainer.callbacks.append(_PreemptionCheckpoint(self))
                self._say(
                    f"SLURM: on signal {self._preemption.signum} the ranks agree on a step, save hpc_ckpt_N.ckpt"
                    f" in {trainer.default_root_dir} at its end, requeue the job and stop"
                )
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _apply_tensor_parallel(self) -> None:
        """Plan (automatic, or ``tp_plan``), split the module over the ``tp`` mesh, clip by the global norm."""
        module = self.lightning_module
        assert module is not None and self._dims is not None and self._mesh is not None
        if _is_split(module):  # fit, then validate/test on the same module: split once
            return
        tp, config = self._dims.tp, self._config
        # Sequence parallel by default where its collectives are cheap: NCCL's reduce-scatter; gloo's is an all-reduce.
        sequence = config.sequence_parallel if config.sequence_parallel is not None else self.root_device.type == "cuda"
        try:
            plan = resolve_plan(module, config.tp_plan, tp) if config.tp_plan else auto_plan(module, tp, sequence)
        except TensorPlanError as exc:
            raise SGDTPConfigError(str(exc)) from exc
        if config.sequence_parallel and not plan.sequence_blocks:
            raise SGDTPConfigError(
                f"sequence_parallel=True, but for {type(module).__name__} sequence parallel is"
                f" {plan.sequence_reason}. Remove sequence_parallel=True (tensor parallel alone is still applied)."
            )
        if config.sequence_parallel is None and not config.tp_plan:
            why = plan.sequence_reason or "off"
            plan.sequence_reason = f"{why} (sequence_parallel=None: on with CUDA devices, off on CPU)"
        apply_tensor_parallel(module, plan, self._mesh["tp"])
        self._tp_plan = plan
        for line in plan.describe():
            self._say(line)
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            clip_grad_norm_(plugin.main_params(optimizer), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # the norm over every shard, not this rank's

    def _setup_training(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        # `trainer.log_dir` broadcasts from rank 0: ask on every rank, here, never from rank 0 alone.
        self._plan_dir = Path(trainer.log_dir or trainer.default_root_dir)
        self._say(
            f"parallelism={self._config.parallelism}: {self.world_size} ranks ({self.num_nodes} node(s) x"
            f" {self.num_processes}), data-parallel group of {self.dp_size}, backend={self._process_group_backend},"
            f" processes from {type(self.cluster_environment).__name__}"
        )
        if self._pipeline is not None:
            self._say_pipeline_sync()
            return
        if self._config.activation_checkpointing and self._checkpointed_blocks is None:
            self._checkpointed_blocks = apply_activation_checkpointing(module)
            self._say(
                f"activation checkpointing on {len(self._checkpointed_blocks)} blocks"
                f" ({self._checkpointed_blocks[0]} .. {self._checkpointed_blocks[-1]}), applied before compile"
            )
        # Logging and metrics are eager bookkeeping. Dynamo would trace into `self.log` (one recompile per
        # metric name) and into torchmetrics' update (a recompile per step: the update counter is guarded
        # on). Running them eagerly costs one clean graph break each and keeps the graphs static.
        for owner, hook in _bookkeeping_hooks(module):
            setattr(owner, hook, torch.compiler.disable(getattr(owner, hook)))
        accumulate = trainer.accumulate_grad_batches
        in_graph = accumulate == 1
        # A new compiler (a new backend object, so Dynamo compiles afresh) for a new module or a new sync mode:
        # graphs compiled for another module or without collectives must never be reused.
        key = (id(module), in_graph)
        if self._compiler is None or self._compiled_for != key:
            self._release_ledger()
            self._compiled_steps.clear()
            self._compiled_for = key
            names = {id(p): n for n, p in module.named_parameters()}
            group = self._dp_group
            self._compiler = SGDTPCompiler(self._config, group=group, param_names=names, on_plan=self._on_graph_plan)
            self._compiler.in_graph_sync = in_graph
            wire = getattr(torch, self._config.comm_dtype_name) if self._config.comm_dtype_name else None
            self._ledger = GradLedger(module.named_parameters(), group, self._config.bucket_cap_bytes, wire)
            self._breaks_at_setup = _graph_break_counts()
        if self._config.compile_cache is not None:
            self._setup_compile_cache(module, in_graph)
        if self.world_size == 1:
            self._say("one process: nothing to communicate; the step is compiled without collectives")
        elif self.dp_size == 1:
            self._say("data-parallel group of 1: no gradient all-reduce; tensor-parallel collectives are in the graphs")
        elif in_graph:
            self._say(
                f"gradient sync inside the compiled backward: buckets of <= {self._config.bucket_cap_mb} MiB,"
                f" {'overlapped with backward compute' if self._config.overlap else 'no overlap scheduling'}"
                + (f", {self._config.grad_comm_dtype} on the wire (lossy)" if self._config.grad_comm_dtype else "")
            )
        else:
            self._say(
                f"accumulate_grad_batches={accumulate}: graphs compiled without collectives; one bucketed sync"
                " after the last micro-batch of each optimizer step (none on the others)"
            )

    # ----------------------------------------------------------------------------------------- pipeline
    def _setup_pipeline(self) -> None:
        """Plan the split (plain data, logged), make the stage compiler and this rank's pipeline runner."""
        module = self.lightning_module
        assert module is not None and self._pipe_dims is not None and self._mesh is not None
        # The schedule runs backward inside training_step; Lightning zeroes gradients after training_step and
        # before backward. Its zero_grad is therefore deferred to us: run before the schedule, at the first
        # micro-step of each accumulation window, as Lightning would have.
        if "optimizer_zero_grad" not in module.__dict__:
            self._zero_grad = module.optimizer_zero_grad
            module.optimizer_zero_grad = _zero_grad_done_by_strategy
        if self._pipeline is not None and self._pipeline.module is module:
            return
        config, dims = self._config, self._pipe_dims
        check_pipeline_contract(module)
        stages = dims.pp * stages_per_rank(config.pipeline_schedule, config.pipeline_stages_per_rank)
        try:
            split = plan_pipeline_split(module, stages, split_points=config.pipeline_split)
        except PipelineSplitError as exc:
            raise SGDTPConfigError(str(exc)) from exc
        dp_group = self._mesh["dp"].get_group()
        names = {id(p): n for n, p in module.named_parameters()}
        self._compiler = SGDTPCompiler(config, group=dp_group, param_names=names, on_plan=self._on_graph_plan)
        self._compiler.in_graph_sync = dims.dp > 1
        self._compiled_for = (id(module), True)
        self._breaks_at_setup = _graph_break_counts()
        self._pipeline = PipelineRunner(
            module,
            split,
            config.pipeline_schedule,
            config.chunks_for(dims.pp),
            self._mesh["pp"].get_group(),
            self.root_device,
            prepare=self._prepare_stage,
            measure=config.pipeline_balance == "measured",
            on_split=self._on_split,
        )
        self._on_split(split)
        _leave_cleanly_at_exit()
        runner, plugin = self._pipeline, self.precision_plugin

        def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
            clip_pipeline_grad_norm_(plugin.main_params(optimizer), clip_val, runner.group, runner.holders)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # the norm over every stage, not this rank's

    def _on_split(self, split: PipelineSplit) -> None:
        self._pipe_split = split
        for line in split.describe():
            self._say(line)
        if split.balance == "cost":
            self._say("  pipeline_balance='measured': a block's cost is its forward time in ms (the slowest rank's)")

    def _prepare_stage(self, stage: torch.nn.Module) -> None:
        """Activation checkpointing per block inside the stage, then compile the stage through the backend."""
        assert self._pipe_split is not None and self._compiler is not None
        if self._config.activation_checkpointing:
            blocks = checkpoint_blocks(stage, self._pipe_split.blocks_per_stage)
            known = self._checkpointed_blocks or []
            if blocks and blocks[0] not in known:  # once per stage, not per traced shape
                self._checkpointed_blocks = sorted({*known, *blocks})
                self._say(
                    f"activation checkpointing on {len(blocks)} block(s) of a stage ({blocks[0]} .. {blocks[-1]})"
                )
        stage.compile(backend=self._compiler)

    def _say_pipeline_sync(self) -> None:
        assert self._pipe_dims is not None
        if self._pipe_dims.dp > 1:
            self._say(
                f"gradient sync inside each stage's compiled backward, over its data-parallel group of"
                f" {self._pipe_dims.dp}: buckets of <= {self._config.bucket_cap_mb} MiB, once per micro-batch"
                " (overlapped with the next micro-batches' compute)"
            )
        else:
            self._say("one pipeline: no data-parallel gradient sync; activations travel stage to stage")

    def _pipeline_step(self, hook: str, args: tuple, kwargs: dict) -> PipelineStepResult:
        assert self._pipeline is not None and self.lightning_module is not None
        batch = args[0] if args else kwargs.get("batch")
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        trainer = self.lightning_module.trainer
        scale = 1.0 / trainer.accumulate_grad_batches if hook == "training_step" else 1.0
        seen = len(self._pipeline.retraced)
        with self._guard(hook):
            result = self._pipeline.run(hook, batch, batch_idx, scale=scale)
        for traced in self._pipeline.retraced[seen:]:
            self._say(f"pipeline stages traced and compiled for {traced}")
        replay_logs(self.lightning_module, result.logs, self.root_device)
        return result

    @override
    def on_train_end(self) -> None:
        if self._pipeline is not None:
            with self._guard("share stages"):  # after fit every rank holds the whole trained model, as with DDP
                self._pipeline.share_stages()

    def _broadcast_stage_buffers(self) -> None:
        """As DDP's broadcast_buffers, per stage: the first pipeline's buffers go to the stage's replicas."""
        assert self._pipeline is not None and self._mesh is not None
        buffers = [b for stage in self._pipeline.stage_modules() for b in stage.buffers()]
        if buffers:
            group = self._mesh["dp"].get_group()
            with self._guard("broadcast_buffers"):
                _sync_params_and_buffers(group, buffers, 250 * 2**20, 0)  # src: rank 0 of the group

    def _pipeline_after_backward(self) -> None:
        """At the last micro-step of an optimizer step: tied parameters summed over the pipeline, then what the
        compiled backward did not average (a stage run eagerly) averaged over the data-parallel group."""
        runner, compiler = self._pipeline, self._compiler
        assert runner is not None and compiler is not None and self._mesh is not None
        if not self._sync_enabled:
            return
        with self._guard("pipeline gradient sync"):
            if self.dp_size > 1:
                rest = [
                    p for p in runner.local_parameters if p.grad is not None and id(p) not in compiler.graph_param_ids
                ]
                if rest:
                    flat = torch.cat([p.grad.reshape(-1) for p in rest]) / self.dp_size
                    dist.all_reduce(flat, group=self._mesh["dp"].get_group())
                    offset = 0
                    for p in rest:
                        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                        offset += p.numel()
            runner.sum_tied_gradients()
            if self._preemption is not None:  # SLURM's signal: every rank learns of it at the same step
                flag = torch.tensor([1.0 if self._preemption.requested else 0.0])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                self._stop_agreed = self._stop_agreed or bool(flag.item())

    def _setup_compile_cache(self, module: pl.LightningModule, in_graph: bool) -> None:
        """Key the bundle by what makes compiled artifacts valid; load it if it verifies; lock compiles."""
        assert self._compiler is not None and self._config.compile_cache is not None
        cls = type(module)
        try:
            source = Path(inspect.getsourcefile(cls) or "").read_bytes()
        except (OSError, TypeError):
            source = b""
        device = self.root_device
        fields = {
            "sgdtp": PLAN_VERSION,
            "torch": torch.__version__,
            "python": sys.implementation.cache_tag,
            "platform": sysconfig.get_platform(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "layout": {
                "world_size": self.world_size,
                "num_nodes": self.num_nodes,
                "devices": self.num_processes,
                "mesh": self._layout,
            },
            "backend": self._process_group_backend,
            "groups": [dist.group.WORLD.group_name] if _distributed_is_initialized() else [],
            "tensor_parallel_plan": self._tp_plan.to_dict() if self._tp_plan is not None else None,
            "plan": {k: self._config.to_dict()[k] for k in PLAN_FIELDS} | {"in_graph_sync": in_graph},
            "module": f"{cls.__module__}.{cls.__qualname__}",
            "module_source_sha256": hashlib.sha256(source).hexdigest(),
            # The same code with other sizes compiles other graphs: a bundle is for these parameters only.
            "parameters_sha256": hashlib.sha256(
                json.dumps([(n, list(p.shape), str(p.dtype)) for n, p in module.named_parameters()]).encode()
            ).hexdigest(),
        }
        cache = CompileCache(
            Path(self._config.compile_cache), fields, self._config.trusted_key, self._config.signing_key
        )
        message = cache.prepare()
        self._say(message)
        self._compile_cache = cache
        self._compiler.compile_lock = cache.lock
        self._compiler.aot_cache = True

    def _compiled(self, hook: str) -> Callable:
        step = self._compiled_steps.get(hook)
        if step is None:
            assert self.lightning_module is not None and self._compiler is not None
            step = torch.compile(getattr(self.lightning_module, hook), backend=self._compiler)
            self._compiled_steps[hook] = step
        return step

    # --------------------------------------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            trainer = self.lightning_module.trainer
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            if batch_idx % trainer.accumulate_grad_batches == 0 and self._zero_grad is not None:
                for optimizer in self.optimizers:
                    self._zero_grad(trainer.current_epoch, batch_idx, optimizer)
            if self._config.broadcast_buffers and self.dp_size > 1:
                self._broadcast_stage_buffers()
            with self.precision_plugin.train_step_context():
                result = self._pipeline_step("training_step", args, kwargs)
            return torch.tensor(result.loss, device=self.root_device)
        with self._guard("training_step"):
            if self._config.broadcast_buffers:
                self._broadcast_buffers()
            with self.precision_plugin.train_step_context(), self._split_context():
                return self._compiled("training_step")(*args, **kwargs)

    def _split_context(self) -> contextlib.AbstractContextManager:
        """With split parameters, plain tensors met in the model (inputs, buffers, masks, rotary tables) count as
        replicated: they are the same on every rank of a tensor-parallel group (DTensor's implicit replication)."""
        if self._mesh is None:
            return contextlib.nullcontext()
        from torch.distributed.tensor.experimental import implicit_replication

        return implicit_replication()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            with self.precision_plugin.val_step_context():
                self._pipeline_step("validation_step", args, kwargs)
            return None
        with self._split_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            with self.precision_plugin.test_step_context():
                self._pipeline_step("test_step", args, kwargs)
            return None
        with self._split_context():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is not None:
            raise NotAvailableYetError(
                "predict with pipeline parallelism is not available yet (the outputs exist on the last stage only)."
                " Consolidate the checkpoint (sgdtp consolidate DIR model.ckpt) and predict with strategy='sgdtp'"
                " without pipeline_stages."
            )
        with self._split_context():
            return super().predict_step(*args, **kwargs)

    def _broadcast_buffers(self) -> None:
        assert self.lightning_module is not None
        buffers = [b for b in self.lightning_module.buffers()]
        if buffers and self.world_size > 1:
            _sync_params_and_buffers(_group.WORLD, buffers, 250 * 2**20, 0)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # Lightning's Strategy.backward, with the gradient sync placed right after backward, before the
        # precision plugin's post_backward runs `on_after_backward`: hooks see averaged gradients, as with DDP.
        module = self.lightning_module
        assert module is not None
        if self._pipeline is not None:
            # The schedule ran every micro-batch's backward inside training_step; Lightning's hooks still run.
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self._pipeline_after_backward()
            closure_loss = self.precision_plugin.post_backward(closure_loss, module)
            self.post_backward(closure_loss)
            return closure_loss
        with self._guard("backward"):
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            with self._split_context():
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            self._sync_after_backward()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._sync_enabled and self._compiler is not None and self._ledger is not None:
            record = walk_autograd_graph(closure_loss, self._compiler.graph_param_ids)
            # Agree before backward: a rank about to run other in-graph collectives fails here, not in a hang.
            # The same all-reduce carries the preemption flag: every rank learns of it in the same step.
            stop = self._preemption is not None and self._preemption.requested
            self._record = self._ledger.agree(record, everything=not self._compiler.in_graph_sync, stop=stop)
            self._stop_agreed = self._stop_agreed or self._record.stop

    def _sync_after_backward(self) -> None:
        if self._record is None or self._ledger is None or self._compiler is None:
            return
        record, self._record = self._record, None
        synced = self._ledger.sync(record)
        new = [n for n in synced if n not in self._fallback_params]
        if new and self._compiler.in_graph_sync:
            self._fallback_params.extend(new)
            self._say(
                f"{len(new)} parameter(s) get gradients outside the compiled graphs (eager regions); synced"
                f" after backward by the fallback buckets: {', '.join(new[:8])}" + (" ..." if len(new) > 8 else "")
            )

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no communication on the micro-batches run inside this context."""
        self._sync_enabled = False
        try:
            yield None
        finally:
            self._sync_enabled = True

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        with self._guard("optimizer_step"):
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._ledger is not None:
            self._ledger.end_step()
            stepped = [p for group in optimizer.param_groups for p in group["params"]]
            missing = self._ledger.uncovered(stepped)
            if missing:
                raise RuntimeError(
                    f"sgdtp: the gradients of {missing[:5]} were not averaged across ranks this step. They came"
                    " from a backward the strategy did not see (in manual optimization call"
                    " self.manual_backward(loss), not loss.backward()) or through an autograd node that hides its"
                    " parameters (reentrant activation checkpointing: use use_reentrant=False)."
                )
            self._publish_plan()
            cache = self._compile_cache
            if cache is not None and self.global_rank == 0 and not self._cache_published:
                self._cache_published = True  # once, after the first step: every graph of the step is compiled
                message = cache.publish()
                if message:
                    self._say(message)
        elif self._pipeline is not None:
            self._publish_plan()
        return out

    # -------------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._mesh is None:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        assert self.lightning_module is not None
        return get_optimizer_state_dict(self.lightning_module, optimizer)  # keyed by name: loads on any mesh

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Data parallel: one file, written by rank 0 (atomically). Tensor/hybrid: a sharded folder, every rank
        writing its shards (``lightning_sgdtp.sharded_checkpoint``)."""
        if self._mesh is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "SGDTPStrategy.save_checkpoint(storage_options=...) is not supported for sharded checkpoints"
            )
        path = Path(self.broadcast(str(filepath)))
        token = self.broadcast(uuid.uuid4().hex[:12])
        if self._pipeline is not None:
            # Each rank writes its stages' tensors (its copy of the others' is stale); DCP keeps one copy of what
            # several ranks write (data-parallel replicas, a tied parameter).
            checkpoint = {**checkpoint, "state_dict": self._pipeline.stage_state_dict(checkpoint["state_dict"])}
        with self._guard("save_checkpoint"):
            sharded.save(path, checkpoint, self.global_rank, token, self.barrier, self._config.signing_key)
        return None

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Either format, on any layout: a sharded folder is read by DCP (each rank its part); a one-file
        checkpoint is split for this mesh. What the strategy loaded itself, Lightning does not load again."""
        path = Path(self.broadcast(str(checkpoint_path)))
        self._states_loaded = False
        module = self.lightning_module
        assert module is not None
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        if sharded.is_sharded(path):
            if self._config.verify_artifacts:
                verify_dir(path, trusted=Path(self._config.trusted_key) if self._config.trusted_key else None)
            with self._guard("load_checkpoint"):
                rest = sharded.load(
                    path, module, optimizers, weights_only, partial_optimizer=self._pipeline is not None
                )
            self._states_loaded = True
            return rest
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        states = checkpoint.get("optimizer_states") or [{}]
        by_name = any(isinstance(k, str) for k in states[0].get("state", {}))  # a consolidated sharded checkpoint
        if self._mesh is None and not by_name:
            return checkpoint  # Lightning's own loading
        rest = sharded.load_full(checkpoint, module, optimizers if "optimizer_states" in checkpoint else [])
        self._states_loaded = True
        return rest

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state dict as plain tensors, on every rank: split (tensor-parallel) parameters
        gathered, the pipeline's stages collected from the ranks that hold them. A collective: call it on every
        rank (``torch.save`` it on rank 0)."""
        from torch.distributed.tensor import DTensor

        module = self.lightning_module
        assert module is not None
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}
        if self._pipeline is None or self._pipe_dims is None:
            return state
        local = {k: v.detach().cpu() for k, v in self._pipeline.stage_state_dict(state).items()}
        parts: list[Any] = [None] * self._pipe_dims.pp
        with self._guard("full_state_dict"):
            dist.all_gather_object(parts, local, group=self._pipeline.group)
        merged = {k: v for part in parts for k, v in part.items()}
        return {k: merged.get(k, v.detach().cpu()).to(v.device) for k, v in state.items()}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self._states_loaded:
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self._states_loaded:
            super().load_optimizer_state_dict(checkpoint)

    # ---------------------------------------------------------------------------------------------- plan
    def _say(self, message: str) -> None:
        if self.global_rank == 0:
            log.info(f"sgdtp: {message}")

    def _on_graph_plan(self, plan: GraphPlan) -> None:
        if self._compile_cache is not None:
            self._compile_cache.record_plan(plan.to_dict())
        self._announce(plan)

    def _announce(self, plan: GraphPlan, origin: str = "captured") -> None:
        self._announced.add(plan.graph_id)
        if not plan.in_graph_sync:
            self._say(
                f"graph {plan.graph_id} {origin}: {len(plan.params)} parameter gradients, no in-graph collectives"
            )
            return
        sizes = ", ".join(_size(b.wire_bytes) for b in plan.buckets)
        self._say(
            f"graph {plan.graph_id} {origin}: {len(plan.params)} parameter gradients in {len(plan.buckets)} bucket(s)"
            f" [{sizes}], {_size(plan.wire_bytes)} all-reduced per backward"
        )

    def _publish_plan(self) -> None:
        for reason, count in _graph_break_counts().items():
            new = count - self._breaks_at_setup.get(reason, 0)
            if new > 0:
                short = _short_reason(reason)
                if short not in self._graph_breaks:
                    self._say(f"graph break: {short}")
                self._graph_breaks[short] = new
        plan = self.plan
        for graph in plan["graphs"]:
            if graph["graph_id"] not in self._announced:
                self._announce(_plan_from_dict(graph), origin="taken from the compile cache")
        fields = ("graphs", "fallback_params", "grad_sync", "pipeline")
        key = json.dumps({k: plan[k] for k in fields}, sort_keys=True, default=str)
        if self.global_rank != 0 or key == self._written_plan:
            return
        if self._written_plan is None and self._pipeline is None:
            b = plan["bytes_per_step"]
            self._say(f"bytes communicated per step: {_size(b['in_graph'])} in-graph + {_size(b['fallback'])} fallback")
        self._written_plan = key
        folder = self._plan_dir or Path.cwd()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{PLAN_FILENAME}.tmp"
        tmp.write_text(json.dumps(plan, indent=2, sort_keys=True, default=str))
        os.replace(tmp, folder / PLAN_FILENAME)

    # -------------------------------------------------------------------------------------- collectives
    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not _is_split(self.model):  # a split module (fit, then validate) already lives on its mesh's devices
            self.model.to(self.root_device)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        with self._guard(f"barrier {args[0] if args else ''}".strip()):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with self._guard("broadcast"):
            dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @override
    def reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            with self._guard("reduce"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader becomes resumable mid-epoch (position and random states go into checkpoints)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not trainer.training or isinstance(dataloader, ResumableLoader):
            return dataloader

        def progress() -> tuple[int, int]:
            return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.processed

        return ResumableLoader(dataloader, progress, self._all_gather_object, self.global_rank, self.world_size)

    def _all_gather_object(self, obj: Any) -> list[Any]:
        if not _distributed_is_initialized() or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self._guard("all_gather_object"):
            dist.all_gather_object(out, obj)
        return out

    # ------------------------------------------------------------------------------------------- faults
    @contextmanager
    def _guard(self, phase: str) -> Generator[None, None, None]:
        """Name the phase for the heartbeat; turn a failed collective into an error that names the lost rank."""
        live = self._liveness
        if live is None:
            yield
            return
        trainer = getattr(self.lightning_module, "_trainer", None)
        live.phase, live.step = f"in {phase}", trainer.global_step if trainer is not None else -1
        try:
            yield
        except Exception as exc:
            if isinstance(exc, RankLostError) or not is_distributed_error(exc):
                raise
            lost = live.diagnose(exc)
            if lost is None:
                raise
            live.report(lost, primary=False)
            raise lost from exc
        live.phase = f"after {phase}"

    def _preempt(self, trainer: pl.Trainer) -> None:
        """At the end of the step all ranks agreed on: save the preemption checkpoint, requeue, stop."""
        self._stop_agreed = False
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        path = self.broadcast(path)  # rank 0's name, in case the ranks see the folder differently
        trainer.save_checkpoint(path)
        done, what = requeue_slurm_job() if self.global_rank == 0 else (False, "")
        done, what = self.broadcast((done, what))
        if not done:
            self._say(f"preemption signal: checkpoint saved to {path}, but {what}; training goes on")
            if self._preemption is not None:
                self._preemption.requested = False
            return
        message = f"sgdtp: preempted at step {trainer.global_step}: checkpoint saved to {path}; {what}; stopping"
        self._say(message.removeprefix("sgdtp: "))
        raise Preempted(message)

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, Preempted):
            return
        if self._liveness is not None:
            self._liveness.report(exception, primary=not isinstance(exception, RankLostError))

    def _release_ledger(self) -> None:
        if self._ledger is not None:
            self._ledger.remove_hooks()

    @override
    def teardown(self) -> None:
        if self._pipeline is not None and _distributed_is_initialized():
            # Pipeline sends may still be in flight on a neighbour: gloo aborts if a peer leaves mid-transfer.
            with contextlib.suppress(Exception):
                self.barrier("pipeline teardown")
        if self._preemption is not None:
            self._preemption.uninstall()
            self._preemption = None
        if self._liveness is not None:
            self._liveness.close()
            self._liveness = None
        self._compiled_steps.clear()
        if self.lightning_module is not None and self._zero_grad is not None:
            self.lightning_module.__dict__.pop("optimizer_zero_grad", None)
            self._zero_grad = None
        if self.lightning_module is not None:
            for owner, hook in _bookkeeping_hooks(self.lightning_module, installed=True):
                delattr(owner, hook)
        if self.lightning_module is not None and _is_split(self.lightning_module):
            # As Lightning's ModelParallelStrategy: a split module stays where it is (``module.cpu()`` cannot swap
            # DTensor parameters); the rest of Strategy.teardown.
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            _optimizers_to_device(self.optimizers, torch.device("cpu"))
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            "sgdtp",
            cls,
            description="lightning-sgdtp: compiled step, gradient all-reduce fused into the compiled backward",
            override=True,
        )


class _PreemptionCheckpoint(Callback):
    """Runs the agreed preemption at ``on_train_batch_end``: the point where ModelCheckpoint saves mid-epoch,
    so that Lightning resumes the loop exactly there."""

    def __init__(self, strategy: SGDTPStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.strategy._stop_agreed:
            self.strategy._preempt(trainer)


def _bookkeeping_hooks(module: torch.nn.Module, installed: bool = False) -> list[tuple[Any, str]]:
    """The methods to run eagerly: Lightning's logging and every torchmetrics metric's forward.

    ``installed=False``: those not wrapped yet; ``installed=True``: those we wrapped (instance attributes).
    """
    from torchmetrics import Metric

    hooks: list[tuple[Any, str]] = [(module, "log"), (module, "log_dict")]
    hooks += [(m, "forward") for m in module.modules() if isinstance(m, Metric)]
    return [(owner, hook) for owner, hook in hooks if (hook in owner.__dict__) == installed]


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
        if not _distributed_is_initialized():
            return
        with contextlib.suppress(Exception):
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=30))
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    atexit.register(leave)


def _zero_grad_done_by_strategy(*args: Any, **kwargs: Any) -> None:
    """Lightning's zero_grad between training_step and backward, with pipeline parallelism: the strategy has
    already zeroed before the schedule (which ran the backward inside training_step)."""


def _is_split(module: torch.nn.Module) -> bool:
    """Whether tensor parallelism was applied already (some parameter is a DTensor)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def _plan_from_dict(d: dict[str, Any]) -> GraphPlan:
    buckets = [Bucket(**{k: v for k, v in b.items() if k in Bucket.__dataclass_fields__}) for b in d["buckets"]]
    fields = {k: v for k, v in d.items() if k in GraphPlan.__dataclass_fields__ and k != "buckets"}
    return GraphPlan(**fields, buckets=buckets)


def _graph_break_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _short_reason(reason: str) -> str:
    """Dynamo's graph-break reasons are paragraphs; keep the headline and the explanation, without memory
    addresses (``<function f at 0x7f...>``), so that plans of two runs compare equal."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    explanation = next((line for line in lines if line.startswith("Explanation:")), "")
    short = " ".join(x for x in (lines[0] if lines else reason, explanation) if x)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", short)


def _check_not_compiled(module: torch.nn.Module) -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    if getattr(module, "_compiler_ctx", None) is not None or isinstance(module, OptimizedModule):
        raise SGDTPConfigError(
            "trainer.fit() got a torch.compile()d LightningModule. The sgdtp strategy compiles the training step"
            " itself (with its own backend, which puts gradient communication in the graph): pass the plain"
            " LightningModule, i.e. drop the torch.compile(...) call."
        )
    compiled = [name for name, m in module.named_modules() if isinstance(m, OptimizedModule)]
    if compiled:
        raise SGDTPConfigError(
            f"submodule(s) {compiled[:5]} of {type(module).__name__} are torch.compile()d. The sgdtp strategy"
            " compiles the whole training step itself; remove the torch.compile(...) call(s) from your model."
        )
