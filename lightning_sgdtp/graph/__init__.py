"""The graph registry: your own fused kernels as single nodes of the compiled graph, with their own backward.

.. code-block:: python

    from lightning_sgdtp import graph

    handle = graph.register(
        name="bias_gelu",
        forward_fn=forward_impl,  # forward_impl(x, bias) -> tensor
        backward_fn=backward_impl,  # backward_impl(ctx, grad_out) -> (grad_x, grad_bias)
        input_specs=[("tensor", "cpu"), ("tensor", "cpu")],  # or graph.TensorSpec(dtype=..., device=..., ndim=...)
        output_specs=[("tensor", "cpu")],
    )
    y = handle(x, bias)  # or torch.ops.sgdtp.bias_gelu(x, bias)
    handle.destroy()  # unregisters; the name can be registered again

Built on ``torch.library`` (schema, kernel, fake impl, autograd formula), so TorchDynamo, AOTAutograd and
Inductor see a real operator. See ``docs/graph.md``.
"""

from lightning_sgdtp.graph.registry import (
    DESTROYED,
    LIVE,
    NAMESPACE,
    BackwardContext,
    GraphHandle,
    destroy_all,
    get,
    record_spec_errors,
    register,
    registered,
)
from lightning_sgdtp.graph.specs import GraphError, SpecError, TensorSpec

__all__ = [
    "DESTROYED",
    "LIVE",
    "NAMESPACE",
    "BackwardContext",
    "GraphError",
    "GraphHandle",
    "SpecError",
    "TensorSpec",
    "destroy_all",
    "get",
    "record_spec_errors",
    "register",
    "registered",
]
