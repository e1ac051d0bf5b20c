"""Settings of third-party models that only serve generation, turned off while the strategy trains.

``transformers`` models build a KV cache (``DynamicCache``) in every forward when their config says
``use_cache=True`` (the default of the causal LMs), in training too. The cache is never read in training; it costs
memory and compute in every step, and under tensor parallelism its ``torch.cat`` of a head-sharded key with the
cache's empty buffer fails in DTensor's sharding propagation (``IndexError: Dimension out of range``), deep inside
compile. ``transformers`` itself turns the cache off when training with gradient checkpointing; the strategy does
the same for the time it holds the model, says so in one ``sgdtp:`` line, and puts the setting back at teardown.
``generate()`` is not affected: it passes ``use_cache`` from its generation config explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class TrainingSettings:
    """What was changed (``(config, attribute, old value)``), to be put back by :meth:`restore`."""

    changed: list[tuple[Any, str, Any]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def restore(self) -> None:
        for config, attribute, value in reversed(self.changed):
            setattr(config, attribute, value)
        self.changed, self.names = [], []


def for_training(module: nn.Module, say: Callable[[str], None]) -> TrainingSettings:
    """Turn off ``config.use_cache`` of every submodule whose config has it on (each config once)."""
    settings, seen = TrainingSettings(), set()
    for name, sub in module.named_modules():
        config = getattr(sub, "config", None)
        if config is None or id(config) in seen or getattr(config, "use_cache", None) is not True:
            continue
        seen.add(id(config))
        settings.changed.append((config, "use_cache", True))
        settings.names.append(name or type(module).__name__)
        config.use_cache = False
    if settings.names:
        say(
            f"use_cache=False while training for {', '.join(settings.names)} (a generation KV cache: never read in"
            " training, and it breaks tensor parallelism); put back at teardown"
        )
    return settings
