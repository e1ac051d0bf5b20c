"""Exact mid-epoch resume: the training loader's position and every rank's random state go into the checkpoint.

Lightning restores model, optimizer and loop counters; for a checkpoint taken in the middle of an epoch it
replays the epoch from its first batch unless the training loader is *stateful* (has ``state_dict`` /
``load_state_dict``: Lightning's ``_Stateful`` protocol, saved under the fit loop's ``combined_loader``). It
also keeps no random state, so dropout and random augmentations differ after a resume. :class:`ResumableLoader`
wraps the training loader (in ``SGDTPStrategy.process_dataloader``) and supplies both:

- ``state_dict``: the epoch and the number of batches the loop has *processed* (not fetched: Lightning
  prefetches one batch ahead), and the global random states of every rank (gathered: only rank 0 writes);
- ``__iter__`` after ``load_state_dict``: skips the batches already trained on (indices only, no data loaded,
  for map-style datasets in the main process) and restores this rank's random state at the very point the
  uninterrupted run was at when it saved.

A run killed mid-epoch and resumed with ``ckpt_path="last"`` then ends with the same parameters as one that was
never interrupted (bitwise on CPU; see ``tests/test_resilience.py``).
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

log = logging.getLogger("lightning.pytorch.sgdtp")


class ResumableLoader:
    """A training loader that resumes mid-epoch. Everything else is the wrapped loader's (attribute access too).

    Args:
        loader: the training loader, as Lightning prepared it (with its distributed sampler).
        progress: returns ``(current_epoch, batches processed in this epoch)`` from the fit loop.
        gather: collects one object from every rank, in rank order (a collective: ``state_dict`` is called on
            every rank when Lightning dumps a checkpoint).
        rank, world_size: this rank and the number of ranks.
    """

    def __init__(
        self,
        loader: Any,
        progress: Callable[[], tuple[int, int]],
        gather: Callable[[Any], list[Any]],
        rank: int,
        world_size: int,
    ) -> None:
        self.loader = loader
        self._progress = progress
        self._gather = gather
        self._rank = rank
        self._world_size = world_size
        self._pending: dict[str, Any] | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        epoch, batches = self._progress()
        rng = self._gather(collect_rng_states())
        return {"epoch": epoch, "batches": batches, "world_size": self._world_size, "rng": rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = dict(state)

    def __iter__(self) -> Iterator[Any]:
        state, self._pending = self._pending, None
        if state is None:
            return iter(self.loader)
        epoch, _ = self._progress()
        try:
            length: int | None = len(self.loader)
        except (TypeError, NotImplementedError):
            length = None
        batches = int(state.get("batches", 0))
        mid_epoch = state.get("epoch") == epoch and batches > 0 and (length is None or batches < length)
        rng = state.get("rng") or []
        rng_state = rng[self._rank] if state.get("world_size") == self._world_size and len(rng) > self._rank else None
        if rng_state is None:
            log.warning(
                "sgdtp: the checkpoint's random states were saved by another number of ranks (or none were"
                " saved); dropout and random augmentations will not repeat the interrupted run exactly."
            )
        if not mid_epoch:
            # An end-of-epoch checkpoint: the uninterrupted run created this epoch's iterator after saving.
            if rng_state is not None:
                set_rng_states(rng_state)
            return iter(self.loader)
        return self._resume_mid_epoch(epoch, batches, rng_state)

    def _resume_mid_epoch(self, epoch: int, batches: int, rng_state: dict[str, Any] | None) -> Iterator[Any]:
        # A generator: its body runs at the first `next`, after Lightning has set the sampler's epoch, at the
        # point where the uninterrupted run was when it saved (about to fetch batch `batches`).
        iterator = iter(self.loader)
        _skip(self.loader, iterator, batches)
        if rng_state is not None:
            set_rng_states(rng_state)
        if self._rank == 0:
            log.info(f"sgdtp: resuming epoch {epoch} after batch {batches} (the batches before it are skipped)")
        yield from iterator


def _skip(loader: Any, iterator: Iterator[Any], batches: int) -> None:
    """Advance ``iterator`` by ``batches``: by indices alone where that is exact, else by loading and dropping."""
    fast = (
        isinstance(loader, DataLoader)
        and loader.num_workers == 0
        and not isinstance(loader.dataset, IterableDataset)
        and hasattr(iterator, "_sampler_iter")
    )
    if fast:
        # torch's single-process iterator takes the next batch of indices from `_sampler_iter`, then loads it.
        for _ in itertools.islice(iterator._sampler_iter, batches):
            pass
        iterator._num_yielded += batches
        return
    for _ in itertools.islice(iterator, batches):
        pass


def collect_rng_states() -> dict[str, Any]:
    """This process's global random states: torch (CPU and every CUDA device), Python, and NumPy if present."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["torch.cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return states
    # As plain values and a tensor: checkpoints are loaded with weights_only=True, which refuses NumPy arrays.
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    states["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "torch.cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch.cuda"])
    if "numpy" in states:
        import numpy as np

        kind, keys, pos, has_gauss, cached = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
