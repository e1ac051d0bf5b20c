"""What belongs to one process is never pickled or copied with the strategy.

``torch.save(trainer)``, ``pickle.dumps(trainer)`` (Lightning's own tests) and ``copy.deepcopy(trainer.strategy)``
copy the strategy as they copy ``DDPStrategy``. What only means something in the process that made it (threads,
locks, pipes, signal handlers, store clients, process groups and meshes, compiled code) is left out of the copy by
its owner (``Job.__getstate__``, ``FaultGuard.__getstate__``; the launcher's child processes:
:func:`without_child_processes`) and rebuilt by the next setup. The objects that are
nothing but such state are :class:`ProcessBound`: copied on their own, they refuse with what to do instead.
"""

from __future__ import annotations

import copy
from typing import Any, NoReturn


class ProcessBound:
    """A mixin: an instance belongs to the process that started it; pickling or copying it fails, naming it."""

    def __getstate__(self) -> NoReturn:
        raise TypeError(
            f"sgdtp: a {type(self).__name__} belongs to the process that started it (threads, signal handlers or a"
            " store client) and cannot be pickled or copied. The strategy leaves it out of torch.save(trainer) and"
            " copy.deepcopy(strategy), and starts a new one at the next setup: copy the strategy or the trainer"
            " instead."
        )


def without_child_processes(state: dict[str, Any]) -> dict[str, Any]:
    """A strategy's pickled state (``__getstate__``) without its launcher's handles of the processes it started
    (``subprocess.Popen``, which holds a lock: Lightning's ``_SubprocessScriptLauncher`` keeps them on rank 0, where
    ``torch.save(trainer)`` then fails under ``ddp``); Lightning's spawn launcher leaves its processes out the same
    way. The processes themselves run on; a copy cannot wait for them."""
    launcher = state.get("_launcher")
    if not getattr(launcher, "procs", None):
        return state
    launcher = copy.copy(launcher)
    launcher.procs = []
    return {**state, "_launcher": launcher}
