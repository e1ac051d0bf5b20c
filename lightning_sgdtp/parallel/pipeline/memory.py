"""A pipeline rank holds only its stages: the other stages' parameters are released after the split.

Every rank builds the whole LightningModule (Lightning calls ``__init__``/``configure_model`` on each), and torch's
pipeline frontend traces all of it. Once this rank's stages are built and linked to the module's own parameters and
the first training step begins, every parameter no local stage uses is replaced in the module by a parameter of the
same shape on the meta device and dropped from the optimizers' parameter groups (it never gets a gradient here, so
it has no optimizer state), and its memory is freed. Reading one raises torch's "meta tensor" error rather than
returning stale values. A later trace (a new micro-batch shape, validation) sees every shape: ``torch.export`` reads
only metadata, so the released parameters are lent to it as tensors of their shape and device with no storage, for
the trace only (a tied one with storage, uninitialised: torch's frontend deep-copies it). A model built on the meta
device never gives the other stages' parameters storage at all (:meth:`ReleasedStages.never_held`,
``engine/materialize.py``): no rank holds the model whole, before or after the split. Checkpoints never need the others' values (every rank saves its stages' part, a sharded folder);
:meth:`ReleasedStages.restore` gives them storage again when the user asks for the whole model
(``SGDTPStrategy.gather_pipeline_stages()``, which then fills them from the ranks that hold them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_sgdtp.parallel.sharding import held_bytes, trace_stand_in
from lightning_sgdtp.parallel.tensor.plan import local_shard


def _empty_like(p: Tensor, device: torch.device) -> nn.Parameter:
    """A parameter like ``p`` (a DTensor: a DTensor on the same mesh), uninitialised, on ``device``."""
    from torch.distributed.tensor import DTensor

    local = local_shard(p)
    empty = torch.empty(local.shape, dtype=local.dtype, device=device)
    if isinstance(p, DTensor):
        empty = DTensor.from_local(
            empty, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return nn.Parameter(empty, requires_grad=p.requires_grad)


@dataclass
class ReleasedStages:
    """The parameters this rank released (of the other ranks' stages), and what it still holds."""

    #: (owner module, attribute, the meta stand-in, makes a tensor like the original, with storage)
    slots: list[tuple[nn.Module, str, nn.Parameter, Callable[[], nn.Parameter]]] = field(default_factory=list)
    released_bytes: int = 0
    held_bytes: int = 0
    count: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # this rank's

    @classmethod
    def release(
        cls,
        module: nn.Module,
        keep: Iterable[Tensor],
        optimizers: Iterable[torch.optim.Optimizer],
        device: torch.device,
    ) -> ReleasedStages:
        """Replace every parameter of ``module`` not in ``keep`` (this rank's stages') by a meta stand-in, and drop
        it from ``optimizers``."""
        kept = {id(p) for p in keep}
        out, stand_ins = cls(device=device), {}
        for owner in module.modules():
            for attr, p in list(owner._parameters.items()):
                if p is None or id(p) in kept or p.is_meta:
                    continue
                if id(p) not in stand_ins:
                    local = local_shard(p)
                    stand_ins[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
                    out.released_bytes += local.numel() * local.element_size()
                    out.count += 1
                out.slots.append((owner, attr, stand_ins[id(p)], lambda p=p: _empty_like(p, device)))
                owner._parameters[attr] = stand_ins[id(p)]
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                group["params"] = [q for q in group["params"] if id(q) not in stand_ins]
        out.held_bytes = held_bytes(module)["parameters"]
        return out

    @classmethod
    def never_held(cls, module: nn.Module, device: torch.device) -> ReleasedStages:
        """The parameters of other ranks' stages that a model built on the meta device never gave storage here
        (``engine/materialize.py``): released from the start, lent to a trace like the others."""
        out, seen = cls(device=device), set()
        for owner in module.modules():
            for attr, p in owner._parameters.items():
                if p is None or not local_shard(p).is_meta:
                    continue
                if id(p) not in seen:
                    seen.add(id(p))
                    out.count += 1
                    out.released_bytes += local_shard(p).numel() * local_shard(p).element_size()
                out.slots.append((owner, attr, p, lambda p=p: _empty_like(p, device)))
        out.held_bytes = held_bytes(module)["parameters"]
        return out

    def drop_from(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """The released parameters out of ``optimizers``' parameter groups (made from the whole module)."""
        ids = {id(stand_in) for _, _, stand_in, _ in self.slots}
        for optimizer in optimizers:
            for group in getattr(optimizer, "_optimizer", optimizer).param_groups:
                group["params"] = [q for q in group["params"] if id(q) not in ids]

    def merge(self, other: ReleasedStages) -> ReleasedStages:
        """These and ``other``'s released parameters, as one."""
        self.slots += other.slots
        self.released_bytes += other.released_bytes
        self.count += other.count
        self.held_bytes = other.held_bytes
        return self

    @contextlib.contextmanager
    def lent_for_tracing(self) -> Iterator[None]:
        """While ``torch.export`` traces the module: each stand-in replaced by a tensor of its shape and device
        with no storage (a trace reads metadata only), put back after."""
        lent: dict[int, nn.Parameter] = {}
        uses: dict[int, int] = {}
        for _, _, stand_in, _ in self.slots:
            uses[id(stand_in)] = uses.get(id(stand_in), 0) + 1
        try:
            for owner, attr, stand_in, _ in self.slots:
                if id(stand_in) not in lent:
                    lent[id(stand_in)] = trace_stand_in(stand_in, self.device, tied=uses[id(stand_in)] > 1)
                owner._parameters[attr] = lent[id(stand_in)]
            yield
        finally:
            for owner, attr, stand_in, _ in self.slots:
                owner._parameters[attr] = stand_in

    def restore(self) -> None:
        """The released parameters back in the module with storage (uninitialised: the caller fills them)."""
        made: dict[int, nn.Parameter] = {}
        for owner, attr, stand_in, make in self.slots:
            owner._parameters[attr] = made.setdefault(id(stand_in), make())
        self.slots, self.held_bytes, self.released_bytes = [], self.held_bytes + self.released_bytes, 0

    def to_dict(self) -> dict[str, int]:
        return {"parameters": self.held_bytes, "released": self.released_bytes, "released_count": self.count}
