"""``diagnose(module, example_batch)``: what will go wrong when the sgdtp strategy compiles this step, and what to do.

It runs the step the way the strategy does (``torch.compile(module.training_step, backend=SGDTPCompiler(...))``
for a LightningModule, the module's forward for a plain ``nn.Module``, or your ``step_fn``) and reports:

- ``graph_break``: every graph break, with Dynamo's reason and your source line (``torch._dynamo.explain``);
- ``recompile``: every recompilation and the guard that failed. The step runs on the example batch, again with
  another ``batch_idx``, on a batch whose first dimension differs (or ``other_batches``), and on the example
  batch again;
- ``mixed_devices``: parameters and buffers on more than one device (``meta`` included);
- ``custom_op_device`` / ``custom_op_spec``: ops of :mod:`lightning_sgdtp.graph` called with tensors their
  specs refuse (an op registered for ``cuda`` called with CPU tensors, a wrong dtype or rank);
- ``compile_cache``: a compile cache written by another torch build or another user (cache pollution);
- ``compile_error``: anything else that stops the step from compiling or running.

Each finding has a severity (``error``, ``warning``, ``info``), a message, where it is (file:line and the source
line, when known) and ``fix``: what to do. ``print(diagnosis)`` gives plain text, ``diagnosis.to_json()`` JSON;
``sgdtp diagnose path/to/file.py:make [--json]`` is the same from a shell.

Running it resets TorchDynamo's caches (``torch._dynamo.reset()``), and it leaves the module as it found it:
the parameters' ``.grad``, buffers (e.g. BatchNorm statistics) and train/eval mode. It runs forward and backward,
never an optimizer step.

The compile-cache check: every diagnose writes a marker file, ``.lightning_sgdtp_cache.json``, into Inductor's
cache directory (``TORCHINDUCTOR_CACHE_DIR``, else ``<tmp>/torchinductor_<user>``) naming the torch build, Python
and uid that use it. A later diagnose reports the directory as stale when the marker names another build, and as
foreign when the directory or any file in it belongs to another uid, or the directory is writable by everyone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Generator, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_sgdtp.graph.registry import NAMESPACE, record_spec_errors, registered
from lightning_sgdtp.graph.specs import SpecError

SEVERITIES = ("error", "warning", "info")
CACHE_MARKER = ".lightning_sgdtp_cache.json"
_MAX_CACHE_ENTRIES = 50_000
_OWN_FILES = (str(Path(__file__).resolve().parent),)


# ---------------------------------------------------------------------------------------------------- results
@dataclass
class Finding:
    """One thing diagnose found. ``fix`` says what to do about it."""

    check: str
    severity: str
    message: str
    fix: str
    where: str | None = None
    source: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Diagnosis:
    """What :func:`diagnose` found. ``str(diagnosis)`` is the plain-text report; ``to_json()`` the same as JSON."""

    target: str
    backend: str
    findings: list[Finding]
    stats: dict[str, Any]
    torch_version: str = torch.__version__

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        """No errors (warnings and info allowed)."""
        return not self.errors

    def of(self, check: str) -> list[Finding]:
        return [f for f in self.findings if f.check == check]

    def to_dict(self) -> dict[str, Any]:
        counts = {s: sum(1 for f in self.findings if f.severity == s) for s in SEVERITIES}
        return {
            "target": self.target,
            "backend": self.backend,
            "torch": self.torch_version,
            "ok": self.ok,
            "counts": counts,
            "stats": self.stats,
            "findings": [asdict(f) for f in self.findings],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def to_text(self) -> str:
        s = self.stats
        lines = [f"sgdtp diagnose: {self.target} (torch {self.torch_version}, backend {self.backend})"]
        if s.get("graphs") is None and "graphs" in s:
            lines.append("  the step could not be traced (see the errors below)")
        elif "graphs" in s:
            ops = ", ".join(s.get("custom_ops_used") or []) or "none"
            lines.append(
                f"  {s['graphs']} graph(s), {s['graph_breaks']} graph break(s), {s.get('recompiles', 0)}"
                f" recompilation(s); custom ops in the graphs: {ops}"
            )
        if s.get("cache_dir"):
            lines.append(f"  compile cache: {s['cache_dir']}")
        order = {sev: i for i, sev in enumerate(SEVERITIES)}
        for f in sorted(self.findings, key=lambda f: order[f.severity]):
            lines.append("")
            lines.append(f"[{f.severity}] {f.check}: {f.message}")
            if f.where:
                lines.append(f"    at {f.where}")
            if f.source:
                lines.append(f"    | {f.source}")
            lines.append(f"    fix: {f.fix}")
        counts = self.to_dict()["counts"]
        lines.append("")
        lines.append(f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info")
        return "\n".join(lines)

    __str__ = to_text


# ------------------------------------------------------------------------------------------------ diagnose
def diagnose(
    module: nn.Module,
    example_batch: Any,
    step_fn: Callable[[Any], Any] | None = None,
    *,
    other_batches: Iterable[Any] | None = None,
    backend: str | Callable[..., Any] = "sgdtp",
    backward: bool = True,
    check_cache: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    write_cache_marker: bool = True,
) -> Diagnosis:
    """Compile the step the way the sgdtp strategy does, on ``example_batch``, and report what goes wrong.

    Args:
        module: a LightningModule (its ``training_step(batch, batch_idx)`` is diagnosed) or a plain ``nn.Module``
            (its forward: ``module(*batch)`` for a tuple batch, else ``module(batch)``).
        example_batch: one batch, as the DataLoader yields it.
        step_fn: diagnose ``step_fn(batch)`` instead (a closure over ``module``).
        other_batches: batches to run after the example batch to look for recompilations. Default: one batch
            whose first dimension differs from the example's. ``[]`` to skip.
        backend: ``"sgdtp"`` (the strategy's ``SGDTPCompiler``), another TorchDynamo backend name (``"aot_eager"``
            is fast) or a backend callable.
        backward: also run backward once through the compiled step (compiles the backward graphs).
        check_cache: check Inductor's compile cache for files of another torch build or another user.
        cache_dir: the cache directory to check (default: ``TORCHINDUCTOR_CACHE_DIR``, else Inductor's default).
        write_cache_marker: write the version marker into a healthy cache directory that has none.
    """
    start = time.monotonic()
    findings: list[Finding] = []
    target, fn, make_args, is_lightning = _resolve_step(module, step_fn)
    backend_name = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
    kind = "step_fn" if step_fn is not None else ("LightningModule" if is_lightning else "nn.Module")
    stats: dict[str, Any] = {"kind": kind}

    runnable, example_batch = _check_devices(module, example_batch, findings)
    if runnable:
        with _preserved(module, is_lightning), record_spec_errors() as spec_errors:
            used: set[str] = set()
            explained = _check_graph_breaks(fn, make_args(example_batch, 0), findings, stats, used)
            if explained:
                _check_recompiles(
                    fn,
                    module,
                    example_batch,
                    other_batches,
                    make_args,
                    is_lightning and step_fn is None,  # training_step(batch, batch_idx): vary batch_idx too
                    backend,
                    backward,
                    findings,
                    stats,
                    used,
                )
            stats["custom_ops_used"] = sorted(used)
            _check_custom_ops(spec_errors, used, module, example_batch, findings)
        torch._dynamo.reset()
    if check_cache:
        path = _cache_path(cache_dir)
        stats["cache_dir"] = str(path)
        findings.extend(check_compile_cache(path, write_marker=write_cache_marker))
    stats["seconds"] = round(time.monotonic() - start, 2)
    return Diagnosis(target=target, backend=backend_name, findings=findings, stats=stats)


# -------------------------------------------------------------------------------------------------- the step
def _is_lightning_module(module: Any) -> bool:
    return any(
        c.__name__ == "LightningModule" and c.__module__.split(".")[0] in ("lightning", "pytorch_lightning")
        for c in type(module).__mro__
    )


def _resolve_step(
    module: nn.Module, step_fn: Callable[[Any], Any] | None
) -> tuple[str, Callable[..., Any], Callable[[Any, int], tuple[Any, ...]], bool]:
    name = type(module).__name__
    is_lightning = _is_lightning_module(module)
    if step_fn is not None:
        label = getattr(step_fn, "__qualname__", None) or type(step_fn).__name__
        return f"{label} (step_fn of {name})", step_fn, lambda batch, i: (batch,), is_lightning
    if is_lightning and _overrides(module, "training_step"):
        return f"{name}.training_step", module.training_step, lambda batch, i: (batch, i), True
    return f"{name}.forward", module, lambda batch, i: tuple(batch) if isinstance(batch, tuple) else (batch,), False


def _overrides(module: nn.Module, method: str) -> bool:
    for cls in type(module).__mro__:
        if method in cls.__dict__:
            return cls.__name__ != "LightningModule"
    return False


@torch.compiler.disable
def _no_log(*args: Any, **kwargs: Any) -> None:
    """Stands in for ``self.log`` of a LightningModule without a Trainer (Lightning would warn at every call)."""


@contextlib.contextmanager
def _preserved(module: nn.Module, is_lightning: bool) -> Generator[None, None, None]:
    """Train mode and the strategy's ``self.log`` treatment during; grads, buffers and mode restored after."""
    was_training = module.training
    grads = {p: p.grad for p in module.parameters()}
    buffers = {b: b.detach().clone() for b in module.buffers()}
    patched = []
    if is_lightning:
        has_trainer = getattr(module, "_trainer", None) is not None
        for hook in ("log", "log_dict"):
            if hook not in module.__dict__ and hasattr(module, hook):
                # As the strategy does: Lightning's logging runs eagerly (one clean graph break per call).
                setattr(module, hook, torch.compiler.disable(getattr(module, hook)) if has_trainer else _no_log)
                patched.append(hook)
    module.train()
    try:
        yield
    finally:
        for hook in patched:
            module.__dict__.pop(hook, None)
        with torch.no_grad():
            for b, value in buffers.items():
                b.copy_(value)
        for p, g in grads.items():
            p.grad = g
        module.train(was_training)


def _tensors(obj: Any) -> Generator[torch.Tensor, None, None]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _resized(batch: Any) -> tuple[Any, str] | None:
    """The batch with its first dimension halved (4 or more) or doubled; ``None`` if it has no such tensor."""
    sizes = {t.shape[0] for t in _tensors(batch) if t.dim() >= 1}
    if not sizes:
        return None
    n = max(sizes)
    m = n // 2 if n >= 4 else 2 * n

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != n:
            return t
        return t[:m].clone() if m < n else torch.cat([t, t])

    return _map_tensors(batch, resize), f"a batch whose first dimension is {m} instead of {n}"


def _loss(output: Any) -> torch.Tensor | None:
    if isinstance(output, dict):
        output = output.get("loss")
    elif isinstance(output, (list, tuple)):
        output = next((o for o in _tensors(output) if o.requires_grad), None)
    if isinstance(output, torch.Tensor) and output.requires_grad and output.is_floating_point():
        return output if output.numel() == 1 else output.float().sum()
    return None


# ------------------------------------------------------------------------------------------------ devices
def _check_devices(module: nn.Module, batch: Any, findings: list[Finding]) -> tuple[bool, Any]:
    where: dict[str, list[str]] = defaultdict(list)
    for name, p in module.named_parameters():
        where[str(p.device)].append(name)
    for name, b in module.named_buffers():
        where[str(b.device)].append(f"{name} (buffer)")
    devices = sorted(where)
    listing = "; ".join(
        f"{d}: {len(where[d])} ({', '.join(where[d][:4])}{', ...' if len(where[d]) > 4 else ''})" for d in devices
    )
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
        return False, batch
    if devices:
        device = torch.device(devices[0])
        off = sorted({str(t.device) for t in _tensors(batch) if t.device != device})
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
            batch = _map_tensors(batch, lambda t: t.to(device))
    return True, batch


# ------------------------------------------------------------------------------------------- graph breaks
_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _user_frame_from_text(text: str) -> tuple[str | None, str | None]:
    frames = [(f, int(n)) for f, n in _USER_FRAME.findall(text) if not _is_library_file(f)]
    if not frames:
        return None, None
    filename, lineno = frames[-1]
    return f"{filename}:{lineno}", _source_line(filename, lineno)


def _user_frame_from_traceback(exc: BaseException) -> tuple[str | None, str | None]:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _is_library_file(f.filename)]
    if frames:
        return f"{frames[-1].filename}:{frames[-1].lineno}", (frames[-1].line or "").strip() or None
    return _user_frame_from_text(str(exc))


def _is_library_file(filename: str) -> bool:
    torch_dir = os.path.dirname(torch.__file__)
    return filename.startswith((torch_dir, *_OWN_FILES, "<")) or "site-packages" in filename


def _source_line(filename: str, lineno: int) -> str | None:
    import linecache

    return linecache.getline(filename, lineno).strip() or None


def _headline(reason: str) -> str:
    return next((line.strip() for line in reason.splitlines() if line.strip()), reason)


def _hints(reason: str) -> list[str]:
    return [
        line.strip().removeprefix("Hint:").strip() for line in reason.splitlines() if line.strip().startswith("Hint:")
    ]


def _break_fix(reason: str) -> tuple[str, str]:
    """``(severity, fix)`` for a graph-break reason."""
    low = reason.lower()
    if "torch.compiler.disable" in low and ("lightningmodule.log" in low or "_no_log" in low):
        return "info", (
            "nothing to do: under the sgdtp strategy Lightning's self.log/self.log_dict run eagerly, one clean break"
            " per call. For no break at all, log from a callback (on_train_batch_end) instead"
        )
    if "torch.compiler.disable" in low or "skip calling" in low:
        return "warning", (
            "this function is marked torch.compiler.disable: it runs eagerly between two graphs, and the gradients"
            " of parameters used inside it are averaged after backward (the ledger's fallback) instead of inside"
            " the compiled backward. Remove the decorator if its code is traceable"
        )
    if "graph_break()" in low or "torch._dynamo.graph_break" in low:
        return "warning", "remove the explicit torch._dynamo.graph_break() call"
    if ".item()" in low or "capture_scalar_outputs" in low:
        return "warning", (
            "keep the value a tensor (torch.where(cond, a, b) instead of `if x.item() > 0`), or set"
            " torch._dynamo.config.capture_scalar_outputs = True"
        )
    if "data-dependent" in low or "generic_jump" in low or "branch" in low:
        return "warning", "branch on tensor values with torch.where or torch.cond, not with a Python if"
    if "print" in low or "logging" in low:
        return "warning", "remove print()/logging calls from the step, or move them to a callback"
    hint = "; ".join(_hints(reason))
    return "warning", (
        "rewrite this line with traceable torch operations, or move it out of the step (e.g. into a callback)"
        + (f". Dynamo's hint: {hint}" if hint else "")
    )


def _op_name(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name
    elif isinstance(target, torch._ops.OpOverloadPacket):
        name = target._qualified_op_name
    else:
        return None
    return name.replace("::", ".") if name.startswith(f"{NAMESPACE}::") else None


def _ops_in(gm: torch.fx.GraphModule) -> set[str]:
    return {n for n in (_op_name(node.target) for node in gm.graph.nodes if node.op == "call_function") if n}


def _check_graph_breaks(
    fn: Callable[..., Any], args: tuple[Any, ...], findings: list[Finding], stats: dict[str, Any], used: set[str]
) -> bool:
    try:
        out = torch._dynamo.explain(fn)(*args)
    except Exception as e:  # noqa: BLE001 - reported as a finding
        _compile_error(e, "tracing the step (torch._dynamo.explain)", findings)
        stats.update(graphs=None, graph_breaks=None)
        return False
    stats.update(graphs=out.graph_count, graph_breaks=max(out.graph_break_count, len(out.break_reasons)))
    for gm in out.graphs:
        used.update(_ops_in(gm))
    seen: dict[tuple[str, str | None], Finding] = {}
    for r in out.break_reasons:
        frames = [f for f in r.user_stack if not _is_library_file(f.filename)] or list(r.user_stack)
        frame = frames[-1] if frames else None
        where = f"{frame.filename}:{frame.lineno}" if frame else None
        headline = _headline(r.reason)
        key = (headline, where)
        if key in seen:
            seen[key].details["count"] += 1
            continue
        severity, fix = _break_fix(r.reason)
        seen[key] = finding = Finding(
            "graph_break",
            severity,
            f"graph break: {headline}",
            fix,
            where=where,
            source=(frame.line or "").strip() or None if frame else None,
            details={
                "reason": r.reason.split("\n\n For more details")[0].strip(),
                "hints": _hints(r.reason),
                "stack": [f"{f.filename}:{f.lineno} in {f.name}" for f in r.user_stack],
                "count": 1,
            },
        )
        findings.append(finding)
    return True


# ------------------------------------------------------------------------------------------- recompiles
def _make_backend(backend: str | Callable[..., Any], module: nn.Module) -> Callable[..., Any] | str:
    if backend == "sgdtp":
        from lightning_sgdtp.compiler.backend import SGDTPCompiler

        return SGDTPCompiler(param_names={id(p): n for n, p in module.named_parameters()})
    return backend


def _recompile_fix(reason: str, synthetic: bool) -> str:
    low = reason.lower()
    if "size mismatch" in low or "stride mismatch" in low:
        return (
            "batch shapes change between steps"
            + (" (here: the other-size batch diagnose ran on purpose)" if synthetic else "")
            + ". Each new shape costs a recompilation until Dynamo switches that dimension to dynamic. Keep shapes"
            " fixed (DataLoader(drop_last=True), pad sequences to one length), or mark the dimension dynamic before"
            " the first step: torch._dynamo.mark_dynamic(tensor, dim)"
        )
    if "dtype mismatch" in low:
        return "feed every batch in one dtype (cast in the DataLoader's collate_fn or the dataset)"
    if "device mismatch" in low:
        return "feed every batch on one device"
    if "requires_grad mismatch" in low:
        return "requires_grad of an input changes between steps: keep it constant"
    if "batch_idx" in low:
        return (
            "the step's code depends on the value of batch_idx (each new value recompiles until Dynamo makes it"
            " dynamic): do not branch on batch_idx inside training_step; move periodic work to a callback"
        )
    if "___check_obj_id" in low or "id_match" in low or "id mismatch" in low:
        return "an object's identity changes between steps: create it once (in __init__ or setup), not in the step"
    if "___stack" in low:
        return (
            "a value the step computed (e.g. with .item()) reaches the code after a graph break as a Python number;"
            " every new value recompiles, and after Dynamo's recompile limit the step runs eagerly. Keep it a tensor"
            " (torch.where instead of if), or remove the graph break before it"
        )
    if re.search(r"(==|!=|<|>)\s*-?\d", reason):
        return (
            "the step depends on the value of a Python number: pass it as a tensor, or keep it constant between steps"
        )
    return "keep the step's inputs (shapes, dtypes, Python values, object identities) the same between steps"


def _check_recompiles(
    fn: Callable[..., Any],
    module: nn.Module,
    batch: Any,
    other_batches: Iterable[Any] | None,
    make_args: Callable[[Any, int], tuple[Any, ...]],
    takes_batch_idx: bool,
    backend: str | Callable[..., Any],
    backward: bool,
    findings: list[Finding],
    stats: dict[str, Any],
    used: set[str],
) -> None:
    from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

    calls: list[tuple[str, Any, int, bool]] = [("the example batch", batch, 0, False)]
    if takes_batch_idx:
        calls.append(("the example batch with batch_idx=1", batch, 1, False))
    if other_batches is None:
        resized = _resized(batch)
        extra = [(desc, b, True) for b, desc in ([resized] if resized else [])]
    else:
        extra = [(f"other_batches[{i}]", b, False) for i, b in enumerate(other_batches)]
    for desc, b, synthetic in extra:
        calls.append((desc, b, len(calls), synthetic))
    if len(calls) > 1:
        calls.append(("the example batch again", batch, len(calls), False))

    inner = _make_backend(backend, module)
    compiled_graphs: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        compiled_graphs.append(1)
        used.update(_ops_in(gm))
        if isinstance(inner, str):
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend(inner)(gm, example_inputs)
        return inner(gm, example_inputs)

    torch._dynamo.reset()
    clear_compilation_metrics()
    compiled = torch.compile(fn, backend=counting_backend)
    recompiles = 0
    for index, (desc, b, batch_idx, synthetic) in enumerate(calls):
        seen = len(get_compilation_metrics())
        try:
            output = compiled(*make_args(b, batch_idx))
            if backward and index == 0:
                loss = _loss(output)
                if loss is not None:
                    loss.backward()
        except Exception as e:  # noqa: BLE001 - reported as a finding
            _compile_error(e, f"running the compiled step on {desc}", findings)
            break
        for m in get_compilation_metrics()[seen:]:
            reason = getattr(m, "recompile_reason", None)
            if getattr(m, "fail_reason", None) and "recompile" in str(m.fail_reason).lower():
                findings.append(
                    Finding(
                        "recompile",
                        "error",
                        f"{m.co_name} hit Dynamo's recompile limit: {_headline(str(m.fail_reason))}",
                        "the step now runs eagerly: remove what changes between steps (see the other recompile findings)",
                        where=f"{m.co_filename}:{m.co_firstlineno}",
                    )
                )
            if not reason:
                continue
            recompiles += 1
            where, source = _user_frame_from_text(reason)
            if where is None:
                where, source = f"{m.co_filename}:{m.co_firstlineno}", _source_line(m.co_filename, m.co_firstlineno)
            guard = reason.split("\n")[0].strip()
            guard = re.sub(r"^\d+/\d+:\s*", "", guard)
            guard = guard.split("  #")[0].strip()
            findings.append(
                Finding(
                    "recompile",
                    "warning",
                    f"{_frame_label(m.co_name)} recompiled on {desc}; guard failed: {guard}",
                    _recompile_fix(reason + (" batch_idx" if "batch_idx" in guard else ""), synthetic),
                    where=where,
                    source=source,
                    details={"call": desc, "reason": reason, "frame": m.co_name, "compile_id": str(m.compile_id)},
                )
            )
    stats["recompiles"] = recompiles
    stats["compiled_graphs"] = len(compiled_graphs)
    stats["calls"] = [c[0] for c in calls]


def _frame_label(co_name: str) -> str:
    """Dynamo names the code after a graph break ``torch_dynamo_resume_in_<fn>_at_<line>``: say it in words."""
    m = re.fullmatch(r"torch_dynamo_resume_in_(\w+)_at_(\d+)", co_name)
    return f"{m.group(1)} (the part after the graph break at line {m.group(2)})" if m else co_name


def _compile_error(exc: BaseException, doing: str, findings: list[Finding]) -> None:
    text = str(exc)
    where, source = _user_frame_from_text(text) if "from user code" in text else _user_frame_from_traceback(exc)
    headline = _headline(text) or type(exc).__name__
    explanation = next((ln.strip() for ln in text.splitlines() if ln.strip().startswith("Explanation:")), "")
    findings.append(
        Finding(
            "compile_error",
            "error",
            f"{type(exc).__name__} while {doing}: {headline}" + (f" ({explanation})" if explanation else ""),
            "fix this first: the step must run eagerly (torch.compiler.set_stance('force_eager') to check) and then"
            " compile; the message and the source line say where",
            where=where,
            source=source,
            details={"exception": type(exc).__name__, "message": text[:4000]},
        )
    )


# --------------------------------------------------------------------------------------------- custom ops
def _check_custom_ops(
    spec_errors: list[SpecError], used: set[str], module: nn.Module, batch: Any, findings: list[Finding]
) -> None:
    reported: set[tuple[Any, ...]] = set()
    by_op = {f"{NAMESPACE}.{h.name}": h for h in registered()}
    # A spec error usually stops tracing: it is the cause of the compile error found above, not a second problem.
    compile_errors = [f for f in findings if f.check == "compile_error"]
    for err in spec_errors:
        key = (err.op, err.where, err.index, err.field, err.got)
        if key in reported:
            continue
        reported.add(key)
        causes = [
            f for f in compile_errors if "SpecError" in f.details.get("message", "") and err.op in f.details["message"]
        ]
        where = next((f.where for f in causes if f.where), None)
        source = next((f.source for f in causes if f.where), None)
        for f in causes:
            if f in findings:
                findings.remove(f)
        if err.field == "device":
            got_type = err.got.split(":")[0] if err.got else "?"
            name = (err.op or "").split(".")[-1]
            findings.append(
                Finding(
                    "custom_op_device",
                    "error",
                    f"{err.op} is registered for {err.expected}, but its {err.where} {err.index} ({err.arg!r}) is on"
                    f" {err.got}",
                    f"register the op for the device you train on (input_specs with device={got_type!r}, or None for"
                    f" any device), or register one op per device (e.g. {name}_{got_type}) and choose by"
                    " tensor.device.type in your module",
                    where=where,
                    source=source,
                    details=err.to_dict(),
                )
            )
        else:
            fixes = {
                "dtype": "cast the tensor before the call, or allow this dtype in the spec (a tuple of dtypes)",
                "ndim": "reshape the tensor before the call, or change the spec's ndim",
                "count": "call the op with one tensor per input spec",
                "type": "pass tensors (constants belong in forward_fn/backward_fn, e.g. via a closure)",
                "shape": "make shape_fn return the shape forward_fn really returns",
            }
            findings.append(
                Finding(
                    "custom_op_spec",
                    "error",
                    str(err),
                    fixes.get(err.field or "", "call the op with tensors that match its specs"),
                    where=where,
                    source=source,
                    details=err.to_dict(),
                )
            )
    # Ops in the graphs whose specs name a device type the module does not use (never reached, or reached only
    # on meta/fake tensors): report before the first real step fails.
    module_types = {p.device.type for p in module.parameters()} | {t.device.type for t in _tensors(batch)}
    for op in sorted(used):
        handle = by_op.get(op)
        if handle is None or any(k[0] == op for k in reported):
            continue
        wanted = sorted({s.device.type for s in handle.input_specs if s.device is not None} - module_types)
        if wanted and module_types:
            findings.append(
                Finding(
                    "custom_op_device",
                    "error",
                    f"{op} is registered for {', '.join(wanted)}, but this model runs on {', '.join(sorted(module_types))}",
                    f"register {op} for {', '.join(sorted(module_types))} (or device=None), or register one op per"
                    " device and choose by tensor.device.type",
                    details=handle.describe(),
                )
            )


# ------------------------------------------------------------------------------------------ compile cache
def _cache_path(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser().absolute()
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return Path(env).expanduser().absolute()
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return Path(default_cache_dir()).absolute()


def cache_identity() -> dict[str, Any]:
    """What the marker records: the builds that must match for a cache's entries to be this process's."""
    triton = None
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            triton = version(dist)
            break
    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "triton": triton,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _user(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def check_compile_cache(
    cache_dir: str | os.PathLike[str] | None = None, *, uid: int | None = None, write_marker: bool = True
) -> list[Finding]:
    """Findings about Inductor's compile cache: stale (another torch build) or foreign (another user's files).

    Args:
        cache_dir: the directory (default: ``TORCHINDUCTOR_CACHE_DIR``, else Inductor's default).
        uid: whose cache it should be (default: this process's effective uid).
        write_marker: write ``.lightning_sgdtp_cache.json`` into a healthy directory that has none.
    """
    path = _cache_path(cache_dir)
    uid = os.geteuid() if uid is None else uid
    me = _user(uid)
    per_user = f"export TORCHINDUCTOR_CACHE_DIR=$HOME/.cache/torchinductor/torch-{torch.__version__}"
    if not path.exists():
        return [
            Finding(
                "compile_cache",
                "info",
                f"no compile cache yet at {path}; torch.compile creates it at the first compile",
                "nothing to do",
                details={"path": str(path)},
            )
        ]
    findings: list[Finding] = []
    st = path.stat()
    if st.st_uid != uid:
        findings.append(
            Finding(
                "compile_cache",
                "error",
                f"the compile cache {path} belongs to {_user(st.st_uid)} (uid {st.st_uid}), not to {me}: Inductor"
                " loads compiled code from it, and cannot write its own entries there",
                f"use a cache directory of your own: {per_user}",
                details={"path": str(path), "owner_uid": st.st_uid, "uid": uid},
            )
        )
    if st.st_mode & 0o002:
        findings.append(
            Finding(
                "compile_cache",
                "warning",
                f"the compile cache {path} is writable by every user (mode {oct(st.st_mode & 0o7777)}): anyone can put"
                " code there that torch.compile will load",
                f"chmod 700 {path}, or use a cache directory of your own: {per_user}",
                details={"path": str(path), "mode": oct(st.st_mode & 0o7777)},
            )
        )
    foreign: dict[int, list[str]] = defaultdict(list)
    total, truncated = 0, False
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in dirs + files:
            total += 1
            if total > _MAX_CACHE_ENTRIES:
                truncated = True
                break
            full = os.path.join(root, name)
            with contextlib.suppress(OSError):
                owner = os.lstat(full).st_uid
                if owner != uid:
                    foreign[owner].append(full)
        if truncated:
            break
    if foreign:
        count = sum(len(v) for v in foreign.values())
        owners = ", ".join(f"{_user(u)} (uid {u}): {len(v)}" for u, v in sorted(foreign.items()))
        examples = [p for v in foreign.values() for p in v][:5]
        findings.append(
            Finding(
                "compile_cache",
                "error",
                f"{count} of {total}{'+' if truncated else ''} entries in the compile cache {path} belong to other"
                f" users ({owners}), e.g. {examples[0]}. Inductor loads compiled code (.so, .py) from this"
                " directory: another user's entries can be wrong for this build, or planted",
                f"remove them (rm -rf {path}; the cache is rebuilt at the next compile), or give every user and job"
                f" its own directory: {per_user}",
                details={
                    "path": str(path),
                    "foreign": {str(u): len(v) for u, v in foreign.items()},
                    "examples": examples,
                },
            )
        )
    marker = path / CACHE_MARKER
    mine = cache_identity()
    if marker.exists():
        try:
            recorded = json.loads(marker.read_text())
            if not isinstance(recorded, dict):
                raise TypeError("not a JSON object")
        except (OSError, ValueError, TypeError) as e:
            findings.append(
                Finding(
                    "compile_cache",
                    "warning",
                    f"the cache marker {marker} is unreadable ({e})",
                    f"delete it (rm {marker}); the next diagnose writes a new one",
                    details={"path": str(path)},
                )
            )
        else:
            diff = {k: (recorded.get(k), v) for k, v in mine.items() if k in recorded and recorded.get(k) != v}
            if diff:
                what = ", ".join(f"{k} {old} (this process: {new})" for k, (old, new) in diff.items())
                findings.append(
                    Finding(
                        "compile_cache",
                        "warning",
                        f"stale compile cache {path}: it was filled by another build ({what}). Its entries are dead"
                        " weight at best; entries keyed without the full build (custom ops, patched or nightly"
                        " builds of one version) can be wrong",
                        f"remove it (rm -rf {path}), or use one cache directory per torch build: {per_user}",
                        details={"path": str(path), "recorded": recorded, "current": mine},
                    )
                )
            if recorded.get("uid") not in (None, uid):
                findings.append(
                    Finding(
                        "compile_cache",
                        "error",
                        f"the compile cache {path} was set up by {recorded.get('user')} (uid {recorded.get('uid')}),"
                        f" not {me}",
                        f"use a cache directory of your own: {per_user}",
                        details={"path": str(path), "recorded": recorded},
                    )
                )
    if not findings:
        wrote = False
        if not marker.exists() and write_marker:
            with contextlib.suppress(OSError):
                tmp = path / f".{CACHE_MARKER}.{os.getpid()}.tmp"
                tmp.write_text(json.dumps({**mine, "uid": uid, "user": me, "written_by": "lightning_sgdtp.diagnose"}))
                os.replace(tmp, marker)
                wrote = True
        findings.append(
            Finding(
                "compile_cache",
                "info",
                f"compile cache {path}: {total} entries, all {me}'s"
                + ("; wrote the version marker" if wrote else (", same torch build" if marker.exists() else "")),
                "nothing to do",
                details={"path": str(path), "entries": total, "marker": str(marker) if marker.exists() else None},
            )
        )
    return findings
