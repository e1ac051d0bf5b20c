"""The core both front ends run (the Trainer's ``SGDTPStrategy`` and Fabric's ``SGDTPFabricStrategy``), without
importing Lightning, so that the two cannot drift: :class:`Job` owns the options, the dimensions, the engine, the
report, the fault guard, the shutdown watchdog and the preemption agreement, and does once what each strategy would
do again (launch checks, joining the process group and laying out, making the engine, the optimizer step's
bookkeeping, collectives under the fault guard, sharded checkpoints, the failure report, teardown). A strategy holds
one (``self._job``), keeps Lightning's vocabulary and delegates; what Lightning knows of the processes (ranks,
devices, the cluster environment) the job reads from its strategy (:class:`Host`). :class:`FrontEnd` is the face
both strategies show their users, read from the job; ``strategy_signature``/``strategy_docs``: their options.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import textwrap
import typing
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from lightning_sgdtp.checkpoint.hooks import ShardedCheckpoints
from lightning_sgdtp.config import SGDTPConfig, check_process_group_backend, check_trainer_plugins
from lightning_sgdtp.engine import model_settings
from lightning_sgdtp.engine.base import BROADCAST_BUCKET_BYTES, EngineInputs, StepEngine
from lightning_sgdtp.engine.parallelize import start_from_rank_0
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.observe.report import PlanReport, plan_dict
from lightning_sgdtp.observe.timeline import OPTIMIZER_LABEL, label
from lightning_sgdtp.planner.auto import given_options
from lightning_sgdtp.runtime import processes, shutdown
from lightning_sgdtp.runtime.faults import FaultGuard
from lightning_sgdtp.runtime.preemption import Preempted, PreemptionCoordinator
from lightning_sgdtp.runtime.shutdown import ShutdownWatchdog
from lightning_sgdtp.sync import comm


class Host(Protocol):
    """What a job reads from its strategy: Lightning knows the processes (its cluster environment and devices)."""

    cluster_environment: Any

    @property
    def global_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def node_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def num_processes(self) -> int: ...

    @property
    def root_device(self) -> torch.device: ...


class Job:
    """One training job as both front ends run it, without Lightning.

    Args:
        host: the strategy that holds the job (ranks, devices, cluster environment).
        make_engine: makes a module's engine (the front end names the engines it runs: the Trainer's picks the
            pipelined one with pipeline options, Fabric's runs the compiled one).
        options: the design documents' ``{"distributed": {"plugin": "sgdtp", ...}}``, or None.
        option_values: the options given by keyword (None: the option's default); they win over ``options``.
        process_group_backend: torch.distributed's backend, or None (nccl on GPUs, gloo on CPU).
        step: the step a failure and the engine name (the Trainer's global step); None: the optimizer steps this
            job counted (a Fabric loop has no step of its own).
        check: what the front end refuses in the options beyond the rest (Fabric: pipeline stages).

    A bad option fails here, in the launching process, before any process starts.
    """

    def __init__(
        self,
        host: Host,
        make_engine: Callable[[nn.Module, EngineInputs], StepEngine],
        options: dict[str, Any] | None,
        option_values: dict[str, Any],
        process_group_backend: str | None,
        step: Callable[[], int] | None = None,
        check: Callable[[SGDTPConfig], None] | None = None,
    ) -> None:
        # The options' parameters are SGDTPConfig's fields (the strategies' signature is made from them): unknown
        # names and bad values fail in from_options, with the known names listed.
        given = {k: v for k, v in option_values.items() if v is not None}
        self.host, self._make_engine = host, make_engine
        self.config = SGDTPConfig.from_options(options, **given)
        if check is not None:
            check(self.config)
        self.given = given_options(options, given)  # what parallelism="auto" keeps fixed
        self.planner: dict[str, Any] | None = None
        check_process_group_backend(process_group_backend)
        self.num_nodes = 1
        self.process_group_backend = process_group_backend
        self.dims: ParallelDims | None = None
        self.engine: StepEngine | None = None
        self.report = PlanReport()
        self.settings = model_settings.TrainingSettings()
        self.steps = 0  # optimizer steps taken
        self._step = step
        self.guard = FaultGuard(self.config.collective_timeout, self.step, *self.config.watch_timeouts)
        self.watchdog: ShutdownWatchdog | None = None
        self.preemption: PreemptionCoordinator | None = None
        self._requeue_said = False

    def step(self) -> int:
        """The step a failure and the engine name: the Trainer's global step, else the optimizer steps taken."""
        return self._step() if self._step is not None else self.steps

    def __getstate__(self) -> dict[str, Any]:
        """``torch.save(trainer)``, ``copy.deepcopy(strategy)``: the options and the report, as with ``DDPStrategy``;
        what belongs to this process's run is left out and rebuilt by the next setup (the dimensions and their meshes'
        process groups, the engine and its compiled code, the watchdog's threads, the preemption signal's handler,
        the settings to undo; the fault guard leaves out its heartbeat: :mod:`~lightning_sgdtp.runtime.process_bound`)."""
        runtime = {"dims": None, "engine": None, "watchdog": None, "preemption": None}
        return {**self.__dict__, **runtime, "settings": model_settings.TrainingSettings()}

    # ----------------------------------------------------------------------------------------------- what it is
    @property
    def dp_size(self) -> int:
        return self.dims.dp if self.dims is not None else self.num_nodes * self.host.num_processes

    @property
    def plan(self) -> dict[str, Any]:
        """Everything the plugin decided, as plain data (also written to ``sgdtp_plan.json`` next to the logs)."""
        return plan_dict(
            self.config, self.dims, self.engine, self.report.graph_breaks, world_size=self.host.world_size,
            dp_size=self.dp_size, num_nodes=self.num_nodes, process_group_backend=self.process_group_backend,
            planner=self.planner,
        )  # fmt: skip

    def describe(self) -> str:
        """The start of the rank-0 line that says how the job runs (each front end completes it)."""
        host = self.host
        return (
            f"parallelism={self.config.parallelism}: {host.world_size} ranks ({self.num_nodes} node(s) x"
            f" {host.num_processes}), data-parallel group of {self.dp_size}, backend={self.process_group_backend}"
        )

    def sampler_kwargs(self) -> dict[str, Any]:
        """Sized by the data-parallel group: the ranks of one tensor-parallel group read the same batches."""
        if self.dims is None:
            return {"num_replicas": self.dp_size, "rank": self.host.global_rank}
        return self.dims.sampler_kwargs(self.host.global_rank)

    # ------------------------------------------------------------------------------------------------ processes
    def check_launch(self, precision: type, layer_sync: bool, front: str) -> None:
        """In the launching process, before any process starts: what ``front`` (``"Trainer"``, ``"Fabric"``) adds
        that the strategy cannot run (a precision plugin of class ``precision`` it cannot run; ``layer_sync``:
        sync_batchnorm), and sizes that cannot work (with ``parallelism="auto"``: at setup, once the planner chose)."""
        check_trainer_plugins(precision, layer_sync, front=front)
        assert self.host.cluster_environment is not None
        n = self.host.num_processes
        if not self.config.planned:
            ParallelDims.resolve(self.config, self.num_nodes * n, n, self.num_nodes)

    def set_world_ranks(self) -> int:
        """This process's rank and the world's size, told to the cluster environment; returns the global rank."""
        env, host = self.host.cluster_environment, self.host
        if env is not None:
            env.set_global_rank(host.node_rank * host.num_processes + host.local_rank)
            env.set_world_size(self.num_nodes * host.num_processes)
        return host.global_rank

    def start(self, default_backend: str, requeue_signal: int | None = None) -> None:
        """Once the processes exist: join the process group (``default_backend`` unless one was named), start the
        fault guard and the shutdown watchdog; ``requeue_signal``: SLURM's, agreed on by the ranks (preemption).
        At interpreter exit the process group is destroyed while Python is alive (:func:`register_exit`), for the
        Trainer too: its teardown leaves the group for a next ``fit``, and a gloo group freed while the interpreter
        finalizes can abort a finished run (CI saw exit -6 after a one-process ``fit`` whose error the script
        caught)."""
        self.report.rank = self.host.global_rank
        self.process_group_backend = self.process_group_backend or default_backend
        if requeue_signal is not None and self.preemption is None:
            self.preemption = PreemptionCoordinator(requeue_signal)
        ignore = (self.preemption.signum,) if self.preemption else ()
        device = self.host.root_device
        self.watchdog = processes.join(
            self.config, self.cluster(), self.process_group_backend, device, self.guard, self.watchdog, ignore
        )
        register_exit(self)

    def start_for_loop(self, default_backend: str) -> None:
        """:meth:`start` for a front end with neither a step-end hook nor a teardown call (Fabric): SLURM's requeue
        signal where its environment has one (the loop asks :meth:`requeue_if_agreed`)."""
        self.start(default_backend, requeue_signal(self.host.cluster_environment))

    def cluster(self) -> processes.Cluster:
        env, host = self.host.cluster_environment, self.host
        assert env is not None
        return processes.Cluster(
            env.main_address, env.main_port, host.global_rank, host.num_processes, self.num_nodes, type(env).__name__,
            env.world_size(),
        )  # fmt: skip

    def lay_out(
        self, module: Callable[[], nn.Module | None], precision: str, fixed: dict[str, Any] | None = None
    ) -> None:
        """The layout (the planner's, for ``module()``, with ``parallelism="auto"``), the dimensions and meshes;
        ``fixed``: what the front end fixes for the planner (Fabric: no pipeline)."""
        self.config, planner, self.dims, lines = processes.lay_out(
            self.config, self.given, module, self.cluster(), self.host.root_device, precision, self.dims, fixed=fixed
        )
        self.planner = planner or self.planner
        for line in lines:
            self.report.say(line)

    # ---------------------------------------------------------------------------------------------------- setup
    def prepare(self, module: nn.Module) -> None:
        """Every rank starts from rank 0's weights, unless the ranks hold parts of this module from an earlier
        trainer function (:meth:`holds_parts`); the training settings the options ask for are applied (and undone
        at teardown)."""
        if not self.holds_parts(module):
            start_from_rank_0(module, BROADCAST_BUCKET_BYTES)
        self.settings = model_settings.for_training(module, self.report.say)

    def holds_parts(self, module: nn.Module) -> bool:
        """Whether the ranks hold parts of ``module`` left by an earlier trainer function on it (a pipeline's
        released stages, after ``fit``): each keeps its values, as a module on its mesh does. Rank 0's copy of the
        other stages is released or stale, and the tensors each rank still holds differ (its stages), so a broadcast
        from rank 0 would send another list than the others receive (a collective mismatch) or overwrite trained
        stages with stale ones. Agreed by every rank (a collective, with a pipeline only): one rank's part is all
        ranks' answer."""
        if self.dims is None or not self.dims.pp_enabled:  # only a pipeline's ranks hold parts: no collective else
            return False
        engine = self.engine
        mine = engine is not None and engine.module is module and engine.holds_a_part
        return any(self.all_gather_object(mine))

    def on_meta(self, empty_init: bool | None) -> bool:
        """Whether the strategy's init context builds on the meta device: asked for (``init_module(empty_init=True)``)
        or, where the strategy decides (``configure_model``), when ``pretrained`` will fill the weights. Each rank
        then allocates its part after the split (:mod:`~lightning_sgdtp.engine.materialize`)."""
        return bool(empty_init) or (empty_init is None and self.config.pretrained is not None)

    def engine_for(self, module: nn.Module | None) -> StepEngine:
        """The engine of this module, made once (a second trainer function on the same module keeps it)."""
        assert module is not None and self.dims is not None
        if self.engine is None or self.engine.module is not module:
            inputs = EngineInputs(
                self.config, self.dims, self.host.root_device, self.report, self.guard, self.preemption,
                self.process_group_backend,
            )  # fmt: skip
            self.engine = self._make_engine(module, inputs)
        return self.engine

    # ---------------------------------------------------------------------------------------------------- steps
    def optimizer_step(self, optimizer: torch.optim.Optimizer, run: Callable[[], Any], scaler: Any = None) -> Any:
        """Lightning's optimizer step (``run``; the closure inside it runs the training step: the step starts
        here) under the fault guard; then the step's coverage proof and the plan file. Returns what ``run`` did.
        ``scaler``: the precision plugin's GradScaler (``16-mixed``), whose inf/NaN verdict every rank then shares
        (:func:`~lightning_sgdtp.sync.comm.found_inf_agreed`: a rank sees only its shards)."""
        engine = self.engine
        assert engine is not None
        engine.begin_step(self.step())
        with self.guard("optimizer_step"), label(OPTIMIZER_LABEL), comm.found_inf_agreed(scaler):
            out = run()
        engine.after_optimizer_step(optimizer, self.host.global_rank)
        self.steps += 1
        if engine.grad_sync is not None:
            with label("sgdtp: publish plan"):
                self.report.publish(lambda: self.plan, engine.plan_token())
        return out

    # ---------------------------------------------------------------------------------------------- collectives
    def reduce(self, tensor: Any, sync: Callable[[Tensor], Tensor], phase: str) -> Any:
        """``sync(tensor)`` (Lightning's all-reduce) under the fault guard, named ``phase``; a non-tensor as it is."""
        if isinstance(tensor, Tensor):
            with self.guard(phase):
                return sync(tensor)
        return tensor

    def barrier(self, name: str = "") -> None:
        comm.barrier(self.guard, name, self.host.root_device)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return comm.broadcast_object(self.guard, obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return comm.all_gather_object(self.guard, obj)

    # ---------------------------------------------------------------------------------------------- checkpoints
    @property
    def sharded_checkpoints(self) -> bool:
        return self.dims is not None and self.dims.sharded_checkpoints

    def checkpoints(self) -> ShardedCheckpoints:
        return ShardedCheckpoints(self.config, self.host.global_rank, self.broadcast, self.barrier, self.guard)

    def save_sharded(self, checkpoint: dict[str, Any], path: Any) -> None:
        """A sharded folder: every rank writes its shards or, with a pipeline, its stages (its copy of the others'
        is stale)."""
        if "state_dict" in checkpoint:
            assert self.engine is not None
            checkpoint = {**checkpoint, "state_dict": self.engine.local_state_dict(checkpoint["state_dict"])}
        self.checkpoints().save(checkpoint, path)

    def load(
        self,
        path: Any,
        module: nn.Module | None,
        optimizers: list[torch.optim.Optimizer],
        weights_only: bool | None,
        load_file: Callable[[Path], dict[str, Any]],
    ) -> tuple[dict[str, Any], bool]:
        """Either format, on any layout: a sharded folder is read by DCP (each rank its part), a one-file
        checkpoint (``load_file``) is split for this mesh. Returns the rest of the checkpoint and whether the model
        and optimizer states were loaded here."""
        path = Path(self.broadcast(str(path)))
        return self.checkpoints().load(
            path, module, optimizers, weights_only, load_file, on_mesh=self.sharded_checkpoints,
            partial_optimizer=self.dims is not None and self.dims.pp_enabled,  # a stage's optimizer: its part
        )  # fmt: skip

    def full_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """The whole model's state dict as plain tensors, on every rank (a collective)."""
        from torch.distributed.tensor import DTensor

        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}
        return self.engine.full_state_dict(state) if self.engine is not None else state

    def save_pretrained(self, module: nn.Module, path: str | Path) -> Path:
        """``module``'s ``transformers`` model (or all of ``module``) as a Hugging Face folder that
        ``from_pretrained`` loads: every rank writes its shards, each output file is joined by one rank. A
        collective (:func:`~lightning_sgdtp.checkpoint.huggingface.save_pretrained`)."""
        from lightning_sgdtp.checkpoint import huggingface as hf

        found = hf.find_hf_model(module)
        prefix, model = found if found is not None else ("", None)
        state = module.state_dict(keep_vars=True)
        sizes = {k: t.numel() * t.element_size() for k, t in hf.export_names(state, prefix, keep_meta=True).items()}
        tensors = {k: t.detach() for k, t in hf.export_names(state, prefix).items()}
        path = Path(self.broadcast(str(path)))
        with self.guard("save_pretrained"):
            out = hf.save_pretrained(tensors, sizes, path, self.host.global_rank, lambda: self.barrier("save_pretrained"),
                                     model.config if model is not None else None)  # fmt: skip
        self.report.say(f"saved a Hugging Face checkpoint to {out} ({len(sizes)} tensors, each rank its shards)")
        return out

    # ------------------------------------------------------------------------------------------ faults, the end
    def failed(self, exception: BaseException) -> None:
        """An error that ends this rank is told to the peers (they stop within seconds, naming it) and to the
        shutdown watchdog; an agreed preemption is no failure."""
        if isinstance(exception, Preempted):
            return
        self.guard.report(exception)
        if self.watchdog is not None:
            self.watchdog.failed(exception)

    def preempt_if_agreed(self, trainer: Any) -> None:
        """At the end of a step the ranks agreed on: save the preemption checkpoint, requeue, stop."""
        if self.preemption is not None and self.preemption.agreed:
            self.preemption.preempt(trainer, self.broadcast, self.host.global_rank, self.report.say)

    def requeue_if_agreed(self, path: Any, save: Callable[[str], None]) -> None:
        """A loop's end of step (Fabric's): where the ranks agreed on SLURM's signal, ``save(path)`` on every rank
        (the strategy's atomic save; ``path`` is rank 0's), requeue the job and stop (:class:`Preempted`, exit 0);
        else nothing. The first call says on rank 0 what the signal will do."""
        preemption = self.preemption
        if preemption is None:
            return
        if not self._requeue_said:
            self._requeue_said = True
            self.report.say(
                f"SLURM: on signal {preemption.signum} the ranks agree on a step; at its end the loop's"
                f" requeue_if_agreed saves the state to {path}, requeues the job and stops"
            )
        if preemption.agreed:
            where = self.broadcast(str(path))
            rank, step = self.host.global_rank, self.step()
            preemption.save_and_requeue(where, lambda: save(where), step, self.broadcast, rank, self.report.say)

    def leave(self) -> None:
        """At interpreter exit (after a Trainer's teardown, nothing left to stop; at a Fabric script's end, no
        teardown ran): stop the heartbeat (joined: the peers learn that this rank left on purpose) and, unless this
        rank failed (its countdown still bounds the exit), the watchdog, before Python finalizes
        (:func:`leave_at_exit` then destroys the process group)."""
        failed = self.guard.failed
        self.guard.close()
        if self.watchdog is not None and not failed:
            self.watchdog.close()

    def stays_in_place(self, module: nn.Module) -> bool:
        """Whether ``module`` stays where it is at teardown: split on a mesh, a pipeline rank's stages, or (setup
        failed early) still on the meta device; ``module.cpu()`` can move none of them."""
        from lightning_sgdtp.engine.materialize import has_meta
        from lightning_sgdtp.engine.parallelize import is_tensor_parallel

        in_place = self.engine is not None and self.engine.holds_a_part
        return in_place or is_tensor_parallel(module) or has_meta(module)

    def teardown(self, forget: bool = False) -> None:
        """Undo what setup installed: the training settings, the engine's changes, the preemption signal, the
        fault guard's heartbeat, the watchdog. ``forget``: drop the engine and the watchdog too (a later setup
        starts afresh)."""
        self.settings.restore()
        if self.engine is not None:
            # After a failure no collective: a peer may never come (it failed too, or waits elsewhere).
            self.engine.teardown(self.barrier if not self.guard.failed else lambda name: None)
        if self.preemption is not None:
            self.preemption.close()
            self.preemption = None
        self.guard.close()
        if self.watchdog is not None:
            self.watchdog.close()
        if forget:
            self.engine, self.watchdog = None, None


class FrontEnd:
    """The properties and collectives both strategies show, read from their job (``self._job``): a mixin placed
    before Lightning's ``ParallelStrategy``; it holds nothing of its own."""

    _job: Job
    parallel_devices: list[torch.device] | None
    local_rank: int

    @property
    def config(self) -> SGDTPConfig:
        return self._job.config

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._job.num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._job.num_nodes = num_nodes

    _num_nodes = num_nodes  # the name Fabric's connector sets (Fabric(num_nodes=...)), the Trainer's num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def dims(self) -> ParallelDims | None:
        """Every parallel dimension, the rank grid and the meshes (known once the processes exist)."""
        return self._job.dims

    @property
    def engine(self) -> Any:
        """What runs the steps: the compiled engine or the pipelined one (chosen at setup)."""
        return self._job.engine

    @property
    def grad_sync(self) -> Any:
        return self._job.engine.grad_sync if self._job.engine is not None else None

    @property
    def dp_size(self) -> int:
        return self._job.dp_size

    @property
    def process_group_backend(self) -> str | None:
        return self._job.process_group_backend

    @property
    def plan(self) -> dict[str, Any]:
        """Everything the plugin decided, as plain data (also written to ``sgdtp_plan.json`` next to the logs)."""
        return self._job.plan

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._job.barrier(args[0] if args else "")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._job.broadcast(obj, src)


def requeue_signal(env: Any) -> int | None:
    """SLURM's requeue signal where ``env`` is Lightning's ``SLURMEnvironment`` with ``auto_requeue`` (read by its
    attributes: this module imports no Lightning), else None."""
    signum = getattr(env, "requeue_signal", None)
    return int(signum) if getattr(env, "auto_requeue", False) and signum is not None else None


#: The jobs of this process that :func:`leave_at_exit` ends (one per Fabric; a script may make several).
_AT_EXIT: weakref.WeakSet[Job] = weakref.WeakSet()
_EXIT_HOOK: list[bool] = []


def register_exit(job: Job) -> None:
    """End ``job`` at interpreter exit: :func:`leave_at_exit`, registered with ``atexit`` once per process."""
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(leave_at_exit)
    _AT_EXIT.add(job)


def leave_at_exit() -> None:
    """Every registered job's threads stop (:meth:`Job.leave`), then the process group is destroyed while Python is
    alive, after meeting the peers unless this rank failed (a peer may never come):
    :func:`~lightning_sgdtp.runtime.shutdown.leave_process_group`. In that order: the store the heartbeats write to
    goes with the process group."""
    jobs = list(_AT_EXIT)
    failed = any(job.guard.failed for job in jobs)
    for job in jobs:
        with contextlib.suppress(Exception):
            job.leave()
    with contextlib.suppress(Exception):
        shutdown.leave_process_group(meet=not failed)


def strategy_signature(init: Callable[..., None]) -> inspect.Signature:
    """``SGDTPStrategy.__init__`` as LightningCLI and ``help()`` see it: its own parameters (``options``, Lightning's),
    then every option as a keyword-only parameter typed as its field (``None``: the option's default). An option
    is declared once, as a field here."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    hints = typing.get_type_hints(SGDTPConfig)
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=hints[f.name] | None)
        for f in dataclasses.fields(SGDTPConfig)
    ]
    return inspect.Signature([*own, *options])


def strategy_docs() -> str:
    """``SGDTPStrategy.__init__``'s ``Args:``: ``options``, then each option's help text from :class:`SGDTPConfig`."""
    doc = inspect.cleandoc(SGDTPConfig.__doc__ or "")
    entries = textwrap.dedent(doc[doc.index("Args:") + len("Args:") :].strip("\n"))
    head = (
        'options: the design documents\' ``{"distributed": {"plugin": "sgdtp", "strategy": "data", ...}}``;'
        " explicit keyword arguments win over it."
    )
    summary = "The strategy's options: ``options`` and every field of :class:`SGDTPConfig` (``docs/options.md``)."
    return f"{summary}\n\nArgs:\n" + textwrap.indent(f"{head}\n{entries}", "    ") + "\n"
