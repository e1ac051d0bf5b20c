"""``SGDTPFabricStrategy``: Fabric glue (``Fabric(strategy="sgdtp")``), beside the Trainer's ``SGDTPStrategy``.

The same options (:class:`~lightning_sgdtp.config.SGDTPConfig`), processes and layout, engine
(:class:`~lightning_sgdtp.engine.compiled.CompiledStep`), gradient sync and checkpoints as the Trainer strategy: both
delegate them to a :class:`~lightning_sgdtp.frontends.job.Job`; only the hooks differ. Fabric has no
``training_step``: the module ``fabric.setup`` returns runs its call (``_call_impl``: forward and its hooks)
compiled by the ``"sgdtp"`` backend, so the gradient buckets are in the compiled backward ``fabric.backward`` runs;
what the loop computes eagerly around it (the loss) is covered by the ledger. ``fabric.no_backward_sync`` runs
the graphs without collectives (compiled on first use), and the accumulated sum is averaged during the next
synced micro-batch, as with the Trainer.

Pipeline stages are refused: a Fabric loop has no step boundary the strategy could cut into micro-batches.

Imports ``lightning.fabric`` only (never ``lightning.pytorch``). Checkpoints are the Trainer's layout
(``state_dict``, ``optimizer_states``), so a Fabric checkpoint resumes under the Trainer and back.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _sync_ddp_if_available
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.fabric.wrappers import _unwrap_objects
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sgdtp.checkpoint import hooks as checkpoints
from lightning_sgdtp.config import SGDTPConfigError, check_fabric_options
from lightning_sgdtp.engine.compiled import CompiledStep
from lightning_sgdtp.engine.parallelize import to_device
from lightning_sgdtp.engine.step_compile import adopt_compiled
from lightning_sgdtp.frontends.job import FrontEnd, Job, strategy_docs, strategy_signature
from lightning_sgdtp.observe.timeline import label
from lightning_sgdtp.parallel.checkpointing import find_block_stack, no_block_stack_message
from lightning_sgdtp.sync import comm

#: The step Fabric's module runs compiled: the module's call, its forward hooks included (tensor parallel's).
FABRIC_STEP = "_call_impl"

_CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module."


class SGDTPFabricStrategy(FrontEnd, ParallelStrategy):
    """``Fabric(strategy="sgdtp")`` or ``Fabric(strategy=SGDTPFabricStrategy(sharding="full", ...))``: the Trainer
    strategy's options and engines for a Fabric loop (``docs/fabric.md``)."""

    strategy_name = "sgdtp"

    def __init__(
        self,
        *,
        options: dict[str, Any] | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        **option_values: Any,
    ) -> None:
        # A bad option fails here, unspawned. The compiled engine alone (no pipeline with Fabric); the job counts the
        # optimizer steps (a Fabric loop has no global step).
        self._job = Job(self, CompiledStep, options, option_values, process_group_backend, check=check_fabric_options)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision=precision,
        )
        self._backward_sync_control = _SGDTPBackwardSyncControl(self)
        #: id(parameter before setup) -> (a weak reference to it, its name): optimizers made before the split.
        self._names_before: dict[int, tuple[weakref.ref, str]] = {}
        self._said_eager = False
        self._clip: Any = None  # the engine's clipping by the norm over every shard (None: torch's, replicas alone)

    # ----------------------------------------------------------------------------------------- properties
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._job.dims is None and self._job.config.planned:
            raise SGDTPConfigError(
                "parallelism='auto' chooses the layout at fabric.setup(model): call fabric.setup_dataloaders(...)"
                " after it (the data-parallel size decides which samples each rank reads)."
            )
        return self._job.sampler_kwargs()

    # ---------------------------------------------------------------------------------------- processes
    @override
    def _configure_launcher(self) -> None:
        accelerator = self.accelerator
        if accelerator is not None and not isinstance(accelerator, (CPUAccelerator, CUDAAccelerator)):
            raise SGDTPConfigError(
                f"Fabric(accelerator={type(accelerator).__name__}) is not supported by the sgdtp strategy: its"
                " compiled collectives run on torch.distributed's gloo (CPU) or NCCL (CUDA). Use"
                " Fabric(accelerator='cpu') or Fabric(accelerator='cuda')."
            )
        self._job.check_launch(type(self.precision), False, "Fabric")
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _set_world_ranks(self) -> None:  # the name Fabric's connector calls
        rank_zero_only.rank = utils_rank_zero_only.rank = self._job.set_world_ranks()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        self._job.start_for_loop(_get_default_process_group_backend_for_device(self.root_device))  # SLURM, atexit
        _report_uncaught(self._job)  # Fabric has no on_exception: an error that ends this rank ends its peers too
        if not self._job.config.planned:
            self._lay_out(None)

    def _lay_out(self, module: nn.Module | None) -> None:
        self._job.lay_out(lambda: module, str(self.precision.precision), fixed={"pp": 1})

    # -------------------------------------------------------------------------------------------- setup
    @override
    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any | None = None
    ) -> tuple[nn.Module, list[Optimizer], Any | None]:
        module = self.setup_module(module)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Lay ``module`` out (tensor parallel, sharding, checkpointing) and compile its call; returns the module
        Fabric wraps (its forward runs the compiled step)."""
        job = self._job
        self._check_module(module)
        if job.dims is None:  # parallelism="auto": planned for this module, on every rank alike
            self._lay_out(module)
        if job.config.activation_checkpointing and find_block_stack(module) is None:
            raise SGDTPConfigError(no_block_stack_message(module))
        self._names_before = {id(p): (weakref.ref(p), n) for n, p in module.named_parameters()}
        job.prepare(module)
        engine = job.engine_for(module)
        job.report.place(Path.cwd(), job.config.plan_file, logger=False)  # Fabric's loggers are not the strategy's
        job.report.say(
            f"Fabric: {job.describe()}; {type(module).__name__}'s call compiled (forward and its hooks),"
            " fabric.backward runs its compiled backward"
        )
        self._clip = engine.setup(True, 1, step=FABRIC_STEP)  # by the norm over every shard: None for replicas alone
        return _SGDTPModule(module, self)

    def _check_module(self, module: nn.Module) -> None:
        """What Fabric lets through and the strategy cannot run: a second model, a wrapped one (a compiled one: adopted)."""
        engine = self._job.engine
        if engine is not None:
            again = "the same model" if engine.module is module else f"a second model ({type(module).__name__})"
            raise SGDTPConfigError(
                f"fabric.setup() got {again}, but the sgdtp strategy runs one model per Fabric (one compiled step and"
                " gradient sync): set up each model once, and put models trained together into one nn.Module."
            )
        adopt_compiled(module, self._job.report.say, "fabric.setup()", _fabric_compile_kwargs())
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
        from torch.nn.parallel import DistributedDataParallel

        wrapped = [
            f"{name or type(module).__name__} ({type(m).__name__})"
            for name, m in module.named_modules()
            if isinstance(m, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule))
        ]
        if wrapped:
            raise SGDTPConfigError(
                f"fabric.setup() got a model wrapped for another strategy: {wrapped[:3]}. The sgdtp strategy lays the"
                " model out itself (data, sharding, tensor parallel): pass the plain nn.Module, without"
                " DistributedDataParallel / FSDP / fully_shard."
            )

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer of the set-up model: one made from the model before ``fabric.setup`` split its parameters
        (tensor parallel, sharding) is pointed at the split ones, by name."""
        if self._job.engine is None:
            raise SGDTPConfigError(
                "fabric.setup_optimizers() was called before the model was set up. With the sgdtp strategy set up the"
                " model first (model = fabric.setup_module(model)), then the optimizer made from its parameters"
                " (optimizer = fabric.setup_optimizers(optimizer)), or both at once: fabric.setup(model, optimizer)."
            )
        self._point_at_split_parameters(optimizer)
        self._job.engine.setup_optimizers([optimizer])
        return optimizer

    def _point_at_split_parameters(self, optimizer: Optimizer) -> None:
        assert self._job.engine is not None
        module = self._job.engine.module
        current = {id(p) for p in module.parameters()}
        by_name = {n.replace(_CHECKPOINT_WRAPPED, ""): p for n, p in module.named_parameters()}
        for group in optimizer.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                if id(p) in current:
                    continue
                ref, name = self._names_before.get(id(p), (None, None))
                if ref is None or ref() is not p or name not in by_name:
                    raise SGDTPConfigError(
                        f"the optimizer {type(optimizer).__name__} steps a tensor of shape {tuple(p.shape)} that is"
                        f" not a parameter of the set-up {type(module).__name__}. Make the optimizer from the model's"
                        " parameters: fabric.setup(model, optimizer) or, after model = fabric.setup_module(model),"
                        " optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))."
                    )
                if optimizer.state.get(p):
                    raise SGDTPConfigError(
                        f"the optimizer {type(optimizer).__name__} has state for {name!r} already, but fabric.setup"
                        " split that parameter (tensor parallel / sharding). Set up the optimizer before its first"
                        " step, or load its state after setup (fabric.load)."
                    )
                params[i] = by_name[name]

    @override
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: on the meta device (each rank allocates its part at setup)."""
        if not self._job.on_meta(empty_init):
            return super().module_init_context(empty_init)
        stack = ExitStack()
        for context in (torch.device("meta"), self.precision.module_init_context()):
            stack.enter_context(context)
        return stack

    @override
    def module_to_device(self, module: nn.Module) -> None:
        to_device(module, self.root_device)

    # --------------------------------------------------------------------------------------------- steps
    def forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """What the set-up module's forward runs: the compiled step while training; eagerly under ``no_grad`` /
        ``eval()``, and for Fabric's redirected methods (``model.training_step(...)``: the ledger averages their
        gradients after backward)."""
        engine = self._job.engine
        assert engine is not None
        training = torch.is_grad_enabled() and module.training
        if "forward" in module.__dict__ or not training:
            if "forward" in module.__dict__ and not self._said_eager:
                self._said_eager = True
                self._job.report.say(
                    "a method other than forward (fabric_model.<method>(...)) runs eagerly: its gradients are"
                    " averaged after backward, not inside a compiled backward; call the model itself for the"
                    " compiled step"
                )
            with engine.implicit_replication():
                return module(*args, **kwargs)
        engine.begin_step(self._job.step())
        with label("sgdtp: forward"):
            return engine.training_step(args, kwargs, None, [])

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        # Fabric's Strategy.backward, with the gradient sync around the precision plugin's backward.
        engine = self._job.engine
        if engine is None:
            return super().backward(tensor, module, *args, **kwargs)
        self.precision.pre_backward(tensor, module)
        engine.before_backward(tensor)
        engine.backward(lambda: self.precision.backward(tensor, module, *args, **kwargs))
        self.precision.post_backward(tensor, module)
        return None

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        step = super().optimizer_step
        if self._job.engine is None:
            return step(optimizer, **kwargs)
        return self._job.optimizer_step(
            optimizer, lambda: step(optimizer, **kwargs), getattr(self.precision, "scaler", None)
        )

    @override
    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """By the norm of the whole model: over every shard and tensor-parallel part (torch's rule otherwise)."""
        with comm.found_inf_agreed(getattr(self.precision, "scaler", None)):  # it unscales: every rank one verdict
            if self._clip is None:
                return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
            self.precision.unscale_gradients(optimizer)
        params = list(self.precision.main_params(optimizer))
        return self._clip(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite)

    # -------------------------------------------------------------------------------------- collectives
    @override
    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Tensor:
        sync = lambda t: _sync_ddp_if_available(t, group, reduce_op=reduce_op)
        return self._job.reduce(tensor, sync, "all_reduce")

    # -------------------------------------------------------------------------------------- checkpoints
    @override
    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return _inner(module).state_dict()

    def save_pretrained(self, module: nn.Module, path: _PATH) -> Path:
        """The model as a Hugging Face folder ``from_pretrained`` loads (every rank its shards; a collective)."""
        return self._job.save_pretrained(_inner(module), path)

    @override
    def load_module_state_dict(self, module: nn.Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        _inner(module).load_state_dict(state_dict, strict=strict)

    @override
    def save_checkpoint(
        self, path: _PATH, state: dict[str, Any], storage_options: Any | None = None, filter: dict | None = None
    ) -> None:
        """The Trainer strategy's layout (``state_dict``, ``optimizer_states``, the rest as given), so that either
        front end resumes from it: one file from rank 0 for replicas, a sharded folder (every rank its part) on a
        mesh; written atomically and recorded in the folder's manifest."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                "fabric.save(..., filter=...) / storage_options are not supported by the sgdtp strategy: it writes the"
                " whole state (sharded on a mesh). Save without them."
            )
        from lightning_sgdtp.checkpoint.fabric_layout import to_trainer_layout

        job = self._job
        module = job.engine.module if job.engine is not None else None
        checkpoint = to_trainer_layout(state, module, by_name=job.sharded_checkpoints)
        if job.sharded_checkpoints:
            return job.save_sharded(checkpoint, path)
        if self.is_global_zero:
            checkpoints.save_file(checkpoint, Path(path), job.config.signing_key)
        return None

    @override
    def load_checkpoint(
        self,
        path: _PATH,
        state: nn.Module | Optimizer | dict[str, nn.Module | Optimizer | Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Either format (a Trainer checkpoint too), on any layout: what ``state`` names is loaded in place; the
        rest is returned."""
        from lightning_sgdtp.checkpoint.fabric_layout import from_trainer_layout

        config = self._job.config
        module, optimizers = _module_and_optimizers(state)

        def load_file(p: Path) -> dict[str, Any]:
            if config.verify_artifacts:
                checkpoints.verify_file(p, config.trusted_key)
            return torch.load(p, map_location="cpu", weights_only=bool(weights_only))

        rest, loaded = self._job.load(path, module, optimizers, weights_only, load_file)
        return from_trainer_layout(rest, state, loaded, strict, self.load_module_state_dict)

    def requeue_if_agreed(self, path: _PATH, state: dict[str, Any]) -> None:
        """Call at the end of each step (every rank). On SLURM, once the ranks agreed on its signal (``--signal``,
        the time limit): ``fabric.save(path, state)``, requeue the job, exit 0; the loop loads ``path`` on restart."""
        self._job.requeue_if_agreed(path, lambda where: self.save_checkpoint(where, _unwrap_objects(state)))

    # ------------------------------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        """Undo what setup installed (Fabric does not call it: ``fabric.strategy.teardown()``, or at exit)."""
        self._job.teardown(forget=True)
        super().teardown()


SGDTPFabricStrategy.__init__.__signature__ = strategy_signature(SGDTPFabricStrategy.__init__)  # type: ignore[attr-defined]
SGDTPFabricStrategy.__init__.__doc__ = strategy_docs()


class _SGDTPModule(nn.Module):
    """What ``fabric.setup`` wraps: the user's module, its call compiled by the strategy."""

    def __init__(self, module: nn.Module, strategy: SGDTPFabricStrategy) -> None:
        super().__init__()
        self.module = module
        self.__dict__["_sgdtp_strategy"] = strategy  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_sgdtp_strategy"].forward(self.module, args, kwargs)


class _SGDTPBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the micro-batches inside run graphs without collectives (compiled on the
    first use); their sum is averaged during the next synced micro-batch, overlapped with it."""

    def __init__(self, strategy: SGDTPFabricStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        engine = self.strategy.engine
        if not enabled or engine is None or engine.grad_sync is None:
            return nullcontext()
        engine.add_accumulating_step()
        return engine.grad_sync.no_sync()


def _inner(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, _SGDTPModule) else module


def _module_and_optimizers(state: Any) -> tuple[nn.Module | None, list[Optimizer]]:
    items = state.values() if isinstance(state, dict) else [state] if state is not None else []
    modules = [_inner(v) for v in items if isinstance(v, nn.Module)]
    return (modules[0] if modules else None), [v for v in items if isinstance(v, Optimizer)]


def _fabric_compile_kwargs() -> dict[str, Any] | None:
    """The arguments of the ``torch.compile`` wrapper Fabric stripped off the module it is setting up (None: none),
    the very dict it re-applies around what the strategy returns. Read from Fabric.setup's frame: Fabric does not
    tell the strategy."""
    from lightning.fabric import Fabric

    codes = {Fabric.setup.__code__, Fabric.setup_module.__code__}
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in codes:
            return frame.f_locals.get("compile_kwargs")
        frame = frame.f_back
    return None


def _report_uncaught(job: Job) -> None:
    """An exception that ends this rank's script is told to the peers first (they stop within seconds, naming it):
    Fabric has no ``on_exception`` hook."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        with contextlib.suppress(Exception):
            job.failed(exc)
        previous(kind, exc, tb)

    if getattr(previous, "_sgdtp", False):
        return
    hook._sgdtp = True  # type: ignore[attr-defined]
    sys.excepthook = hook
