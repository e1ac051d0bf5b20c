"""The LightningModule contract of pipeline parallelism: what ``training_step`` must do so the schedule can run it
(checked before the first batch, named in the error when broken), where its ``self(...)`` call is found, and its
``self.log`` calls recorded per micro-batch on the last stage and replayed on every rank of the pipeline
(:mod:`~lightning_sgdtp.parallel.pipeline.runner` runs the schedule)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten


class PipelineContractError(RuntimeError):
    """The LightningModule does not meet the pipeline contract. The message names the missing piece."""


# ------------------------------------------------------------------------------------------ contract
class Captured(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.args_, self.kwargs_ = args, kwargs


@contextlib.contextmanager
def replaced(module: nn.Module, attribute: str, value: Any) -> Generator[None, None, None]:
    """Set an instance attribute (``forward``, ``log``) for the duration; restore what was there."""
    missing = object()
    before = module.__dict__.get(attribute, missing)
    setattr(module, attribute, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(module, attribute)
        else:
            setattr(module, attribute, before)


def capture_forward_inputs(module: nn.Module, hook: str, batch: Any, batch_idx: int) -> tuple[tuple, dict]:
    """The arguments ``module.<hook>(batch, batch_idx)`` passes to ``self(...)``; stops it right there."""

    def grab(*args: Any, **kwargs: Any) -> Any:
        raise Captured(args, kwargs)

    with replaced(module, "forward", grab), replaced(module, "log", lambda *a, **k: None):
        try:
            getattr(module, hook)(batch, batch_idx)
        except Captured as call:
            return call.args_, call.kwargs_
    raise PipelineContractError(
        f"{type(module).__name__}.{hook} never called self(...): with pipeline parallelism the model runs through"
        f" the pipeline when {hook} calls self(inputs), once per step; compute the loss from what it returns."
    )


def check_pipeline_contract(module: nn.Module) -> None:
    """What can be checked before the first batch: the LightningModule defines the steps the pipeline runs."""
    from lightning_sgdtp.engine.step_compile import overrides

    if not overrides(module, "training_step"):
        raise PipelineContractError(
            f"{type(module).__name__} defines no training_step: with pipeline parallelism training_step(batch,"
            " batch_idx) must call self(inputs) once and return the loss computed from its output."
        )
    if not module.automatic_optimization:
        raise PipelineContractError(
            f"{type(module).__name__} uses manual optimization (automatic_optimization=False): with pipeline"
            " parallelism the schedule runs forward and backward of every micro-batch itself, so training_step cannot"
            " call manual_backward. Use automatic optimization, or train without pipeline_stages."
        )
    if not overrides(module, "forward"):
        raise PipelineContractError(
            f"{type(module).__name__} defines no forward: the pipeline traces forward(inputs) and cuts it into stages;"
            " define forward to run the model (e.g. return self.model(x))."
        )
    batch_norms = [n for n, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if batch_norms:
        raise PipelineContractError(
            f"{type(module).__name__} has BatchNorm layers ({', '.join(batch_norms[:3])}"
            f"{', ...' if len(batch_norms) > 3 else ''}): in a pipeline each micro-batch would be normalised by its own"
            " statistics (a different model from training without the pipeline), and the traced stages do not carry"
            " the running statistics' updates back. Train it with parallelism='data' or 'tensor', or replace"
            " BatchNorm with GroupNorm / LayerNorm."
        )


def batch_size_of(args: tuple, kwargs: dict, hook: str) -> int:
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.dim() > 0]
    if not tensors:
        raise PipelineContractError(
            f"{hook} called self(...) without a tensor argument: the pipeline splits the tensors given to self(...)"
            " into micro-batches along their first dimension. Call self(inputs) with the batch's input tensor."
        )
    return tensors[0].shape[0]


@dataclass
class _LogCall:
    args: tuple
    kwargs: dict
    values: list[Any] = field(default_factory=list)


class LogRecorder:
    """Records ``self.log`` calls made per micro-batch; :meth:`summary` averages them into plain data."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.calls: dict[str, _LogCall] = {}
        #: The weight of the micro-batch now running (its loss's weight in the step): values are averaged with it.
        self.weight = 1.0

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        call = self.calls.setdefault(name, _LogCall(args, kwargs))
        call.values.append((value, self.weight))

    def summary(self) -> list[tuple[str, str, Any, tuple, dict]]:
        """``(name, kind, value, args, kwargs)``: kind ``"metric"`` (value: the metric's module path) or
        ``"value"`` (value: the mean over micro-batches, a float)."""
        from torchmetrics import Metric

        paths = {id(m): n for n, m in self.module.named_modules()}
        out = []
        for name, call in self.calls.items():
            last = call.values[-1][0]
            if isinstance(last, Metric):
                if id(last) not in paths:
                    raise PipelineContractError(
                        f"self.log({name!r}, metric): with pipeline parallelism a logged torchmetrics Metric must be"
                        " an attribute of the LightningModule (so every rank logs the same metric)."
                    )
                out.append((name, "metric", paths[id(last)], call.args, call.kwargs))
                continue
            numbers = [
                (float(v.detach().float().mean()) if isinstance(v, Tensor) else float(v)) * w for v, w in call.values
            ]
            out.append((name, "value", math.fsum(numbers) / len(numbers), call.args, call.kwargs))
        return out


def replay_logs(module: nn.Module, summary: Sequence[tuple[str, str, Any, tuple, dict]], device: torch.device) -> None:
    """Log on this rank what the last stage recorded (the same names, options and values on every rank)."""
    for name, kind, value, args, kwargs in summary:
        logged = module.get_submodule(value) if kind == "metric" else torch.tensor(value, device=device)
        module.log(name, logged, *args, **kwargs)
