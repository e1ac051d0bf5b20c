"""A model built on the meta device gets storage part by part, after the split: no rank ever holds it whole.

The module is built with ``torch.device("meta")`` (``trainer.init_module(empty_init=True)``,
``fabric.init_module(empty_init=True)``, the strategy's ``configure_model`` context when ``pretrained`` is given, or
by the user): shapes and dtypes, no memory. Planning and splitting need nothing else, so the tensor plan, the
sharding and the pipeline's stages are all applied on meta (``engine/parallelize.py``); then :func:`materialize`,
on each rank:

1. allocates **its own part** of every meta tensor on its device: a DTensor's local shard, a plain tensor whole (a
   pipeline rank only the tensors of its stages: ``held``);
2. fills what the checkpoint has from ``pretrained`` (a Hugging Face folder), each rank reading only its pieces
   (:mod:`lightning_sgdtp.checkpoint.huggingface`); a checkpoint that does not fit the model is refused here, every
   tensor that does not fit named, before any step;
3. initializes the rest module by module: the module's tensors made whole on the host for that one module, its
   initialization run (the ``init_weights`` option, else a ``transformers`` model's ``_init_weights``, else the
   module's ``reset_parameters``) under a seed drawn from the job's seed (rank 0's) and the module's name, and this
   rank's slice kept. So a replicated tensor is the same on every rank and a sharded one is a slice of one global
   initialization, whatever the layout; the host holds one module whole at a time (the largest: the embedding).

Tensors keep their identity (``torch.utils.swap_tensors``): tied weights stay tied, and what already refers to a
parameter (hooks, the gradient sync built next) sees the materialized one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_sgdtp.checkpoint import huggingface as hf


class MaterializeError(RuntimeError):
    """A meta tensor this rank cannot fill: nothing in the checkpoint and no initialization for its module."""


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (a DTensor: its local shard)."""
    return any(_local(t).is_meta for t in (*module.parameters(), *module.buffers()))


@dataclass
class Materialized:
    """What :func:`materialize` did on this rank, for the rank-0 lines."""

    allocated: int = 0  # tensors given storage
    allocated_bytes: int = 0
    loaded: int = 0  # filled from the checkpoint
    initialized: int = 0  # filled by their module's initialization
    left: int = 0  # meta tensors of other ranks' stages, left without storage
    modules: list[str] = field(default_factory=list)  # module types initialized
    source: str | None = None

    def describe(self) -> list[str]:
        from lightning_sgdtp.planner.units import size_text

        held = size_text(self.allocated_bytes)
        line = f"materialized on meta: this rank allocated its part ({self.allocated} tensors, {held})"
        if not self.allocated:  # a model built with its weights: overwritten in place
            line = "pretrained weights into the model as split (it was built with weights)"
        if self.source is not None:
            line += f"; {self.loaded} read by shard from {self.source}"
        if self.initialized:
            kinds = ", ".join(sorted(set(self.modules))[:6])
            line += f"; {self.initialized} initialized ({kinds})"
        if self.left:
            line += f"; {self.left} of other stages left unallocated"
        return [line]


def materialize(
    module: nn.Module,
    device: torch.device,
    pretrained: str | Path | None = None,
    init_weights: Callable[[nn.Module], None] | None = None,
    seed: int = 0,
    held: Callable[[str], bool] | None = None,
) -> Materialized:
    """Give every meta tensor of ``module`` this rank's storage on ``device`` and its values (see the module's
    docstring); with ``pretrained``, also overwrite the already materialized tensors the checkpoint has. ``held``:
    whether this rank holds the tensor of a state dict key (a pipeline rank: its stages); the others stay meta.
    ``seed``: the same on every rank (rank 0's). A collective when ``pretrained`` is given (DCP's load)."""
    done = Materialized(source=str(pretrained) if pretrained is not None else None)
    state = module.state_dict(keep_vars=True)  # names as checkpoints know them (no wrapper prefixes)
    names = _names_by_id(module, state)
    index = hf.read_index(pretrained) if pretrained is not None else {}
    found = hf.find_hf_model(module)
    if found is not None and index:
        index = hf.renamed(index, found[1])  # names as the model calls them (from_pretrained's renamings)
    matched = None
    if pretrained is not None:
        matched = _match(module, state, index, found)
        problem = matched.problem(pretrained)
        if problem is not None:
            raise hf.PretrainedError(problem)
    # 1. storage for this rank's part
    fresh: set[int] = set()
    for owner, attr, tensor, is_param in _slots(module):
        key = names.get(id(tensor), attr)
        if id(tensor) in fresh or not _local(tensor).is_meta:
            continue
        if held is not None and not held(key):
            done.left += 1
            fresh.add(id(tensor))  # counted once
            continue
        now = _allocate(owner, attr, tensor, is_param, device)
        fresh.update({id(tensor), id(now)})
        done.allocated += 1
        done.allocated_bytes += _local(now).numel() * _local(now).element_size()
    state = module.state_dict(keep_vars=True)
    # 2. what the checkpoint has, read by shard (every rank takes part in the collective)
    from_file: set[int] = set()
    if matched is not None:
        targets = {n: state[k] for n, k in matched.keys.items() if not _local(state[k]).is_meta}
        hf.load(pretrained, {n: t.detach() if not _is_dtensor(t) else t for n, t in targets.items()}, index)
        from_file = {id(t) for t in targets.values()}
        done.loaded = len(targets)
    # 3. the rest, module by module
    was_meta = set(fresh)
    base = _shared_seed(seed)
    for name, sub in module.named_modules():
        own = [
            (attr, t, is_param)
            for attr, t, is_param in _own(sub)
            if id(t) in was_meta and id(t) not in from_file and not _local(t).is_meta
        ]
        if not own:
            continue
        _initialize(sub, name, own, init_weights, found, base, device)
        done.initialized += len(own)
        done.modules.append(type(sub).__name__)
        for _, t, _ in own:
            was_meta.discard(id(t))
    return done


# ------------------------------------------------------------------------------------------------ the pieces
def _local(t: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _is_dtensor(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _slots(module: nn.Module) -> list[tuple[nn.Module, str, Tensor, bool]]:
    out = []
    for sub in module.modules():
        for attr, t, is_param in _own(sub):
            out.append((sub, attr, t, is_param))
    return out


def _own(sub: nn.Module) -> list[tuple[str, Tensor, bool]]:
    params = [(a, p, True) for a, p in sub._parameters.items() if p is not None]
    return params + [(a, b, False) for a, b in sub._buffers.items() if b is not None]


def _names_by_id(module: nn.Module, state: dict[str, Tensor]) -> dict[int, str]:
    """Each tensor's state dict key (the first, for a tied one); a non-persistent buffer its module path."""
    names: dict[int, str] = {}
    for key, t in state.items():
        names.setdefault(id(t), key)
    for key, b in module.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), key.replace("_checkpoint_wrapped_module.", ""))
    return names


def _empty_local(t: Tensor, device: torch.device) -> Tensor:
    """Uninitialised storage for this rank's part of ``t`` (a DTensor: its local shard, on the same mesh)."""
    from torch.distributed.tensor import DTensor

    local = _local(t)
    empty = torch.empty(local.shape, dtype=local.dtype, device=device)
    if isinstance(t, DTensor):
        return DTensor.from_local(empty, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return empty


def _allocate(owner: nn.Module, attr: str, t: Tensor, is_param: bool, device: torch.device) -> Tensor:
    """Storage for ``owner.<attr>``; returns the tensor now in place (a parameter: the same object)."""
    empty = _empty_local(t, device)
    if is_param:
        # the same Python object keeps its place everywhere it is referred to (ties, hooks, optimizers), and its
        # attributes (a sharded parameter's mark): swap_tensors swaps them too, so they are put back
        marks = dict(t.__dict__)
        torch.utils.swap_tensors(t, nn.Parameter(empty, requires_grad=t.requires_grad))
        t.__dict__.update(marks)
        return t
    owner._buffers[attr] = empty
    return empty


def _match(module: nn.Module, state: dict[str, Tensor], index: dict[str, hf.StoredTensor], found: Any) -> hf.Match:
    """The checkpoint's names against the state dict; buffers may be absent (a model computes them), and a
    ``transformers`` model's ignore patterns apply."""
    params = {id(p) for p in module.parameters()}
    optional = [k for k, t in state.items() if id(t) not in params]
    ignored = ""
    if found is not None:
        patterns = getattr(found[1], "_keys_to_ignore_on_load_unexpected", None) or []
        ignored = "|".join(f"(?:{p})" for p in patterns)
    return hf.match(state, {n: s.shape for n, s in index.items()}, optional, ignored)


def _shared_seed(seed: int) -> int:
    """Rank 0's seed, on every rank: replicated tensors must come out the same everywhere."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        box = [seed]
        dist.broadcast_object_list(box, src=0)
        return int(box[0])
    return seed


def _module_seed(base: int, name: str) -> int:
    digest = hashlib.sha256(f"{base}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_functions(
    sub: nn.Module, name: str, init_weights: Callable[[nn.Module], None] | None, found: Any
) -> list[tuple[str, Callable[[nn.Module], None]]]:
    """What may initialize ``sub``, in the order tried: the option's function alone; else a ``transformers``
    model's ``_init_weights`` (inside that model), then the module's ``reset_parameters``."""
    if init_weights is not None:
        return [("init_weights", init_weights)]
    out = []
    if found is not None and (name + ".").startswith(found[0]):
        out.append((f"{type(found[1]).__name__}._init_weights", found[1]._init_weights))
    reset = getattr(sub, "reset_parameters", None)
    if callable(reset):
        out.append(("reset_parameters", lambda _: reset()))
    return out


def _initialize(
    sub: nn.Module,
    name: str,
    own: list[tuple[str, Tensor, bool]],
    init_weights: Callable[[nn.Module], None] | None,
    found: Any,
    base: int,
    device: torch.device,
) -> None:
    """Run ``sub``'s initialization on whole host copies of its tensors ``own``, keep this rank's slices. The copies
    start as NaN: a function that leaves one untouched has not initialized it, and the next one is tried."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    whole: dict[str, Tensor] = {}
    tried = []
    for label, fn in _init_functions(sub, name, init_weights, found):
        tried.append(label)
        saved_params, saved_buffers = dict(sub._parameters), dict(sub._buffers)
        try:
            # what is not being initialized (read from the checkpoint, or another rank's) the function writes into
            # a stand-in on the meta device: no memory, and the real tensor keeps its values
            for attr, t, is_param in _own(sub):
                stand_in = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                (sub._parameters if is_param else sub._buffers)[attr] = nn.Parameter(stand_in) if is_param else stand_in
            for attr, t, is_param in own:
                full = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
                if full.is_floating_point():
                    full.fill_(float("nan"))
                whole[attr] = nn.Parameter(full, requires_grad=t.requires_grad) if is_param else full
                (sub._parameters if is_param else sub._buffers)[attr] = whole[attr]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_module_seed(base, name))
                with torch.no_grad():
                    fn(sub)
        finally:
            sub._parameters.update(saved_params)
            sub._buffers.update(saved_buffers)
        left = [a for a, w in whole.items() if w.is_floating_point() and torch.isnan(w).any()]
        if not left:
            break
    else:
        how = f"{' and '.join(tried)} left {left} uninitialized" if tried else "it has no reset_parameters()"
        raise MaterializeError(
            f"{name or 'the model'} ({type(sub).__name__}) was built on the meta device and its tensors"
            f" {[a for a, _, _ in own]} are not in the pretrained checkpoint and nothing initializes them: {how}."
            " Give the strategy init_weights=fn (fn(module) initializes one module's own tensors), load them with"
            " pretrained=..., or build this module with real weights."
        )
    with torch.no_grad():
        for attr, t, _ in own:
            full = whole[attr].detach()
            if isinstance(t, DTensor):
                piece = distribute_tensor(
                    full.to(t.device_mesh.device_type), t.device_mesh, t.placements, src_data_rank=None
                )
                _local(t).copy_(piece.to_local())
            else:
                t.copy_(full.to(t.device))
