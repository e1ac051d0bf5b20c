"""``register(...)``: a user's fused kernel as a ``torch.library`` custom op that torch.compile keeps as one node.

Each registered op lives in the ``sgdtp`` namespace (``torch.ops.sgdtp.<name>``) and owns one
``torch.library.Library("sgdtp", "FRAGMENT")``, so :meth:`GraphHandle.destroy` removes exactly that op (its
schema, kernels, fake impl and autograd formula) and the name can be registered again. Per op:

- the schema has one ``Tensor`` argument per input spec and one ``Tensor`` result per output spec;
- the real kernel (``CompositeExplicitAutograd``, every device) checks the inputs against the specs, calls
  ``forward_fn``, and checks what it returned against the output specs and the shapes the fake impl promises;
- the fake impl (``torch.library.register_fake``) checks the inputs at trace time and builds empty outputs from
  the output specs: dtype and device from the spec, else from the first input; shape from ``shape_fn``, else
  the first input's shape. TorchDynamo and AOTAutograd only ever see this, so the op is one graph node;
- the autograd formula (``torch.library.register_autograd``) saves inputs and outputs and calls ``backward_fn``.

``backward_fn(ctx, *grad_outputs)``: ``ctx.inputs`` and ``ctx.outputs`` are the op's input and output tensors
(saved in forward), ``ctx.needs_input_grad`` one bool per input, ``grad_outputs`` one gradient per output. It
returns one gradient per input (a tensor shaped like that input, or ``None``), as a tuple, or a single tensor for
a one-input op. Under torch.compile it is traced into the compiled backward (so it must be traceable torch
code, or call other registered ops); in eager mode it runs at every backward.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import Self

from lightning_sgdtp.graph.specs import _NAME, GraphError, SpecError, SpecLike, TensorSpec, as_spec, spec_error

NAMESPACE = "sgdtp"
LIVE, DESTROYED = "live", "destroyed"

_LOCK = threading.RLock()
_LIVE: dict[str, GraphHandle] = {}
_RECORDERS: list[list[SpecError]] = []


@dataclass(frozen=True)
class BackwardContext:
    """What ``backward_fn(ctx, *grad_outputs)`` receives as ``ctx``."""

    op: str
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]


@contextlib.contextmanager
def record_spec_errors() -> Generator[list[SpecError], None, None]:
    """Collect every :class:`SpecError` raised by registered ops inside the block (they are still raised).

    Under torch.compile a spec error raised by a fake impl reaches the caller wrapped in Dynamo's own
    exception; ``lightning_sgdtp.diagnose`` uses this to report the original, structured error.
    """
    seen: list[SpecError] = []
    with _LOCK:
        _RECORDERS.append(seen)
    try:
        yield seen
    finally:
        with _LOCK:
            _RECORDERS.remove(seen)


def _raise(err: SpecError) -> None:
    for seen in _RECORDERS:
        seen.append(err)
    raise err


class GraphHandle:
    """A registered op. Call it like a function (or call ``torch.ops.sgdtp.<name>``); ``destroy()`` unregisters it.

    Attributes:
        name: the op's name; ``qualname`` is ``"sgdtp::<name>"``.
        op: the ``torch.ops.sgdtp.<name>.default`` overload (only valid while the handle is live).
        input_specs, output_specs: the normalized :class:`TensorSpec` lists.
        state: ``"live"`` or ``"destroyed"``.
    """

    def __init__(
        self,
        name: str,
        forward_fn: Callable[..., Any],
        backward_fn: Callable[..., Any] | None,
        input_specs: list[TensorSpec],
        output_specs: list[TensorSpec],
        shape_fn: Callable[..., Any] | None,
    ) -> None:
        self.name = name
        self.qualname = f"{NAMESPACE}::{name}"
        self.forward_fn = forward_fn
        self.backward_fn = backward_fn
        self.shape_fn = shape_fn
        self.input_specs = input_specs
        self.output_specs = output_specs
        self.input_names = [s.name or f"input{i}" for i, s in enumerate(input_specs)]
        self.output_names = [s.name or f"output{i}" for i, s in enumerate(output_specs)]
        self._label = f"{NAMESPACE}.{name}"
        self._state = LIVE
        self._lib: torch.library.Library | None = None
        self.op: torch._ops.OpOverload | None = None

    # ------------------------------------------------------------------------------------------ public
    @property
    def state(self) -> str:
        return self._state

    @property
    def schema(self) -> str:
        args = ", ".join(f"Tensor {n}" for n in self.input_names)
        outs = "Tensor" if len(self.output_specs) == 1 else "(" + ", ".join(["Tensor"] * len(self.output_specs)) + ")"
        return f"{self.name}({args}) -> {outs}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._state != LIVE:
            raise GraphError(
                f"{self._label} was destroyed (handle.destroy()); register it again with"
                f" lightning_sgdtp.graph.register(name={self.name!r}, ...) to use it"
            )
        if kwargs:
            raise GraphError(f"{self._label} takes its tensors positionally ({', '.join(self.input_names)})")
        if len(args) != len(self.input_specs):
            _raise(self._count_error(len(args), traced=False))
        for i, value in enumerate(args):
            if not isinstance(value, torch.Tensor):  # the dispatcher would refuse it first, naming no spec
                _raise(self._spec_error("input", i, "type", "a Tensor", type(value).__name__, traced=False))
        return self.op(*args)

    def destroy(self) -> None:
        """Unregister the op: ``torch.ops.sgdtp.<name>`` stops resolving and the name can be registered again."""
        with _LOCK:
            if self._state != LIVE:
                raise GraphError(f"{self._label} is already destroyed; destroy() was called twice")
            _unregister(self.qualname, self._lib)
            self._lib = None
            self.op = None
            self._state = DESTROYED
            if _LIVE.get(self.name) is self:
                del _LIVE[self.name]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._state == LIVE:
            self.destroy()

    def __repr__(self) -> str:
        return f"<GraphHandle {self._label} [{self._state}] {self.schema}>"

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": f"torch.ops.{self._label}",
            "state": self._state,
            "schema": f"{NAMESPACE}::{self.schema}",
            "input_specs": [repr(s) for s in self.input_specs],
            "output_specs": [repr(s) for s in self.output_specs],
            "has_backward": self.backward_fn is not None,
            "has_shape_fn": self.shape_fn is not None,
        }

    # ----------------------------------------------------------------------------------------- checks
    def _count_error(self, got: int, traced: bool) -> SpecError:
        specs = ", ".join(f"{n}: {s!r}" for n, s in zip(self.input_names, self.input_specs))
        return spec_error(
            f"{self._label} takes {len(self.input_specs)} tensor argument(s), got {got}; expected ({specs})",
            op=self._label,
            where="call",
            index=None,
            arg=None,
            field="count",
            expected=str(len(self.input_specs)),
            got=str(got),
            traced=traced,
        )

    def _spec_error(self, where: str, index: int, field: str, expected: str, got: str, traced: bool) -> SpecError:
        names, specs = (
            (self.input_names, self.input_specs) if where == "input" else (self.output_names, self.output_specs)
        )
        has = "is a" if field == "type" else f"has {field}"
        text = (
            f"{self._label}: {where} {index} ({names[index]!r}) {has} {got}, expected {expected}"
            f" ({where}_specs[{index}] = {specs[index]!r})"
        )
        if where == "output":
            text += "; returned by forward_fn"
        if traced:
            text += " [checked by the fake impl: at trace time under torch.compile, or on meta tensors]"
        return spec_error(
            text,
            op=self._label,
            where=where,
            index=index,
            arg=names[index],
            field=field,
            expected=expected,
            got=got,
            traced=traced,
        )

    def _check_inputs(self, args: Sequence[Any], traced: bool) -> None:
        if len(args) != len(self.input_specs):
            _raise(self._count_error(len(args), traced))
        for i, (spec, value) in enumerate(zip(self.input_specs, args)):
            bad = spec.mismatch(value)
            if bad is not None:
                _raise(self._spec_error("input", i, *bad, traced=traced))

    def _output_meta(self, args: Sequence[torch.Tensor]) -> list[tuple[Sequence[Any], torch.dtype, torch.device]]:
        """``(shape, dtype, device)`` of every output, as the fake impl builds them."""
        first = args[0]
        n = len(self.output_specs)
        if self.shape_fn is None:
            shapes = [tuple(first.shape)] * n
        else:
            got = self.shape_fn(*args)
            if n == 1 and _is_shape(got):
                shapes = [tuple(got)]
            elif isinstance(got, (tuple, list)) and len(got) == n and all(_is_shape(s) for s in got):
                shapes = [tuple(s) for s in got]
            else:
                raise GraphError(
                    f"{self._label}: shape_fn returned {got!r}; expected "
                    + ("a shape (a sequence of ints)" if n == 1 else f"a list of {n} shapes, one per output")
                )
        meta = []
        for spec, shape in zip(self.output_specs, shapes):
            dtype = spec.dtype[0] if spec.dtype is not None else first.dtype
            if spec.device is None or spec.device_matches(first.device):
                device = first.device
            else:
                device = spec.device
            meta.append((shape, dtype, device))
        return meta

    # --------------------------------------------------------------------------------------- kernels
    def _fake(self, *args: torch.Tensor) -> Any:
        self._check_inputs(args, traced=True)
        outs = [
            args[0].new_empty(shape, dtype=dtype, device=device) for shape, dtype, device in self._output_meta(args)
        ]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _real(self, *args: torch.Tensor) -> Any:
        self._check_inputs(args, traced=False)
        result = self.forward_fn(*args)
        n = len(self.output_specs)
        if isinstance(result, torch.Tensor):
            outs = [result]
        elif isinstance(result, (tuple, list)):
            outs = list(result)
        else:
            raise GraphError(f"{self._label}: forward_fn returned {type(result).__name__}; expected {n} tensor(s)")
        if len(outs) != n:
            raise GraphError(
                f"{self._label}: forward_fn returned {len(outs)} value(s), but output_specs declares {n}"
                f" ({', '.join(repr(s) for s in self.output_specs)})"
            )
        for i, (spec, out) in enumerate(zip(self.output_specs, outs)):
            bad = spec.mismatch(out)
            if bad is not None:
                _raise(self._spec_error("output", i, *bad, traced=False))
        # What the fake impl promised is what torch.compile planned with: the real result must agree.
        for i, (out, (shape, dtype, device)) in enumerate(zip(outs, self._output_meta(args))):
            if tuple(out.shape) != tuple(shape):
                source = "shape_fn" if self.shape_fn is not None else "the first input's shape (no shape_fn given)"
                _raise(
                    self._spec_error(
                        "output", i, "shape", f"{tuple(shape)} from {source}", str(tuple(out.shape)), False
                    )
                )
            if out.dtype != dtype:
                _raise(self._spec_error("output", i, "dtype", str(dtype).removeprefix("torch."), str(out.dtype), False))
            if out.device != device:
                _raise(self._spec_error("output", i, "device", str(device), str(out.device), False))
        # A custom op's results are fresh, contiguous tensors (as the fake impl says): never alias an input.
        storages = {_storage(a) for a in args}
        fixed = []
        for out in outs:
            if _storage(out) in storages:
                out = out.clone(memory_format=torch.contiguous_format)
            elif not out.is_contiguous():
                out = out.contiguous()
            storages.add(_storage(out))
            fixed.append(out)
        return fixed[0] if n == 1 else tuple(fixed)

    def _setup_context(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        outs = (output,) if len(self.output_specs) == 1 else tuple(output)
        ctx.save_for_backward(*inputs, *outs)

    def _backward(self, ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        n = len(self.input_specs)
        bctx = BackwardContext(self._label, tuple(saved[:n]), tuple(saved[n:]), tuple(ctx.needs_input_grad))
        assert self.backward_fn is not None
        result = self.backward_fn(bctx, *grads)
        if isinstance(result, torch.Tensor) or result is None:
            result = (result,)
        result = tuple(result)
        if len(result) != n:
            raise GraphError(
                f"{self._label}: backward_fn returned {len(result)} gradient(s); expected one per input ({n}:"
                f" {', '.join(self.input_names)}), None for an input without gradient"
            )
        for i, (g, x) in enumerate(zip(result, bctx.inputs)):
            if g is None:
                continue
            if not isinstance(g, torch.Tensor):
                raise GraphError(
                    f"{self._label}: backward_fn returned {type(g).__name__} for input {i}; expected a tensor or None"
                )
            if g.shape != x.shape:
                raise GraphError(
                    f"{self._label}: backward_fn returned a gradient of shape {tuple(g.shape)} for input {i}"
                    f" ({self.input_names[i]!r}) of shape {tuple(x.shape)}; reduce broadcast dimensions in backward_fn"
                )
        return result


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list, torch.Size)) and all(
        isinstance(d, (int, torch.SymInt)) and not isinstance(d, bool) for d in value
    )


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage().data_ptr(), t.device
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses): nothing to compare
        return id(t)


def _unregister(qualname: str, lib: torch.library.Library | None) -> None:
    if lib is not None:
        lib._destroy()  # schema, kernels, fake impl, autograd; drops the cached torch.ops.sgdtp.<name>
    # What Library._destroy leaves to the garbage collector: the name in torch.library's set of definitions and
    # FX's cached signature of the old schema (a re-registration may have another number of inputs).
    defs = getattr(torch.library, "_defs", None)
    if isinstance(defs, set):
        defs.discard(qualname)
    try:
        from torch.fx.operator_schemas import _SCHEMA_TO_SIGNATURE_CACHE

        _SCHEMA_TO_SIGNATURE_CACHE.pop((qualname, ""), None)
    except ImportError:  # pragma: no cover - older torch
        pass


def register(
    name: str,
    forward_fn: Callable[..., Any],
    backward_fn: Callable[..., Any] | None,
    input_specs: Sequence[SpecLike],
    output_specs: Sequence[SpecLike],
    shape_fn: Callable[..., Any] | None = None,
) -> GraphHandle:
    """Register ``forward_fn`` as ``torch.ops.sgdtp.<name>``: one graph node under torch.compile, with its own backward.

    Args:
        name: a Python identifier, unique among live registrations.
        forward_fn: ``forward_fn(*inputs) -> tensor | tuple of tensors`` (one per output spec). Runs eagerly (even
            inside a compiled graph, as an opaque call): any code, a Triton or C++ kernel included.
        backward_fn: ``backward_fn(ctx, *grad_outputs) -> gradients``, one per input (``None`` where there is
            none); ``ctx.inputs``, ``ctx.outputs`` and ``ctx.needs_input_grad`` as in :class:`BackwardContext`.
            ``None``: the op is not differentiable (backward through it raises).
        input_specs: one :class:`TensorSpec` (or ``("tensor", device[, dtype])``) per input, checked at every call.
        output_specs: one spec per output. Each output's dtype and device are the spec's, else the first input's.
        shape_fn: ``shape_fn(*inputs) -> shape`` (or a list of shapes, one per output) when an output's shape is
            not the first input's. Gets fake tensors under torch.compile: use only shapes, never values.

    Returns:
        A live :class:`GraphHandle`.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise GraphError(f"op name {name!r} is not a Python identifier (letters, digits, underscores)")
    if not callable(forward_fn):
        raise GraphError(f"{NAMESPACE}.{name}: forward_fn must be callable, got {type(forward_fn).__name__}")
    if backward_fn is not None and not callable(backward_fn):
        raise GraphError(f"{NAMESPACE}.{name}: backward_fn must be callable or None, got {type(backward_fn).__name__}")
    if shape_fn is not None and not callable(shape_fn):
        raise GraphError(f"{NAMESPACE}.{name}: shape_fn must be callable or None, got {type(shape_fn).__name__}")
    if isinstance(input_specs, (str, TensorSpec)) or isinstance(output_specs, (str, TensorSpec)):
        raise GraphError(f"{NAMESPACE}.{name}: input_specs and output_specs are lists of specs, one per tensor")
    ins = [as_spec(s, f"{NAMESPACE}.{name}: input_specs[{i}]") for i, s in enumerate(input_specs)]
    outs = [as_spec(s, f"{NAMESPACE}.{name}: output_specs[{i}]") for i, s in enumerate(output_specs)]
    if not ins:
        raise GraphError(f"{NAMESPACE}.{name}: needs at least one input (outputs take their device from the first)")
    if not outs:
        raise GraphError(f"{NAMESPACE}.{name}: needs at least one output spec")
    for kind, specs in (("input", ins), ("output", outs)):
        names = [s.name for s in specs if s.name is not None]
        if len(names) != len(set(names)):
            raise GraphError(f"{NAMESPACE}.{name}: {kind} names {names} are not unique")

    with _LOCK:
        if name in _LIVE:
            raise GraphError(
                f"{NAMESPACE}.{name} is already registered ({_LIVE[name]!r}); destroy that handle first"
                " (handle.destroy()) or choose another name"
            )
        handle = GraphHandle(name, forward_fn, backward_fn, ins, outs, shape_fn)
        lib = torch.library.Library(NAMESPACE, "FRAGMENT")
        try:
            try:
                lib.define(handle.schema)
            except RuntimeError as e:
                raise GraphError(
                    f"torch.ops.{NAMESPACE}.{name} is already defined outside lightning_sgdtp.graph; choose another"
                    f" name ({str(e).splitlines()[0]})"
                ) from None
            lib.impl(name, handle._real, "CompositeExplicitAutograd")
            torch.library.register_fake(handle.qualname, handle._fake, lib=lib)
            if backward_fn is not None:
                torch.library.register_autograd(
                    handle.qualname, handle._backward, setup_context=handle._setup_context, lib=lib
                )
            handle.op = getattr(getattr(torch.ops, NAMESPACE), name).default
        except BaseException:
            _unregister(handle.qualname, lib)
            raise
        handle._lib = lib
        _LIVE[name] = handle
        return handle


def registered() -> list[GraphHandle]:
    """The live handles, by name."""
    with _LOCK:
        return [_LIVE[n] for n in sorted(_LIVE)]


def get(name: str) -> GraphHandle:
    """The live handle registered as ``name``."""
    with _LOCK:
        if name not in _LIVE:
            live = ", ".join(sorted(_LIVE)) or "none"
            raise GraphError(f"no live op named {name!r} in lightning_sgdtp.graph (live: {live})")
        return _LIVE[name]


def destroy_all() -> int:
    """Destroy every live handle; returns how many. Registered with ``atexit``."""
    with _LOCK:
        handles = list(_LIVE.values())
        for handle in handles:
            with contextlib.suppress(Exception):
                handle.destroy()
        return len(handles)


atexit.register(destroy_all)
