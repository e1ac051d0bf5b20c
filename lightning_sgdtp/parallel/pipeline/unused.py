"""Parameters no traced stage calls (MBartForCausalLM's decoder layers keep a cross-attention that only an encoder
would feed): each belongs to the stage the split's rule gives its module
(:func:`~lightning_sgdtp.parallel.pipeline.split.stage_parameters`), which keeps it, so it exists on one rank, is
saved in its checkpoint part and, getting no gradient, comes out of training unchanged."""

from __future__ import annotations

from torch import nn

from lightning_sgdtp.parallel.pipeline.split import PipelineSplit, blocks_text


def unused_parameters(module: nn.Module, split: PipelineSplit, used: set[int]) -> dict[str, int]:
    """The parameters of ``module`` whose id is not in ``used`` (no traced stage calls them: a decoder layer's
    cross-attention in a model without an encoder), by every name they have, each with the stage the split's rule
    gives it (:func:`stage_parameters`: the stage of the module that holds it). That stage keeps them: they exist
    on one rank, are saved in its checkpoint part and, getting no gradient, come out of training unchanged."""
    return {
        name: split.stage_of(name) for name, p in module.named_parameters(remove_duplicate=False) if id(p) not in used
    }


def unused_line(module: nn.Module, unused: dict[str, int]) -> str:
    """Rank 0's line on :func:`unused_parameters`: the largest modules all of whose parameters are unused named
    (else the parameters), with their stages."""
    # per module (a prefix of a parameter's name): the stages of its unused parameters, -1 for a used one
    stages_under: dict[str, set[int]] = {}
    for name, _ in module.named_parameters(remove_duplicate=False):
        path = name.split(".")
        for depth in range(1, len(path)):
            stages_under.setdefault(".".join(path[:depth]), set()).add(unused.get(name, -1))
    # a module is named when every parameter under it is unused and on one stage: the largest such
    parts: dict[str, int] = {}
    for name, stage in unused.items():
        path = name.split(".")
        prefixes = (".".join(path[:depth]) for depth in range(1, len(path)))
        parts.setdefault(next((m for m in prefixes if stages_under[m] == {stage}), name), stage)
    counts = {s: sum(1 for v in unused.values() if v == s) for s in sorted(set(unused.values()))}
    where = ", ".join(f"{n} on stage {s}" for s, n in counts.items())
    return (
        f"pipeline: {len(unused)} parameter(s) no stage's traced forward uses"
        f" ({blocks_text([f'{n} (stage {s})' for n, s in parts.items()], limit=8)}): each kept by the stage of its"
        f" module ({where}) and saved in its checkpoint part; they get no gradient, so training leaves them unchanged"
    )
