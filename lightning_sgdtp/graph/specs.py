"""What a registered op accepts and returns: :class:`TensorSpec`, the tuple shorthand, and the checks.

A spec constrains a tensor argument (or result) of a registered op. Every field is optional:

- ``dtype``: a ``torch.dtype``, a dtype name (``"float32"``), or a tuple of them (any of these);
- ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, a ``torch.device``. A device without an index matches every
  device of that type; ``None`` matches any device;
- ``ndim``: the number of dimensions;
- ``name``: the argument's name in the op's schema and in error messages (default ``input0``, ``input1``,
  ... and ``output0``, ...).

The shorthand ``("tensor",)``, ``("tensor", device)`` or ``("tensor", device, dtype)`` (and the bare string
``"tensor"``) means ``TensorSpec(device=device, dtype=dtype)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class GraphError(RuntimeError):
    """Misuse of the graph registry: a taken name, a destroyed handle, an invalid spec or ``backward_fn`` result."""


class SpecError(ValueError):
    """A registered op was called with (or returned) a tensor that does not match its spec.

    The message names the op, the argument (index and name) and the expected spec. The fields are
    available as attributes for tools (``lightning_sgdtp.diagnose`` reads them).

    Attributes:
        op: ``"sgdtp.<name>"``.
        where: ``"input"``, ``"output"`` or ``"call"`` (wrong number of arguments).
        index: the argument's position (``None`` for a wrong number of arguments).
        arg: the argument's name.
        field: ``"device"``, ``"dtype"``, ``"ndim"``, ``"shape"``, ``"type"`` or ``"count"``.
        expected: the expected value, as text.
        got: what was given, as text.
        traced: ``True`` when raised while tracing (fake tensors, under ``torch.compile``).
    """

    # Plain class attributes set by ``spec_error``, not an ``__init__`` with arguments: TorchDynamo can trace the
    # construction of this exception (a call with the wrong number of arguments raises it inside traced code).
    op: str | None = None
    where: str | None = None
    index: int | None = None
    arg: str | None = None
    field: str | None = None
    expected: str | None = None
    got: str | None = None
    traced: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "where": self.where,
            "index": self.index,
            "arg": self.arg,
            "field": self.field,
            "expected": self.expected,
            "got": self.got,
            "traced": self.traced,
            "message": str(self),
        }


def spec_error(message: str, **fields: Any) -> SpecError:
    """A :class:`SpecError` with ``message`` and the given attributes."""
    err = SpecError(message)
    for key, value in fields.items():
        setattr(err, key, value)
    return err


def _parse_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
    raise GraphError(f"invalid dtype {value!r} in a spec: use a torch.dtype such as torch.float32, or its name")


@dataclass(frozen=True, init=False)
class TensorSpec:
    """Constraints on one tensor argument or result of a registered op (every field optional)."""

    dtype: tuple[torch.dtype, ...] | None
    device: torch.device | None
    ndim: int | None
    name: str | None

    def __init__(
        self,
        dtype: torch.dtype | str | Sequence[torch.dtype | str] | None = None,
        device: str | torch.device | None = None,
        ndim: int | None = None,
        name: str | None = None,
    ) -> None:
        if dtype is not None:
            dtypes = (
                tuple(_parse_dtype(d) for d in dtype) if isinstance(dtype, (tuple, list)) else (_parse_dtype(dtype),)
            )
            if not dtypes:
                raise GraphError("TensorSpec(dtype=()) allows no dtype at all; use None to allow any dtype")
        else:
            dtypes = None
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise GraphError(f"invalid device {device!r} in a spec: {e}") from None
        if ndim is not None and (not isinstance(ndim, int) or isinstance(ndim, bool) or ndim < 0):
            raise GraphError(f"invalid ndim {ndim!r} in a spec: use a non-negative int, or None for any")
        if name is not None and not (isinstance(name, str) and _NAME.match(name)):
            raise GraphError(f"invalid argument name {name!r} in a spec: use a Python identifier")
        object.__setattr__(self, "dtype", dtypes)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "ndim", ndim)
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        parts = []
        if self.dtype is not None:
            names = [str(d).removeprefix("torch.") for d in self.dtype]
            parts.append(f"dtype={names[0]}" if len(names) == 1 else f"dtype=({', '.join(names)})")
        if self.device is not None:
            parts.append(f"device={str(self.device)!r}")
        if self.ndim is not None:
            parts.append(f"ndim={self.ndim}")
        if self.name is not None:
            parts.append(f"name={self.name!r}")
        return f"TensorSpec({', '.join(parts)})"

    # ----------------------------------------------------------------------------------------- matching
    def device_matches(self, device: torch.device) -> bool:
        if self.device is None:
            return True
        if device.type != self.device.type:
            return False
        return self.device.index is None or device.index == self.device.index

    def mismatch(self, value: Any) -> tuple[str, str, str] | None:
        """``(field, expected, got)`` for the first constraint ``value`` breaks, else ``None``."""
        if not isinstance(value, torch.Tensor):
            return "type", "a Tensor", type(value).__name__
        if not self.device_matches(value.device):
            return "device", str(self.device), str(value.device)
        if self.dtype is not None and value.dtype not in self.dtype:
            expected = " or ".join(str(d).removeprefix("torch.") for d in self.dtype)
            return "dtype", expected, str(value.dtype).removeprefix("torch.")
        if self.ndim is not None and value.dim() != self.ndim:
            return "ndim", str(self.ndim), str(value.dim())
        return None


SpecLike = TensorSpec | tuple | list | str


def as_spec(value: SpecLike, what: str) -> TensorSpec:
    """A :class:`TensorSpec` from a spec or its shorthand; ``what`` names it in errors (``input_specs[1]``)."""
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, (tuple, list)) and 1 <= len(value) <= 3 and isinstance(value[0], str):
        kind, rest = value[0], list(value[1:])
        if kind.lower() != "tensor":
            raise GraphError(
                f"{what} = {tuple(value)!r}: only tensor arguments are supported (got kind {kind!r}). Pass"
                " constants by closing over them in forward_fn/backward_fn, or as 0-dim tensors."
            )
        device = rest[0] if len(rest) > 0 else None
        dtype = rest[1] if len(rest) > 1 else None
        try:
            return TensorSpec(dtype=dtype, device=device)
        except GraphError as e:
            raise GraphError(f"{what} = {tuple(value)!r}: {e}") from None
    raise GraphError(
        f"{what} = {value!r} is not a spec. Use lightning_sgdtp.graph.TensorSpec(dtype=..., device=..., ndim=...)"
        ' or the shorthand ("tensor", device) / ("tensor", device, dtype).'
    )
