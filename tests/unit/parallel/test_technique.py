"""One more technique is added from one place: a do-nothing technique registered here alone (one option, an axis of
size 1) is seen by config's known options and checks, ParallelDims, the plan dict, the compile-cache key and the
planner's search; unregistered (the negative control), none of them knows it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from lightning_sgdtp.compiler import cache
from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.engine.parallelize import apply_piece, per_step_hooks, plan_part
from lightning_sgdtp.mesh.dims import ParallelDims
from lightning_sgdtp.observe.report import plan_dict
from lightning_sgdtp.parallel import TECHNIQUES, register, unregister
from lightning_sgdtp.parallel.technique import Axis, Problem, Technique
from lightning_sgdtp.planner.cost import HARDWARE, profile, step_time
from lightning_sgdtp.planner.memory import Layout
from lightning_sgdtp.planner.search import candidate_layouts


class Noop(Technique):
    """Divides nothing: an axis of one rank and an option that only has to be a non-negative int."""

    name = "noop"
    axis = Axis("noop", position=3)
    fields = ("noop_level",)
    defaults: ClassVar[dict[str, Any]] = {"noop_level": 0}
    graph_fields = fields

    def __init__(self) -> None:
        self.searched_over: list[int] = []
        self.steps_entered: list[int] = []

    def check(self, config: Any) -> Problem | None:
        level = config.noop_level
        if isinstance(level, bool) or not isinstance(level, int) or level < 0:
            return Problem(f"noop_level={level!r} must be an int >= 0, e.g. noop_level=1.")
        return None

    def sizes(self, world_size: int, devices_per_node: int, blocks: int) -> Sequence[int]:
        self.searched_over.append(world_size)
        return (1,)

    def traffic(self, layout: Any, activation_bytes: float) -> float:
        return 1e9 if layout.size("noop") == 1 else 0.0  # what the cost model must price, over the axis's link

    def plan(self, config: Any, dims: Any, module: Any, part: str) -> Any | None:
        return {"level": config.noop_level} if config.noop_level else None

    def apply(self, part: Any, piece: Any, dims: Any) -> list[str]:
        part.noop_applied = piece
        return [f"noop: level {piece['level']} on {dims.size('noop')} rank(s)"]

    def per_step(self, piece: Any, dims: Any) -> AbstractContextManager[Any] | None:
        @contextlib.contextmanager
        def step() -> Iterator[None]:
            self.steps_entered.append(piece["level"])
            yield

        return step()


@pytest.fixture
def noop() -> Iterator[Noop]:
    technique = register(Noop())
    try:
        yield technique
    finally:
        unregister("noop")


def _plan(config: SGDTPConfig) -> dict[str, Any]:
    dims = ParallelDims.resolve(config, 2, 2)
    return plan_dict(config, dims, None, {}, world_size=2, dp_size=dims.dp, num_nodes=1, process_group_backend="gloo")


def _key(config: SGDTPConfig) -> dict[str, Any]:
    """The compile-cache key fields of a small module on 2 CPU ranks of one node."""
    cluster = {"world_size": 2, "num_nodes": 1, "devices_per_node": 2, "rank_grid": None}
    where = {"device": torch.device("cpu"), "process_group_backend": "gloo", "tensor_parallel_plan": None}
    return cache.key_fields(nn.Linear(4, 3), config, in_graph_sync=True, **cluster, **where)


def test_the_registry_lists_the_techniques_in_the_order_applied() -> None:
    assert [t.name for t in TECHNIQUES] == ["pipeline", "tensor", "sharding", "checkpointing"]
    with pytest.raises(ValueError, match="registered already"):
        register(TECHNIQUES[0])


def test_a_registered_technique_is_a_known_option_checked_by_its_own_message(noop: Noop) -> None:
    config = SGDTPConfig.from_options(noop_level=2)
    assert config.noop_level == 2 and config.to_dict()["noop_level"] == 2
    assert SGDTPConfig.from_options({"distributed": {"noop_level": 3}}).noop_level == 3
    assert SGDTPConfig().noop_level == 0, "its default, when not given"
    with pytest.raises(SGDTPConfigError, match=r"noop_level=-1 must be an int >= 0, e.g. noop_level=1\."):
        SGDTPConfig.from_options(noop_level=-1)
    with pytest.raises(SGDTPConfigError, match="noop_level"):  # listed among the known options
        SGDTPConfig.from_options(noop_lvl=1)


def test_a_registered_technique_is_in_the_dims_the_plan_and_the_cache_key(noop: Noop) -> None:
    config = SGDTPConfig.from_options(noop_level=2)
    dims = ParallelDims.resolve(config, 2, 2)
    assert dims.axis_sizes() == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "noop": 1, "tp": 1}
    assert _plan(config)["techniques"]["noop"] == {"options": {"noop_level": 2}, "axis": "noop", "size": 1}
    fields = _key(config)
    assert fields["plan"]["noop_level"] == 2 and "noop_level" in cache.GRAPH_OPTIONS
    assert cache.cache_key(_key(SGDTPConfig.from_options(noop_level=1))) != cache.cache_key(fields)


def test_a_registered_technique_is_searched_and_priced_by_the_planner(noop: Noop) -> None:
    model = profile(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), tokens=16, batch=4)
    layout = Layout(axes=(("noop", 1),))
    priced = step_time(model, layout, HARDWARE["h100"], 8, 10_000)
    assert priced.technique_sends > 0 and priced.to_dict()["technique_sends"] == priced.technique_sends
    unregister("noop")
    try:
        assert step_time(model, layout, HARDWARE["h100"], 8, 10_000).total == pytest.approx(
            priced.total - priced.technique_sends
        )
    finally:
        register(noop)
    candidates = candidate_layouts(4, 4, 4)
    assert noop.searched_over, "the planner asked the technique for its sizes"
    assert candidates and all(c.layout.axes == (("noop", 1),) for c in candidates)
    assert all(c.layout.size("noop") == 1 and c.layout.world_size == 4 for c in candidates)


def test_negative_control_without_registering_nothing_knows_it() -> None:
    with pytest.raises(SGDTPConfigError, match="unknown option"):
        SGDTPConfig.from_options(noop_level=2)
    assert not hasattr(SGDTPConfig(), "noop_level")
    assert "noop" not in _plan(SGDTPConfig())["techniques"]
    assert "noop_level" not in cache.GRAPH_OPTIONS and "noop_level" not in _key(SGDTPConfig())["plan"]
    assert all(c.layout.axes == () for c in candidate_layouts(4, 4, 4))


def test_a_registered_technique_plans_applies_and_hooks_each_step(noop: Noop) -> None:
    """Its piece of the part plan (``Technique.plan``, by name), its recipe line (``apply_piece``) and its per-step
    hook (``per_step_hooks``, what the compiled engine runs each training step under)."""
    config = SGDTPConfig.from_options(noop_level=2)
    dims = ParallelDims.resolve(config, 1, 1)
    model = nn.Linear(4, 3)
    plan = plan_part(config, dims, model)
    assert plan.pieces == {"noop": {"level": 2}} and plan.to_dict()["pieces"] == {"noop": "{'level': 2}"}
    assert apply_piece(noop, model, plan, dims) == ["noop: level 2 on 1 rank(s)"]
    assert model.noop_applied == {"level": 2}
    with per_step_hooks(plan, dims):
        pass
    assert noop.steps_entered == [2]
    # Nothing planned (level 0): no piece, nothing applied, no hook.
    idle = plan_part(SGDTPConfig(), dims, nn.Linear(4, 3))
    assert idle.pieces == {} and "pieces" not in idle.to_dict()
    assert apply_piece(noop, model, idle, dims) == []
    with per_step_hooks(idle, dims):
        pass
    assert noop.steps_entered == [2]
