"""The ``"sgdtp"`` torch.compile backend: capture -> gradient-bucket pass -> Inductor.

TorchDynamo hands the backend one forward graph at a time. We pass it to Inductor's ``compile_fx``
with our own ``inner_compile``: AOTAutograd calls it once for the forward and once (lazily, at the
first backward) for the partitioned backward graph, whose output ``i`` is the gradient of graph input
``i``. For the backward we run :func:`insert_bucketed_allreduce` over the parameter gradients, then let
Inductor compile the result with its compute/communication overlap scheduling switched on.

Two details that cost correctness if missed:

- AOTAutograd's cache can hand back a backward compiled earlier (for example by plain Inductor) without
  our collectives; gradients would then silently not be synced. We salt the cache keys with the pass's
  settings (``_CacheSalt``, part of the Inductor config both caches hash), and keep AOTAutograd's cache off
  unless the strategy's compile cache asks for it (a hit skips our pass: its ``GraphBuckets`` are then restored
  from the cache).
- The waits are placed by our pass, not by Inductor: in torch 2.13 its default scheduler leaves each
  ``wait_tensor`` where :func:`insert_bucketed_allreduce` put it (benchmarks/README.md, "Plugin issues found by the
  first benchmark run", finding 1), as late as possible with overlap, right after its all-reduce without. The
  overlap passes (``sink_waits_iterative`` and friends) keep them there.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from lightning_sgdtp.compiler.artifacts import PLUGIN_FINGERPRINT, install_atomic_builds
from lightning_sgdtp.compiler.bucket_cost import CostModel
from lightning_sgdtp.compiler.buckets import GraphBuckets, insert_bucketed_allreduce
from lightning_sgdtp.compiler.regions import REGION_PATCHES, holds_regions
from lightning_sgdtp.compiler.shard_proof import check_sharded_gradients, count_collectives, gradient_positions
from lightning_sgdtp.compiler.waits import one_tensor_per_output, one_wait_per_collective
from lightning_sgdtp.config import SGDTPConfig
from lightning_sgdtp.parallel.sharding import MARK

PASS_VERSION = "sgdtp-grad-buckets-v1"
OVERLAP_PASSES = ["reorder_communication_preserving_peak_memory", "sink_waits_iterative"]
#: Inductor's own collective bucketing / overlap passes, off while it compiles a backward that carries our buckets:
#: a user who switches them on globally (for another model) must not have our planned buckets merged or reordered.
OURS_ALONE = {
    "bucket_all_reduces_fx": "none",
    "bucket_reduce_scatters_fx": "none",
    "bucket_all_gathers_fx": "none",
    "_fuse_ddp_communication": False,
    "aten_distributed_optimizations.enable_overlap_scheduling": False,
    "aten_distributed_optimizations.collective_bucketing": False,
}


class _CacheSalt(CustomGraphPass):
    """A no-op post-grad pass whose ``uuid()`` enters Inductor's cache key.

    Graphs compiled with the bucket pass never share cache entries with graphs compiled without it (or with
    another process group, bucket size, wire dtype or overlap setting).
    """

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, graph: fx.Graph) -> None:
        return None

    def uuid(self) -> str:
        return self.key


@dataclass(frozen=True)
class CompileSettings:
    """How an :class:`SGDTPCompiler` compiles, fixed when it is made (the engine decides it from its part's plan,
    :func:`~lightning_sgdtp.engine.parallelize.plan_part`; nothing changes it afterwards).

    Args:
        in_graph_sync: insert the gradient all-reduces into backward graphs (off: the micro-batches of an
            accumulation that only accumulate, a data-parallel group of one, the ``debug_skip_sync`` control).
        prove_shards: prove that each sharded parameter's gradient is reduced in the graph (off only for the
            ``debug_skip_sync="dp-sync"`` control, which trains wrong on purpose).
        aot_cache: AOTAutograd's cache (off by default: a hit skips this backend's pass, so no graph is reported;
            the salt keeps other compilers' entries out). The compile cache switches it on and restores the graphs.
        cost: the measured cost model (``bucket_cap_mb="auto"``): bucket boundaries chosen by it; None: by the cap.
        compile_lock: held around every compile (one rank of a node compiles, the others then hit the node's
            cache). Taken per compile, never across a collective.
    """

    in_graph_sync: bool = True
    prove_shards: bool = True
    aot_cache: bool = False
    cost: CostModel | None = None
    compile_lock: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class SGDTPCompiler:
    """A torch.compile backend that syncs parameter gradients inside the compiled backward.

    ``SGDTPCompiler(config, group)`` is passed as ``torch.compile(..., backend=compiler)``. It keeps what its
    bucket pass decided for each backward graph (``graphs``) and which parameters live inside its graphs
    (``graph_param_ids``), so the strategy can sync the rest and prove coverage.

    Args:
        config: the validated options.
        group: the data-parallel process group (default: the world group, if initialized).
        param_names: ``id(parameter) -> qualified name``, used to name parameters in ``graphs``.
        on_graph: called with each backward graph's ``GraphBuckets`` as the pass decides them.
        inductor_mode: torch.compile's ``mode``, passed on to Inductor.
        graph_ids: where graph numbers come from (default: a new count from 0).
        settings: how it compiles (:class:`CompileSettings`; default: every gradient synced in the graph).
    """

    def __init__(
        self,
        config: SGDTPConfig | None = None,
        group: dist.ProcessGroup | None = None,
        param_names: dict[int, str] | None = None,
        on_graph: Callable[[GraphBuckets], None] | None = None,
        inductor_mode: str | None = None,
        graph_ids: Iterator[int] | None = None,
        settings: CompileSettings | None = None,
    ) -> None:
        self.config = config or SGDTPConfig()
        self.settings = settings or CompileSettings()
        #: torch.compile's ``mode`` ("max-autotune", ...): Inductor's own option set for that mode.
        self.inductor_patches = torch._inductor.list_mode_options(inductor_mode) if inductor_mode else {}
        self.group = group
        self.param_names = dict(param_names or {})
        self.on_graph = on_graph
        self.graphs: list[GraphBuckets] = []
        self.graph_param_ids: set[int] = set()
        #: Numbers the graphs; shared by the backends of one engine (one id space in the plan).
        self.graph_ids = graph_ids if graph_ids is not None else itertools.count()
        #: graph id -> the sharded parameters' collectives in its forward and backward (the plan's sharding entry).
        self.sharded_graphs: dict[int, dict[str, Any]] = {}
        #: Graphs captured with nested compile regions (regional compile).
        self.regions_compiled = 0

    @property
    def in_graph_sync(self) -> bool:
        return self.settings.in_graph_sync

    @property
    def cost(self) -> CostModel | None:
        return self.settings.cost

    def __deepcopy__(self, memo: dict[int, Any]) -> SGDTPCompiler:
        # One backend object per compiled model, holding its process group (which cannot be copied) and what it
        # decided. Lightning wraps `torch.compile(module, **kwargs)` and deep-copies the kwargs: hand back itself.
        return self

    def _group(self) -> tuple[str | None, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self.group or dist.group.WORLD
        return group.group_name, dist.get_world_size(group)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        graph_id = next(self.graph_ids)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        # AOTAutograd flattens tensor subclasses (a DTensor is its local shard and its mesh): backward output
        # `offsets[i]` is the gradient of graph input i (of its local shard, for a DTensor).
        offsets = list(itertools.accumulate((_flat_count(v) for v in example_inputs), initial=0))
        grad_outputs: dict[int, str] = {}
        params: dict[int, Any] = {}
        #: Sharded parameters: their reading reduces their gradients (proved below, never bucketed by us).
        shard_outputs: dict[int, str] = {}
        for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
            if isinstance(value, torch.nn.Parameter) and value.requires_grad:
                name = self.param_names.get(id(value)) or _source_name(node)
                if getattr(value, MARK, False):
                    shard_outputs[i] = name  # by input; its backward output is found from the graph (below)
                    continue
                grad_outputs[offsets[i]] = name
                params[offsets[i]] = value
        group_name, world_size = self._group()
        sync = bool(self.in_graph_sync and grad_outputs and group_name is not None and world_size > 1)
        if sync or (group_name is not None and world_size == 1):
            # Parameters whose gradients this graph really averages (the ledger trusts this set); with a
            # data-parallel group of one (tensor parallel alone) there is nothing to average: covered as they are.
            self.graph_param_ids.update(id(v) for v in params.values())
        cfg = self.config
        wire_dtype = cfg.wire_dtype
        # The key holds what changes the graphs, never a raw measurement: with a measured plan ("auto") the bucket
        # boundaries it chose are added to the backward's salt once the pass has run (`bucket_salt`), so two jobs
        # whose timings differ a little but plan the same buckets share every compiled graph.
        sizing = "measured" if self.cost is not None else cfg.bucket_cap_bytes
        sharded = bool(shard_outputs)
        salt = (
            f"{PASS_VERSION}:{PLUGIN_FINGERPRINT}:{sync}:{group_name}:{world_size}:{sizing}:{wire_dtype}:{cfg.overlap}"
            f":{sharded}"
        )
        install_atomic_builds()
        shard_patches = _shard_patches(cfg.bucket_cap_bytes) if sharded else {}

        def inner_compile(g: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
            if sharded and one_wait_per_collective(g.graph):  # Inductor's bucketing asserts one wait per collective
                g.recompile()
            if sharded and kwargs.get("is_backward") and one_tensor_per_output(g.graph):  # no two .grad share one
                g.recompile()
            if sharded:
                record = self.sharded_graphs.setdefault(graph_id, {"graph_id": graph_id})
                if not kwargs.get("is_backward"):
                    record["collectives_in_forward"] = count_collectives(g.graph)
                elif self.settings.prove_shards:
                    at = gradient_positions(g.graph, len(example_inputs)) or offsets
                    record.update(
                        check_sharded_gradients(g.graph, {at[i]: n for i, n in shard_outputs.items()}, graph_id)
                    )
                else:
                    record["proof"] = "skipped (negative control)"
                record["bucketing"] = (
                    f"Inductor's bucket_all_gathers_fx / bucket_reduce_scatters_fx, <= {cfg.bucket_cap_bytes / 2**20:g}"
                    " MiB per bucket, overlap-scheduled"
                )
            if not kwargs.get("is_backward") or not grad_outputs:
                with self.settings.compile_lock(), _salted(salt), torch._inductor.config.patch(shard_patches):
                    return compile_fx_inner(g, inputs, **kwargs)
            outputs = g.graph.output_node().args[0]
            if len(outputs) != offsets[-1]:
                # AOTAutograd gave some input more gradient outputs than it has leaves (a plain parameter applied
                # to tensor-parallel activations gets a DTensor gradient): which output belongs to which parameter
                # is not known, so no collective goes into this graph. Its gradients are averaged after backward
                # (the ledger's fallback; GradSync moves them there), said in the plan and in one line.
                if sync:
                    self.graph_param_ids.difference_update(id(v) for v in params.values())
                why = f"{len(outputs)} gradient outputs for {offsets[-1]} flattened inputs: gradients averaged after backward"
                decided = GraphBuckets(
                    graph_id, False, str(group_name), world_size, sorted(grad_outputs.values()),
                    fallback=why if sync else None,
                )  # fmt: skip
                self.graphs.append(decided)
                if self.on_graph is not None:
                    self.on_graph(decided)
                with self.settings.compile_lock(), _salted(salt):
                    return compile_fx_inner(g, inputs, **kwargs)
            if sync:
                decided = insert_bucketed_allreduce(
                    g,
                    grad_outputs,
                    group_name=group_name,
                    world_size=world_size,
                    cap_bytes=cfg.bucket_cap_bytes,
                    wire_dtype=wire_dtype,
                    graph_id=graph_id,
                    overlap=cfg.overlap,
                    cost=self.cost,
                )
            else:
                decided = GraphBuckets(
                    graph_id=graph_id,
                    in_graph_sync=False,
                    group=str(group_name),
                    world_size=world_size,
                    params=[grad_outputs[p] for p in sorted(grad_outputs) if isinstance(outputs[p], fx.Node)],
                )
            self.graphs.append(decided)
            if self.on_graph is not None:
                self.on_graph(decided)
            overlap = {
                "reorder_for_compute_comm_overlap": True,
                "reorder_for_compute_comm_overlap_passes": OVERLAP_PASSES,
            }
            with (
                self.settings.compile_lock(),  # the backward is compiled lazily, at the first backward: lock here too
                _salted(f"{salt}:{bucket_salt(decided)}"),
                torch._inductor.config.patch(OURS_ALONE) if sync else contextlib.nullcontext(),
                torch._inductor.config.patch(overlap) if sync and cfg.overlap else contextlib.nullcontext(),
                torch._inductor.config.patch(shard_patches),
            ):
                return compile_fx_inner(g, inputs, **kwargs)

        aot_cache = torch._functorch.config.patch(enable_autograd_cache=self.settings.aot_cache)
        # A step with nested compile regions (regional compile): Inductor's buffer reuse off (compiler/regions.py).
        regional = holds_regions(gm)
        self.regions_compiled += regional
        patches = self.inductor_patches | (REGION_PATCHES if regional else {})
        with self.settings.compile_lock(), _salted(salt), aot_cache:
            return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def bucket_salt(decided: GraphBuckets) -> str:
    """The bucket boundaries of a backward graph, as they enter its cache key (the parameters of each bucket)."""
    return "|".join(",".join(b.params) for b in decided.buckets)


def _cap_mib(cap: float, bucket_id: int) -> float:
    return cap


def _shard_patches(cap_bytes: int) -> dict[str, Any]:
    """Inductor's own passes for the sharded parameters' collectives: all-gathers bucketed (forward, and the
    re-gathers of backward), reduce-scatters bucketed, and scheduled to overlap compute (a bucket's gather issued
    before the compute that precedes its use: the prefetch)."""
    cap = functools.partial(_cap_mib, cap_bytes / 2**20)  # picklable: Inductor's cache key holds it
    return {
        "bucket_all_gathers_fx_bucket_size_determinator": cap,
        "bucket_reduce_scatters_fx_bucket_size_determinator": cap,
        "bucket_all_gathers_fx": "all",
        "bucket_reduce_scatters_fx": "all",
        "reorder_for_compute_comm_overlap": True,
        "reorder_for_compute_comm_overlap_passes": OVERLAP_PASSES,
    }


def _flat_count(value: Any) -> int:
    """How many graph inputs AOTAutograd makes of one input: one, or the leaves of a tensor subclass."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(value):
        return 1
    attrs, _ = value.__tensor_flatten__()
    return sum(_flat_count(getattr(value, a)) for a in attrs)


def _salted(key: str) -> Any:
    return torch._inductor.config.patch(post_grad_custom_pre_pass=_CacheSalt(key))


def _source_name(node: fx.Node) -> str:
    arg = node.meta.get("grapharg")
    return arg.source.name if arg is not None else node.name


def sgdtp_backend(
    gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None, mode: str | None = None
) -> Callable:
    """The backend registered with TorchDynamo as ``"sgdtp"``.

    ``torch.compile(model, backend="sgdtp", options={"distributed": {"plugin": "sgdtp", "strategy": "data"}})``
    syncs the gradients of the parameters used inside the compiled graphs over the default process group.
    """
    config = SGDTPConfig.from_options(options)
    config.check_single_graph()
    # parallelism="tensor": every rank is in the one tensor-parallel group, no gradient to average (DTensor's own
    # collectives are traced into the graphs).
    settings = CompileSettings(in_graph_sync=config.parallelism == "data")
    return SGDTPCompiler(config, inductor_mode=mode, settings=settings)(gm, example_inputs)


def register_backend() -> None:
    """Register ``"sgdtp"`` with TorchDynamo (idempotent)."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS
    from torch._dynamo.backends.registry import register_backend as _register

    # With the package installed, torch may already know "sgdtp" from our entry point; it then loads the
    # entry point itself (which imports this package) and must be the one to register it.
    if "sgdtp" not in _COMPILER_FNS and _BACKENDS.get("sgdtp") is None:
        _register(compiler_fn=sgdtp_backend, name="sgdtp")
