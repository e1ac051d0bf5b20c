"""The planner's step-time and activation model (lightning_sgdtp/planner/cost.py), the named shapes, and
``parallelism="auto"``'s glue (lightning_sgdtp/planner/auto.py): pure, in this process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.planner.auto import batch_shape, configure, decide, fixed_fields
from lightning_sgdtp.planner.cost import (
    HARDWARE,
    Link,
    Schedule,
    activation_bytes,
    all_reduce_s,
    gather_s,
    measured_hardware,
    profile,
    step_time,
    tp_split_fraction,
)
from lightning_sgdtp.planner.memory import Layout
from lightning_sgdtp.planner.search import Candidate, size_text
from lightning_sgdtp.planner.shapes import SHAPES, build

H100 = HARDWARE["h100"]


class Stack(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 4, vocab: int = 100) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, vocab, bias=False)
        self.example_input_array = torch.zeros(6, 16, dtype=torch.long)


def test_the_profile_reads_width_blocks_vocabulary_and_the_weights_that_multiply() -> None:
    model = profile(Stack(), tokens=16, batch=6)
    assert (model.blocks, model.width, model.vocab) == (4, 32, 100)
    per_block = 2 * 32 * 128
    assert model.block_matmul_params == 4 * per_block and model.matmul_params == 4 * per_block + 32 * 100
    tied = Stack()
    tied.head.weight = tied.emb.weight  # a tied head multiplies: counted where the head uses it
    assert profile(tied, 16, 6).matmul_params == model.matmul_params


def test_collectives_follow_the_ring_and_a_group_of_one_is_free() -> None:
    link = Link(1e-5, 1e9)
    assert all_reduce_s(1e9, 1, link) == gather_s(1e9, 1, link) == 0.0
    assert all_reduce_s(1e9, 2, link) == pytest.approx(1e-5 + 1.0)  # 2 (g-1)/g = 1
    assert gather_s(1e9, 4, link) == pytest.approx(1e-5 + 0.75)
    assert H100.link_for(8, 8) is H100.island_link and H100.link_for(16, 8) is H100.network_link


def test_compute_divides_over_tensor_parallel_and_checkpointing_recomputes_the_forward() -> None:
    model = profile(Stack(), tokens=16, batch=6)
    one = step_time(model, Layout(), H100, 8, 10_000)
    split = step_time(model, Layout(tp=2), H100, 8, 10_000)
    assert one.compute / 2 < split.compute < one.compute  # norms and activations run whole on every rank
    half = step_time(model, Layout(tp=2), H100, 8, 10_000, tp_split=0.5)  # a replicated head: not divided
    assert half.compute > split.compute
    ckpt = step_time(model, Layout(), H100, 8, 10_000, Schedule(checkpointing=True))
    assert ckpt.compute == pytest.approx(one.compute * 8 / 6)
    assert split.tensor_parallel > 0 == one.tensor_parallel
    module = Stack()
    assert 0 < tp_split_fraction(module, Layout(tp=2)) < 1  # what the automatic plan splits (here the head)
    assert tp_split_fraction(module, Layout()) == 1.0


def test_hybrid_sharding_and_a_pipeline_s_micro_batches_change_the_collectives() -> None:
    model = profile(Stack(), tokens=16, batch=8)
    cpu = dataclasses.replace(H100, overlap=0.0, network_link=Link(1e-4, 1e8))  # slow between nodes
    flat = step_time(model, Layout(dp=8, sharding="full"), cpu, 4, 10**8).data_parallel
    hsdp = step_time(model, Layout(dp=8, sharding="full", shard_size=4), cpu, 4, 10**8).data_parallel
    assert hsdp < flat  # gathers inside a node, 1/4 of the gradient all-reduced across nodes
    piped = [
        step_time(model, Layout(dp=2, pp=2, sharding="full"), cpu, 8, 10**8, Schedule(micro_batches=m)).data_parallel
        for m in (2, 4)
    ]
    assert piped[1] == pytest.approx(2 * piped[0], rel=0.01)  # gathered and reduce-scattered every micro-batch


def test_the_bubble_shrinks_with_micro_batches_and_replicas_add_samples() -> None:
    model = profile(Stack(), tokens=16, batch=8)
    two = step_time(model, Layout(pp=2), H100, 8, 10_000, Schedule(micro_batches=2))
    eight = step_time(model, Layout(pp=2), H100, 8, 10_000, Schedule(micro_batches=8))
    assert two.bubble == pytest.approx(two.compute / 2) and eight.bubble == pytest.approx(eight.compute / 8)
    replicas = step_time(model, Layout(dp=4), H100, 8, 10_000)
    assert replicas.samples == 4 * 8 and replicas.data_parallel > 0


def test_the_schedules_trade_bubble_sends_and_activations() -> None:
    """Interleaved 1F1B with 2 stages per rank halves the bubble and doubles the sends (Narayanan et al. 2021) and
    keeps 1 + (p - 1) / (p v) times 1F1B's activations; GPipe keeps every micro-batch in flight."""
    model = profile(Stack(blocks=8), tokens=16, batch=8)
    one_f_one_b = Schedule(micro_batches=4)
    interleaved = Schedule(micro_batches=4, pipeline="interleaved_1f1b", stages_per_rank=2)
    gpipe = Schedule(micro_batches=4, pipeline="gpipe")
    base, inter = (step_time(model, Layout(pp=2), H100, 8, 10_000, s) for s in (one_f_one_b, interleaved))
    assert inter.bubble == pytest.approx(base.bubble / 2) and inter.pipeline_sends == pytest.approx(
        2 * base.pipeline_sends
    )
    assert step_time(model, Layout(pp=2), H100, 8, 10_000, gpipe).total == pytest.approx(base.total)
    acts = {s.pipeline: activation_bytes(model, Layout(pp=2), H100, s) for s in (one_f_one_b, interleaved, gpipe)}
    logits = activation_bytes(model, Layout(pp=2), H100, Schedule(micro_batches=4, checkpointing=True))
    assert acts["1f1b"] < acts["interleaved_1f1b"] < acts["gpipe"] and logits < acts["1f1b"]
    assert acts["gpipe"] >= 0.99 * 2 * acts["1f1b"]  # 4 micro-batches in flight, not 2 (the last stage's too)
    ckpt = {
        s.pipeline: activation_bytes(model, Layout(pp=2), H100, dataclasses.replace(s, checkpointing=True))
        for s in (one_f_one_b, interleaved, gpipe)
    }  # with checkpointing too, GPipe never keeps less (the last stage's logits may dominate the other two)
    assert ckpt["1f1b"] <= ckpt["interleaved_1f1b"] < ckpt["gpipe"]
    assert acts["interleaved_1f1b"] == pytest.approx(1.25 * acts["1f1b"], rel=0.01)  # 1 + 1 / (2 x 2)
    assert (interleaved.describe(), gpipe.describe(), one_f_one_b.describe()) == (
        ", interleaved 1F1B x2",
        ", GPipe",
        "",
    )


def test_data_parallel_communication_hides_behind_backward_where_the_hardware_overlaps() -> None:
    model = profile(Stack(), tokens=16, batch=8)
    cpu = dataclasses.replace(H100, overlap=0.0)
    exposed = step_time(model, Layout(dp=4), cpu, 8, 10**8).data_parallel
    hidden = step_time(model, Layout(dp=4), H100, 8, 10**8).data_parallel
    assert exposed > hidden > 0  # the last block's share waits in any case
    full = step_time(model, Layout(dp=4, sharding="full"), cpu, 8, 10**8).data_parallel
    assert full == pytest.approx(3 * gather_s(10**8, 4, cpu.link_for(4, 8)))  # 2 gathers + 1 reduce-scatter


def test_activations_shrink_with_checkpointing_tensor_parallel_and_micro_batches() -> None:
    model = profile(Stack(), tokens=16, batch=8)
    whole = activation_bytes(model, Layout(), H100)
    assert activation_bytes(model, Layout(), H100, Schedule(checkpointing=True)) < whole
    assert activation_bytes(model, Layout(tp=4), H100) < whole
    piped = [activation_bytes(model, Layout(pp=2), H100, Schedule(micro_batches=m)) for m in (2, 4, 8)]
    assert piped == sorted(piped, reverse=True)
    cpu = measured_hardware(type("Cost", (), {"latency_s": 1e-4, "seconds_per_byte": 1e-9, "flops_per_s": 1e10,
                                              "bytes_per_s": 1e10})())  # fmt: skip
    assert activation_bytes(model, Layout(), cpu) > whole  # no flash attention on CPU: the scores are kept
    assert cpu.overlap == 0.0 and cpu.name == "measured (cpu)"


@pytest.mark.parametrize(("name", "billions"), [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)])
def test_the_named_shapes_have_the_published_parameter_counts(name: str, billions: float) -> None:
    module = build(name)
    assert sum(p.numel() for p in module.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    assert next(module.parameters()).device.type == "meta" and SHAPES[name].tokens == 8192


# ------------------------------------------------------------------------------------------ parallelism="auto"
def test_the_batch_shape_comes_from_example_input_array() -> None:
    assert batch_shape(Stack())[:2] == (6, 16)
    plain = Stack()
    del plain.example_input_array
    batch, tokens, why = batch_shape(plain)
    assert (batch, tokens) == (1, 1) and "set it for a better plan" in why


def test_options_the_user_gave_are_fixed_and_the_winner_becomes_checked_options() -> None:
    config = SGDTPConfig(parallelism="auto", sharding="full", tensor_parallel_size=2, shard_size="node")
    assert fixed_fields(config, {"parallelism", "sharding", "tensor_parallel_size"}) == {
        "tp": 2, "sharding": "full", "shard_size": "node"
    }  # fmt: skip
    assert fixed_fields(SGDTPConfig(parallelism="auto"), {"parallelism"}) == {}  # the defaults are not fixed
    auto = SGDTPConfig(parallelism="auto", max_memory_per_rank="1GB")
    hybrid = configure(auto, Candidate(Layout(dp=2, tp=2, sharding="full")))
    assert (hybrid.parallelism, hybrid.tensor_parallel_size, hybrid.sharding) == ("hybrid", 2, "full")
    piped = configure(auto, Candidate(Layout(dp=2, pp=2), Schedule(checkpointing=True, micro_batches=4)))
    assert (piped.parallelism, piped.pipeline_stages, piped.pipeline_chunks) == ("data", 2, 4)
    assert piped.activation_checkpointing and piped.max_memory_per_rank is None
    assert configure(auto, Candidate(Layout(tp=4))).parallelism == "tensor"
    inter = Schedule(micro_batches=4, pipeline="interleaved_1f1b", stages_per_rank=2)
    three_d = configure(auto, Candidate(Layout(tp=2, pp=2), inter))
    assert (three_d.parallelism, three_d.tensor_parallel_size, three_d.pipeline_stages) == ("tensor", 2, 2)
    assert (three_d.pipeline_schedule, three_d.pipeline_stages_per_rank) == ("interleaved_1f1b", 2)
    fixed = SGDTPConfig(parallelism="auto", pipeline_stages=2, pipeline_schedule="gpipe")
    assert fixed_fields(fixed, {"parallelism", "pipeline_stages", "pipeline_schedule"}) == {
        "pp": 2,
        "pipeline": "gpipe",
    }


def test_auto_plans_sharded_when_replicated_does_not_fit_and_says_why() -> None:
    module = Stack()
    config = SGDTPConfig(parallelism="auto", max_memory_per_rank="800KB")  # a replica needs 976 KB at least
    resolved, result, lines = decide(config, {"parallelism"}, module, 2, 2, H100, 4)
    replicated = next(c for c in result.candidates if c.layout == Layout(dp=2) and not c.schedule.checkpointing)
    assert not replicated.fits and result.best.fits and resolved.parallelism in ("data", "tensor")
    assert resolved.sharded or resolved.pipeline_stages or resolved.tensor_parallel_size
    assert lines[0].startswith(f"planner: parallelism='auto' chose {result.best.describe()}: ")
    assert "limit 781.25 KiB" in lines[0] and "batch 6 x 16 tokens from example_input_array" in lines[0]
    whole = sum(p.numel() * p.element_size() for p in module.parameters())  # real weights: built whole, at setup
    assert lines[1].startswith(f"planner: setup peak per rank: {size_text(whole)} (model built whole: all of it")
    assert "; built on the meta device instead: " in lines[1] and result.materialized
    assert [line.startswith("planner: next: ") for line in lines[2:]] == [True, True]
    built_whole = r"parallelism='auto': no layout fits .*: the model is built whole, .* the smallest layout, .* needs"
    with pytest.raises(SGDTPConfigError, match=built_whole):  # not even its whole model fits
        decide(SGDTPConfig(parallelism="auto", max_memory_per_rank="10KB"), set(), module, 2, 2, H100, 4)
    hsdp = SGDTPConfig(parallelism="auto", sharding="full", shard_size="node")  # 2 nodes of 2: groups of 2
    resolved, result, _ = decide(hsdp, {"parallelism", "sharding", "shard_size"}, module, 4, 2, H100, 4)
    rows = [c.layout for c in result.candidates if c.time is not None]
    assert resolved.shard_size == 2 and rows  # "node": 2 ranks, or every dp rank where they fit in one node
    assert all(lay.shard_size == 2 or lay.dp * lay.tp <= 2 for lay in rows), rows
    with pytest.raises(SGDTPConfigError, match=r"no layout of 2 ranks keeps your options \{'tp': 4\}"):
        decide(SGDTPConfig(parallelism="auto", tensor_parallel_size=4), {"parallelism"}, module, 2, 2, H100, 4)


def test_a_memory_limit_needs_the_planner_and_a_unit() -> None:
    with pytest.raises(SGDTPConfigError, match=r"max_memory_per_rank='300MB' is a limit for the planner"):
        SGDTPConfig(max_memory_per_rank="300MB")
    with pytest.raises(SGDTPConfigError, match=r"max_memory_per_rank: memory '300': give a positive number"):
        SGDTPConfig(parallelism="auto", max_memory_per_rank="300")
    with pytest.raises(SGDTPConfigError, match=r'"strategy": "auto": the planner chooses a layout'):
        SGDTPConfig.from_options({"distributed": {"strategy": "auto"}}).check_single_graph()
