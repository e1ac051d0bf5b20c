"""DTensor support that torch 2.13 lacks for what real models do to tensor-parallel activations.

1. **Rules torch has for GPUs but not for the CPU kernels.** ``F.scaled_dot_product_attention`` on CPU runs
   ``_scaled_dot_product_flash_attention_for_cpu`` (and its backward), for which DTensor registers no strategy, so
   tensor-parallel attention fails on CPU with "does not have a sharding strategy registered". The rules are the ones
   torch registers for the CUDA flash kernel: everything replicated, split by head (dim 1: the tensor-parallel case)
   or by batch (dim 0). An explicit ``attn_mask`` (``transformers`` passes one whenever it is traced: a
   ``(batch, 1, q, k)`` boolean causal mask) follows the split where it has that dimension, and is replicated where
   it broadcasts (size 1); without it, an unchanged Llama failed at compile ("input_specs(3) != strategies(4)").
2. **A rule torch has for none:** ``fill_.Tensor`` (``x[:, 0] = 0`` on a split activation: the value arrives as a
   0-d tensor): the filled tensor keeps its placement, the value is replicated.
3. **A split dimension folded into another survives the compiler.** A model that folds the heads into the batch
   (``q.reshape(batch * heads, t, d)``: BLOOM's attention, and its ALiBi ``baddbmm``) makes DTensor describe the
   head-split tensor as a ``_StridedShard``. torch 2.13 gathers one with a ``.tolist()`` on a fake tensor (a graph
   break at every such gather), and cannot rebuild one that crosses a graph boundary ("DTensorSpec doesn't allow
   specify shard_order when use_strided_shard_as_shard_order is True"). Two of its functions are wrapped, each only
   when the installed torch shows that failure on a tiny case: the gather computes its index list from plain
   integers, and the rebuild keeps the spec the tensor had. Nothing else changes.
4. **A write into part of a split dimension is refused** (``h[..., :3] = 0`` or ``h[..., :3] += 1`` on a
   column-parallel output split on that last dimension): DTensor gathers that part into a copy, so the write went to
   the copy and was lost, silently (a 100% wrong gradient, measured on 2 ranks). The error names the placement, the
   index and the fixes. Writes that do not cut the split dimension (``h[:, 0] = 0``) are exact and run.

1 and 2 go through DTensor's own registration API and replace nothing torch already has. 3 wraps two torch functions,
only where they fail; 4 gives ``DTensor`` a ``__setitem__`` that checks the index and then calls torch's.
"""

from __future__ import annotations

from typing import Any

import torch

_registered = False


class SplitWriteError(RuntimeError):
    """An in-place write into part of a split dimension (4. above); the message names the fixes. A RuntimeError, not a
    NotImplementedError: under the compiler the latter is a graph break, and the write then failed further on."""


def register() -> None:
    """Install all of the above once (idempotent; each piece skipped where torch already has it)."""
    global _registered
    if _registered:
        return
    _register_cpu_attention()
    _register_fill_tensor()
    _make_folded_splits_traceable()
    _refuse_writes_into_split_parts()
    _registered = True


def _register_cpu_attention() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    known = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    if forward is None or backward is None or forward.default in known:
        return

    def rules(op_schema, tensors: int) -> list[list]:
        mask = op_schema.kwargs_schema.get("attn_mask")
        out = []
        for p in (Replicate(), Shard(1), Shard(0)):
            rule = [p] * tensors
            if mask is not None:
                rule.append(p if isinstance(p, Shard) and mask.shape[p.dim] > 1 else Replicate())
            out.append(rule)
        return out

    @register_op_strategy(forward.default)
    def _forward(op_schema):  # (output, logsumexp) from (query, key, value[, attn_mask])
        mesh = op_schema.get_mesh_from_args()
        return expand_to_full_mesh_op_strategy(mesh, op_schema, rules(op_schema, 5), input_index=2)

    @register_op_strategy(backward.default)
    def _backward(op_schema):  # (grad q, k, v) from (grad_out, query, key, value, out, logsumexp[, attn_mask])
        mesh = op_schema.get_mesh_from_args(validate=False)
        return expand_to_full_mesh_op_strategy(mesh, op_schema, rules(op_schema, 9), input_index=3)


def _register_fill_tensor() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    op = torch.ops.aten.fill_.Tensor
    propagator = DTensor._op_dispatcher.sharding_propagator
    if op in propagator.op_strategy_funcs or op in propagator.op_single_dim_strategy_funcs:
        return

    @register_op_strategy(op)
    def _fill(op_schema):  # self filled in place keeps its placement; the 0-d value is replicated
        mesh = op_schema.get_mesh_from_args()
        ndim = len(op_schema.args_schema[0].shape)
        rules = [[p, p, Replicate()] for p in (Replicate(), *(Shard(d) for d in range(ndim)))]
        return expand_to_full_mesh_op_strategy(mesh, op_schema, rules, inplace_op=True)


def _make_folded_splits_traceable() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import placement_types as pt

    strided = getattr(pt, "_StridedShard", None)
    mode = getattr(pt, "_StridedShardOffsetMode", None)
    if strided is None or mode is None:
        return
    if _gather_index_fails_when_traced(strided, mode):
        sizes = strided.local_shard_size_and_offset

        def local_shard_size_and_offset(self, size, chunks, rank, offset_mode=mode.FIRST):  # type: ignore[no-untyped-def]
            if offset_mode is mode.ALL and isinstance(size, int) and isinstance(rank, int):
                from torch._subclasses.fake_tensor import unset_fake_temporarily
                from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

                # plain integers: the index list of a known size, computed outside the trace
                with unset_fake_temporarily(), disable_proxy_modes_tracing():
                    return sizes(self, size, chunks, rank, offset_mode)
            return sizes(self, size, chunks, rank, offset_mode)

        strided.local_shard_size_and_offset = local_shard_size_and_offset
    if _rebuild_fails(strided):
        rebuild = DTensor.__tensor_unflatten__

        def __tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride):  # type: ignore[no-untyped-def]
            from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

            placements, meta, shard_order, requires_grad = flatten_spec
            if shard_order is None or not any(isinstance(p, strided) for p in placements):
                return rebuild(inner_tensors, flatten_spec, outer_size, outer_stride)
            # a view's spec: its _StridedShard is a plain shard in the given order (what __tensor_flatten__ saw)
            spec = DTensorSpec(
                inner_tensors["device_mesh"], placements, TensorMeta(outer_size, outer_stride, meta.dtype),
                shard_order=shard_order, use_strided_shard_as_shard_order=False,
            )  # fmt: skip
            return DTensor(inner_tensors["_local_tensor"], spec, requires_grad=requires_grad)

        DTensor.__tensor_unflatten__ = staticmethod(__tensor_unflatten__)


def _gather_index_fails_when_traced(strided: Any, mode: Any) -> bool:
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    try:
        with FakeTensorMode():
            strided(0, split_factor=2).local_shard_size_and_offset(8, 2, 0, mode.ALL)
    except DataDependentOutputException:
        return True
    return False


def _rebuild_fails(strided: Any) -> bool:
    import inspect

    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if "use_strided_shard_as_shard_order" not in inspect.signature(DTensorSpec).parameters:
        return False
    try:  # what __tensor_unflatten__ does with a view's spec (shard_order set, flag derived): no mesh needed
        DTensorSpec(None, (strided(0, split_factor=2),), shard_order=((0, (0,)),))  # type: ignore[arg-type]
    except ValueError:
        return True
    return False


def _refuse_writes_into_split_parts() -> None:
    from torch.distributed.tensor import DTensor

    if "__setitem__" in DTensor.__dict__:
        return

    def __setitem__(self: DTensor, index: Any, value: Any) -> None:
        cut = _cut_split_dim(self, index)
        if cut is not None:
            raise SplitWriteError(
                f"an in-place write into part of a tensor split over the tensor-parallel group (x[{_show(index)}] ="
                f" / op=, x of shape {tuple(self.shape)}, placements {self.placements}): it cuts dimension {cut}, the"
                " one the tensor is split on, so DTensor would write into a gathered copy and the write would be lost."
                " Write it out of place (x = torch.cat(...), torch.where(...), x.index_put(...)), or keep the layer"
                " whose output this is whole: tp_plan={'<that layer>': 'colwise_gather'} (its weight stays split,"
                " its output is gathered) or 'replicate'."
            )
        torch.Tensor.__setitem__(self, index, value)

    DTensor.__setitem__ = __setitem__  # type: ignore[method-assign]


def _cut_split_dim(t: Any, index: Any) -> int | None:
    """The dimension ``t[index]`` takes only part of while ``t`` is split on it (None: the index keeps every split
    dimension whole, so DTensor writes in place and the write is exact)."""
    from torch.distributed.tensor.placement_types import Shard

    split = {p.dim % t.ndim for p in t.placements if isinstance(p, Shard)}  # _StridedShard too
    items = list(index) if isinstance(index, tuple) else [index]
    widths = [_width(i) for i in items]
    dim = 0
    for i, width in zip(items, widths):
        if i is Ellipsis:
            dim += t.ndim - sum(widths)
            continue
        if any(d in split for d in range(dim, dim + width)) and not (isinstance(i, slice) and i == slice(None)):
            return next(d for d in range(dim, dim + width) if d in split)
        dim += width
    return None


def _width(i: Any) -> int:
    """How many dimensions of the indexed tensor one index item takes (a boolean mask: its own number)."""
    if i is None or i is Ellipsis:
        return 0
    return i.ndim if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1


def _show(index: Any) -> str:
    items = index if isinstance(index, tuple) else (index,)

    def one(i: Any) -> str:
        if i is Ellipsis:
            return "..."
        if isinstance(i, slice):
            return ":".join("" if v is None else str(v) for v in (i.start, i.stop)) + (f":{i.step}" if i.step else "")
        return "tensor" if isinstance(i, torch.Tensor) else repr(i)

    return ", ".join(one(i) for i in items)
