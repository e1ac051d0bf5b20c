"""The graph registry: ops registered with ``lightning_sgdtp.graph.register`` are torch.library custom ops that
compile as one node (fullgraph), use their own backward, check their specs, and have a lifecycle.

In a fresh interpreter: tests/integration/test_graph_at_exit.py; under data parallel:
tests/distributed/test_data_parallel.py::test_parity_of_a_registered_op_under_sgdtp_data_parallel."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_sgdtp import graph
from lightning_sgdtp.compiler.backend import SGDTPCompiler
from lightning_sgdtp.graph import GraphError, SpecError, TensorSpec


@pytest.fixture(autouse=True)
def clean_registry() -> Generator[None, None, None]:
    torch._dynamo.reset()
    yield
    graph.destroy_all()
    torch._dynamo.reset()


def gelu_grad(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf(z * 0.7071067811865476)) + z * torch.exp(-0.5 * z * z) * 0.3989422804014327


def register_bias_gelu(name: str = "bias_gelu", scale: float = 1.0, calls: dict[str, int] | None = None, **kw: Any):
    """gelu(x + b); the backward is the true one times ``scale`` (scale != 1 proves backward_fn is what runs)."""

    def forward(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if calls is not None:
            calls["forward"] += 1
        return F.gelu(x + b)

    def backward(ctx: graph.BackwardContext, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if calls is not None:
            calls["backward"] += 1
        x, b = ctx.inputs
        gz = scale * grad * gelu_grad(x + b)
        return gz, gz.sum(0)

    specs = kw.pop("input_specs", [("tensor", "cpu"), ("tensor", "cpu")])
    return graph.register(name, forward, backward, specs, kw.pop("output_specs", [("tensor", "cpu")]), **kw)


class CountingBackend:
    """Counts graphs and the op's nodes in what Dynamo captures, then hands the graph to ``inner``."""

    def __init__(self, op: Any, inner: Any = "aot_eager") -> None:
        self.op, self.inner, self.nodes = op, inner, []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.nodes.append(sum(1 for n in gm.graph.nodes if n.target is self.op))
        inner = lookup_backend(self.inner) if isinstance(self.inner, str) else self.inner
        return inner(gm, example_inputs)


# ----------------------------------------------------------------------------------------------- one node
@pytest.mark.parametrize("inner", ["aot_eager", "sgdtp"])
def test_compiles_as_one_node_without_graph_break_and_uses_backward_fn(inner: str) -> None:
    """fullgraph=True; the captured graph holds the op once; the gradients are backward_fn's (3x the true ones)."""
    calls = {"forward": 0, "backward": 0}
    h = register_bias_gelu(scale=3.0, calls=calls)
    x = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(8, requires_grad=True)

    def step(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (h(x, b) * 2).sum()

    true_gx = 2 * gelu_grad(x.detach() + b.detach()).expand(4, 8)
    backend = CountingBackend(h.op, SGDTPCompiler() if inner == "sgdtp" else inner)
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    for _ in range(2):
        x.grad = b.grad = None
        compiled(x, b).backward()
        assert torch.allclose(x.grad, 3 * true_gx, atol=1e-5)
        assert torch.allclose(b.grad, 3 * true_gx.sum(0), atol=1e-5)
    assert backend.nodes == [1], backend.nodes
    # the kernel runs at every call; backward_fn was traced once into the compiled backward
    assert calls == {"forward": 2, "backward": 1}, calls

    explained = torch._dynamo.explain(step)(x, b)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    assert [str(t) for t in explained.ops_per_graph[0]].count(str(h.op)) == 1

    # eager: backward_fn runs at every backward
    x.grad = b.grad = None
    step(x, b).backward()
    assert torch.allclose(x.grad, 3 * true_gx, atol=1e-5) and calls["backward"] == 2


def test_opcheck_and_torch_ops_name() -> None:
    h = register_bias_gelu()
    x, b = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    result = torch.library.opcheck(h.op, (x, b))
    assert set(result.values()) == {"SUCCESS"}, result
    assert torch.equal(torch.ops.sgdtp.bias_gelu(x, b), F.gelu(x + b))
    assert str(h.op._schema) == "sgdtp::bias_gelu(Tensor input0, Tensor input1) -> Tensor"


def test_fake_impl_follows_output_specs_and_shape_fn() -> None:
    """Output dtype from the spec, device from the first input, shape from shape_fn (outputs of two shapes)."""

    def forward(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (a @ w.t()).double(), a.sum(1)

    def backward(ctx: graph.BackwardContext, g_mm: torch.Tensor, g_sum: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a, w = ctx.inputs
        g_mm = g_mm.float()
        return g_mm @ w + g_sum[:, None].expand_as(a), g_mm.t() @ a

    h = graph.register(
        "gemm_and_rowsum",
        forward,
        backward,
        input_specs=[TensorSpec(ndim=2, name="a"), TensorSpec(ndim=2, name="w")],
        output_specs=[TensorSpec(dtype=torch.float64), ("tensor",)],
        shape_fn=lambda a, w: [(a.shape[0], w.shape[0]), (a.shape[0],)],
    )
    assert "gemm_and_rowsum(Tensor a, Tensor w) -> (Tensor, Tensor)" in str(h.op._schema)
    with FakeTensorMode() as mode:
        a, w = mode.from_tensor(torch.randn(5, 3)), mode.from_tensor(torch.randn(4, 3))
        mm, rowsum = torch.ops.sgdtp.gemm_and_rowsum(a, w)
    assert (mm.shape, mm.dtype, rowsum.shape, rowsum.dtype) == ((5, 4), torch.float64, (5,), torch.float32)

    a, w = torch.randn(5, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    assert set(torch.library.opcheck(h.op, (a, w)).values()) == {"SUCCESS"}
    compiled = torch.compile(lambda a, w: [o.sum() for o in h(a, w)], backend="aot_eager", fullgraph=True)
    s_mm, s_sum = compiled(a, w)
    (s_mm + s_sum).backward()
    ref_a, ref_w = a.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((ref_a @ ref_w.t()).sum() + ref_a.sum()).backward()
    assert torch.allclose(a.grad, ref_a.grad, atol=1e-5) and torch.allclose(w.grad, ref_w.grad, atol=1e-5)


# ------------------------------------------------------------------------------------------------ specs
def test_spec_checks_in_eager_name_op_argument_and_expected_spec() -> None:
    h = register_bias_gelu(input_specs=[TensorSpec(dtype=torch.float32, ndim=2, name="x"), ("tensor", "cpu")])
    x, b = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(SpecError, match=r"sgdtp\.bias_gelu: input 0 \('x'\) has dtype float64, expected float32") as e:
        h(x.double(), b)
    assert "input_specs[0] = TensorSpec(dtype=float32, ndim=2, name='x')" in str(e.value)
    assert (e.value.op, e.value.index, e.value.arg, e.value.field, e.value.traced) == (
        "sgdtp.bias_gelu",
        0,
        "x",
        "dtype",
        False,
    )
    with pytest.raises(SpecError, match=r"input 0 \('x'\) has ndim 1, expected 2"):
        h(b, b)
    with pytest.raises(SpecError, match=r"sgdtp\.bias_gelu takes 2 tensor argument\(s\), got 1; expected \(x: "):
        h(x)
    with pytest.raises(SpecError, match=r"input 1 \('input1'\) is a float, expected a Tensor"):
        h(x, 1.0)


def test_op_registered_for_cuda_refuses_cpu_tensors() -> None:
    h = register_bias_gelu("bias_gelu_cuda", input_specs=[("tensor", "cuda"), ("tensor", "cuda")])
    with pytest.raises(
        SpecError, match=r"sgdtp\.bias_gelu_cuda: input 0 \('input0'\) has device cpu, expected cuda"
    ) as e:
        h(torch.randn(4, 8), torch.randn(8))
    assert e.value.field == "device" and e.value.expected == "cuda" and e.value.got == "cpu"


def test_spec_checks_at_trace_time_under_compile() -> None:
    h = register_bias_gelu(input_specs=[TensorSpec(dtype=torch.float32), ("tensor", "cpu")])
    x, b = torch.randn(4, 8, dtype=torch.float64), torch.randn(8)
    with graph.record_spec_errors() as seen, pytest.raises(Exception, match=r"sgdtp\.bias_gelu: input 0 .*float64"):
        torch.compile(lambda x, b: h(x, b), backend="eager", fullgraph=True)(x, b)
    assert seen and seen[0].traced and seen[0].field == "dtype", seen  # raised by the fake impl, while tracing
    assert "checked by the fake impl" in str(seen[0])
    # wrong number of inputs inside a compiled function: the same SpecError (Dynamo falls back, the call raises)
    with pytest.raises(SpecError, match="takes 2 tensor argument"):
        torch.compile(lambda x: h(x), backend="eager")(x.float())
    # direct torch.ops call with meta tensors goes through the fake impl too
    with pytest.raises(SpecError, match="has device meta, expected cpu"):
        h(torch.randn(4, 8, device="meta"), torch.randn(8, device="meta"))


def test_forward_and_backward_results_are_checked() -> None:
    bad_shape = graph.register("bad_shape", lambda x: x[:1], None, ["tensor"], ["tensor"])
    with pytest.raises(
        SpecError, match=r"sgdtp\.bad_shape: output 0 .* has shape \(1, 3\), expected \(4, 3\) from the first"
    ):
        bad_shape(torch.randn(4, 3))
    two = graph.register("two_outputs", lambda x: x * 2, None, ["tensor"], ["tensor", "tensor"])
    with pytest.raises(GraphError, match=r"forward_fn returned 1 value\(s\), but output_specs declares 2"):
        two(torch.randn(3))
    wrong_dtype = graph.register("wrong_dtype", lambda x: x.double(), None, ["tensor"], [TensorSpec(dtype="float32")])
    with pytest.raises(SpecError, match=r"output 0 .* has dtype float64, expected float32"):
        wrong_dtype(torch.randn(3))
    bad_grads = graph.register("bad_grads", lambda x, y: x + y, lambda ctx, g: g, ["tensor", "tensor"], ["tensor"])
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(GraphError, match=r"backward_fn returned 1 gradient\(s\); expected one per input \(2"):
        bad_grads(x, x).sum().backward()
    broadcast = graph.register("broadcast", lambda x, b: x + b, lambda ctx, g: (g, g), ["tensor", "tensor"], ["tensor"])
    with pytest.raises(GraphError, match=r"gradient of shape \(2, 3\) for input 1 \('input1'\) of shape \(3,\)"):
        broadcast(torch.randn(2, 3), torch.randn(3, requires_grad=True)).sum().backward()
    # an output that aliases an input is copied: a custom op's results are fresh tensors
    ident = graph.register("ident", lambda x: x, None, ["tensor"], ["tensor"])
    x = torch.randn(3)
    y = ident(x)
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr()


def test_invalid_registrations() -> None:
    def fwd(x: torch.Tensor) -> torch.Tensor:
        return x

    with pytest.raises(GraphError, match="only tensor arguments are supported"):
        graph.register("scalar", fwd, None, [("float",)], ["tensor"])
    with pytest.raises(GraphError, match="not a Python identifier"):
        graph.register("bad-name", fwd, None, ["tensor"], ["tensor"])
    with pytest.raises(GraphError, match="invalid dtype"):
        TensorSpec(dtype="float33")
    with pytest.raises(GraphError, match="needs at least one input"):
        graph.register("noinput", fwd, None, [], ["tensor"])
    with pytest.raises(GraphError, match="is not a spec"):
        graph.register("bad_spec", fwd, None, [42], ["tensor"])
    assert graph.registered() == []  # failed registrations leave nothing behind
    assert not hasattr(torch.ops.sgdtp, "scalar")


# --------------------------------------------------------------------------------------------- lifecycle
def test_lifecycle() -> None:
    h = register_bias_gelu()
    assert h.state == "live" and graph.registered() == [h] and graph.get("bias_gelu") is h
    with pytest.raises(GraphError, match=r"sgdtp\.bias_gelu is already registered .*destroy that handle first"):
        register_bias_gelu()
    x, b = torch.randn(4, 8), torch.randn(8)
    compiled = torch.compile(lambda x, b: h(x, b), backend="eager")
    compiled(x, b)

    h.destroy()
    assert h.state == "destroyed" and graph.registered() == []
    assert not hasattr(torch.ops.sgdtp, "bias_gelu")  # no stale op left behind
    with pytest.raises(GraphError, match=r"sgdtp\.bias_gelu was destroyed .*register it again"):
        h(x, b)
    with pytest.raises(GraphError, match="sgdtp.bias_gelu was destroyed"):
        compiled(x, b)  # the compiled code guards on the handle's state: it recompiles and raises
    with pytest.raises(GraphError, match=r"already destroyed; destroy\(\) was called twice"):
        h.destroy()
    with pytest.raises(GraphError, match="no live op named 'bias_gelu'"):
        graph.get("bias_gelu")

    # the name is free again, with another schema: torch.ops.sgdtp.bias_gelu is the new op
    with graph.register("bias_gelu", lambda x: x * 3, None, ["tensor"], ["tensor"]) as h2:
        assert torch.equal(torch.ops.sgdtp.bias_gelu(torch.ones(2)), torch.full((2,), 3.0))
        assert str(torch.ops.sgdtp.bias_gelu.default._schema) == "sgdtp::bias_gelu(Tensor input0) -> Tensor"
        assert graph.registered() == [h2]
    assert h2.state == "destroyed" and graph.registered() == []


def test_name_defined_outside_the_registry_is_refused() -> None:
    lib = torch.library.Library("sgdtp", "FRAGMENT")
    try:
        lib.define("foreign_op(Tensor x) -> Tensor")
        with pytest.raises(GraphError, match="already defined outside lightning_sgdtp.graph"):
            graph.register("foreign_op", lambda x: x, None, ["tensor"], ["tensor"])
        assert graph.registered() == []
    finally:
        lib._destroy()
