"""Tensor parallel inside pipeline stages: the whole module's split layers, run by the stages' traced modules.

Tensor parallel (:mod:`~lightning_sgdtp.parallel.tensor.plan`) splits a layer in two ways: its parameters become
DTensors over the tensor-parallel mesh, and forward hooks (torch's ``ParallelStyle`` input and output functions,
put there by ``distribute_module``) turn the layer's inputs and outputs into the DTensors the split needs. A
pipeline stage is a module traced by ``torch.export`` (``torch.distributed.pipelining``), not the user's layers: it
holds the LightningModule's own parameters under the same names (relinked after the split) and calls one traced
submodule per original module (``blocks.0.attn.qkv`` is an ``InterpreterModule`` called with ``call_module``). So
the split is applied once, to the whole module, at setup (the optimizer Lightning makes next steps the split
parameters, as with sharding); the trace runs on whole plain parameters with the hooks set aside
(:func:`hooks_set_aside`: ``torch.export`` must see plain tensors); and each traced stage gets the same hooks on its
submodules of the same names (:func:`hook_stage`). What runs between the split layers (heads reshaped,
attention) runs on DTensors with global shapes, as in the unsplit model: the traced ``view`` with the global head
count is right for DTensors.

Written here, not taken from torch: ``parallelize_module`` accepts ``nn.Linear`` / ``nn.Embedding`` only, and a
traced stage has neither; the hooks it made for the whole module are what the stage needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

#: The attribute of the whole module that lists the hooks tensor parallel put on its submodules.
HOOKS = "_sgdtp_tensor_hooks"


@dataclass(frozen=True)
class _Hook:
    module: str  # the submodule's qualified name
    key: int  # the hook's handle id on that submodule
    pre: bool  # a forward pre-hook (else a forward hook)
    with_kwargs: bool
    always_call: bool


@contextlib.contextmanager
def recording_hooks(module: nn.Module) -> Iterator[None]:
    """Record the forward hooks added to ``module``'s submodules inside the block (tensor parallel's), as
    ``module._sgdtp_tensor_hooks``."""
    before = {name: (set(m._forward_pre_hooks), set(m._forward_hooks)) for name, m in module.named_modules()}
    yield
    hooks: list[_Hook] = list(getattr(module, HOOKS, []))
    for name, m in module.named_modules():
        pre, post = before.get(name, (set(), set()))
        for key in m._forward_pre_hooks.keys() - pre:
            hooks.append(_Hook(name, key, True, key in m._forward_pre_hooks_with_kwargs, False))
        for key in m._forward_hooks.keys() - post:
            always = key in m._forward_hooks_always_called
            hooks.append(_Hook(name, key, False, key in m._forward_hooks_with_kwargs, always))
    module.__dict__[HOOKS] = hooks


def has_tensor_hooks(module: nn.Module) -> bool:
    return bool(module.__dict__.get(HOOKS))


def _hook_fn(whole: nn.Module, hook: _Hook) -> Callable:
    owner = whole.get_submodule(hook.module)
    return (owner._forward_pre_hooks if hook.pre else owner._forward_hooks)[hook.key]


@contextlib.contextmanager
def hooks_set_aside(whole: nn.Module) -> Iterator[None]:
    """While ``torch.export`` traces ``whole``: its tensor-parallel hooks removed (the trace must see plain
    tensors), put back after."""
    hooks = whole.__dict__.get(HOOKS, [])
    taken = [(h, _hook_fn(whole, h)) for h in hooks]
    for h, _ in taken:
        owner = whole.get_submodule(h.module)
        (owner._forward_pre_hooks if h.pre else owner._forward_hooks).pop(h.key)
    try:
        yield
    finally:
        for h, fn in taken:
            owner = whole.get_submodule(h.module)
            (owner._forward_pre_hooks if h.pre else owner._forward_hooks)[h.key] = fn


def hook_stage(stage: nn.Module, whole: nn.Module) -> list[str]:
    """Give a traced stage's submodules the tensor-parallel hooks of ``whole``'s submodules of the same names (those
    the stage calls); returns their names. The parameters are ``whole``'s own already (the split ones)."""
    named = dict(stage.named_modules())
    hooked: list[str] = []
    for h in whole.__dict__.get(HOOKS, []):
        target = named.get(h.module)
        if target is None or type(target) is nn.Module:
            continue  # on another stage, or a holder of a tied parameter that this stage does not call
        fn = _hook_fn(whole, h)
        if h.pre:
            target.register_forward_pre_hook(fn, with_kwargs=h.with_kwargs)
        else:
            target.register_forward_hook(fn, with_kwargs=h.with_kwargs, always_call=h.always_call)
        if not hooked or hooked[-1] != h.module:
            hooked.append(h.module)
    return hooked


def match_gradient_layouts(parameters: list[nn.Parameter]) -> int:
    """Give each split parameter's gradient the parameter's layout; returns how many changed. A stage that holds
    only the token embedding's use of a tied weight gets its gradient replicated (DTensor's embedding backward),
    while the stage holding the LM head's use gets it split: summing the two over the pipeline needs one layout.
    Replicated to split is a local slice: no communication."""
    from torch.distributed.tensor import DTensor

    changed = 0
    for p in parameters:
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
            changed += 1
    return changed
