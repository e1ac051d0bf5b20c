"""Memory and time as people write them: ``"300MB"`` in, ``1.50 GiB`` and ``12.3 ms`` out. A leaf of the package,
so that the options (``config``) check ``max_memory_per_rank`` without importing the planner's search."""

from __future__ import annotations

import re

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class PlannerInputError(ValueError):
    """A value the planner cannot use; the message names it and the fix."""


def parse_memory(text: str | int) -> int:
    """``"300MB"``, ``"80GB"``, ``"1.5GiB"`` (decimal and binary units, any case) as bytes; an int is bytes."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise PlannerInputError(
            f"memory {text!r}: give a positive number with a unit, e.g. '300MB', '80GB' or '1.5GiB'"
            f" (units: {', '.join(u if len(u) < 3 else u[0] + 'i' + u[2] for u in _UNITS)})"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def size_text(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``312.0 KiB``, ``1.50 GiB``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def time_text(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"
