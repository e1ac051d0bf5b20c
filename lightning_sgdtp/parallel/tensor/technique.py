"""Tensor parallel as a registered technique: its options and their checks, its axis (``tp``, innermost, on one
node's fast links) and what the planner searches. The plan and its application live beside it (``plan``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_sgdtp.parallel.technique import Axis, Problem, Technique, divisors

TP_STYLES = ("colwise", "rowwise", "colwise_gather", "replicate")


class TensorParallel(Technique):
    """Every split layer's weights divided over the ``tp`` ranks of one group (DTensor styles)."""

    name = "tensor"
    # innermost: a group's activations cross its links at every block, so it takes the fastest ones
    axis = Axis("tp", position=4, fast_links=True)
    fields = ("tensor_parallel_size", "tp_plan", "sequence_parallel")
    graph_fields = fields

    def check(self, config: Any) -> Problem | None:
        size, plan, sp = config.tensor_parallel_size, config.tp_plan, config.sequence_parallel
        if sp is not None and not isinstance(sp, bool):
            return Problem(f"sequence_parallel={sp!r} must be True, False or None (automatic).")
        if sp and plan is not None:
            return Problem(
                "sequence_parallel=True applies to the automatic plan; with tp_plan, drop sequence_parallel (or tp_plan)."
            )
        # option checks (config raises them): tensor-parallel options need tensor parallelism
        if config.parallelism == "data":
            for name, value in (("tensor_parallel_size", size), ("tp_plan", plan), ("sequence_parallel", sp or None)):
                if value is not None:
                    return Problem(
                        f"{name}={value!r} needs tensor parallelism: set parallelism='tensor' or 'hybrid' (or remove"
                        f" {name} to train data-parallel)."
                    )
            return None
        if size is not None and size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            return Problem(
                f"tensor_parallel_size={size!r} must be a positive int (ranks per tensor-parallel group, e.g. 2) or"
                " 'auto' (one fast-link island: an NVLink group, or one node on CPU)."
            )
        if plan is None:
            return None
        if not isinstance(plan, dict) or not plan:
            return Problem(
                f"tp_plan={plan!r} must be a non-empty dict of module-name globs to styles, e.g."
                " {'blocks.*.attn.qkv': 'colwise', 'blocks.*.attn.proj': 'rowwise'}."
            )
        for pattern, style in plan.items():
            if not isinstance(pattern, str) or style not in TP_STYLES:
                return Problem(
                    f"tp_plan[{pattern!r}] = {style!r}: keys are globs over module names, values one of {TP_STYLES}."
                )
        return None

    def sizes(self, world_size: int, devices_per_node: int, blocks: int) -> Sequence[int]:
        return divisors(world_size)

    def refuses(self, size: int, devices_per_node: int, blocks: int) -> str | None:
        if size > 1 and devices_per_node % size:
            return f"tensor parallel stays inside a node: tp={size} does not divide {devices_per_node}"
        return None


TENSOR = TensorParallel()
