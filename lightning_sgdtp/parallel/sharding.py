"""Sharded data parallel: parameters (and so gradients and optimizer state) split across the data-parallel ranks.

The static-graph way (SimpleFSDP, arXiv 2411.00284): each parameter is stored as a DTensor split over the
``dp`` mesh dimension, and reading it (``module.weight``) redistributes it to ``Replicate`` with
``Partial("avg")`` gradients. Dynamo traces that read, so the compiled forward holds the parameter all-gathers
and the compiled backward the gradient reduce-scatters (an all-reduce for a parameter that is kept whole); no
hook, no runtime wrapper. The optimizer from ``configure_optimizers`` sees the DTensor parameters and steps
their local shards; ``torch.distributed.checkpoint`` reads and writes them by name, on any layout.

Two modes, named after what stays split while the step runs (FSDP's ``FULL_SHARD`` and ``SHARD_GRAD_OP``):

- ``"full"`` (ZeRO-3): a gathered parameter is freed after its use in forward and gathered again in backward
  (an activation-checkpoint policy ``MUST_RECOMPUTE`` on the gather): at most the blocks in flight are whole;
- ``"optimizer"`` (ZeRO-2): gathered once per step and kept from forward to backward (``MUST_SAVE``): the
  communication of ``ddp`` (one all-gather + one reduce-scatter = one all-reduce), gradients and optimizer state
  split, parameters split between steps.

Which dimension is split: the first whose size the data-parallel size divides, so that every rank holds the same
shape (the compiled graphs, the compile cache and the cross-rank graph check stay identical on every rank). A
parameter with no such dimension (a scalar, an odd bias) stays whole on every rank and gets its gradient
all-reduced by the same read (``Replicate`` -> ``Partial("avg")``); the plan names each one.

With tensor parallel (hybrid), the parameter is first a DTensor over ``tp``; it becomes a 2-D DTensor over
``("dp", "tp")``: split over ``dp`` inside this rank's tensor-parallel shard (``_StridedShard`` when both split
the same dimension, which is how FSDP2 + TP records it for checkpoints).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sgdtp.parallel.technique import Axis, Problem, Technique

SHARDINGS = ("none", "optimizer", "full")
#: The dtypes a collective may send in (``grad_comm_dtype``, ``param_gather_dtype``): None is the tensor's own.
WIRE_DTYPES = {"fp32": None, "float32": None, "bf16": "bfloat16", "bfloat16": "bfloat16"}
#: Attribute set on every parameter whose gradient the sharded read reduces (GradSync and the bucket pass skip it).
MARK = "_sgdtp_sharded"


@dataclass
class ShardPlan:
    """What :func:`shard_parameters` decided, in plain data (the plan and the log lines)."""

    mode: str
    dp: int
    #: hybrid sharding: the groups of ``dp`` ranks that each hold all shards (1: split over every dp rank)
    replicas: int = 1
    #: parameter name -> the dimension split over ``dp``
    split: dict[str, int] = field(default_factory=dict)
    #: parameter name -> why it stays whole
    whole: dict[str, str] = field(default_factory=dict)
    #: parameter name -> why it is not sharded at all (replicated over dp, averaged by the gradient buckets)
    replicated: dict[str, str] = field(default_factory=dict)
    #: bytes of the parameters as this rank held them before (the whole model, or its tensor-parallel part)
    param_bytes_before: int = 0
    #: bytes of the parameters this rank holds now (its shards + the parameters kept whole)
    param_bytes_held: int = 0
    #: the largest block (top-level child with parameters) in bytes before sharding: one block's gathered parameters
    largest_block_bytes: int = 0
    largest_block: str = ""

    def describe(self) -> list[str]:
        how = {
            "full": "freed after use in forward and gathered again in backward (ZeRO-3)",
            "optimizer": "gathered once per step and kept until backward (ZeRO-2)",
        }[self.mode]
        whole = ""
        if self.replicated:
            whole += f"; not sharded (gradient buckets as without sharding): {', '.join(sorted(self.replicated))}"
        if self.whole:
            names = sorted(self.whole)
            whole = f"; {len(names)} kept whole (all-reduced): {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}"
        return [
            (
                f"sharding={self.mode}: {len(self.split)} parameters split over {self.dp} data-parallel ranks"
                + (f" (in each of {self.replicas} groups that replicate them)" if self.replicas > 1 else "")
                + f"{whole};"
                f" parameters {how}; gradients reduce-scattered and the optimizer state split with them"
            ),
            (
                f"sharding: this rank holds {_mib(self.param_bytes_held)} of {_mib(self.param_bytes_before)}"
                f" parameters ({self.param_bytes_held / max(1, self.param_bytes_before):.1%}); the largest block"
                f" gathered is {self.largest_block or '-'} ({_mib(self.largest_block_bytes)})"
            ),
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "dp": self.dp,
            "replicas": self.replicas,
            "split": dict(self.split),
            "whole": dict(self.whole),
            "replicated": dict(self.replicated),
            "param_bytes_before": self.param_bytes_before,
            "param_bytes_held": self.param_bytes_held,
            "largest_block": self.largest_block,
            "largest_block_bytes": self.largest_block_bytes,
        }


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def shard_dim(shape: torch.Size | tuple[int, ...], dp: int) -> int | None:
    """The dimension to split over ``dp`` ranks: the first that ``dp`` divides (None: keep the parameter whole)."""
    for d, size in enumerate(shape):
        if size >= dp and size % dp == 0:
            return d
    return None


def is_sharded(module: nn.Module) -> bool:
    """Whether :func:`shard_parameters` was applied to ``module`` already."""
    return any(getattr(p, MARK, False) for p in module.parameters())


def sharded_names(module: nn.Module) -> set[str]:
    return {n for n, p in module.named_parameters() if getattr(p, MARK, False)}


# ------------------------------------------------------------------------------------------- the read
def _keep(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE


def _recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_RECOMPUTE


class ParameterRead:
    """``module.weight`` of a sharded module: all-gather over ``dp`` (forward), reduce-scatter of the averaged
    gradient (backward). ``reduce=False`` is the negative control (the gradient is not reduced: ``debug_skip_sync``,
    tests only), fixed when the read is made."""

    def __init__(
        self,
        mode: str,
        dp_mesh: Any,
        gather_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        reduce: bool = True,
        tp_mesh: Any | None = None,
    ) -> None:
        self.mode, self.dp_mesh, self.tp_mesh = mode, dp_mesh, tp_mesh
        self.gather_dtype, self.reduce_dtype = gather_dtype, reduce_dtype
        self.reduce = reduce

    def __call__(self, param: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        if not isinstance(param, DTensor):  # a whole stand-in (:func:`whole_for_tracing`): read as stored
            return param

        policy = _recompute if self.mode == "full" else _keep
        context = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self._gather, param, use_reentrant=False, context_fn=context)

    def _gather(self, param: Tensor) -> Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        if "tp" not in (param.device_mesh.mesh_dim_names or ()):
            # data parallel alone, a pipeline stage's replicas, or hybrid sharding ("dp_replicate", "dp_shard"):
            # the gradient is averaged over every dimension (reduce-scattered over the split one, all-reduced over
            # the replicas)
            ndim = param.device_mesh.ndim
            whole = param.redistribute(
                placements=[Replicate()] * ndim, forward_dtype=self.gather_dtype, backward_dtype=self.reduce_dtype
            )
            return whole.to_local(grad_placements=[Partial("avg") if self.reduce else Replicate()] * ndim)
        # ("dp", "tp"), or ("dp_replicate", "dp_shard", "tp") with hybrid sharding: gather over dp on this rank's
        # tensor-parallel shard (averaging the gradient over every dp dimension), then the tensor-parallel DTensor
        ndim = self.dp_mesh.ndim
        grad = [Partial("avg") if self.reduce else Replicate()] * ndim
        *replicas, dp_placement, tp_placement = param.placements
        local = DTensor.from_local(param.to_local(), self.dp_mesh, [*replicas, _plain(dp_placement)], run_check=False)
        whole = local.redistribute(
            placements=[Replicate()] * ndim, forward_dtype=self.gather_dtype, backward_dtype=self.reduce_dtype
        )
        return DTensor.from_local(whole.to_local(grad_placements=grad), self.tp_mesh, [tp_placement], run_check=False)


def _plain(placement: Any) -> Any:
    """A ``_StridedShard(d, ...)`` over dp is ``Shard(d)`` of the tensor-parallel local shard."""
    from torch.distributed.tensor import Shard

    return Shard(placement.dim) if is_split(placement) else placement


def is_split(placement: Any) -> bool:
    """``Shard`` or ``_StridedShard`` (torch 2.13: ``_StridedShard`` is not a ``Shard`` and its ``is_shard()`` is
    False)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() or isinstance(placement, _StridedShard)


#: Why: a vocabulary-parallel lookup yields torch's ``_MaskPartial``, whose mask meets two fake-tensor modes once its
#: weight is re-wrapped in the graph (torch 2.13: "Mixing fake modes NYI" at compile).
_VOCABULARY = "torch 2.13 cannot compile a vocabulary-parallel lookup of a re-wrapped weight"


def keep_embeddings_whole(module: nn.Module, plan: Any) -> None:
    """With sharding and tensor parallel: embeddings (and a head tied to one) are not split by vocabulary but
    sharded over dp like any other parameter (:data:`_VOCABULARY`)."""
    named = dict(module.named_modules())
    weights = {id(m.weight) for m in named.values() if isinstance(m, nn.Embedding)}
    for name in list(plan.styles):
        m = named.get(name)
        if isinstance(m, nn.Embedding) or id(getattr(m, "weight", None)) in weights:
            del plan.styles[name]
            plan.replicated[name] = "an embedding (or tied to one): sharded over dp, not split by vocabulary"


# ------------------------------------------------------------------------------------------ applying it
def shard_parameters(
    module: nn.Module,
    mode: str,
    dp_mesh: Any,
    full_mesh: Any | None = None,
    gather_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reduce: bool = True,
    tp_mesh: Any | None = None,
) -> ShardPlan:
    """Split every parameter of ``module`` over ``dp_mesh`` in place; ``full_mesh`` is the ``("dp", "tp")`` mesh
    when some parameters are tensor-parallel DTensors. ``dp_mesh`` is 1-D, or ``("dp_replicate", "dp_shard")`` for
    hybrid sharding (split over the last dimension, replicated over the first). Parameter names (state dict keys)
    do not change."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if mode not in SHARDINGS[1:]:
        raise ValueError(f"sharding mode {mode!r}: one of {SHARDINGS[1:]}")
    dp = dp_mesh.size(dp_mesh.ndim - 1)  # the ranks one parameter is split over
    replicas = [Replicate()] * (dp_mesh.ndim - 1)  # hybrid sharding: the shards' copies
    plan = ShardPlan(mode=mode, dp=dp, replicas=dp_mesh.size() // dp)
    read = ParameterRead(mode, dp_mesh, gather_dtype, reduce_dtype, reduce, tp_mesh)
    module._sgdtp_read = read  # a pipeline's stages read through it too (share_reads)
    names = {id(p): n for n, p in module.named_parameters()}
    from lightning_sgdtp.parallel.checkpointing import find_block_stack

    found = find_block_stack(module)  # the transformer layers; else the top-level children
    stack = f"{found[0]}." if found is not None and found[0] else ""
    blocks = [f"{stack}{n}" for n, _ in found[1].named_children()] if found else [n for n, _ in module.named_children()]
    for block in blocks:
        size = sum(_local(p).numel() * p.element_size() for p in module.get_submodule(block).parameters())
        if size > plan.largest_block_bytes:
            plan.largest_block_bytes, plan.largest_block = size, block
    done: dict[int, nn.Parameter] = {}  # tied parameters: split once, shared
    for mod in list(module.modules()):
        own = [(n, p) for n, p in mod._parameters.items() if p is not None]
        if not own:
            continue
        for attr, p in own:
            if id(p) in done:
                mod._parameters[attr] = done[id(p)]
                continue
            name = names.get(id(p), attr)
            if isinstance(p, DTensor) and isinstance(mod, nn.Embedding) and p.placements[0].is_shard(0):
                # The one rule is keep_embeddings_whole's, applied to the tensor plan before the split.
                raise ValueError(f"{name}: a vocabulary-parallel embedding cannot be sharded ({_VOCABULARY})")
            local = _local(p).detach()
            plan.param_bytes_before += local.numel() * local.element_size()
            dim = shard_dim(local.shape, dp)
            if dim is None:
                plan.whole[name] = f"no dimension of {tuple(local.shape)} divisible by {dp}"
            else:
                plan.split[name] = dim
            if isinstance(p, DTensor):  # tensor parallel: over ("dp", "tp"), or ("dp_replicate", "dp_shard", "tp")
                assert full_mesh is not None, "a tensor-parallel parameter needs the (dp, tp) mesh"
                (tp_placement,) = p.placements
                if dim is None:
                    dp_placement: Any = Replicate()
                    piece = local
                elif tp_placement.is_shard() and tp_placement.dim == dim:
                    dp_placement = _StridedShard(dim, split_factor=p.device_mesh.size())
                    piece = local.chunk(dp, dim)[dp_mesh.get_local_rank(dp_mesh.ndim - 1)].clone()
                else:
                    dp_placement = Shard(dim)
                    piece = local.chunk(dp, dim)[dp_mesh.get_local_rank(dp_mesh.ndim - 1)].clone()
                value = DTensor.from_local(
                    piece.contiguous(), full_mesh, [*replicas, dp_placement, tp_placement], run_check=False,
                    shape=p.shape, stride=p.stride(),
                )  # fmt: skip
            else:
                value = distribute_tensor(local, dp_mesh, [*replicas, Shard(dim) if dim is not None else Replicate()])
                value = DTensor.from_local(
                    value.to_local().clone(),
                    dp_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )  # its own storage: a view would keep the whole parameter alive
            new = nn.Parameter(value, requires_grad=p.requires_grad)
            setattr(new, MARK, True)
            plan.param_bytes_held += _local(new).numel() * new.element_size()
            done[id(p)] = new
            mod._parameters[attr] = new
        attrs = [attr for attr, _ in own if getattr(mod._parameters[attr], MARK, False)]
        if attrs:
            _read_through(mod, attrs, read)
    return plan


def stored_parameter(module: nn.Module, name: str) -> nn.Parameter:
    """The parameter ``name`` as stored (not ``get_parameter``: a sharded module's attribute read gathers it)."""
    owner, _, leaf = name.rpartition(".")
    param = module.get_submodule(owner)._parameters.get(leaf)
    if param is None:
        raise AttributeError(f"{type(module).__name__} has no parameter {name!r}")
    return param


def share_reads(part: nn.Module, source: nn.Module) -> None:
    """Give ``part`` (a pipeline stage's module, holding ``source``'s sharded parameters under the same names) the
    same reads: its modules' ``weight`` etc. gather over dp, as ``source``'s do."""
    read = source._sgdtp_read
    owners: dict[str, list[str]] = {}
    for name, p in part.named_parameters(remove_duplicate=False):
        if getattr(p, MARK, False):
            owner, _, leaf = name.rpartition(".")
            owners.setdefault(owner, []).append(leaf)
    for owner, attrs in owners.items():
        _read_through(part.get_submodule(owner), attrs, read)
    part._sgdtp_read = read


@contextlib.contextmanager
def whole_for_tracing(module: nn.Module) -> Iterator[None]:
    """While tracing ``module`` with ``torch.export`` (the pipeline's split): each parameter on a mesh (sharded, or
    split by tensor parallel) replaced by a whole plain one of its shape with no storage (a trace reads metadata
    only; the traced stages are relinked to the module's own parameters), put back after. No rank gathers the model
    whole. Tied parameters stay one tensor, so the trace still sees them tied."""
    from torch.distributed.tensor import DTensor

    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    whole: dict[int, nn.Parameter] = {}
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    try:
        for mod in module.modules():
            for attr, p in list(mod._parameters.items()):
                if isinstance(p, DTensor):  # sharded, or split by tensor parallel
                    if id(p) not in whole:  # a trace reads shapes only: no storage (never the model whole)
                        device = torch.device(p.device_mesh.device_type)
                        whole[id(p)] = trace_stand_in(p, device, tied=uses[id(p)] > 1)
                    swapped.append((mod, attr, p))
                    mod._parameters[attr] = whole[id(p)]
        yield
    finally:
        for mod, attr, p in swapped:
            mod._parameters[attr] = p


def trace_stand_in(p: Tensor, device: torch.device, tied: bool = False) -> nn.Parameter:
    """What ``torch.export`` traces in place of ``p`` (a shard, or a parameter this rank does not hold): a plain
    tensor of its whole shape on ``device`` with no storage (a trace reads metadata only). A tied parameter gets
    storage, uninitialised: torch's pipeline frontend deep-copies a parameter two stages use (``Pipe.__init__``),
    which reads it."""
    empty = torch.empty(p.shape, dtype=p.dtype, device=device)
    if not tied:
        empty.untyped_storage().resize_(0)
    return nn.Parameter(empty, requires_grad=p.requires_grad)


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _read_through(mod: nn.Module, attrs: list[str], read: ParameterRead) -> None:
    """Make ``mod.<attr>`` return ``read(stored shard)``: a subclass of the module's class with one property per
    parameter (``nn.Module.__getattr__`` is bypassed; ``state_dict``/``named_parameters`` still see the shards).
    torch's ``parametrize`` would rename the state dict keys (``parametrizations.weight.original``) and so break
    checkpoints keyed by name; this keeps them."""
    cls = type(mod)
    props = {a: property(lambda self, a=a: read(self._parameters[a])) for a in attrs}
    if getattr(cls, "_sgdtp_sharded_class", False):
        for a, prop in props.items():
            setattr(cls, a, prop)
        return
    mod.__class__ = type(f"Sharded{cls.__name__}", (cls,), {**props, "_sgdtp_sharded_class": True})


# --------------------------------------------------------------------------------------- memory, exact
def held_bytes(module: nn.Module, optimizers: list[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards of DTensors), counted
    from the tensors themselves."""
    seen: set[int] = set()

    def count(t: Any) -> int:
        if not isinstance(t, Tensor):
            return 0
        local = _local(t)
        if local.is_meta:  # a pipeline's released parameter (stage_memory): nothing held
            return 0
        storage = local.untyped_storage()  # what the process really holds (a view keeps its whole storage)
        key = storage.data_ptr() if local.numel() else id(local)
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()

    params = sum(count(p) for p in module.parameters())
    grads = sum(count(p.grad) for p in module.parameters() if p.grad is not None)
    state = 0
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        for per_param in opt.state.values():
            state += sum(count(v) for v in per_param.values() if isinstance(v, Tensor) and v.dim() > 0)
    return {"parameters": params, "gradients": grads, "optimizer_state": state, "total": params + grads + state}


# --------------------------------------------------------------------------------------- the technique
class Sharding(Technique):
    """Parameters, gradients and optimizer state split over the data-parallel ranks (ZeRO-3 / ZeRO-2), in groups
    of ``shard_size`` with hybrid sharding."""

    name = "sharding"
    # the data-parallel ranks a parameter is split over; its replicas (dp_replicate) lie outside it
    axis = Axis("dp_shard", position=2, splits_batch=True, averages_grads=True)
    fields = ("sharding", "param_gather_dtype", "shard_size")
    graph_fields = fields
    searched = False  # the planner searches its modes and a node-sized shard_size, not an axis size

    def check(self, config: Any) -> Problem | None:
        # option checks (config raises them): a known mode, data-parallel ranks to split over
        if config.sharding not in SHARDINGS:
            return Problem(
                f"sharding={config.sharding!r} is not known. Use one of {list(SHARDINGS)}: 'full' splits parameters,"
                " gradients and optimizer state across the data-parallel ranks (ZeRO-3), 'optimizer' gradients and"
                " optimizer state (ZeRO-2), 'none' keeps a whole replica per rank."
            )
        sharded = config.sharding != "none"
        if sharded and config.parallelism == "tensor":  # parallelism='tensor' has no data-parallel ranks
            return Problem(
                f"sharding={config.sharding!r} splits over the data-parallel ranks, and parallelism='tensor' has none."
                " Use parallelism='data' (or remove sharding)."
            )
        return self._check_size(config, sharded) or self._check_gather(config)

    def _check_size(self, config: Any, sharded: bool) -> Problem | None:
        size = config.shard_size
        if size is None:
            return None
        if size != "node" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            return Problem(
                f"shard_size={size!r}: use None (split over every data-parallel rank), 'node' (split inside"
                " each node, replicate across nodes) or a positive int that divides the data-parallel size."
            )
        if not sharded:
            return Problem(
                f"shard_size={size!r} applies to sharded parameters: set sharding='full' or 'optimizer' (or"
                " remove shard_size)."
            )
        return None

    def _check_gather(self, config: Any) -> Problem | None:
        dtype = config.param_gather_dtype
        if dtype is None:
            return None
        if dtype not in WIRE_DTYPES:
            return Problem(
                f"param_gather_dtype={dtype!r} is not supported. Use None (the parameter's own dtype) or 'bf16'."
            )
        # an option check: a gather dtype needs sharded parameters
        if config.sharding == "none":
            return Problem(
                f"param_gather_dtype={dtype!r} applies to sharded parameters: set sharding='full' or 'optimizer' (or"
                " remove param_gather_dtype)."
            )
        return None


SHARDING = Sharding()
