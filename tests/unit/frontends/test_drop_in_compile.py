"""What a ``ddp`` user brings along works under ``"sgdtp"`` (issue 46): a ``torch.compile``d LightningModule (the
strategy takes the plain module and the settings that mean something for its own compile of the step, and says on
rank 0 which it used and which not), a precision plugin of their own (accepted by what it is: a subclass of
Lightning's), and Lightning's mocks. In this process; the training run of both (the numbers against ddp, the
plugin's hooks called): ``tests/distributed/test_data_parallel.py`` ``breaks``."""

from __future__ import annotations

import logging
from typing import Any
from unittest.mock import Mock

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.utilities.compile import _verify_strategy_supports_compile, from_compiled
from torch import nn

from lightning_sgdtp import SGDTPConfigError, SGDTPStrategy
from lightning_sgdtp.config import check_trainer_plugins, precision_plugin_refusal
from lightning_sgdtp.engine import step_compile
from lightning_sgdtp.engine.step_compile import (
    adopt_compiled,
    compile_kwargs,
    compile_step,
    run_bookkeeping_eagerly,
    user_compile,
)


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        loss = self(x).square().mean()
        self.log("loss", loss)  # run eagerly by the strategy: a graph break it allows under fullgraph=True
        return loss


class Counting:
    """A backend that counts the graphs it gets and their calls; ``inductor_patches`` as the sgdtp backend's."""

    def __init__(self) -> None:
        self.graphs = 0
        self.calls: list[str] = []
        self.inductor_patches: dict[str, Any] = {"epilogue_fusion": True}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        self.calls += [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]
        return gm.forward


# ------------------------------------------------------------------------------------------- the settings mapping
def test_the_settings_the_strategy_takes_and_those_it_cannot() -> None:
    u = user_compile({"mode": "max-autotune", "dynamic": False, "fullgraph": True}, "torch.compile(model)")
    assert (u.dynamic, u.fullgraph) == (False, True)
    assert u.inductor == {"max_autotune": True, "coordinate_descent_tuning": True}  # the mode's, but CUDA graphs
    assert list(u.unused) == ["CUDA graphs (triton.cudagraphs, of mode='reduce-overhead' / 'max-autotune')"]

    u = user_compile({"backend": "eager", "mode": "default", "recompile_limit": 4}, "model.compile()")
    assert u.inductor == {} and u.dynamic is None and not u.fullgraph
    assert u.unused == {
        "backend='eager' and its mode": "replaced by the strategy's 'sgdtp' backend: Inductor with the gradient sync"
        " in the graph",
        "recompile_limit=4": "not passed on to the strategy's compile of the step",
    }
    assert user_compile({"options": {"epilogue_fusion": False}}, "x").inductor == {"epilogue_fusion": False}
    assert user_compile({}, "x").inductor == {}  # no mode: none of the modes' option sets


def test_the_rank_0_line_says_what_was_used_and_what_not() -> None:
    u = user_compile({"mode": "reduce-overhead", "dynamic": True, "backend": "inductor"}, "torch.compile(model)")
    assert u.line() == (
        "torch.compile(model): the step is compiled by the strategy, backend 'sgdtp', with your dynamic=True; not"
        " used: CUDA graphs (triton.cudagraphs, of mode='reduce-overhead' / 'max-autotune'): the strategy does not"
        " capture its graphs, which hold the gradient collectives, in CUDA graphs"
    )
    assert user_compile({}, "model.compile()").line() == (
        "model.compile(): the step is compiled by the strategy, backend 'sgdtp', (no setting of yours to pass on)"
    )


def test_the_settings_are_read_back_from_torch_s_own_objects() -> None:
    compiled = torch.compile(nn.Linear(2, 2), mode="max-autotune-no-cudagraphs", dynamic=False, fullgraph=True)
    kwargs = compile_kwargs(compiled.dynamo_ctx)
    assert kwargs == {
        "dynamic": False,
        "fullgraph": True,
        "options": {"max_autotune": True, "coordinate_descent_tuning": True},
    }
    assert compile_kwargs(torch.compile(nn.Linear(2, 2), backend="eager").dynamo_ctx)["backend"] == "eager"


# ---------------------------------------------------------------------------------------------- the Trainer's path
def test_a_compiled_module_is_taken_back_and_passes_lightning_s_check(caplog: pytest.LogCaptureFixture) -> None:
    """``trainer.fit(torch.compile(model))``: Lightning unwraps it (``from_compiled``) and assigns it to the strategy,
    then checks that the strategy supports compiled modules. The strategy takes it back to the plain module first."""
    model = Tiny()
    lightning_unwrapped = from_compiled(torch.compile(model, dynamic=False, options={"epilogue_fusion": False}))
    assert lightning_unwrapped is model and "training_step" in model.__dict__  # Lightning's dynamo-wrapped methods
    strategy = SGDTPStrategy()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.sgdtp"):
        strategy._lightning_module = model
    assert model._compiler_ctx is None and not {"forward", "training_step", "validation_step"} & set(model.__dict__)
    _verify_strategy_supports_compile(model, strategy)  # raised RuntimeError for a module still marked compiled
    adopted = step_compile._ADOPTED[model]
    assert (adopted.dynamic, adopted.fullgraph, adopted.inductor) == (False, False, {"epilogue_fusion": False})
    said = [r.getMessage() for r in caplog.records if "torch.compile(model)" in r.getMessage()]
    line = "the step is compiled by the strategy, backend 'sgdtp', with your dynamic=False, Inductor config"
    assert said == [f"sgdtp: torch.compile(model): {line} {{'epilogue_fusion': False}}"]


def test_model_compile_in_place_is_taken_back() -> None:
    model = Tiny()
    model.compile(dynamic=True, backend="aot_eager")
    said: list[str] = []
    adopt_compiled(model, said.append)
    assert model._compiled_call_impl is None and step_compile._ADOPTED[model].dynamic is True
    assert said[0].startswith("model.compile(): the step is compiled by the strategy, backend 'sgdtp', with your")
    assert "not used: backend='aot_eager': replaced by the strategy's 'sgdtp' backend" in said[0]


def test_compiled_submodules_stay_and_are_said() -> None:
    """Dynamo traces a compiled submodule into the strategy's step (the outer compile's backend takes it all)."""
    model = Tiny()
    model.net = torch.compile(model.net)
    said: list[str] = []
    adopt_compiled(model, said.append)
    assert isinstance(model.net, torch._dynamo.eval_frame.OptimizedModule)
    adopt_compiled(model, said.append)  # Lightning assigns the module twice (fit, then connect): said once
    assert said == ["submodule(s) ['net'] compiled by you: traced into the step (their settings apply outside it)"]
    run_bookkeeping_eagerly(model)
    backend = Counting()
    compile_step(model.training_step, backend)(torch.randn(3, 4)).backward()
    assert backend.graphs == 1 and backend.calls.count("linear") == 2, backend.calls  # the submodule in the graph


def test_a_mock_lightning_module_is_not_mistaken_for_a_compiled_one() -> None:
    """Lightning's launcher tests assign ``Mock(spec=LightningModule)``: its ``_compiler_ctx`` and
    ``_compiled_call_impl`` are Mocks, not torch's objects."""
    mock = Mock(spec=L.LightningModule)
    said: list[str] = []
    adopt_compiled(mock, said.append)
    assert said == [] and not mock.method_calls
    strategy = SGDTPStrategy()
    strategy._lightning_module = mock  # refused as "a torch.compile()d LightningModule" before
    assert strategy.lightning_module is mock


# --------------------------------------------------------------------------------------- the step's compile, honoured
def test_the_step_compile_passes_the_settings_on() -> None:
    """``dynamic=True``: one graph for two batch sizes (the default compiles twice); the Inductor config goes under
    the backend's own (its settings win)."""
    shapes = (torch.randn(3, 4), torch.randn(5, 4))
    for dynamic, graphs in ((None, 2), (True, 1)):
        model, backend = Tiny(), Counting()
        step_compile._ADOPTED[model] = user_compile(
            {"dynamic": dynamic, "options": {"epilogue_fusion": False, "max_autotune": False}}, "x"
        )
        step = compile_step(model.forward, backend)
        for x in shapes:
            step(x)
        assert backend.graphs == graphs, dynamic
        assert backend.inductor_patches == {"epilogue_fusion": True, "max_autotune": False}


def test_fullgraph_makes_graph_breaks_errors_but_the_bookkeeping_s() -> None:
    model = Tiny()
    step_compile._ADOPTED[model] = user_compile({"fullgraph": True}, "x")
    run_bookkeeping_eagerly(model)  # self.log: eager (no Trainer: silenced), an allowed graph break
    backend = Counting()
    compile_step(model.training_step, backend)(torch.randn(3, 4))  # no error: self.log's break is allowed
    assert backend.graphs == 1 and backend.calls.count("linear") == 2, backend.calls

    class Breaking(Tiny):
        def training_step(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()
            return super().training_step(x)

    breaking = Breaking()
    step_compile._ADOPTED[breaking] = user_compile({"fullgraph": True}, "x")
    run_bookkeeping_eagerly(breaking)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        compile_step(breaking.training_step, Counting())(torch.randn(3, 4))


def test_fabric_s_re_applied_compile_is_made_a_no_op() -> None:
    """Fabric strips ``torch.compile`` off the module and re-applies it, with the same dict of arguments, around what
    the strategy returns: the strategy takes the settings and sets ``disable=True`` in that dict."""
    model = Tiny()
    kwargs: dict[str, Any] = {"mode": "default", "dynamic": False}
    said: list[str] = []
    adopt_compiled(model, said.append, "fabric.setup()", kwargs)
    assert kwargs["disable"] is True and torch.compile(model, **kwargs) is model
    assert step_compile._ADOPTED[model].dynamic is False and said[0].startswith("torch.compile(model): the step")
    with pytest.raises(SGDTPConfigError, match="_reapply_compile"):  # fabric.setup(..., _reapply_compile=False)
        adopt_compiled(torch.compile(Tiny()), said.append, "fabric.setup()")


# ------------------------------------------------------------------------------------------------ precision plugins
def test_precision_plugins_are_accepted_by_what_they_are() -> None:
    from lightning.fabric.plugins import precision as fabric_precision
    from lightning.pytorch.plugins import precision as trainer_precision

    for module in (trainer_precision, fabric_precision):

        class MyAMP(module.MixedPrecision):  # Lightning's test_amp_ddp: a subclass of MixedPrecision
            pass

        for plugin in (MyAMP, module.Precision, module.HalfPrecision, module.DoublePrecision, module.MixedPrecision):
            assert precision_plugin_refusal(plugin) is None, plugin
            check_trainer_plugins(plugin, False)

        class MyQuantized(module.BitsandbytesPrecision):
            pass

        assert precision_plugin_refusal(MyQuantized).startswith("a BitsandbytesPrecision: it swaps nn.Linear layers")
        for refused in ("TransformerEnginePrecision", "DeepSpeedPrecision", "FSDPPrecision", "XLAPrecision"):
            assert precision_plugin_refusal(getattr(module, refused)), refused
    assert precision_plugin_refusal(object) == (
        "it is not one of Lightning's precision plugins (Precision, MixedPrecision, HalfPrecision, DoublePrecision)"
    )


def test_the_trainer_takes_a_plugin_subclass_and_64_true() -> None:
    from lightning.pytorch.plugins.precision import DeepSpeedPrecision, MixedPrecision

    class MyAMP(MixedPrecision):
        pass

    plugin = MyAMP("bf16-mixed", "cpu")
    trainer = L.Trainer(strategy="sgdtp", accelerator="cpu", devices=2, plugins=[plugin], logger=False)
    assert trainer.strategy.precision_plugin is plugin  # the user's instance: its hooks are the ones called
    L.Trainer(strategy="sgdtp", accelerator="cpu", devices=2, precision="64-true", logger=False)
    with pytest.raises(SGDTPConfigError) as refused:
        L.Trainer(strategy="sgdtp", accelerator="cpu", devices=2, plugins=[DeepSpeedPrecision("bf16-mixed")])
    assert str(refused.value) == (
        "precision plugin DeepSpeedPrecision is not supported by the sgdtp strategy: it hands backward and the"
        " optimizer step to a DeepSpeed engine (strategy='deepspeed'). Use Trainer(precision=...) with one of 32-true,"
        " bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true, or a subclass of Lightning's Precision, MixedPrecision,"
        " HalfPrecision, DoublePrecision."
    )


def test_outside_fabric_setup_there_is_no_stripped_compile() -> None:
    """The strategy's module setup called other than from ``Fabric.setup`` finds no wrapper Fabric stripped: None,
    which ``adopt_compiled`` reads as "nothing to take over" (False was read as the wrapper's arguments)."""
    from lightning_sgdtp.frontends.fabric import _fabric_compile_kwargs

    assert _fabric_compile_kwargs() is None
