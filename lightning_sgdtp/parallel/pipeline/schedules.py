"""Pipeline shape rules: the schedules, stages per rank, micro-batches per step. A leaf: it imports nothing of the
package, so the options (``config``), the layout (``layout.ParallelDims``) and the runner (``parallel.pipeline``)
all take these rules from here and none imports another upward."""

from __future__ import annotations

#: ``pipeline_schedule`` values and torch's schedule classes.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
}


def stages_per_rank(schedule: str, virtual: int | None) -> int:
    """Stages each rank holds: 1 for GPipe/1F1B; ``virtual`` (default 2) for interleaved 1F1B."""
    if schedule != "interleaved_1f1b":
        return 1
    return virtual or 2


def pipeline_stages(pp: int, schedule: str, virtual: int | None) -> int:
    """Stages of one pipeline of ``pp`` ranks (several per rank with the interleaved schedule)."""
    return pp * stages_per_rank(schedule, virtual)


def default_micro_batches(pp: int, schedule: str, virtual: int | None) -> int:
    """Micro-batches per step when ``pipeline_chunks`` is not given: two per stage."""
    return 2 * pipeline_stages(pp, schedule, virtual)


def check_chunks(schedule: str, chunks: int, pp: int, stages: int) -> str | None:
    """Why torch's schedule would refuse ``chunks`` micro-batches (None when it accepts them)."""
    if schedule == "1f1b" and chunks < stages:
        return (
            f"pipeline_schedule='1f1b' needs at least as many micro-batches as stages: pipeline_chunks={chunks} <"
            f" {stages} stages. Use pipeline_chunks >= {stages} (more chunks, a smaller bubble), or 'gpipe'."
        )
    if schedule == "interleaved_1f1b":
        rounds = max(1, chunks // pp)
        if chunks % rounds:
            return (
                f"pipeline_schedule='interleaved_1f1b' over {pp} ranks needs pipeline_chunks to be a multiple of"
                f" max(1, chunks // {pp}) = {rounds}; {chunks} is not. Use a multiple of {pp}, e.g. {pp * rounds}."
            )
    return None


def micro_batch_count(batch_size: int, chunks: int) -> int:
    """Micro-batches for a batch: ``chunks``, or for a batch it does not divide (the last of an epoch) the
    largest count <= ``chunks`` that divides it, so every micro-batch has the same shape."""
    return max(c for c in range(1, min(chunks, batch_size) + 1) if batch_size % c == 0)


#: ``F.cross_entropy``'s default ``ignore_index``: the label every fine-tuning collator puts on padding.
IGNORE_INDEX = -100


def micro_batch_weights(micro_batches: list) -> list[float] | None:
    """How much each micro-batch's loss counts in the step, so that the step is the one of training without the
    pipeline when the loss is a mean over the labels that are not :data:`IGNORE_INDEX` (``cross_entropy``'s mean
    over the real tokens of a padded batch): micro-batch i weighs ``chunks x n_i / n``, ``n_i`` its counted labels.
    None (every micro-batch weighs 1) when no integer tensor of the batch holds the ignore index."""
    import torch
    from torch.utils._pytree import tree_flatten

    leaves = [tree_flatten(mb)[0] for mb in micro_batches]
    labelled = [
        j
        for j, x in enumerate(leaves[0])
        if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() > 0
        if any(bool((mb[j] == IGNORE_INDEX).any()) for mb in leaves)
    ]
    if not labelled:
        return None
    counts = [sum(int((mb[j] != IGNORE_INDEX).sum()) for j in labelled) for mb in leaves]
    total = sum(counts)
    return [len(counts) * c / total for c in counts] if total else None
