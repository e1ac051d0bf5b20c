"""A pipeline rank holds only its stages: the other stages' parameters are released after the split.

Every rank builds the whole LightningModule (Lightning calls ``configure_model``/``__init__`` on each), and torch's
pipeline frontend traces all of it. Once this rank's stages are built and linked to the module's own parameters,
the parameters no local stage uses have their storage freed (``untyped_storage().resize_(0)``, as FSDP1 frees a flat
parameter): the Parameter objects stay, with their shapes, names and places in the optimizer, so the state dict
keeps its keys, a later trace of a new micro-batch shape still sees every shape (``torch.export`` reads metadata,
never values), and the optimizer never makes state for them (they never get a gradient here). A tensor with no
storage must not be read: only :meth:`ReleasedStages.restore` brings the values back (a collective: each stage's
holder sends its tensors), when the user asks for the whole model (``SGDTPStrategy.gather_pipeline_stages()``).
Checkpoints never need it: every rank saves its stages' part (a sharded folder).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn


def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def nbytes(t: Tensor) -> int:
    """The bytes this rank holds of ``t`` (a DTensor: its shard; released: none)."""
    local = _local(t)
    return local.untyped_storage().nbytes() and local.numel() * local.element_size()


def is_released(t: Tensor) -> bool:
    local = _local(t)
    return local.numel() > 0 and local.untyped_storage().nbytes() == 0


@dataclass
class ReleasedStages:
    """The parameters this rank released (of the other ranks' stages), and what it still holds."""

    parameters: list[nn.Parameter] = field(default_factory=list)
    storage_bytes: list[int] = field(default_factory=list)
    released_bytes: int = 0
    held_bytes: int = 0

    @classmethod
    def release(cls, module: nn.Module, keep: Iterable[Tensor]) -> ReleasedStages:
        """Free the storage of every parameter of ``module`` not in ``keep`` (this rank's stages' parameters)."""
        kept = {id(p) for p in keep}
        out = cls()
        with torch.no_grad():
            for p in module.parameters():
                size = nbytes(p)
                if id(p) in kept or is_released(p):
                    out.held_bytes += size
                    continue
                out.storage_bytes.append(_local(p).untyped_storage().nbytes())
                _local(p).untyped_storage().resize_(0)
                out.parameters.append(p)
                out.released_bytes += size
        return out

    def restore(self) -> None:
        """Give the released parameters storage again (uninitialised: the caller fills them)."""
        with torch.no_grad():
            for p, size in zip(self.parameters, self.storage_bytes):
                _local(p).untyped_storage().resize_(size)
        self.parameters, self.storage_bytes, self.held_bytes = [], [], self.held_bytes + self.released_bytes
        self.released_bytes = 0

    def to_dict(self) -> dict[str, int]:
        return {"parameters": self.held_bytes, "released": self.released_bytes, "released_count": len(self.parameters)}
