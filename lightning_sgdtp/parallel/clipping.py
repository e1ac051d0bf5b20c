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
from lightning_sgdtp.parallel.tensor import local_shard


def global_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all gradients of ``parameters`` as if none were split. Same on every rank."""

    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    replicated = torch.zeros((), dtype=torch.float32)
    # (mesh, the mesh dimensions the gradient is split over) -> (accumulated local part, the groups to sum over)
    split: dict[object, tuple[Tensor, list]] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        local = local_shard(g).detach().float()
        part = local.abs().max() if is_inf else local.abs().pow(norm_type).sum()
        if local.numel() == 0:
            part = torch.zeros((), dtype=torch.float32)
        if _is_split_grad(g):
            # Split over some mesh dimensions (sharded over dp, tensor parallel over tp, or both): the parts are
            # summed over each of those dimensions' groups; a replicated dimension holds copies and is not summed.
            mesh = g.device_mesh
            dims = tuple(d for d, pl in enumerate(g.placements) if is_split(pl))
            groups = [mesh.get_group(d) for d in dims]
            acc, _ = split.get((mesh, dims), (torch.zeros((), dtype=torch.float32), groups))
            acc = torch.maximum(acc, part.cpu()) if is_inf else acc + part.cpu()
            split[(mesh, dims)] = (acc, groups)
        else:
            replicated = torch.maximum(replicated, part.cpu()) if is_inf else replicated + part.cpu()
    total = replicated
    for acc, groups in split.values():
        for group in groups:
            dist.all_reduce(acc, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
        total = torch.maximum(total, acc) if is_inf else total + acc
    return total if is_inf else total.pow(1.0 / norm_type)


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Scale all gradients so that their global norm is at most ``max_norm`` (torch's rule); returns the norm."""
    params = [p for p in parameters if p.grad is not None]
    total = global_grad_norm(params, norm_type)
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
    rank's ``sum |g|^p`` is summed over the pipeline ``group``; a parameter ``holders[id(p)]`` ranks hold (a tied
    embedding and head) counts once. The data-parallel replicas hold averaged, equal gradients: no reduce; with
    sharding, each holds a shard of them, summed over the stage's data-parallel group."""
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    is_inf = math.isinf(norm_type)
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    whole, split = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    dp_group = None
    for p in params:
        g = local_shard(p.grad).detach().float()
        part = (g.abs().max() if is_inf else g.abs().pow(norm_type).sum()).double().cpu() if g.numel() else 0.0
        part = part / (1 if is_inf else (holders or {}).get(id(p), 1))
        if _is_split_grad(p.grad):  # sharded over the stage's replicas (sharding=...): the shards add up
            dp_group = p.grad.device_mesh.get_group(0)
            split = torch.maximum(split, torch.as_tensor(part)) if is_inf else split + part
        else:
            whole = torch.maximum(whole, torch.as_tensor(part)) if is_inf else whole + part
    if dp_group is not None:  # every replica of a stage holds the same parameters: all of them get here
        dist.all_reduce(split, op=op, group=dp_group)
    total = torch.maximum(whole, split) if is_inf else whole + split
    dist.all_reduce(total, op=op, group=group)
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
