"""``parallelism="auto"``: the planner's choice turned into the options the strategy builds, at setup.

Every rank runs the same pure plan on the same inputs (the measured link and device figures are the slowest
rank's, agreed by one collective in ``bucket_cost.measure``), so every rank chooses the same layout without
sending it. The options the user set stay fixed (:func:`fixed_fields`); the rest comes from the winner
(:func:`configure`), and the resolved options go through :class:`~lightning_sgdtp.config.SGDTPConfig`'s checks
like any others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.planner.cost import HARDWARE, Hardware, measured_hardware, profile
from lightning_sgdtp.planner.inputs import check_inputs
from lightning_sgdtp.planner.search import (
    Candidate,
    Plan,
    PlannerInputError,
    check_a_layout_is_left,
    check_fits,
    plan,
    size_text,
    time_text,
)


def given_options(options: dict[str, Any] | None, given: dict[str, Any]) -> set[str]:
    """The option names the user set, as keywords or in the design documents' options dict."""
    named = dict((options or {}).get("distributed") or {})
    return set(given) | {"parallelism" if k == "strategy" else k for k in named}


def plan_at_setup(
    config: SGDTPConfig,
    given: set[str],
    module: nn.Module,
    world_size: int,
    devices_per_node: int,
    device: torch.device,
    precision: str,
    fixed: dict[str, Any] | None = None,
) -> tuple[SGDTPConfig, dict[str, Any], list[str]]:
    """The strategy's setup with ``parallelism="auto"`` (every rank; the measurement is a collective over the
    world): the resolved options, ``strategy.plan["planner"]`` and the lines for rank 0."""
    from lightning_sgdtp.compiler.bucket_cost import measure

    hardware = hardware_for(device, measure(None, device))
    half = str(precision).startswith(("bf16", "16"))
    args = (config, given, module, world_size, devices_per_node, hardware, 2 if half else 4)
    resolved, result, lines = decide(*args, fixed=fixed)
    return resolved, result.to_dict(), lines


def fixed_fields(config: SGDTPConfig, given: set[str]) -> dict[str, Any]:
    """The planner's fields the user's options fix: a tensor-parallel size, pipeline stages and chunks, sharding,
    an int or ``"node"`` shard size, activation checkpointing (when given explicitly)."""
    fixed: dict[str, Any] = {}
    if isinstance(config.tensor_parallel_size, int):
        fixed["tp"] = config.tensor_parallel_size
    if config.pipeline_stages is not None:
        fixed["pp"] = config.pipeline_stages
    if config.pipeline_chunks is not None:
        fixed["micro_batches"] = config.pipeline_chunks
    if "pipeline_schedule" in given:
        fixed["pipeline"] = config.pipeline_schedule
    if config.pipeline_stages_per_rank is not None:
        fixed["stages_per_rank"] = config.pipeline_stages_per_rank
    if "sharding" in given:
        fixed["sharding"] = config.sharding
    if config.shard_size is not None:
        fixed["shard_size"] = config.shard_size  # an int, or "node"
    if "activation_checkpointing" in given:
        fixed["checkpointing"] = config.activation_checkpointing
    return fixed


def batch_shape(module: nn.Module) -> tuple[int, int, str]:
    """Samples per rank and tokens per sample, from ``example_input_array`` (a tensor of samples x tokens, or the
    first tensor of a tuple / dict); else one sample of one token, and the line says so."""
    example = getattr(module, "example_input_array", None)
    if isinstance(example, dict):
        example = next(iter(example.values()), None)
    if isinstance(example, (tuple, list)):
        example = example[0] if example else None
    if isinstance(example, torch.Tensor) and example.dim() >= 1:
        tokens = example.shape[1] if example.dim() >= 2 and not example.is_floating_point() else 1
        return (
            int(example.shape[0]),
            int(tokens),
            f"batch {example.shape[0]} x {tokens} tokens from example_input_array",
        )
    return 1, 1, "no example_input_array: activations and compute per sample of one token (set it for a better plan)"


def hardware_for(device: torch.device, measured: Any) -> Hardware:
    """The hardware the plan assumes: a known GPU's given figures (docs/planner.md), else what was measured."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        for name, known in HARDWARE.items():
            if name in props.name.lower():
                return dataclasses.replace(known, memory_bytes=props.total_memory)
        return measured_hardware(measured, props.total_memory, devices=props.name)
    return measured_hardware(measured, None, devices=device.type)


def configure(config: SGDTPConfig, chosen: Candidate) -> SGDTPConfig:
    """The options of ``chosen``, checked like the user's own."""
    layout, schedule = chosen.layout, chosen.schedule
    values: dict[str, Any] = {
        "parallelism": "data" if layout.tp == 1 else ("tensor" if layout.dp == 1 else "hybrid"),
        "tensor_parallel_size": layout.tp if layout.tp > 1 else None,
        "sharding": layout.sharding,
        "shard_size": layout.shard_size,
        "activation_checkpointing": schedule.checkpointing,
        "max_memory_per_rank": None,
    }
    if layout.pp > 1:
        values.update(pipeline_stages=layout.pp, pipeline_chunks=schedule.micro_batches)
        values.update(pipeline_schedule=schedule.pipeline)
        values.update(
            pipeline_stages_per_rank=schedule.stages_per_rank if schedule.pipeline == "interleaved_1f1b" else None
        )
    return dataclasses.replace(config, **values)


def decide(
    config: SGDTPConfig,
    given: set[str],
    module: nn.Module,
    world_size: int,
    devices_per_node: int,
    hardware: Hardware,
    activation_bytes: int,
    fixed: dict[str, Any] | None = None,
) -> tuple[SGDTPConfig, Plan, list[str]]:
    """Plan ``module`` over the job's ranks; the resolved options, the whole table and one line per decision.
    ``fixed``: fields the front end fixes besides the user's options (Fabric: ``{"pp": 1}``). The setup peak is
    planned for the module as it is: built whole (real weights: all of it on every rank before the split) unless
    its parameters are on the meta device (each rank then materializes its part)."""
    batch, tokens, source = batch_shape(module)
    fixed = {**(fixed or {}), **fixed_fields(config, given)}
    try:
        check_inputs(
            module=module,
            world_size=world_size,
            devices_per_node=devices_per_node,
            tokens=tokens,
            batch=batch,
            memory=config.max_memory_per_rank,
            fixed=fixed,
        )
        model = profile(module, tokens, batch, activation_bytes)
        result = plan(module, model, hardware, world_size, devices_per_node, config.max_memory_per_rank, fixed=fixed)
        check_a_layout_is_left(result, world_size, fixed)
        check_fits(result)
    except PlannerInputError as e:
        raise SGDTPConfigError(f"parallelism='auto': {e}") from e
    winner = result.best
    assert winner is not None and winner.time is not None and winner.memory is not None
    limit = f"limit {size_text(result.limit)}" if result.limit else "no memory limit"
    lines = [
        f"planner: parallelism='auto' chose {winner.describe()}: {_figures(winner)}; {result.why()}"
        f" ({len(result.candidates)} layouts, {limit}, {hardware.name}, {source}"
        + (f", fixed by your options: {fixed}" if fixed else "")
        + ")"
    ]
    lines.append("planner: " + "; ".join(result.setup_lines(winner)))  # built whole or on meta: the module says
    for other in [c for c in result.candidates if c is not winner][:2]:
        state = other.skipped if other.skipped else ("fits" if other.fits else "too large")
        lines.append(f"planner: next: {other.describe()}: {_figures(other)} ({state})")
    return configure(config, winner), result, lines


def _figures(c: Candidate) -> str:
    if c.time is None or c.memory is None:
        return "not predicted"
    return (
        f"{time_text(c.time.total)}/step for {c.time.samples} samples, {size_text(c.memory.total)} per rank predicted"
    )
