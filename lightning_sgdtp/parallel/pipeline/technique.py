"""Pipeline parallel as a registered technique: its options and their checks (the shape rules are in
``schedules``), its axis (``pp``, outermost: a stage sends one activation per micro-batch, so it takes the slow
links) and what the planner searches. The split, the runner and the schedules live beside it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_sgdtp.parallel.pipeline.schedules import SCHEDULES, check_chunks, default_micro_batches, pipeline_stages
from lightning_sgdtp.parallel.technique import Axis, Problem, Technique, divisors

#: The options that need pipeline stages, with their defaults.
_NEEDS_STAGES = (
    ("pipeline_schedule", "1f1b"),
    ("pipeline_split", None),
    ("pipeline_balance", "params"),
    ("pipeline_stages_per_rank", None),
)


class Pipeline(Technique):
    """The model cut into stages, one (or several, interleaved) per rank of a pipeline, run under a schedule."""

    name = "pipeline"
    axis = Axis("pp", position=0)
    fields = (
        "pipeline_stages",
        "pipeline_chunks",
        "pipeline_schedule",
        "pipeline_split",
        "pipeline_balance",
        "pipeline_stages_per_rank",
    )

    def check(self, config: Any) -> Problem | None:
        stages, chunks, per_rank = config.pipeline_stages, config.pipeline_chunks, config.pipeline_stages_per_rank
        # option checks (config raises them): what needs stages, then what stages need
        if not config.pipelined:
            for name, default in _NEEDS_STAGES:
                if getattr(config, name) != default:
                    return Problem(
                        f"{name}={getattr(config, name)!r} needs pipeline parallelism: set pipeline_stages (ranks per"
                        f" pipeline) and/or pipeline_chunks (micro-batches per step), or remove {name}."
                    )
            return None
        if config.compile_cache not in (None, False, "auto"):
            return Problem(
                "compile_cache with pipeline parallelism is not available yet (each micro-batch shape compiles its"
                " stages at the first step). Remove compile_cache, or train without pipeline_stages.",
                later=True,
            )
        # an option check: hybrid stages need a fixed tensor-parallel size
        if config.parallelism == "hybrid" and config.tensor_parallel_size in (None, "auto"):
            return Problem(
                "parallelism='hybrid' with pipeline stages needs tensor_parallel_size (ranks per tensor-parallel"
                " group inside each stage, e.g. 2): 'auto' sizes a group by the node's fast links, which the stages"
                " share. Set tensor_parallel_size, or use parallelism='tensor' (every rank of a stage in its group)."
            )
        for name, value, least in (("pipeline_stages", stages, 2), ("pipeline_chunks", chunks, 1)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                what = (
                    " (ranks per pipeline, e.g. 2)."
                    if name == "pipeline_stages"
                    else " (micro-batches per step, e.g. 4)."
                )
                return Problem(f"{name}={value!r} must be an int >= {least}" + what)
        return self._check_schedule(config, per_rank) or (
            self.check_sizes(config, stages) if stages is not None else None
        )

    def _check_schedule(self, config: Any, per_rank: Any) -> Problem | None:
        if config.pipeline_schedule not in SCHEDULES:
            return Problem(
                f"pipeline_schedule={config.pipeline_schedule!r} is not known. Use one of {sorted(SCHEDULES)}."
            )
        if config.pipeline_balance not in ("params", "measured"):
            return Problem(
                f"pipeline_balance={config.pipeline_balance!r}: use 'params' (parameter count) or 'measured' (time"
                " each block's forward on the first batch)."
            )
        split = config.pipeline_split
        if split is not None and config.pipeline_balance != "params":
            return Problem("pipeline_split names the stages itself: drop pipeline_balance (or pipeline_split).")
        if split is not None and (isinstance(split, str) or not all(isinstance(n, str) for n in split)):
            return Problem(
                f"pipeline_split={split!r} must be a list of module names: the blocks where stages 1, 2, ... start,"
                " e.g. ['model.blocks.2']."
            )
        if per_rank is not None:
            if config.pipeline_schedule != "interleaved_1f1b":
                return Problem(
                    f"pipeline_stages_per_rank={per_rank!r} applies to pipeline_schedule='interleaved_1f1b' only"
                    " (GPipe and 1F1B run one stage per rank)."
                )
            if isinstance(per_rank, bool) or not isinstance(per_rank, int) or per_rank < 2:
                return Problem(f"pipeline_stages_per_rank={per_rank!r} must be an int >= 2.")
        return None

    def check_sizes(self, config: Any, ranks: int) -> Problem | None:
        """What depends on the number of ranks per pipeline (known from the options, or once the world size is)."""
        stages = pipeline_stages(ranks, config.pipeline_schedule, config.pipeline_stages_per_rank)
        if config.pipeline_split is not None and len(config.pipeline_split) != stages - 1:
            return Problem(
                f"pipeline_split has {len(config.pipeline_split)} names for {stages} stages: give {stages - 1}, the"
                " block where each stage after the first starts."
            )
        problem = check_chunks(config.pipeline_schedule, self.micro_batches(config, ranks), ranks, stages)
        return Problem(problem) if problem else None

    def micro_batches(self, config: Any, ranks: int) -> int:
        """Micro-batches per step: ``pipeline_chunks``, or its default (two per stage) for ``ranks`` ranks."""
        if config.pipeline_chunks is not None:
            return config.pipeline_chunks
        return default_micro_batches(ranks, config.pipeline_schedule, config.pipeline_stages_per_rank)

    def sizes(self, world_size: int, devices_per_node: int, blocks: int) -> Sequence[int]:
        return divisors(world_size)

    def refuses(self, size: int, devices_per_node: int, blocks: int) -> str | None:
        return f"pp={size} stages for {blocks} blocks: every stage needs one" if size > blocks else None


PIPELINE = Pipeline()
