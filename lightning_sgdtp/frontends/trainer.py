"""``SGDTPStrategy``: Lightning glue. Each hook delegates in a few lines; the algorithms live elsewhere.

With ``frontends/fabric.py`` the only module that imports Lightning (``frontends/registration.py`` derives the
``pytorch_lightning`` twin from this source). Loops, callbacks, logging and checkpoint files stay Lightning's. The
strategy owns the processes (as ``DDPStrategy``) and hands the rest, once, to its
:class:`~lightning_sgdtp.frontends.job.Job`, the core it shares with Fabric's strategy: the dimensions and their meshes (``mesh.dims.ParallelDims``), an engine (``engine.compiled.CompiledStep`` or
``engine.pipelined.PipelinedStep``, each with its ``GradSync``, optimizer updates and timeline), the report
(``observe.report.PlanReport``), faults and preemption, and sharded checkpoints. Here stays what only the Trainer has:
hook signatures, the precision plugin around backward, the eval steps, checkpoint IO, the resumable loader and the
preemption callback. ``docs/how-it-works.md`` follows one step through them.
"""

from __future__ import annotations

import contextlib
import functools
import signal
from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device as default_backend
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sgdtp.checkpoint import hooks as checkpoints
from lightning_sgdtp.checkpoint.resume import ResumableLoader
from lightning_sgdtp.config import SGDTPConfigError
from lightning_sgdtp.engine.base import EngineInputs, StepEngine
from lightning_sgdtp.engine.compiled import CompiledStep
from lightning_sgdtp.engine.parallelize import to_device
from lightning_sgdtp.engine.pipelined import PipelinedStep
from lightning_sgdtp.engine.step_compile import adopt_compiled
from lightning_sgdtp.frontends.job import FrontEnd, Job, strategy_docs, strategy_signature
from lightning_sgdtp.observe.timeline import CLOSURE_LABEL, labelled
from lightning_sgdtp.parallel.checkpointing import find_block_stack, no_block_stack_message
from lightning_sgdtp.runtime.process_bound import without_child_processes
from lightning_sgdtp.sync.ledger import GradLedger


class AtomicCheckpointIO(TorchCheckpointIO):
    """One-file checkpoints written atomically with their SHA256 manifest inside (signed with ``signing_key``); with
    ``verify``, checked against it (and ``trusted_key``) before anything is unpickled
    (:mod:`lightning_sgdtp.checkpoint.hooks`)."""

    def __init__(self, verify: bool = True, trusted_key: str | None = None, signing_key: str | None = None) -> None:
        super().__init__()
        self.verify, self.trusted_key, self.signing_key = verify, trusted_key, signing_key

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if "://" in str(path) or storage_options is not None:  # remote: fsspec's; storage_options: Lightning's error
            return super().save_checkpoint(checkpoint, path, storage_options)
        return checkpoints.save_file(checkpoint, Path(path), self.signing_key)

    @override
    def remove_checkpoint(self, path: _PATH) -> None:
        super().remove_checkpoint(path)
        if "://" not in str(path):
            checkpoints.removed(Path(path))

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
        # Validate first: a bad option fails here, in the launching process, before anything is spawned.
        self._job = Job(self, _step_engine, options, option_values, process_group_backend, step=self._global_step)
        config = self._job.config
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io
            or AtomicCheckpointIO(config.verify_artifacts, config.trusted_key, config.signing_key),
            precision_plugin=precision_plugin,
        )
        # A checkpoint's model and optimizer states were loaded by the strategy itself (sharded or resharded).
        self._states_loaded = False

    # ----------------------------------------------------------------------------------------- properties
    @property
    def _lightning_module(self) -> pl.LightningModule | None:
        return self.__dict__.get("_lm")

    @_lightning_module.setter
    def _lightning_module(self, module: pl.LightningModule | None) -> None:
        # Lightning assigns the module here on every process, before the strategy starts (rank 0 by Lightning's count):
        # a compiled one is taken back to the plain module, its settings kept for the step's compile.
        if module is not None:
            adopt_compiled(module, self._job.report.say if utils_rank_zero_only.rank == 0 else lambda line: None)
            built_later = is_overridden("configure_model", module, pl.LightningModule)  # its layers come at setup
            if self._job.config.activation_checkpointing and find_block_stack(module) is None and not built_later:
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
        dims = self._job.dims
        return dims.world_mesh if dims is not None else None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self._job.sampler_kwargs()

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

    def __getstate__(self) -> dict[str, Any]:
        # torch.save(trainer), deepcopy: as DDPStrategy's, on rank 0 too (the job leaves out this process's run)
        return without_child_processes(super().__getstate__())

    # ---------------------------------------------------------------------------------------- processes
    @override
    def _configure_launcher(self) -> None:
        self._job.check_launch(type(self.precision_plugin), self._layer_sync is not None, "Trainer")
        assert self.cluster_environment is not None
        # Always, as DDPStrategy: with processes started by SLURM or torchrun the launcher starts nothing, but it
        # checks devices / num_nodes against the launcher's tasks before anything else happens.
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        env = self.cluster_environment
        requeue = isinstance(env, SLURMEnvironment) and env.auto_requeue and env.requeue_signal is not None
        self._job.start(default_backend(self.root_device), env.requeue_signal if requeue else None)
        # "auto" plans in setup, after configure_model built the model; so does an automatic tensor-parallel size
        # (the largest that divides the model's query heads)
        if not self._job.config.planned and not self._job.config.sizes_tp_from_model:
            self._job.lay_out(lambda: self.lightning_module, self.precision_plugin.precision)

    def set_world_ranks(self) -> None:
        rank_zero_only.rank = utils_rank_zero_only.rank = self._job.set_world_ranks()

    # -------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        job = self._job
        if job.dims is None:
            job.lay_out(lambda: self.lightning_module, self.precision_plugin.precision)
        job.prepare(self.model)
        engine = job.engine_for(self.lightning_module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # `trainer.log_dir` broadcasts from rank 0: ask on every rank, here, never from rank 0 alone. The plan file
            # goes there with a logger; with logger=False (ddp writes no file) only where plan_file says.
            folder = Path(trainer.log_dir or trainer.default_root_dir)
            job.report.place(folder, job.config.plan_file, logger=bool(trainer.loggers))
            job.report.say(f"{job.describe()}, processes from {type(self.cluster_environment).__name__}")
        clip = engine.setup(fitting, trainer.accumulate_grad_batches)
        if clip is not None:  # the norm over every shard or stage, not this rank's
            plugin = self.precision_plugin
            plugin.clip_grad_by_norm = lambda optimizer, value: clip(plugin.main_params(optimizer), value)
        if fitting:
            self.setup_optimizers(trainer)
            engine.setup_optimizers(self.optimizers)
            if job.preemption is not None and not any(isinstance(c, _PreemptionCheckpoint) for c in trainer.callbacks):
                trainer.callbacks.append(_PreemptionCheckpoint(self))
                job.report.say(
                    f"SLURM: on signal {job.preemption.signum} the ranks agree on a step, save hpc_ckpt_N.ckpt"
                    f" in {trainer.default_root_dir} at its end, requeue the job and stop"
                )
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """On the meta device with ``empty_init=True``, or in ``configure_model`` when ``pretrained`` is given: each
        rank allocates its part after the split (``docs/big-models.md``)."""
        if not self._job.on_meta(empty_init):
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    # --------------------------------------------------------------------------------------------- steps
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._job.engine
        assert engine is not None and self.lightning_module is not None
        with self.precision_plugin.train_step_context():
            return engine.step(args, kwargs, self.lightning_module.trainer, self.optimizers)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        default, context = super().validation_step, self.precision_plugin.val_step_context
        return self._job.engine.eval_step("validation_step", args, kwargs, lambda: default(*args, **kwargs), context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        default, context = super().test_step, self.precision_plugin.test_step_context
        return self._job.engine.eval_step("test_step", args, kwargs, lambda: default(*args, **kwargs), context)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        default, context = super().predict_step, self.precision_plugin.predict_step_context
        return self._job.engine.eval_step("predict_step", args, kwargs, lambda: default(*args, **kwargs), context)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # Lightning's Strategy.backward, with the gradient sync placed right after backward, before the
        # precision plugin's post_backward runs `on_after_backward`: hooks see averaged gradients, as with DDP.
        module, engine = self.lightning_module, self._job.engine
        assert module is not None and engine is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        engine.backward(lambda: self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs))
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self._job.engine is not None:
            self._job.engine.before_backward(closure_loss)

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
        step = super().optimizer_step  # its closure runs training_step: the job starts the step before it
        return self._job.optimizer_step(
            optimizer,
            lambda: step(optimizer, labelled(closure, CLOSURE_LABEL), model, **kwargs),
            getattr(self.precision_plugin, "scaler", None),
        )

    def gather_pipeline_stages(self) -> None:
        """With ``pipeline_stages``, each rank holds only its stages' parameters after ``fit``: this gives every rank
        the whole trained model (each stage sent by its holder). A collective: call it on every rank."""
        if self._job.engine is not None:
            self._job.engine.gather_stages()

    # -------------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._job.sharded_checkpoints:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        return get_optimizer_state_dict(self.lightning_module, optimizer)  # keyed by name: loads on any mesh

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Data parallel: one file, written by rank 0 (atomically). With a mesh: a sharded folder, every rank
        writing its shards or, with a pipeline, its stages (its copy of the others' is stale)."""
        if not self._job.sharded_checkpoints:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError(
                "SGDTPStrategy.save_checkpoint(storage_options=...) is not supported for sharded checkpoints"
            )
        return self._job.save_sharded(checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Either format, on any layout: a sharded folder is read by DCP (each rank its part); a one-file
        checkpoint is split for this mesh. What the strategy loaded itself, Lightning does not load again."""
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        load_file = lambda p: self.checkpoint_io.load_checkpoint(p, weights_only=weights_only)
        rest, self._states_loaded = self._job.load(
            checkpoint_path, self.lightning_module, optimizers, weights_only, load_file
        )
        return rest

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's state dict as plain tensors, on every rank: split (tensor-parallel) parameters
        gathered, the pipeline's stages collected from the ranks that hold them. A collective: call it on every
        rank (``torch.save`` it on rank 0)."""
        assert self.lightning_module is not None
        return self._job.full_state_dict(self.lightning_module)

    def save_pretrained(self, path: _PATH) -> Path:
        """The trained model as a Hugging Face folder (``*.safetensors`` + index + ``config.json``) that
        ``from_pretrained`` loads; every rank writes its shards. A collective: call it on every rank, e.g. after
        ``trainer.fit`` (``docs/big-models.md``)."""
        assert self.lightning_module is not None
        return self._job.save_pretrained(self.lightning_module, path)

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
        return self._job.reduce(tensor, lambda t: _sync_ddp_if_available(t, group, reduce_op=reduce_op), "reduce")

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader becomes resumable mid-epoch (position and random states go into checkpoints)."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or not trainer.training or isinstance(dataloader, ResumableLoader):
            return dataloader
        progress = functools.partial(_fit_progress, trainer)  # not a closure: the loader pickles with the trainer
        return ResumableLoader(dataloader, progress, self._job.all_gather_object, self.global_rank, self.world_size)

    # ------------------------------------------------------------------------------------------- faults
    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException) and exception.code is None:
            # Lightning ends a SIGTERM'd run with SystemExit(None): exit code 0, which a launcher or scheduler reads
            # as success. Exit as a process ended by SIGTERM does.
            exception.code = 128 + signal.SIGTERM
        self._job.failed(exception)

    @override
    def teardown(self) -> None:
        self._job.teardown()
        if self.lightning_module is not None and self._job.stays_in_place(self.lightning_module):  # on a mesh
            # As Lightning's ModelParallelStrategy: a split module stays where it is (``module.cpu()`` cannot swap
            # DTensor parameters, nor copy a pipeline's released ones or a meta model's); the rest of teardown.
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


def _step_engine(module: torch.nn.Module, inputs: EngineInputs) -> StepEngine:
    """The engine of a module: the pipelined one with pipeline options, else the compiled one."""
    return (PipelinedStep if inputs.dims.pp_enabled else CompiledStep)(module, inputs)  # the one choice of engine


def _fit_progress(trainer: pl.Trainer) -> tuple[int, int]:
    """Where the resumable loader resumes: the epoch and the batches processed in it."""
    return trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_progress.current.processed


class _PreemptionCheckpoint(Callback):
    """Runs the agreed preemption at ``on_train_batch_end``: the point where ModelCheckpoint saves mid-epoch,
    so that Lightning resumes the loop exactly there."""

    def __init__(self, strategy: SGDTPStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.strategy._job.preempt_if_agreed(trainer)
