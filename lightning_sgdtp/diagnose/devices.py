"""``mixed_devices`` / ``meta_parameters``: parameters and buffers on more than one device (``meta`` included),
and ``batch_device``: an example batch on another device than the module.

It runs first and decides whether the step can run at all: on mixed devices nothing else that runs the step is
checked. A batch on another device is moved to the module's device, as the strategy does with every batch; the
other checks run on that batch (:attr:`DeviceCheck.batch`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from lightning_sgdtp.diagnose.context import DiagnoseContext, map_tensors, tensors
from lightning_sgdtp.diagnose.report import CheckResult, Finding


@dataclass
class DeviceCheck(CheckResult):
    runnable: bool = True  # False: mixed devices or meta tensors; the step is not run
    batch: Any = None  # the example batch, on the module's device


def check(ctx: DiagnoseContext) -> DeviceCheck:
    where: dict[str, list[str]] = defaultdict(list)
    for name, p in ctx.module.named_parameters():
        where[str(p.device)].append(name)
    for name, b in ctx.module.named_buffers():
        where[str(b.device)].append(f"{name} (buffer)")
    devices = sorted(where)
    listing = "; ".join(
        f"{d}: {len(where[d])} ({', '.join(where[d][:4])}{', ...' if len(where[d]) > 4 else ''})" for d in devices
    )
    findings: list[Finding] = []
    if "meta" in devices:
        findings.append(
            Finding(
                "mixed_devices" if len(devices) > 1 else "meta_parameters",
                "error",
                f"parameters/buffers on {len(devices)} device(s), meta included: {listing}. Meta tensors have no data:"
                " the step cannot run, and module.to(device) cannot move them",
                "materialize them before training: build the module on a real device, or call"
                " module.to_empty(device=...) and then initialize them (reset_parameters()) or load a checkpoint"
                " (module.load_state_dict(..., assign=True)); with Lightning do it in configure_model()",
                details={"devices": {d: where[d] for d in devices}},
            )
        )
    elif len(devices) > 1:
        findings.append(
            Finding(
                "mixed_devices",
                "error",
                f"parameters/buffers on {len(devices)} devices: {listing}",
                "keep the whole module on one device: do not create parameters with an explicit device= in"
                " __init__, register plain tensors as buffers (self.register_buffer) so that module.to() moves them,"
                " and do not move submodules by hand after the strategy has placed the module",
                details={"devices": {d: where[d] for d in devices}},
            )
        )
    if len(devices) > 1 or "meta" in devices:
        findings.append(
            Finding(
                "compile_skipped",
                "info",
                "graph breaks, recompilations and custom ops were not checked: the step cannot run on mixed devices",
                "fix the device finding above and run diagnose again",
            )
        )
        return DeviceCheck(findings, runnable=False, batch=ctx.batch)
    batch = ctx.batch
    if devices:
        device = torch.device(devices[0])
        off = sorted({str(t.device) for t in tensors(batch) if t.device != device})
        if off:
            findings.append(
                Finding(
                    "batch_device",
                    "info",
                    f"the example batch has tensors on {', '.join(off)} and the module is on {device}; diagnose moved"
                    " them to the module's device, as the strategy does with every batch",
                    "nothing to do for training; to diagnose on another device, move the module there first",
                )
            )
            batch = map_tensors(batch, lambda t: t.to(device))
    return DeviceCheck(findings, runnable=True, batch=batch)
