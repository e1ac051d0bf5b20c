"""Gradient clipping by the global norm when some gradients are split across ranks (DTensor shards).

Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over local gradients: with tensor parallelism each
rank would see the norm of its own shards only (and torch refuses to mix DTensor and plain gradients).
Here a split gradient contributes the sum of its shards' ``|g|^p`` over its group (one all-reduce per mesh),
a replicated one counts once, so every rank computes the same norm: the norm of the unsplit model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_sgdtp.parallel.sharding import is_split
from lightning_sgdtp.parallel.tensor.plan import local_shard


def global_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all gradients of ``parameters`` as if none were split. Same on every rank."""
    norm_type = float(norm_type)
    total = _sum_of_powers([p for p in parameters if p.grad is not None], norm_type)
    return (total if math.isinf(norm_type) else total.pow(1.0 / norm_type)).float()


def _sum_of_powers(params: list[Tensor], norm_type: float, holders: dict[int, int] | None = None) -> Tensor:
    """``sum |g|^p`` (``max |g|`` for the inf-norm) over the gradients of ``params`` as if none were split (float64,
    the same on every rank that holds these parameters). A gradient split over some mesh dimensions (sharded over
    dp, tensor parallel over tp, or both) adds its parts over each of those dimensions' groups; a replicated
    dimension holds copies and is not summed. ``holders[id(p)]``: the ranks that hold a parameter and will add
    their parts too (a tied embedding and head on two pipeline stages); its part is divided by that."""
    is_inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    replicated = torch.zeros((), dtype=torch.float64)
    # (mesh, the mesh dimensions the gradient is split over) -> (accumulated local part, the groups to sum over)
    split: dict[object, tuple[Tensor, list]] = {}
    for p in params:
        g = p.grad
        local = local_shard(g).detach().double()
        part = (local.abs().max() if is_inf else local.abs().pow(norm_type).sum()).cpu() if local.numel() else None
        if part is None:
            part = torch.zeros((), dtype=torch.float64)
        if not is_inf:
            part = part / (holders or {}).get(id(p), 1)
        if _is_split_grad(g):
            mesh = g.device_mesh
            dims = tuple(d for d, pl in enumerate(g.placements) if is_split(pl))
            acc, groups = split.get(
                (mesh, dims), (torch.zeros((), dtype=torch.float64), [mesh.get_group(d) for d in dims])
            )
            split[(mesh, dims)] = (torch.maximum(acc, part) if is_inf else acc + part, groups)
        else:
            replicated = torch.maximum(replicated, part) if is_inf else replicated + part
    total = replicated
    for acc, groups in split.values():
        for group in groups:
            dist.all_reduce(acc, op=op, group=group)
        total = torch.maximum(total, acc) if is_inf else total + acc
    return total


def clip_grad_norm_(
    parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
) -> Tensor:
    """Scale all gradients so that their global norm is at most ``max_norm`` (torch's rule); returns the norm.
    ``error_if_nonfinite``: a NaN or infinite norm raises (as torch's), before any gradient is scaled."""
    params = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(params, norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot"
            " be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set"
            " `error_if_nonfinite=False`"
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        local = local_shard(p.grad)
        local.mul_(coef.to(local.device, local.dtype))
    return total


def clip_pipeline_grad_norm_(
    parameters: Iterable[Tensor],
    max_norm: float,
    group: dist.ProcessGroup,
    holders: dict[int, int] | None = None,
    norm_type: float = 2.0,
) -> Tensor:
    """Clip by the norm of the whole model when each rank of a pipeline holds some stages' parameters: each
    rank's ``sum |g|^p`` (its split gradients' parts added over the stage's data-parallel and tensor-parallel
    groups first) is summed over the pipeline ``group``; a parameter ``holders[id(p)]`` ranks hold (a tied
    embedding and head) counts once. The data-parallel replicas hold averaged, equal gradients: no reduce."""
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    total = _sum_of_powers(params, norm_type, holders)
    dist.all_reduce(total, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
    norm = (total if is_inf else total.pow(1.0 / norm_type)).float()
    coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)
    for p in params:
        local = local_shard(p.grad)
        local.mul_(coef.to(local.device, local.dtype))
    return norm


def _is_split_grad(g: Tensor) -> bool:
    """A DTensor gradient split over some mesh dimension (its parts add up over that dimension's group)."""
    from torch.distributed.tensor import DTensor

    return isinstance(g, DTensor) and any(is_split(pl) for pl in g.placements)
