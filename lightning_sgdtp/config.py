"""One typed, validated description of what the user asked for.

Every entry point (``SGDTPStrategy(...)``, ``SGDTPFabricStrategy(...)``, ``options=...`` and ``torch.compile(model,
backend="sgdtp", options=...)``) builds an :class:`SGDTPConfig`, so an invalid option fails the same way everywhere:
at construction, before any process is spawned, with a message that names the option and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_sgdtp.parallel import TECHNIQUES
from lightning_sgdtp.parallel.pipeline.technique import PIPELINE
from lightning_sgdtp.parallel.sharding import WIRE_DTYPES as GRAD_COMM_DTYPES
from lightning_sgdtp.parallel.technique import check_all, option_names, own_defaults
from lightning_sgdtp.parallel.tensor.technique import TP_STYLES  # noqa: F401  (a public name of this module)

PARALLELISMS = ("data", "tensor", "hybrid", "auto")


#: ``debug_skip_sync`` values: the negative controls.
DEBUG_SKIPS = (None, "dp-sync", "reduce-scatter")

#: The ``precision=`` values the strategy runs: Lightning's plugins in ``PRECISION_PLUGINS``.
SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")
#: Lightning's precision plugins the strategy runs (``lightning.pytorch`` and ``lightning.fabric`` alike), and any
#: subclass of them: its own hooks (``convert_module``, ``forward_context``, ``backward``, ...) are the ones called.
PRECISION_PLUGINS = ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision")
#: Lightning's precision plugins it cannot run (and their subclasses), with why.
REFUSED_PRECISION_PLUGINS = {
    "BitsandbytesPrecision": "it swaps nn.Linear layers for bitsandbytes' quantized ones, whose weights keep their"
    " quantization state outside the tensor (Params4bit.quant_state): the strategy's broadcast from rank 0, sharding"
    " and tensor-parallel split move the tensors alone",
    "TransformerEnginePrecision": "Transformer Engine's layers and its fp8_autocast (which updates the FP8 scaling"
    " state and reduces it across ranks itself) are not traceable by torch.compile, and the strategy compiles the"
    " training step",
    "DeepSpeedPrecision": "it hands backward and the optimizer step to a DeepSpeed engine (strategy='deepspeed')",
    "FSDPPrecision": "it leaves mixed precision to FSDP's wrapper (strategy='fsdp'), which the sgdtp strategy does"
    " not use (it shards with its own sharding= option)",
    "XLAPrecision": "it is for XLA devices (TPUs); the strategy runs on CPU and CUDA",
}


class SGDTPConfigError(ValueError):
    """An option given to lightning-sgdtp is invalid. The message says which one and how to fix it."""


class NotAvailableYetError(NotImplementedError):
    """A documented option whose implementation has not landed yet. Never silently ignored."""


@dataclass(frozen=True)
class SGDTPConfig:
    """What the user asked for. See ``docs/options.md`` for every field with an example.

    Args:
        parallelism: ``"data"`` (every rank a replica), ``"tensor"`` (every rank holds a slice of each split layer:
            one tensor-parallel group of all ranks) or ``"hybrid"`` (a 2-D mesh: data parallel across groups of
            ``tensor_parallel_size`` ranks). See ``docs/tensor-parallel.md``. ``"auto"``: the planner chooses the
            layout at setup (data, tensor, hybrid or pipeline parallel, sharding, checkpointing, micro-batches) from
            the model, the memory and the measured links, the fastest predicted per sample that fits; the layout
            options you set stay fixed and it plans the rest. See ``docs/planner.md``.
        bucket_cap_mb: ``"auto"`` (default): bucket boundaries chosen per backward graph by a cost model measured at
            setup (all-reduce latency and bandwidth on the data-parallel group, compute and memory throughput)
            over the order in which backward produces the gradients; see ``docs/speed.md``. A number: an upper
            bound of one fused gradient all-reduce, in MiB (like DDP's ``bucket_cap_mb``).
        grad_comm_dtype: ``None`` (communicate in the gradient's dtype) or ``"bf16"``: halves the bytes sent;
            lossy (gradients are rounded to bfloat16 before the sum).
        overlap: Schedule bucket all-reduces to overlap backward compute (the point of the plugin). ``False``
            waits for each bucket right after its all-reduce (no overlap); useful to measure what overlap buys.
        activation_checkpointing: Recompute each repeated block (transformer layer) in backward instead of
            keeping its activations. Applied per block, before compile.
        broadcast_buffers: Broadcast module buffers (e.g. BatchNorm statistics) from rank 0 before each
            training step, like DDP.
        collective_timeout: Seconds a collective may wait before the job fails (process-group timeout). It also
            bounds how long the job takes to end when a rank dies, raises or hangs (see
            ``docs/slurm-and-faults.md#a-rank-dies-raises-or-hangs``).
        heartbeat_timeout: Seconds a rank's heartbeat may stay silent before the other ranks take it for frozen or
            lost (SIGSTOP, a hung driver call, a stalled or vanished node) and every rank ends, naming it, whatever
            ``collective_timeout`` is. ``False``: off. See ``docs/slurm-and-faults.md#a-rank-is-frozen-or-stuck``.
        stall_timeout: Seconds a rank may run Python in one phase and step while another rank waits for it in a
            collective before it is stuck: it prints its stack and the job ends, naming it. Longer than
            ``heartbeat_timeout``; not while compiling, setting up, loading or saving a checkpoint, or in the first
            step. ``False``: off.
        shutdown_grace: Seconds a rank has to end on its own after SIGTERM / SIGINT, or after it failed, before it
            is ended (exit code 128 + signal, or 1) even if it is blocked in a collective; its peers are told and
            end too. See ``docs/slurm-and-faults.md``.
        rendezvous_timeout: Seconds the ranks may take to meet at ``MASTER_ADDR:MASTER_PORT`` when the job
            starts; then the job fails with an error that names the address and port.
        verify_artifacts: Verify a checkpoint against the SHA256 manifest of its folder (and its signature, with
            ``trusted_key``) before anything is unpickled; refuse it otherwise. Checkpoints written by the strategy
            have a manifest; sign others with ``sgdtp sign DIR``.
        trusted_key: A gpg keyring (checked with ``gpgv``) or a PEM public key: checkpoints must be signed by it.
        signing_key: Sign each checkpoint folder's manifest: ``"gpg:KEY"`` (a gpg key id, fingerprint or email;
            ``GNUPGHOME`` applies) or the path of a PEM private key.
        regional_compile: compile each distinct block of the block stack once and reuse it for every layer
            (``nested_compile_region``); ``False``: one graph, each layer on its own. See ``docs/compile-cache.md``.
        compile_cache: ``"auto"`` (default): a per-user cache folder (``$SGDTP_COMPILE_CACHE``, else the platform's
            cache directory; ``SGDTP_COMPILE_CACHE=off`` turns it off; not with pipeline stages); a folder shared by
            the nodes; False: off. One rank per node compiles, later jobs of the same model, layout and plan start
            warm. See ``docs/compile-cache.md``.
        compile_cache_max_gb: the bound of the compile cache folder; the least recently used bundles go first.
        tensor_parallel_size: ranks per tensor-parallel group (``"tensor"``/``"hybrid"``): an int, or ``"auto"``
            (the default): all ranks for ``"tensor"``, one fast-link island for ``"hybrid"`` (an NVLink group;
            on CPU, one node).
        tp_plan: ``{glob over module names: style}`` replacing the automatic tensor-parallel plan; styles
            ``"colwise"``, ``"rowwise"``, ``"colwise_gather"``, ``"replicate"``.
        sequence_parallel: split the residual stream of the block stack by sequence too (norms, dropout and
            residual adds on 1/tp of the activations; all-gather before and reduce-scatter after the split layers
            instead of one all-reduce). ``None`` (default): off on every device; on CPU gloo runs a reduce-scatter
            as a full all-reduce, and on CUDA it stays off until a GPU run of ``benchmarks/gpu_check.py`` passes
            (``docs/hardware.md``). ``True``: on. Applied only where it is correct; see the plan's log line.
        pipeline_stages: ranks per pipeline (pipeline-parallel size, >= 2); data parallel runs across the
            pipelines (``devices / pipeline_stages`` replicas). With ``parallelism="tensor"`` every rank of a stage
            is in its tensor-parallel group; with ``"hybrid"``, ``tensor_parallel_size`` ranks of a stage are
            (pipeline x data x tensor, 3-D). ``None`` with ``pipeline_chunks`` set: one
            pipeline per node when there are several nodes (each stage across nodes, data parallel inside
            them), else all ranks. See ``docs/pipeline-parallel.md``.
        pipeline_chunks: micro-batches per step (the batch each rank loads is cut into this many); the global
            batch and the optimizer step are those of training without the pipeline. Default with
            ``pipeline_stages``: ``2 x pipeline_stages``.
        pipeline_schedule: ``"1f1b"`` (default: one forward, one backward; activations of at most ``stages``
            micro-batches alive), ``"gpipe"`` (all forwards, then all backwards) or ``"interleaved_1f1b"``
            (``pipeline_stages_per_rank`` stages per rank, a smaller bubble for more messages).
        pipeline_split: the names of the blocks where stages 1, 2, ... start, instead of the automatic split.
        pipeline_balance: ``"params"`` (default: balance the automatic split by parameter count) or
            ``"measured"`` (time each block's forward on the first batch, balance by that).
        pipeline_stages_per_rank: stages each rank holds with ``"interleaved_1f1b"`` (default 2).
        optimizer_update: how the optimizers from ``configure_optimizers`` update: ``"auto"`` (default: torch's
            fused kernel where it has one for the optimizer and device, else the step compiled by
            ``torch.compile``; user choices of ``fused``/``foreach`` kept), ``"fused"``, ``"compiled"`` or
            ``"eager"`` (as configured). See ``docs/speed.md``.
        sharding: ``"none"`` (default: every data-parallel rank holds the whole model), ``"full"`` (parameters,
            gradients and optimizer state split across the data-parallel ranks; a parameter is gathered where it is
            used and freed after use: ZeRO-3 / FSDP) or ``"optimizer"`` (gradients and optimizer state split,
            parameters split between steps and gathered once per step: ZeRO-2). Every mode: data, hybrid (with
            tensor parallel, a 2-D layout) and pipeline (each stage over its replicas). See ``docs/sharding.md``.
        param_gather_dtype: with ``sharding``: ``None`` (gather parameters in their own dtype) or ``"bf16"`` (half
            the bytes of each all-gather; the computation then sees bfloat16 parameters, as with bf16-mixed).
        shard_size: with ``sharding`` (``parallelism="data"`` or ``"hybrid"``, with or without pipeline stages; a
            stage's data-parallel ranks with pipeline stages): over how many data-parallel ranks a parameter is
            split. ``None`` (default: all of them), ``"node"`` (the ranks of one node: split inside a node over its
            fast links, replicated across nodes, FSDP's hybrid shard / HSDP) or an int that divides the
            data-parallel size. The replicas' gradients are all-reduced across the groups.
        profile_steps: ``(first, last)``: record optimizer steps ``first`` .. ``last`` (inclusive) with
            torch.profiler on every rank and write a timeline (a trace per rank for Perfetto / Chrome, and one HTML
            page of a step) into ``sgdtp_timeline/`` next to the logs. See ``docs/speed.md``.
        plan_file: where rank 0 writes the plan (``strategy.plan`` as JSON). ``"auto"`` (default): ``sgdtp_plan.json``
            in the logger's folder (``trainer.log_dir``), none without a logger (``logger=False``; Fabric); a file
            path (or an existing folder, the file inside it): there, with or without a logger; False: none.
        max_memory_per_rank: with ``parallelism="auto"``: the memory a rank may use, with a unit (``"300MB"``,
            ``"80GB"``, ``"1.5GiB"``); default: the device's memory on GPUs, none on CPU. Only layouts predicted to
            fit (parameters, gradients, optimizer state, the gathered block, activations) are chosen; if none fits,
            setup fails naming the smallest layout and its predicted memory.
        debug_skip_sync: a negative control, for tests: ``"dp-sync"`` (no data-parallel gradient averaging at all)
            or ``"reduce-scatter"`` (the sharded parameters' gradients not reduced; the compile-time proof must then
            fail). Training is wrong on purpose: it acts only with ``SGDTP_DEBUG_OPTIONS=1`` in the environment (the
            test suite sets it) and is refused with a warning otherwise. Shown in the plan. See
            ``docs/options.md``.
        pretrained: a Hugging Face checkpoint (the folder ``save_pretrained`` writes: ``*.safetensors``, with its index
            when in several files) loaded into the model at setup, after the split: each rank reads only the bytes
            of what it holds (its shards, slices, stages), converted to the parameters' dtype. Every missing,
            unexpected or misshaped tensor is named in one error before any step. With it, ``configure_model`` runs
            on the meta device (nothing is allocated before the split). See ``docs/big-models.md``.
        init_weights: how a model built on the meta device is initialized where ``pretrained`` has nothing:
            ``fn(module)`` initializing one module's own parameters and buffers, or its import path
            (``"package.module:function"``). Default: a ``transformers`` model's ``_init_weights``, else each
            module's ``reset_parameters()``. Run per module on whole host copies under a seed from the job's seed
            and the module's name, each rank keeping its slice: the same values on any layout.
        technique_options: the options of techniques registered with ``lightning_sgdtp.parallel.register`` that
            declare their own (no field here); give them as keywords like any option, they are kept here.
    """

    parallelism: Literal["data", "tensor", "hybrid", "auto"] = "data"
    bucket_cap_mb: float | str = "auto"
    grad_comm_dtype: str | None = None
    overlap: bool = True
    activation_checkpointing: bool = False
    broadcast_buffers: bool = True
    collective_timeout: float = 1800.0
    rendezvous_timeout: float = 300.0
    heartbeat_timeout: float | bool = 15.0
    stall_timeout: float | bool = 600.0
    shutdown_grace: float = 10.0
    verify_artifacts: bool = True
    trusted_key: str | None = None
    signing_key: str | None = None
    compile_cache: str | bool | None = "auto"
    compile_cache_max_gb: float = 10.0
    regional_compile: bool = True
    pipeline_chunks: int | None = None
    pipeline_stages: int | None = None
    pipeline_schedule: str = "1f1b"
    pipeline_split: list[str] | None = None
    pipeline_balance: str = "params"
    pipeline_stages_per_rank: int | None = None
    tensor_parallel_size: Any | None = None
    tp_plan: dict[str, str] | None = None
    sequence_parallel: bool | None = None
    optimizer_update: str = "auto"
    profile_steps: tuple[int, int] | None = None
    plan_file: str | bool = "auto"
    sharding: str = "none"
    param_gather_dtype: str | None = None
    shard_size: int | str | None = None
    max_memory_per_rank: str | int | None = None
    debug_skip_sync: str | None = None
    pretrained: str | None = None
    init_weights: Any | None = None
    technique_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.parallelism not in PARALLELISMS:
            raise SGDTPConfigError(
                f"parallelism={self.parallelism!r} is not known. Use one of {PARALLELISMS}, for example"
                " SGDTPStrategy(parallelism='data')."
            )
        self._check_techniques()
        self._check_auto()
        cap = self.bucket_cap_mb
        if cap != "auto" and (isinstance(cap, bool) or not isinstance(cap, (int, float))):
            raise SGDTPConfigError(
                f"bucket_cap_mb={cap!r} must be 'auto' (buckets sized by measurement) or a number of MiB, e.g. 25."
            )
        if cap != "auto" and not cap > 0:
            raise SGDTPConfigError(
                f"bucket_cap_mb={self.bucket_cap_mb!r} must be > 0 (MiB per fused all-reduce). Use e.g. 25,"
                " or a very large value for a single bucket."
            )
        if self.grad_comm_dtype is not None and self.grad_comm_dtype not in GRAD_COMM_DTYPES:
            raise SGDTPConfigError(
                f"grad_comm_dtype={self.grad_comm_dtype!r} is not supported. Use None (communicate in the"
                " gradient's own dtype) or 'bf16' (half the bytes, lossy)."
            )
        from lightning_sgdtp.engine.optim import UPDATES

        if self.optimizer_update not in UPDATES:
            raise SGDTPConfigError(
                f"optimizer_update={self.optimizer_update!r} is not known. Use one of {list(UPDATES)}: 'auto'"
                " (fused kernel or compiled step where possible), 'fused', 'compiled' or 'eager' (as configured)."
            )
        self._check_profile_steps()
        self._check_weights()
        if self.debug_skip_sync not in DEBUG_SKIPS:
            raise SGDTPConfigError(
                f"debug_skip_sync={self.debug_skip_sync!r} is not known. Use None, 'dp-sync' or 'reduce-scatter' (a"
                " negative control for tests: training is wrong on purpose)."
            )
        if self.debug_skip_sync == "reduce-scatter" and not self.sharded:
            raise SGDTPConfigError(
                "debug_skip_sync='reduce-scatter' applies to sharded parameters: set sharding='full' or 'optimizer'"
                " (or use 'dp-sync')."
            )
        for name in ("overlap", "broadcast_buffers", "verify_artifacts", "regional_compile"):
            if not isinstance(getattr(self, name), bool):
                raise SGDTPConfigError(f"{name}={getattr(self, name)!r} must be True or False.")
        for name in ("collective_timeout", "rendezvous_timeout", "shutdown_grace"):
            timeout = getattr(self, name)
            if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
                raise SGDTPConfigError(f"{name}={timeout!r} must be a positive number of seconds, e.g. 600.")
        self._check_watch()

        if self.trusted_key is not None and not Path(self.trusted_key).is_file():
            raise SGDTPConfigError(
                f"trusted_key={self.trusted_key!r} is not a file. Give a gpg keyring (gpg --export KEY > keyring.gpg)"
                " or a PEM public key."
            )
        if self.compile_cache not in (None, False) and not isinstance(self.compile_cache, (str, Path)):
            raise SGDTPConfigError(f"compile_cache={self.compile_cache!r}: use 'auto', a folder path or False (off).")
        if self.plan_file is True or self.plan_file == "" or not isinstance(self.plan_file, (str, Path, bool)):
            raise SGDTPConfigError(f"plan_file={self.plan_file!r}: use 'auto', a file path or False (no file).")
        bound = self.compile_cache_max_gb
        if isinstance(bound, bool) or not (isinstance(bound, (int, float)) and bound > 0):
            raise SGDTPConfigError(f"compile_cache_max_gb={bound!r} must be a positive number of GiB, e.g. 10.")
        key = self.signing_key
        if key is not None and not (key.startswith("gpg:") and len(key) > 4) and not Path(key).is_file():
            raise SGDTPConfigError(
                f"signing_key={key!r} is neither 'gpg:KEY' (a gpg key id, fingerprint or email) nor a PEM private key"
                " file."
            )

    @property
    def cache_folder(self) -> Path | None:
        """The compile cache's folder: the option's, the default one (``"auto"``, not with pipeline stages), or None."""
        from lightning_sgdtp.compiler.artifacts import default_cache_folder

        if self.compile_cache == "auto":
            return default_cache_folder() if not self.pipelined else None
        return Path(self.compile_cache) if self.compile_cache else None

    @property
    def planned(self) -> bool:
        """The planner chooses the layout at setup (``parallelism="auto"``)."""
        return self.parallelism == "auto"

    @property
    def sizes_tp_from_model(self) -> bool:
        """``parallelism="hybrid"`` with an automatic ``tensor_parallel_size``: the size is the largest inside one
        fast-link island that divides the model's query heads, so the layout waits for the model (setup)."""
        return self.parallelism == "hybrid" and self.tensor_parallel_size in (None, "auto")

    def _check_watch(self) -> None:
        for name, example in (("heartbeat_timeout", 15), ("stall_timeout", 600)):
            value = getattr(self, name)
            off = value is False or value is None
            if not off and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1):
                raise SGDTPConfigError(
                    f"{name}={value!r} must be a number of seconds >= 1, e.g. {example}, or False (off)."
                )
        beat, stall = self.watch_timeouts
        if beat is not None and stall is not None and stall <= beat:
            raise SGDTPConfigError(
                f"stall_timeout={stall!r} must be longer than heartbeat_timeout={beat!r}: a stuck rank still beats,"
                f" a frozen one is named first. Use e.g. stall_timeout={max(600, 4 * beat):g}."
            )

    @property
    def watch_timeouts(self) -> tuple[float | None, float | None]:
        """(heartbeat_timeout, stall_timeout) in seconds, ``None`` where off."""
        return (self.heartbeat_timeout or None, self.stall_timeout or None)  # type: ignore[return-value]

    def _check_auto(self) -> None:
        if self.max_memory_per_rank is None:
            return
        if not self.planned:
            raise SGDTPConfigError(
                f"max_memory_per_rank={self.max_memory_per_rank!r} is a limit for the planner: set"
                " parallelism='auto' (it then chooses a layout that fits), or remove max_memory_per_rank."
            )
        from lightning_sgdtp.planner.units import PlannerInputError, parse_memory

        try:
            parse_memory(self.max_memory_per_rank)
        except PlannerInputError as e:
            raise SGDTPConfigError(f"max_memory_per_rank: {e}") from e

    def _check_weights(self) -> None:
        if self.pretrained is not None:
            if not isinstance(self.pretrained, (str, Path)):
                raise SGDTPConfigError(
                    f"pretrained={self.pretrained!r}: give the path of a Hugging Face checkpoint folder (the one"
                    " save_pretrained() writes) or of one .safetensors file."
                )
            from lightning_sgdtp.checkpoint.huggingface import PretrainedError, files_of

            try:
                files_of(self.pretrained)
            except PretrainedError as e:
                raise SGDTPConfigError(str(e)) from e
            object.__setattr__(self, "pretrained", str(self.pretrained))
        fn = self.init_weights
        if fn is not None and not callable(fn) and not (isinstance(fn, str) and ":" in fn):
            raise SGDTPConfigError(
                f"init_weights={fn!r}: give a function fn(module) that initializes one module's own tensors, or its"
                " import path 'package.module:function'."
            )

    def init_function(self) -> Any:
        """``init_weights`` as a function (an import path imported), or None."""
        fn = self.init_weights
        if not isinstance(fn, str):
            return fn
        import importlib

        module_name, _, attr = fn.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise SGDTPConfigError(f"init_weights={fn!r} cannot be imported: {e}") from e

    def _check_profile_steps(self) -> None:
        steps = self.profile_steps
        if steps is None:
            return
        ok = (
            isinstance(steps, (tuple, list))
            and len(steps) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
            and 0 <= steps[0] <= steps[1]
        )
        if not ok:
            raise SGDTPConfigError(
                f"profile_steps={steps!r} must be (first, last): two optimizer-step numbers with 0 <= first <= last,"
                " e.g. (10, 12). Leave the first steps out: they compile."
            )
        object.__setattr__(self, "profile_steps", tuple(steps))

    @property
    def pipelined(self) -> bool:
        return self.pipeline_stages is not None or self.pipeline_chunks is not None

    def _check_techniques(self) -> None:
        """Each registered technique's checks of its options (``parallel/``), in the order applied; the first
        problem is raised."""
        unknown = set(self.technique_options or {}) - set(own_defaults(TECHNIQUES))
        if unknown:
            raise SGDTPConfigError(
                f"technique_options has unknown keys {sorted(unknown)}: the registered techniques' own options are"
                f" {sorted(own_defaults(TECHNIQUES))}."
            )
        problem = check_all(TECHNIQUES, self)
        if problem is not None:
            raise (NotAvailableYetError if problem.later else SGDTPConfigError)(problem.message)

    def check_pipeline_sizes(self, ranks: int) -> None:
        """What depends on the number of ranks per pipeline (known here, or once the world size is)."""
        problem = PIPELINE.check_sizes(self, ranks)
        if problem is not None:
            raise SGDTPConfigError(problem.message)

    def pipeline_micro_batches(self, ranks: int) -> int:
        """Micro-batches per step: ``pipeline_chunks``, or its default (two per stage) for ``ranks`` ranks per
        pipeline."""
        return PIPELINE.micro_batches(self, ranks)

    @property
    def gather_dtype(self) -> Any:
        """The torch dtype of the parameter all-gathers (None: the parameter's own)."""
        import torch

        name = GRAD_COMM_DTYPES.get(self.param_gather_dtype) if self.param_gather_dtype else None
        return getattr(torch, name) if name else None

    @property
    def wire_dtype(self) -> Any:
        """The torch dtype of gradient communication (None: the gradient's own)."""
        import torch

        return getattr(torch, self.comm_dtype_name) if self.comm_dtype_name else None

    @property
    def sharded(self) -> bool:
        return self.sharding != "none"

    @property
    def bucket_cap_bytes(self) -> int:
        """The cap in bytes; with ``"auto"`` the cap of the eager fallback and of what is not planned by the cost
        model (25 MiB, DDP's default)."""
        return max(1, int((25.0 if self.measured_buckets else self.bucket_cap_mb) * 2**20))

    @property
    def measured_buckets(self) -> bool:
        return self.bucket_cap_mb == "auto"

    @property
    def comm_dtype_name(self) -> str | None:
        """Name of the torch dtype used on the wire, or None for the gradient's own dtype."""
        return GRAD_COMM_DTYPES[self.grad_comm_dtype] if self.grad_comm_dtype is not None else None

    def __getattr__(self, name: str) -> Any:
        """A registered technique's own option (``technique_options``, else its default), read like a field."""
        own = own_defaults(TECHNIQUES)
        if name.startswith("_") or name not in own:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return (self.__dict__.get("technique_options") or {}).get(name, own[name])

    def to_dict(self) -> dict[str, Any]:
        """Every option by name, the registered techniques' own ones among them."""
        out = dataclasses.asdict(self)
        own = out.pop("technique_options") or {}
        return out | {name: own.get(name, default) for name, default in own_defaults(TECHNIQUES).items()}

    def check_single_graph(self) -> None:
        """What ``torch.compile(model, backend="sgdtp", options=...)`` cannot do alone: it compiles one graph in one
        process over the default group, with no mesh and no schedule."""
        if self.pipelined:
            raise SGDTPConfigError(
                'torch.compile(backend="sgdtp") compiles one graph in one process; pipeline parallelism'
                " (pipeline_chunks / pipeline_stages) runs stages on several ranks under a schedule. Train with"
                " Trainer(strategy=SGDTPStrategy(options=...)) and the same options dict, or drop the pipeline options."
            )
        if self.planned:
            raise SGDTPConfigError(
                'torch.compile(backend="sgdtp") with "strategy": "auto": the planner chooses a layout over the ranks'
                " of a job, and one compiled graph has none to choose. Train with"
                ' Trainer(strategy=SGDTPStrategy(parallelism="auto")), or name the strategy ("data").'
            )
        if self.parallelism == "hybrid":
            raise SGDTPConfigError(
                'torch.compile(backend="sgdtp") with "strategy": "hybrid" cannot know your data-parallel group. Train'
                ' with Trainer(strategy=SGDTPStrategy(parallelism="hybrid")), or pass the backend object itself:'
                ' torch.compile(module.forward, backend=SGDTPCompiler(config, group=mesh["dp"].get_group())).'
            )

    @classmethod
    def from_options(cls, options: dict[str, Any] | None = None, **overrides: Any) -> SGDTPConfig:
        """Build a config from the design documents' ``torch.compile`` options dict.

        ``{"distributed": {"plugin": "sgdtp", "strategy": "data", "pipeline_chunks": 4}}``; every other
        key of ``"distributed"`` is a field of this class. Explicit keyword ``overrides`` win.
        """
        fields = {f.name for f in dataclasses.fields(cls)} | set(option_names(TECHNIQUES))
        kwargs: dict[str, Any] = {}
        options = dict(options or {})
        unknown_top = set(options) - {"distributed"}
        if unknown_top:
            raise SGDTPConfigError(
                f"options has unknown keys {sorted(unknown_top)}; the sgdtp backend reads only"
                ' options={"distributed": {"plugin": "sgdtp", "strategy": "data", ...}}.'
            )
        dist = dict(options.get("distributed") or {})
        plugin = dist.pop("plugin", "sgdtp")
        if plugin != "sgdtp":
            raise SGDTPConfigError(
                f'options["distributed"]["plugin"]={plugin!r}: this backend is the "sgdtp" plugin; set "plugin": "sgdtp".'
            )
        if "strategy" in dist and "parallelism" in dist:
            raise SGDTPConfigError(
                'options["distributed"] has both "strategy" and "parallelism" (the same option); keep "strategy".'
            )
        if "strategy" in dist:
            kwargs["parallelism"] = dist.pop("strategy")
        unknown = set(dist) - fields
        if unknown:
            raise SGDTPConfigError(
                f'options["distributed"] has unknown keys {sorted(unknown)}. Known keys: "plugin", "strategy",'
                f" {sorted(fields - {'parallelism', 'technique_options'})}."
            )
        kwargs.update(dist)
        unknown = set(overrides) - fields
        if unknown:
            raise SGDTPConfigError(
                f"unknown option(s) {sorted(unknown)}. Known options: {sorted(fields - {'technique_options'})}."
            )
        kwargs.update(overrides)
        own = set(own_defaults(TECHNIQUES)) - set(cls.__dataclass_fields__)
        extra = {k: kwargs.pop(k) for k in sorted(own & set(kwargs))}
        if extra:
            kwargs["technique_options"] = {**(kwargs.get("technique_options") or {}), **extra}
        return cls(**kwargs)


def check_process_group_backend(name: str | None) -> None:
    import torch.distributed as dist

    if name is not None and name not in dist.Backend.backend_list:
        raise SGDTPConfigError(
            f"process_group_backend={name!r} is not a torch.distributed backend. Use one of"
            f" {dist.Backend.backend_list}, or leave it None (nccl on GPUs, gloo on CPU)."
        )


def check_fabric_options(config: SGDTPConfig) -> None:
    if config.pipelined:  # what Fabric cannot run
        raise SGDTPConfigError(
            "pipeline_stages / pipeline_chunks are not available with Fabric: a Fabric loop has no training_step to"
            " cut into micro-batches and schedule across stages. Remove them (data, sharding, tensor and hybrid"
            " parallel work with Fabric), or train with the Trainer (SGDTPStrategy(pipeline_stages=...))."
        )


def check_trainer_plugins(precision_plugin: type, sync_batchnorm: bool, front: str = "Trainer") -> None:
    """What the Trainer (or Fabric: ``front``) adds that the strategy cannot run: ``precision_plugin``, the class of
    its precision plugin; ``sync_batchnorm``: ``Trainer(sync_batchnorm=True)``."""
    why = precision_plugin_refusal(precision_plugin)
    if why is not None:
        raise SGDTPConfigError(
            f"precision plugin {precision_plugin.__name__} is not supported by the sgdtp strategy: {why}. Use"
            f" {front}(precision=...) with one of {', '.join(SUPPORTED_PRECISION)}, or a subclass of Lightning's"
            f" {', '.join(PRECISION_PLUGINS)}."
        )
    if sync_batchnorm:
        raise NotAvailableYetError(
            "Trainer(sync_batchnorm=True) is not available yet with the sgdtp strategy (SyncBatchNorm's"
            " forward collectives are not in the compiled step). Remove sync_batchnorm=True (buffers are still"
            " broadcast from rank 0 each step, as broadcast_buffers=True), or use strategy='ddp'."
        )


def precision_plugin_refusal(plugin: type) -> str | None:
    """Why the strategy cannot run a precision plugin of class ``plugin`` (None: it can). Decided by the first of
    Lightning's own classes in its MRO (what a user's subclass extends), without importing Lightning."""
    for cls in plugin.__mro__:
        if cls.__module__.split(".")[0] not in ("lightning", "pytorch_lightning", "lightning_fabric"):
            continue
        if cls.__name__ in REFUSED_PRECISION_PLUGINS:
            extends = "" if cls is plugin else f"a {cls.__name__}: "
            return extends + REFUSED_PRECISION_PLUGINS[cls.__name__]
        if cls.__name__ in PRECISION_PLUGINS:
            return None
    return f"it is not one of Lightning's precision plugins ({', '.join(PRECISION_PLUGINS)})"
