"""How the model is reshaped for its mesh before compile (one module per technique), and the registry of them.

:data:`TECHNIQUES` lists every technique in the order applied. Config checks their options, ``ParallelDims``
sizes their axes, the planner searches them, the report and the compile-cache key show them, each by looping over
this list; :func:`register` adds one more from one place (``parallel/technique.py`` is the interface).
"""

from __future__ import annotations

from lightning_sgdtp.parallel.checkpointing import CHECKPOINTING
from lightning_sgdtp.parallel.pipeline.technique import PIPELINE
from lightning_sgdtp.parallel.sharding import SHARDING
from lightning_sgdtp.parallel.technique import Technique
from lightning_sgdtp.parallel.tensor.technique import TENSOR

#: In the order applied (torchtitan's): the pipeline cuts the model into stages first, and each stage is then
#: parallelized like a whole model; tensor parallel splits layers next, because every later step must see the split
#: parameters; sharding splits over the data-parallel ranks after it (a split parameter becomes a 2-D DTensor) and
#: before compile; activation checkpointing wraps each block last, before compile, so that each block stays one
#: traced op. Context parallel goes after tensor parallel, expert parallel with it. Config checks options in this
#: order too (the first problem is the one raised).
TECHNIQUES: list[Technique] = [PIPELINE, TENSOR, SHARDING, CHECKPOINTING]


def register(technique: Technique, before: str | None = None) -> Technique:
    """Add ``technique`` to :data:`TECHNIQUES` (last, or before the one named ``before``); returns it."""
    if any(t.name == technique.name for t in TECHNIQUES):
        raise ValueError(f"a technique named {technique.name!r} is registered already")
    names = [t.name for t in TECHNIQUES]
    TECHNIQUES.insert(names.index(before) if before is not None else len(TECHNIQUES), technique)
    return technique


def unregister(name: str) -> None:
    """Remove the technique named ``name`` (tests that register one put the registry back)."""
    TECHNIQUES[:] = [t for t in TECHNIQUES if t.name != name]


def technique(name: str) -> Technique:
    """The registered technique named ``name``."""
    for t in TECHNIQUES:
        if t.name == name:
            return t
    raise KeyError(f"no technique named {name!r}: registered are {[t.name for t in TECHNIQUES]}")
