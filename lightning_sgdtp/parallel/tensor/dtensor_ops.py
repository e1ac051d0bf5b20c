"""DTensor sharding rules that torch 2.13 has for GPUs but not for the CPU kernels.

``F.scaled_dot_product_attention`` on CPU runs ``_scaled_dot_product_flash_attention_for_cpu`` (and its
backward), for which DTensor registers no strategy, so tensor-parallel attention fails on CPU with
"does not have a sharding strategy registered". The rules are the ones torch registers for the CUDA flash
kernel: everything replicated, split by head (dim 1: the tensor-parallel case) or by batch (dim 0).
An explicit ``attn_mask`` (``transformers`` passes one whenever it is traced: a ``(batch, 1, q, k)`` boolean
causal mask) follows the split where it has that dimension, and is replicated where it broadcasts (size 1);
without it, an unchanged Llama failed at compile under tensor parallelism ("input_specs(3) != strategies(4)").
This extends DTensor through its own registration API; it replaces nothing torch already has.
"""

from __future__ import annotations

import torch

_registered = False


def register() -> None:
    """Register the CPU attention rules once (idempotent; skipped where torch already has them)."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    known = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
    if forward is None or backward is None or forward.default in known:
        _registered = True
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

    _registered = True
