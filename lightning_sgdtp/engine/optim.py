"""The optimizer's update: how the optimizers from ``configure_optimizers`` run their ``step`` (option
``optimizer_update``).

On the modules users write the update is a large part of the step: AdamW's per-parameter loop (torch's default on
CPU) walks every weight, gradient and both moments about a dozen times, ~40 % of a 13.7M-parameter MLP step here.
The update is the same math done in fewer passes over memory, in one of two ways torch itself provides:

- ``"fused"``: torch's fused kernel for the optimizer (``fused=True`` of SGD, Adam, AdamW, Adagrad): one pass per
  parameter, vectorized. No compile time.
- ``"compiled"``: the optimizer's ``step`` captured by ``torch.compile`` (Inductor generates one fused loop per
  group of parameters), for the optimizers without a fused kernel (RMSprop, NAdam, ...). Learning-rate schedulers
  change the rate without a recompile (Dynamo passes the float as an input).
- ``"auto"`` (default): fused where torch has the kernel for this optimizer, device and dtype and the user left
  ``fused``/``foreach`` unset; other torch optimizers compiled; an optimizer that is not ``torch.optim``'s (a
  package's Lion, a hand-written one) and any optimizer of split (DTensor) parameters stay as they are.
- ``"eager"``: the optimizers run as configured (what ``ddp`` runs).

Only the update changes. Lightning's hooks between backward and the update (``on_after_backward``,
``on_before_optimizer_step``, gradient clipping, ``self.log``) run eagerly as before and see the averaged
gradients: they are user code, which is why the update is its own compiled region and not part of the backward
graph. Checkpoints keep the user's settings: ``state_dict()`` reports the ``fused``/``foreach`` the user chose,
and loading a checkpoint (which replaces the parameter groups) keeps the fused kernel.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

UPDATES = ("auto", "fused", "compiled", "eager")
#: torch optimizers with a fused kernel (``fused=True``), and the devices that have it.
_FUSED = {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad}


class OptimizerUpdateError(ValueError):
    """``optimizer_update`` asks for something this optimizer cannot do."""


@dataclass
class UpdatePlan:
    """How one optimizer's update runs, and why (``plan["step_program"]["optimizer_update"]``)."""

    optimizer: str
    how: str
    why: str

    def to_dict(self) -> dict[str, str]:
        return {"optimizer": self.optimizer, "how": self.how, "why": self.why}


def _params(optimizer: Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _fused_blocker(optimizer: Optimizer, device: torch.device) -> str | None:
    """Why torch's fused kernel cannot run this optimizer here (None: it can)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    name = type(optimizer).__name__
    if type(optimizer) not in _FUSED:
        return f"torch has no fused kernel for {name}"
    if device.type not in _get_fused_kernels_supported_devices():
        return f"no fused kernels on {device.type}"
    if type(optimizer) is torch.optim.Adagrad and device.type != "cpu":
        return "fused Adagrad is CPU-only"
    if any(isinstance(p, DTensor) for p in _params(optimizer)):
        return "its parameters are split (DTensor)"
    if any(not p.is_floating_point() or p.device.type != device.type for p in _params(optimizer)):
        return "a parameter is not a floating-point tensor on the device"
    if any(g.get("differentiable") for g in optimizer.param_groups):
        return "differentiable=True"
    return None


def _user_chose(optimizer: Optimizer) -> str | None:
    """The implementation the user asked for explicitly (``fused=`` or ``foreach=``), if any."""
    for key in ("fused", "foreach"):
        values = {g.get(key) for g in optimizer.param_groups} | {optimizer.defaults.get(key)}
        chosen = values - {None}
        if chosen:
            return f"{key}={min(chosen, key=str)}"
    return None


def choose(optimizer: Optimizer, mode: str, device: torch.device) -> UpdatePlan:
    """Decide how ``optimizer`` updates (pure: nothing is changed)."""
    name = type(optimizer).__name__
    if mode not in UPDATES:
        raise OptimizerUpdateError(f"optimizer_update={mode!r}; choose one of {list(UPDATES)}")
    if mode == "eager":
        return UpdatePlan(name, "eager", "optimizer_update='eager'")
    blocker = _fused_blocker(optimizer, device)
    if mode == "fused":
        if blocker is not None:
            raise OptimizerUpdateError(
                f"optimizer_update='fused', but for {name}: {blocker}. Use optimizer_update='compiled' (any torch"
                " optimizer) or 'auto' (fused where possible, else compiled or as configured)."
            )
        return UpdatePlan(name, "fused", "optimizer_update='fused'")
    if mode == "compiled":
        return UpdatePlan(name, "compiled", "optimizer_update='compiled': torch.compile of its step")
    # auto
    chose = _user_chose(optimizer)
    if chose is not None:
        return UpdatePlan(name, "eager", f"you configured {chose}: kept")
    if blocker is None:
        return UpdatePlan(name, "fused", "torch's fused kernel: one vectorized pass per parameter, no compile")
    from torch.distributed.tensor import DTensor

    if not type(optimizer).__module__.startswith("torch.optim"):
        return UpdatePlan(name, "eager", f"not a torch.optim optimizer ({blocker}); kept as configured")
    if any(isinstance(p, DTensor) for p in _params(optimizer)):
        return UpdatePlan(name, "eager", "its parameters are split (DTensor): kept as configured")
    return UpdatePlan(name, "compiled", f"{blocker}: its step compiled by torch.compile (Inductor)")


class OptimizerUpdates:
    """Installs the chosen update on each optimizer and removes it again (``restore``)."""

    def __init__(self) -> None:
        self.plans: list[UpdatePlan] = []
        self._undo: list[Callable[[], None]] = []

    def install(
        self, optimizers: Iterable[Optimizer], mode: str, device: torch.device, say: Callable[[str], None]
    ) -> None:
        self.restore()
        self.plans.clear()
        for optimizer in optimizers:
            optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
            plan = choose(optimizer, mode, device)
            if plan.how == "fused":
                self._undo.append(use_fused(optimizer))
            elif plan.how == "compiled":
                self._undo.append(compile_update(optimizer))
            self.plans.append(plan)
            say(f"optimizer {plan.optimizer}: update {plan.how} ({plan.why})")

    def describe(self) -> list[dict[str, str]]:
        return [p.to_dict() for p in self.plans]

    def restore(self) -> None:
        """Put the optimizers back as configured (``describe`` still says what ran)."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def use_fused(optimizer: Optimizer) -> Callable[[], None]:
    """Run ``optimizer`` with torch's fused kernel; return the undo. Its ``state_dict()`` keeps reporting the
    user's settings, and loading a state dict keeps the kernel."""
    keys = ("fused", "foreach")
    original = {k: optimizer.defaults.get(k) for k in keys}

    def switch(opt: Optimizer) -> None:
        for group in [opt.defaults, *opt.param_groups]:
            group["fused"], group["foreach"] = True, False

    def saved_as_configured(opt: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        for group in state_dict["param_groups"]:
            group.update(original)
        return state_dict

    switch(optimizer)
    hooks = [
        optimizer.register_state_dict_post_hook(saved_as_configured),
        optimizer.register_load_state_dict_post_hook(switch),
    ]

    def undo() -> None:
        for hook in hooks:
            hook.remove()
        for group in [optimizer.defaults, *optimizer.param_groups]:
            group.update(original)

    return undo


def compile_update(optimizer: Optimizer) -> Callable[[], None]:
    """Run ``optimizer.step`` compiled by ``torch.compile``; return the undo.

    Lightning calls ``step(closure=...)``: the closure (training step, backward, hooks) runs first, eagerly, as
    the optimizer would run it; then the compiled update, without the closure (Dynamo must not trace Lightning's
    loop)."""
    had_own = "step" in optimizer.__dict__
    step = optimizer.step  # bound; a scheduler's counting wrapper is kept inside
    # A float learning rate is a constant to Dynamo (one recompile per value a scheduler sets); a 0-d tensor is an
    # input (torch's recommendation for compiled optimizers). Schedulers fill it in place; checkpoints keep floats.
    floats = [not isinstance(g["lr"], torch.Tensor) for g in optimizer.param_groups]

    def lr_as_tensor(opt: Optimizer) -> None:
        for group in opt.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]))

    def saved_as_floats(opt: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        for group, was_float in zip(state_dict["param_groups"], floats):
            if was_float and isinstance(group["lr"], torch.Tensor):
                group["lr"] = float(group["lr"])
        return state_dict

    lr_as_tensor(optimizer)
    hooks = [
        optimizer.register_state_dict_post_hook(saved_as_floats),
        optimizer.register_load_state_dict_post_hook(lr_as_tensor),
    ]

    @torch.compile
    def update() -> None:
        step()

    def run(self: Optimizer, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if kwargs:
            step(**kwargs)  # e.g. a grad scaler's arguments: the plain step
        else:
            update()
        return loss

    optimizer.step = types.MethodType(run, optimizer)  # type: ignore[method-assign]  (a scheduler made later wraps it)

    def undo() -> None:
        for hook in hooks:
            hook.remove()
        for group, was_float in zip(optimizer.param_groups, floats):
            if was_float and isinstance(group["lr"], torch.Tensor):
                group["lr"] = float(group["lr"])
        if had_own:
            optimizer.step = step  # type: ignore[method-assign]
        else:
            del optimizer.step

    return undo
