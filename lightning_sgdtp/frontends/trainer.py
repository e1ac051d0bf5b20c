"""``SGDTPStrategy``: Lightning glue. Each hook delegates in a few lines; the algorithms live elsewhere.

The only module that imports Lightning (``_registration`` derives the ``pytorch_lightning`` twin from this
source). Loops, callbacks, logging and checkpoint files stay Lightning's. The strategy owns the processes (as
``DDPStrategy``) and hands the rest, once, to: the dimensions and their meshes (``layout.ParallelDims``), an engine
(``engine.compiled.CompiledStep`` or ``engine.pipelined.PipelinedStep``, each with its ``GradSync``, optimizer
updates and timeline), the report (``report.PlanReport``), faults and preemption, and checkpoints
(``checkpoints``). ``docs/how-it-works.md`` follows one step through them.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sgdtp.checkpoint import hooks as checkpoints
from lightning_sgdtp.checkpoint.hooks import ShardedCheckpoints
from lightning_sgdtp.checkpoint.resume import ResumableLoader
from lightning_sgdtp.config import (
    SGDTPConfig,
    SGDTPConfigError,
    check_process_group_backend,
    check_trainer_plugins,
)
from lightning_sgdtp.engine import model_settings
from lightning_sgdtp.engine.base import EngineInputs, StepEngine
from lightning_sgdtp.engine.compiled import CompiledStep
from lightning_sgdtp.engine.parallelize import is_tensor_parallel, start_from_rank_0, to_device
from lightning_sgdtp.engine.pipelined import PipelinedStep
from lightning_sgdtp.engine.step_compile import check_not_compiled
from lightning_sgdtp.frontends.job import FrontEnd, strategy_docs, strategy_signature
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.observe.report import PlanReport
from lightning_sgdtp.observe.timeline import CLOSURE_LABEL, OPTIMIZER_LABEL, label, labelled
from lightning_sgdtp.parallel.checkpointing import find_block_stack, no_block_stack_message
from lightning_sgdtp.planner.auto import given_options
from lightning_sgdtp.runtime import processes
from lightning_sgdtp.runtime.faults import FaultGuard
from lightning_sgdtp.runtime.preemption import Preempted, PreemptionCoordinator
from lightning_sgdtp.runtime.shutdown import ShutdownWatchdog
from lightning_sgdtp.sync import comm
from lightning_sgdtp.sync.ledger import GradLedger

_BROADCAST_BUCKET_BYTES = 250 * 2**20


class AtomicCheckpointIO(TorchCheckpointIO):
    """One-file checkpoints written atomically and recorded in the folder's SHA256 manifest (signed with
    ``signing_key``); with ``verify``, checked against it (and ``trusted_key``) before anything is unpickled
    (:mod:`lightning_sgdtp.checkpoint.hooks`)."""

    def __init__(self, verify: bool = True, trusted_key: str | None = None, signing_key: str | None = None) -> None:
        super().__init__()
        self.verify, self.trusted_key, self.signing_key = verify, trusted_key, signing_key

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path):  # remote filesystems: fsspec's own semantics
            return super().save_checkpoint(checkpoint, path, storage_options)
        return checkpoints.save_file(checkpoint, Path(path), self.signing_key)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        super().remove_checkpoint(path)
        if "://" not in str(path):
            checkpoints.record(Path(path), self.signing_key)

    @override
    def load_checkpoint(
        self, path: _PATH, map_location: Any | None = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if self.verify and "://" not in str(path):
            checkpoints.verify_file(Path(path), self.trusted_key)
        return super().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


class SGDTPStrategy(FrontEnd, ParallelStrategy):
    """Data-parallel training with the step compiled and gradient communication inside the compiled backward.

    ``Trainer(strategy="sgdtp")`` or ``Trainer(strategy=SGDTPStrategy(bucket_cap_mb=25, ...))``. Every option
    is a field of :class:`~lightning_sgdtp.config.SGDTPConfig` (see ``docs/options.md``); the design documents'
    ``options={"distributed": {"plugin": "sgdtp", "strategy": "data"}}`` is accepted too, and explicit
    keyword arguments win over it.
    """

    strategy_name = "sgdtp"

    def __init__(
        self,
        *,
        options: dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **option_values: Any,
    ) -> None:
        # The options' parameters are SGDTPConfig's fields (the signature below is made from them): unknown names
        # and bad values fail in from_options, with the known names listed.
        given = {k: v for k, v in option_values.items() if v is not None}
        # Validate first: a bad option fails here, in the launching process, before anything is spawned.
        self._config = config = SGDTPConfig.from_options(options, **given)
        self._given, self._planner = given_options(options, given), None  # what parallelism="auto" keeps fixed
        check_process_group_backend(process_group_backend)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io
            or AtomicCheckpointIO(config.verify_artifacts, config.trusted_key, config.signing_key),
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._dims: ParallelDims | None = None
        self._engine: StepEngine | None = None
        self._report = PlanReport()
        self._settings = model_settings.TrainingSettings()
        self._guard = FaultGuard(config.collective_timeout, step=self._global_step)
        self._watchdog: ShutdownWatchdog | None = None
        self._preemption: PreemptionCoordinator | None = None
        # A checkpoint's model and optimizer states were loaded by the strategy itself (sharded or resharded).
        self._states_loaded = False

    # ----------------------------------------------------------------------------------------- properties
    @property
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_lm")

    @_lightning_module.setter
    def _lightning_module(self, module: pl.LightningModule | None) -> None:
        # Lightning assigns the module here before it spawns any process: the earliest place to refuse a
        # compiled module with our own message (Lightning's generic one comes right after).
        if module is not None:
            check_not_compiled(module)
            if self._config.activation_checkpointing and find_block_stack(module) is None:
                raise SGDTPConfigError(no_block_stack_message(module))
        self.__dict__["_lm"] = module

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def ledger(self) -> GradLedger | None:
        return self.grad_sync.ledger if self.grad_sync is not None else None

    @property
    def device_mesh(self) -> Any | None:
        """The 2-D ``DeviceMesh``: (``"dp"``, ``"tp"``) for ``parallelism="tensor"``/``"hybrid"``, (``"pp"``,
        ``"dp"``) with pipeline parallelism; None for data parallel alone."""
        return self._dims.world_mesh if self._dims is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Sized by the data-parallel group: the ranks of one tensor-parallel group read the same batches.
        if self._dims is None:
            return {"num_replicas": self.dp_size, "rank": self.global_rank}
        return self._dims.sampler_kwargs(self.global_rank)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Load into the model as it is laid out for training (split across ranks, optimizers created).
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self._states_loaded

    def _global_step(self) -> int:
        trainer = getattr(self.lightning_module, "_trainer", None)
        return trainer.global_step if trainer is not None else -1

    # ---------------------------------------------------------------------------------------- processes
    @override
    def _configure_launcher(self) -> None:
        plugin = type(self.precision_plugin)
        supported = plugin in (Precision, MixedPrecision, HalfPrecision)
        check_trainer_plugins(None if supported else plugin.__name__, self._layer_sync is not None)
        assert self.cluster_environment is not None
        self._check_sizes()
        # Always, as DDPStrategy: with processes started by SLURM or torchrun the launcher starts nothing, but it
        # checks devices / num_nodes against the launcher's tasks before anything else happens.
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        self._report.rank = self.global_rank
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        env = self.cluster_environment
        assert env is not None
        requeue = isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None
        if requeue and self._preemption is None:
            self._preemption = PreemptionCoordinator(env.requeue_signal)
        cluster = processes.Cluster(
            env.main_address, env.main_port, self.global_rank, self.num_processes, self.num_nodes, type(env).__name__,
            env.world_size(),
        )  # fmt: skip
        ignore = (self._preemption.signum,) if self._preemption else ()
        device = self.root_device
        self._watchdog = processes.join(
            self._config, cluster, self._process_group_backend, device, self._guard, self._watchdog, ignore
        )
        module, precision = lambda: self.lightning_module, self.precision_plugin.precision
        self._config, planner, self._dims, lines = processes.lay_out(
            self._config, self._given, module, cluster, device, precision, self._dims
        )
        self._planner = planner or self._planner
        for line in lines:
            self._report.say(line)

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
        start_from_rank_0(self.model, _BROADCAST_BUCKET_BYTES)
        self._settings = model_settings.for_training(self.model, self._report.say)
        engine = self._engine_for(self.lightning_module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # `trainer.log_dir` broadcasts from rank 0: ask on every rank, here, never from rank 0 alone.
            self._report.folder = Path(trainer.log_dir or trainer.default_root_dir)
            self._report.say(
                f"parallelism={self._config.parallelism}: {self.world_size} ranks ({self.num_nodes} node(s) x"
                f" {self.num_processes}), data-parallel group of {self.dp_size}, backend={self._process_group_backend},"
                f" processes from {type(self.cluster_environment).__name__}"
            )
        clip = engine.setup(fitting, trainer.accumulate_grad_batches)
        if clip is not None:  # the norm over every shard or stage, not this rank's
            plugin = self.precision_plugin
            plugin.clip_grad_by_norm = lambda optimizer, value: clip(plugin.main_params(optimizer), value)
        if fitting:
            self.setup_optimizers(trainer)
            engine.setup_optimizers(self.optimizers)
            if self._preemption is not None and not any(
                isinstance(c, _PreemptionCheckpoint) for c in trainer.callbacks
            ):
                trainer.callbacks.append(_PreemptionCheckpoint(self))
                self._report.say(
                    f"SLURM: on signal {self._preemption.signum} the ranks agree on a step, save hpc_ckpt_N.ckpt"
                    f" in {trainer.default_root_dir} at its end, requeue the job and stop"
                )
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _engine_for(self, module: pl.LightningModule | None) -> StepEngine:
        """The engine of this module, made once: the pipelined one with pipeline options, else the compiled one."""
        assert module is not None and self._dims is not None
        if self._engine is None or self._engine.module is not module:
            engine_cls = PipelinedStep if self._dims.pp_enabled else CompiledStep  # the one choice of engine
            inputs = EngineInputs(
                self._config, self._dims, self.root_device, self._report, self._guard, self._preemption,
                self._process_group_backend,
            )  # fmt: skip
            self._engine = engine_cls(module, inputs)
        return self._engine

    # --------------------------------------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._engine is not None and self.lightning_module is not None
        with self.precision_plugin.train_step_context():
            return self._engine.step(args, kwargs, self.lightning_module.trainer, self.optimizers)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        default, context = super().validation_step, self.precision_plugin.val_step_context
        return self._engine.eval_step("validation_step", args, kwargs, lambda: default(*args, **kwargs), context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        default, context = super().test_step, self.precision_plugin.test_step_context
        return self._engine.eval_step("test_step", args, kwargs, lambda: default(*args, **kwargs), context)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        default, context = super().predict_step, self.precision_plugin.predict_step_context
        return self._engine.eval_step("predict_step", args, kwargs, lambda: default(*args, **kwargs), context)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # Lightning's Strategy.backward, with the gradient sync placed right after backward, before the
        # precision plugin's post_backward runs `on_after_backward`: hooks see averaged gradients, as with DDP.
        module = self.lightning_module
        assert module is not None and self._engine is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._engine.backward(lambda: self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs))
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._engine is not None:
            self._engine.before_backward(closure_loss)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: no communication on the micro-batches run inside this context."""
        with self.grad_sync.no_sync() if self.grad_sync is not None else contextlib.nullcontext():
            yield None

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        assert self._engine is not None
        self._engine.begin_step(self._global_step())  # the closure runs training_step: the step starts here
        with self._guard("optimizer_step"), label(OPTIMIZER_LABEL):
            out = super().optimizer_step(optimizer, labelled(closure, CLOSURE_LABEL), model, **kwargs)
        self._engine.after_optimizer_step(optimizer, self.global_rank)
        if self._engine.grad_sync is not None:
            with label("sgdtp: publish plan"):
                self._report.publish(lambda: self.plan, self._engine.plan_token())
        return out

    def gather_pipeline_stages(self) -> None:
        """With ``pipeline_stages``, each rank holds only its stages' parameters after ``fit``: this gives every rank
        the whole trained model (each stage sent by its holder). A collective: call it on every rank."""
        if self._engine is not None:
            self._engine.gather_stages()

    # -------------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._sharded_checkpoints():
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        return get_optimizer_state_dict(self.lightning_module, optimizer)  # keyed by name: loads on any mesh

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Data parallel: one file, written by rank 0 (atomically). With a mesh: a sharded folder, every rank
        writing its shards or, with a pipeline, its stages (its copy of the others' is stale)."""
        if not self._sharded_checkpoints():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "SGDTPStrategy.save_checkpoint(storage_options=...) is not supported for sharded checkpoints"
            )
        state_dict = self._engine.local_state_dict(checkpoint["state_dict"])
        return self._checkpoints().save({**checkpoint, "state_dict": state_dict}, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Either format, on any layout: a sharded folder is read by DCP (each rank its part); a one-file
        checkpoint is split for this mesh. What the strategy loaded itself, Lightning does not load again."""
        path = Path(self.broadcast(str(checkpoint_path)))
        rest, self._states_loaded = self._checkpoints().load(
            path,
            self.lightning_module,
            [getattr(o, "_optimizer", o) for o in self.optimizers],
            weights_only,
            lambda p: self.checkpoint_io.load_checkpoint(p, weights_only=weights_only),
            on_mesh=self._sharded_checkpoints(),
            partial_optimizer=self._dims is not None and self._dims.pp_enabled,  # a stage's optimizer: its part
        )
        return rest

    def _sharded_checkpoints(self) -> bool:
        return self._dims is not None and self._dims.sharded_checkpoints

    def _checkpoints(self) -> ShardedCheckpoints:
        return ShardedCheckpoints(self._config, self.global_rank, self.broadcast, self.barrier, self._guard)

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state dict as plain tensors, on every rank: split (tensor-parallel) parameters
        gathered, the pipeline's stages collected from the ranks that hold them. A collective: call it on every
        rank (``torch.save`` it on rank 0)."""
        from torch.distributed.tensor import DTensor

        module = self.lightning_module
        assert module is not None
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}
        return self._engine.full_state_dict(state) if self._engine is not None else state

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self._states_loaded:
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self._states_loaded:
            super().load_optimizer_state_dict(checkpoint)

    # -------------------------------------------------------------------------------------- collectives
    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        to_device(self.model, self.root_device)  # a module on its mesh (fit, then validate) stays on its devices

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

        gather = lambda obj: comm.all_gather_object(self._guard, obj)
        return ResumableLoader(dataloader, progress, gather, self.global_rank, self.world_size)

    # ------------------------------------------------------------------------------------------- faults
    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and exception.code is None:
            # Lightning ends a SIGTERM'd run with SystemExit(None): exit code 0, which a launcher or scheduler reads
            # as success. Exit as a process ended by SIGTERM does.
            exception.code = 128 + signal.SIGTERM
        if not isinstance(exception, Preempted):
            self._guard.report(exception)
            if self._watchdog is not None:
                self._watchdog.failed(exception)

    @override
    def teardown(self) -> None:
        self._settings.restore()
        if self._engine is not None:
            # After a failure no collective: a peer may never come (it failed too, or waits elsewhere).
            self._engine.teardown(self.barrier if not self._guard.failed else lambda name: None)
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        self._guard.close()
        if self._watchdog is not None:
            self._watchdog.close()
        in_place = self._engine is not None and self._engine.holds_a_part
        if self.lightning_module is not None and (in_place or is_tensor_parallel(self.lightning_module)):  # on a mesh
            # As Lightning's ModelParallelStrategy: a split module stays where it is (``module.cpu()`` cannot swap
            # DTensor parameters, nor copy a pipeline's released ones); the rest of Strategy.teardown.
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            _optimizers_to_device(self.optimizers, torch.device("cpu"))
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()


# One declaration of each option (SGDTPConfig's field): LightningCLI and help() read these.
SGDTPStrategy.__init__.__signature__ = strategy_signature(SGDTPStrategy.__init__)  # type: ignore[attr-defined]
SGDTPStrategy.__init__.__doc__ = strategy_docs()


class _PreemptionCheckpoint(Callback):
    """Runs the agreed preemption at ``on_train_batch_end``: the point where ModelCheckpoint saves mid-epoch,
    so that Lightning resumes the loop exactly there."""

    def __init__(self, strategy: SGDTPStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        strategy = self.strategy
        if strategy._preemption is not None and strategy._preemption.agreed:
            strategy._preemption.preempt(trainer, strategy.broadcast, strategy.global_rank, strategy._report.say)
