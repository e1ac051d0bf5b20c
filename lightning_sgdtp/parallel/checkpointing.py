"""Activation checkpointing per block, applied before compile.

Each block of the model's repeated block stack (a transformer's layers) is wrapped with torch's
``checkpoint_wrapper`` (non-reentrant). Dynamo traces the wrapped call as one higher-order op, so the
recomputation stays inside the compiled region and the in-graph gradient buckets are planned over the
whole backward, recomputation included.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_sgdtp.parallel.technique import Problem, Technique


def find_block_stack(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The largest ``nn.ModuleList`` / ``nn.Sequential`` whose children are >= 2 modules of one type."""
    best: tuple[str, nn.Module] | None = None
    best_params = 0
    for name, child in module.named_modules():
        if not isinstance(child, (nn.ModuleList, nn.Sequential)):
            continue
        blocks = list(child.children())
        if len(blocks) < 2 or len({type(b) for b in blocks}) != 1:
            continue
        n_params = sum(p.numel() for p in child.parameters())
        if n_params > best_params:
            best, best_params = (name, child), n_params
    return best


def no_block_stack_message(module: nn.Module) -> str:
    return (
        "activation_checkpointing=True needs a stack of repeated blocks (an nn.ModuleList or nn.Sequential"
        f" of at least two modules of the same type) in {type(module).__name__}; none was found. Keep your"
        " layers in an nn.ModuleList, or set activation_checkpointing=False."
    )


def block_names(module: nn.Module) -> list[str]:
    """The qualified names of the blocks of the block stack (what activation checkpointing wraps).

    Raises a ValueError that says what to provide when the model has no recognizable block stack.
    """
    found = find_block_stack(module)
    if found is None:
        raise ValueError(no_block_stack_message(module))
    stack_name, stack = found
    prefix = f"{stack_name}." if stack_name else ""
    return [f"{prefix}{name}" for name, _ in stack.named_children()]


def checkpoint_blocks(module: nn.Module, blocks_per_stage: list[list[str]]) -> list[str]:
    """Wrap, inside ``module`` (the LightningModule, or a pipeline stage), each block named in ``blocks_per_stage``
    that it holds with a non-reentrant checkpoint; the part is compiled afterwards, so each stays one graph.
    Returns their names."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    wanted = {b for stage in blocks_per_stage for b in stage}
    found = [name for name, _ in module.named_modules() if name in wanted]
    for name in found:
        owner, _, leaf = name.rpartition(".")
        parent = module.get_submodule(owner)
        parent._modules[leaf] = checkpoint_wrapper(parent._modules[leaf], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return found


class Checkpointing(Technique):
    """Each block recomputed in backward instead of keeping its activations: no axis, a step of the recipe."""

    name = "checkpointing"
    fields = ("activation_checkpointing",)
    graph_fields = fields

    def check(self, config: Any) -> Problem | None:
        # an option check (config raises it): split parameters cannot be checkpointed yet
        if config.parallelism not in ("data", "auto") and config.activation_checkpointing:
            return Problem(
                f"activation_checkpointing=True with parallelism={config.parallelism!r} is not available yet: on torch"
                " 2.13 AOTAutograd cannot save a checkpointed region's split (DTensor) inputs (it fails at the first"
                " step with 'expected all tensors_saved_with_vc_check to be Tensors'). Use activation_checkpointing"
                " with parallelism='data', or a larger tensor_parallel_size to fit the activations.",
                later=True,
            )
        if not isinstance(config.activation_checkpointing, bool):
            return Problem(f"activation_checkpointing={config.activation_checkpointing!r} must be True or False.")
        return None


CHECKPOINTING = Checkpointing()
