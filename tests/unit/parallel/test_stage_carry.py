"""Values a later stage reads are carried stage to stage (lightning_sgdtp/parallel/pipeline/carry.py): torch's
interleaved schedule sends between adjacent stages only, and transformers models give what they compute before
the block stack (rotary tables, masks, positions) to every block."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline

from lightning_sgdtp.parallel.pipeline.carry import carry_stage_inputs


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * scale + bias)


class Net(nn.Module):
    """What a transformers model does: two values made once before the blocks (one from a parameter, so its
    gradient comes back through the stages between), read by every block."""

    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        scale, bias = self.scale.sigmoid(), torch.arange(8.0) / 8  # a table with no gradient, like rotary cos/sin
        for block in self.blocks:
            h = block(h, scale, bias)
        return h


def _sources(split_gm: torch.fx.GraphModule) -> list[set[int]]:
    """For each stage, the stages it reads from (model inputs left out)."""
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    result = []
    for call in calls:
        read = set()
        for arg in call.args:
            while isinstance(arg, torch.fx.Node) and arg.target is operator.getitem:
                arg = arg.args[0]
            if isinstance(arg, torch.fx.Node) and arg.op == "call_module":
                read.add(calls.index(arg))
        result.append(read)
    return result


def _in_output_order(split_gm: torch.fx.GraphModule) -> bool:
    """Each later stage reads the previous stage's outputs in their order: torch sends a stage's input gradients
    back in input order and the previous stage receives them in output order."""
    calls = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    slots = [[a.args[1] for a in call.args if a.target is operator.getitem] for call in calls[1:]]
    return all(s == sorted(s) for s in slots)


def _computes_like(split_gm: torch.fx.GraphModule, net: nn.Module, *inputs: torch.Tensor) -> None:
    """The edited graph, run whole in one process (torch's Pipe runs it without autograd; the stages share net's
    parameters), gives the model's output and every parameter's gradient (carried values' gradients come back
    through the stages between)."""
    got = torch.fx.Interpreter(split_gm).run(*inputs)
    got = got[0] if isinstance(got, tuple) else got
    expected = net(*inputs)
    torch.testing.assert_close(got, expected)
    expected.sum().backward()
    want = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    got.sum().backward()
    for name, param in net.named_parameters():
        torch.testing.assert_close(param.grad, want[name], msg=name)


def _pipe(net: nn.Module, x: torch.Tensor, starts: list[str]):
    return pipeline(net, mb_args=(x,), split_spec={b: SplitPoint.BEGINNING for b in starts})


def test_every_stage_reads_only_the_stage_before_and_results_and_gradients_stay_equal() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 8)
    pipe = _pipe(net, x, ["blocks.1", "blocks.2", "blocks.3"])
    assert _sources(pipe.split_gm)[3] == {0, 2}  # what torch's interleaved schedule refuses
    carried = carry_stage_inputs(pipe.split_gm)
    assert _sources(pipe.split_gm) == [set(), {0}, {1}, {2}]
    assert _in_output_order(pipe.split_gm), "the gradients go back in the order they are received"
    assert any("stage 3 (through 1, 2)" in c for c in carried), carried
    for name, stage in pipe.split_gm.named_children():  # torch's stages read each placeholder's example value
        if name.startswith("submod_"):
            assert all("val" in n.meta for n in stage.graph.nodes if n.op == "placeholder"), name
    _computes_like(pipe.split_gm, net, x)


def test_adjacent_stages_are_left_as_they_are() -> None:
    net, x = Net(blocks=2), torch.randn(3, 8)
    pipe = _pipe(net, x, ["blocks.1"])
    before = str(pipe.split_gm.graph)
    assert carry_stage_inputs(pipe.split_gm) == []
    assert str(pipe.split_gm.graph) == before


def test_an_unchanged_transformers_llama_carries_its_rotary_tables_and_computes_the_same() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids).logits

    net, ids = Logits(), torch.randint(0, 64, (2, 8))
    pipe = _pipe(net, ids, ["model.model.layers.1", "model.model.layers.2", "model.model.layers.3"])
    carried = carry_stage_inputs(pipe.split_gm)
    assert _sources(pipe.split_gm) == [set(), {0}, {1}, {2}], carried
    assert _in_output_order(pipe.split_gm)
    with torch.no_grad():
        got = pipe(ids)
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, net(ids))


class EncoderDecoder(nn.Module):
    """T5's shape: the decoder's input is first read where the decoder starts, on a later stage than the encoder's."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.dec_emb = nn.Embedding(16, 8)
        self.decoder = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        h = x
        for block in self.encoder:
            h = torch.tanh(block(h))
        d = self.dec_emb(decoder_ids)
        for block in self.decoder:
            d = torch.tanh(block(d) + h)
        return d


def test_a_model_input_first_read_by_a_later_stage_goes_in_at_stage_zero() -> None:
    """torch's stages give the micro-batch to stage 0 only: a cut inside the encoder left the decoder's ids to a
    stage that never receives them ("forward() takes 2 positional arguments but 3 were given" on stage 0)."""
    torch.manual_seed(0)
    net, x, ids = EncoderDecoder(), torch.randn(3, 8), torch.randint(0, 16, (3,))
    pipe = pipeline(net, mb_args=(x, ids), split_spec={"encoder.1": SplitPoint.BEGINNING})
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    assert [a.op for a in calls[1].args].count("placeholder") == 1, "torch's split: stage 1 reads the model input"
    carried = carry_stage_inputs(pipe.split_gm)
    assert carried == ["model input decoder_ids -> stage 1 (through 0)"], carried
    assert [a.name for a in calls[0].args] == ["x", "decoder_ids"], "stage 0 takes the micro-batch's arguments"
    assert all(a.op != "placeholder" for a in calls[1].args), "stage 1 reads only what stage 0 sends"
    assert _in_output_order(pipe.split_gm)
    stage0 = pipe.split_gm.get_submodule(str(calls[0].target))
    assert all("val" in n.meta for n in stage0.graph.nodes if n.op == "placeholder")
    stage0(x, ids)  # called the way torch's schedule calls the first stage
    _computes_like(pipe.split_gm, net, x, ids)


class ScaleFirst(nn.Module):
    """A block that reads the carried value before the hidden state (T5's decoder blocks read the masks and the
    position bias around the hidden states)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = scale.exp()  # the carried value used before the hidden state
        return torch.tanh(self.lin(x) * gate)


class ScaleFirstNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.blocks = nn.ModuleList([ScaleFirst() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale.sigmoid()
        for block in self.blocks:
            x = block(scale, x)
        return x


def test_a_stage_reads_what_it_receives_in_the_order_it_is_sent() -> None:
    """Stage 2 reads the carried scale (from stage 0, through stage 1) before stage 1's hidden state. torch's stage
    sends input gradients in input order and the stage before receives them in output order: left as traced, the
    (8,) gradient and the (3, 8) one would cross (gloo: "Received data size doesn't match expected size")."""
    torch.manual_seed(0)
    net, x = ScaleFirstNet(), torch.randn(3, 8)
    pipe = _pipe(net, x, ["blocks.1", "blocks.2"])
    carry_stage_inputs(pipe.split_gm)
    assert _sources(pipe.split_gm) == [set(), {0}, {1}]
    assert _in_output_order(pipe.split_gm)
    _computes_like(pipe.split_gm, net, x)
