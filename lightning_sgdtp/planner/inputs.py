"""What the planner refuses before it plans: inputs no job can have. Pure.

``sgdtp plan`` and ``parallelism="auto"`` both call :func:`check_inputs` once, before anything is predicted, so that
an impossible value (0 GPUs per node, a negative batch, a memory of 0, a model without parameters or with 0 layers)
stops with one message that names the input as the user wrote it (``--gpus-per-node 0``; ``max_memory_per_rank``),
why it cannot be, and what to give instead, instead of a plan over nonsense or a default taken silently.

The two front doors spell the inputs differently: :class:`Spelling` holds each one's names (:data:`CLI`,
:data:`STRATEGY`) and where the user sets the value; the rules are the same. docs/planner.md lists what is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_sgdtp.parallel.pipeline.schedules import SCHEDULES
from lightning_sgdtp.planner.memory import SHARDINGS
from lightning_sgdtp.planner.units import PlannerInputError, parse_memory

#: What ``fixed`` may hold: the fields of a layout and of its schedule.
FIXABLE = ("dp", "tp", "pp", "sharding", "shard_size", "checkpointing", "micro_batches", "pipeline", "stages_per_rank")
#: The counts a plan reads: the least each may be, and why.
COUNTS: dict[str, tuple[int, str]] = {
    "nodes": (1, "a job runs on at least one node"),
    "devices_per_node": (1, "a node has at least one GPU"),
    "world_size": (1, "a job has at least one rank"),
    "tokens": (1, "a sample has at least one token"),
    "batch": (1, "each data-parallel replica runs at least one sample per step"),
    "global_batch": (1, "a step runs at least one sample"),
    "optimizer_states": (0, "a parameter has 0 or more optimizer state tensors (AdamW 2, SGD with momentum 1, SGD 0)"),
    "rows": (0, "the table prints 0 or more layouts"),
}
#: The fixed fields that count something, and what: whole numbers >= 1 (``shard_size`` may also be ``"node"``).
FIXED_COUNTS = {
    "dp": "data-parallel ranks",
    "tp": "tensor-parallel ranks",
    "pp": "pipeline stages",
    "shard_size": "the ranks a parameter is sharded over",
    "micro_batches": "micro-batches per step",
    "stages_per_rank": "pipeline stages per rank",
}
#: The fixed fields that take one of a few values.
FIXED_CHOICES: dict[str, tuple[Any, ...]] = {
    "sharding": SHARDINGS,
    "pipeline": tuple(SCHEDULES),
    "checkpointing": (True, False),
}
#: Where a model states its number of layers (Hugging Face configs, nanoGPT's).
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


@dataclass(frozen=True)
class Spelling:
    """How a front door names the planner's inputs (``names``: field -> name) and where the user sets one
    (``where``: field -> a hint added to the fix; for ``"module"`` and ``"parameters"``, the fix itself)."""

    names: Mapping[str, str]
    where: Mapping[str, str] = field(default_factory=dict)

    def name(self, key: str) -> str:
        return self.names.get(key, key)

    def shown(self, key: str, value: Any) -> str:
        """``--nodes 0`` for a flag or a phrase, ``max_memory_per_rank='0GB'`` for an option."""
        name = self.name(key)
        return f"{name}={value!r}" if name.isidentifier() else f"{name} {value!r}"

    def hint(self, key: str) -> str:
        return f" ({self.where[key]})" if key in self.where else ""


#: ``sgdtp plan``'s flags.
CLI = Spelling(
    names={
        "nodes": "--nodes",
        "devices_per_node": "--gpus-per-node",
        "memory": "--gpu-memory",
        "tokens": "--seq-len",
        "batch": "--batch",
        "global_batch": "--global-batch",
        "optimizer_states": "--optimizer-states",
        "rows": "--rows",
        "fixed": "--fix",
        "module": "TARGET",
    },
    where={
        "devices_per_node": "default 8, or the topology file's",
        "module": "Return the module alone from the factory (sgdtp diagnose's factories also return a batch)",
        "parameters": "Return it with its layers built (call configure_model() in the factory if they are built"
        " there; on the meta device is fine)",
    },
)
#: The strategy's options and what Lightning tells it, with ``parallelism="auto"``.
STRATEGY = Spelling(
    names={
        "world_size": "world size",
        "devices_per_node": "devices per node",
        "memory": "max_memory_per_rank",
        "tokens": "example_input_array's tokens per sample",
        "batch": "example_input_array's samples",
        "fixed": "",
        "module": "the module",
    },
    where={
        "world_size": "Trainer(devices=..., num_nodes=...)",
        "devices_per_node": "Trainer(devices=...)",
        "tokens": "its second dimension",
        "batch": "its first dimension",
        "parameters": "Build its layers in __init__ or configure_model, before the strategy plans at setup",
    },
)


def _is_count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def count_problem(key: str, value: Any, spelling: Spelling = STRATEGY) -> str | None:
    """Why ``value`` cannot be the count ``key`` (:data:`COUNTS`), with the fix; None when it can."""
    least, why = COUNTS[key]
    if _is_count(value, least):
        return None
    return f"{spelling.shown(key, value)}: {why}. Give {spelling.name(key)} {least} or more{spelling.hint(key)}."


def world_problem(world_size: int, devices_per_node: int, spelling: Spelling = STRATEGY) -> str | None:
    """Why ``world_size`` ranks cannot run on nodes of ``devices_per_node`` (more than one node: whole nodes only)."""
    bad = count_problem("world_size", world_size, spelling) or count_problem(
        "devices_per_node", devices_per_node, spelling
    )
    if bad or world_size <= devices_per_node or world_size % devices_per_node == 0:
        return bad
    return (
        f"{spelling.shown('world_size', world_size)} over nodes of {devices_per_node} devices: a job of more than one"
        f" node runs on whole nodes, and {world_size} is not a multiple of {devices_per_node}. Give"
        f" {spelling.name('world_size')} a multiple of {devices_per_node}, or {spelling.name('devices_per_node')} that"
        f" divide it{spelling.hint('world_size')}."
    )


def fixed_problem(key: str, value: Any, spelling: Spelling = STRATEGY) -> str | None:
    """Why a layout field cannot be fixed to ``value``; None when it can."""
    shown = f"{spelling.name('fixed')} {key}={value!r}".strip()
    if key not in FIXABLE:
        return f"{shown}: {key} is not a field of a layout. Fix one of {list(FIXABLE)}."
    if key in FIXED_CHOICES:
        choices = FIXED_CHOICES[key]
        if value in choices and type(value) is type(choices[0]):
            return None
        listed = "true or false" if key == "checkpointing" else f"one of {list(choices)}"
        return f"{shown}: {key} is {listed}. Give that, or leave {key} to the planner."
    if _is_count(value, 1) or (key == "shard_size" and value == "node"):
        return None
    node = " (or 'node': the data-parallel ranks of one node)" if key == "shard_size" else ""
    return (
        f"{shown}: {key} counts {FIXED_COUNTS[key]}, a whole number >= 1{node}. Give {key}=1 or more, or leave {key}"
        " to the planner."
    )


def stated_layers(module: nn.Module) -> tuple[str, int] | None:
    """The first layer count below 1 that ``module`` or a submodule states (itself or its ``config``:
    :data:`LAYER_FIELDS`), as ``("LlamaModel.config.num_hidden_layers", 0)``; None when none does."""
    for m in module.modules():
        for source, where in ((getattr(m, "config", None), f"{type(m).__name__}.config"), (m, type(m).__name__)):
            for attr in LAYER_FIELDS:
                layers = getattr(source, attr, None)
                if isinstance(layers, int) and not isinstance(layers, bool) and layers < 1:
                    return f"{where}.{attr}", layers
    return None


def module_problem(module: Any, spelling: Spelling = STRATEGY) -> str | None:
    """Why ``module`` cannot be planned: not a module, no parameters, or a stated layer count below 1."""
    name = spelling.name("module")
    if not isinstance(module, nn.Module):
        return (
            f"{name} is a {type(module).__name__}, not a torch.nn.Module: the planner reads a model's parameters."
            f" {spelling.where.get('module', 'Give the model itself')}."
        )
    kind = type(module).__name__
    if next(module.parameters(), None) is None:
        return (
            f"{name} ({kind}) has no parameters: there is nothing to split, shard or train."
            f" {spelling.where.get('parameters', 'Build its layers before it is planned')}."
        )
    stated = stated_layers(module)
    if stated is not None:
        where, layers = stated
        return (
            f"{name} ({kind}) has {layers} layers ({where}={layers}): a model without layers has no blocks to split"
            f" over stages, shard or checkpoint. Give {where.rpartition('.')[2]} 1 or more."
        )
    return None


def check_inputs(
    *,
    module: Any,
    world_size: int | None = None,
    devices_per_node: int | None = None,
    nodes: int | None = None,
    topology_devices: int | None = None,
    memory: str | int | None = None,
    tokens: int | None = None,
    batch: int | None = None,
    global_batch: int | None = None,
    optimizer_states: int | None = None,
    rows: int | None = None,
    fixed: Mapping[str, Any] | None = None,
    spelling: Spelling = STRATEGY,
) -> None:
    """Raise :class:`PlannerInputError` naming the first input no plan can have, why, and the fix; the cheap checks
    first, the module's last. None: not given (the default applies). ``topology_devices``: the GPUs of the topology
    file, which ``devices_per_node`` must match; ``world_size``: the job's (the strategy's), else it is ``nodes`` x
    ``devices_per_node``, whole nodes by construction."""
    counts = {
        "nodes": nodes,
        "devices_per_node": devices_per_node,
        "tokens": tokens,
        "batch": batch,
        "global_batch": global_batch,
        "optimizer_states": optimizer_states,
        "rows": rows,
    }
    problems = [count_problem(k, v, spelling) for k, v in counts.items() if v is not None]
    if topology_devices is not None and devices_per_node is not None and devices_per_node != topology_devices:
        problems.append(
            f"{spelling.shown('devices_per_node', devices_per_node)} but the topology file has {topology_devices}"
            f" GPUs: drop {spelling.name('devices_per_node')} or record the topology of the nodes you plan for."
        )
    if world_size is not None:  # a bad devices_per_node is named above: here only the world's own size
        per_node = devices_per_node if devices_per_node is not None and _is_count(devices_per_node, 1) else 1
        problems.append(world_problem(world_size, per_node, spelling))
    if memory is not None:
        try:
            parse_memory(memory)
        except PlannerInputError as e:
            problems.append(f"{spelling.name('memory')}: {e}")
    problems += [fixed_problem(k, v, spelling) for k, v in (fixed or {}).items()]
    problems.append(module_problem(module, spelling))
    first = next((p for p in problems if p), None)
    if first is not None:
        raise PlannerInputError(first)


def parse_fix(items: list[str], spelling: Spelling = CLI) -> dict[str, Any]:
    """``sgdtp plan``'s ``--fix NAME=VALUE`` items as the planner's ``fixed``: whole numbers as ints, ``true`` /
    ``false`` as bools, the rest as text (:func:`fixed_problem` checks the values)."""
    fixed: dict[str, Any] = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in FIXABLE or not value:
            raise PlannerInputError(
                f"{spelling.name('fixed')} {item!r}: give NAME=VALUE with NAME one of {list(FIXABLE)}"
            )
        is_int = value.lstrip("+-").isdigit()
        fixed[key] = int(value) if is_int else {"true": True, "false": False}.get(value, value)
    return fixed
