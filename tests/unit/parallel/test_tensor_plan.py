"""The tensor-parallel plan and the mesh sizes: pure functions over module trees and numbers, no processes."""

from __future__ import annotations

import pytest
from gpt import GPT, GPTConfig
from helpers.models import MHALanguageModel
from torch import nn

from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.mesh.dims import ParallelLayout
from lightning_sgdtp.mesh.topology import Topology
from lightning_sgdtp.parallel.tensor.plan import TensorPlanError, auto_plan, resolve_plan


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(dim, dim, bias=False)


class LlamaMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.down_proj = nn.Linear(3 * dim, dim)


class LlamaLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(dim)
        self.self_attn = LlamaAttention(dim, heads)
        self.mlp = LlamaMLP(dim)


class Llama(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaLayer(dim, heads) for _ in range(2))
        self.lm_head = nn.Linear(dim, vocab, bias=False)


def gpt(n_head: int = 4) -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=n_head, n_embd=48))


def test_gpt_plan_splits_attention_mlp_embedding_and_tied_head() -> None:
    plan = auto_plan(gpt(), 2)
    for i in range(2):
        assert plan.styles[f"blocks.{i}.attn.qkv"] == "colwise"
        assert plan.styles[f"blocks.{i}.attn.proj"] == "rowwise"
        assert plan.styles[f"blocks.{i}.mlp.fc"] == "colwise"
        assert plan.styles[f"blocks.{i}.mlp.proj"] == "rowwise"
    assert plan.styles["tok_emb"] == "rowwise" and plan.styles["lm_head"] == "colwise_gather"
    assert "pos_emb" in plan.replicated
    lines = plan.describe()
    assert lines[0].startswith("tensor-parallel plan (automatic, tp=2)") and any("pos_emb" in line for line in lines)


def test_llama_names_are_understood() -> None:
    plan = auto_plan(Llama(), 4)
    assert {plan.styles[f"layers.0.self_attn.{n}"] for n in ("q_proj", "k_proj", "v_proj")} == {"colwise"}
    assert plan.styles["layers.0.self_attn.o_proj"] == "rowwise"
    assert plan.styles["layers.1.mlp.gate_proj"] == plan.styles["layers.1.mlp.up_proj"] == "colwise"
    assert plan.styles["layers.1.mlp.down_proj"] == "rowwise"
    assert plan.styles["embed_tokens"] == "rowwise" and plan.styles["lm_head"] == "colwise_gather"


def test_heads_that_do_not_divide_stay_replicated_and_say_why() -> None:
    plan = auto_plan(gpt(n_head=3), 2)
    assert "blocks.0.attn.qkv" not in plan.styles
    assert "3 heads are not divisible by tp=2" in plan.replicated["blocks.0.attn.qkv"]
    assert plan.styles["blocks.0.mlp.fc"] == "colwise"  # the MLP still splits


def test_grouped_query_attention_needs_divisible_key_value_heads() -> None:
    model = Llama(dim=32, heads=4)
    for layer in model.layers:
        layer.self_attn.num_key_value_heads = 1  # (the shapes do not matter to the plan: the head counts do)
    plan = auto_plan(model, 2)
    assert plan.replicated["layers.0.self_attn.k_proj"] == "1 key/value heads are not divisible by tp=2"
    assert plan.styles["layers.0.mlp.gate_proj"] == "colwise"


class FusedMultiQuery(nn.Module):
    """Falcon's default attention: one fused projection of every query head plus one key and one value head."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = heads, 1
        self.query_key_value = nn.Linear(dim, dim + 2 * dim // heads)
        self.dense = nn.Linear(dim, dim)


def test_a_fused_projection_whose_key_value_heads_do_not_divide_is_still_split_and_says_so() -> None:
    # separate k/v layers stay whole (above); a fused one is split by output features, its output gathered where the
    # model splits it: each rank holds half the weight (Falcon's default held 61% at tp=2 with it whole)
    plan = auto_plan(nn.ModuleDict({"attn": FusedMultiQuery()}), 2)
    assert plan.styles["attn.query_key_value"] == "colwise" and plan.styles["attn.dense"] == "rowwise"
    note = plan.notes["attn.query_key_value"]
    assert "fused" in note and "1 key/value heads, not divisible by tp=2: the weight is still split" in note
    assert any("the attention between runs whole on each rank" in line for line in plan.describe())


def test_the_token_embedding_is_vocabulary_parallel_inside_the_layer() -> None:
    plan = auto_plan(gpt(), 2)
    assert plan.styles["tok_emb"] == "rowwise"
    assert "lookup, mask and all-reduce inside the layer" in plan.notes["tok_emb"]
    assert any(line.startswith("  tok_emb: rowwise (vocabulary-parallel") for line in plan.describe())


def test_multihead_attention_is_replicated_with_a_reason() -> None:
    plan = auto_plan(MHALanguageModel(), 2)
    assert "nn.MultiheadAttention" in plan.replicated["layers.0.self_attn"]
    assert not any(name.startswith("layers.0.self_attn") for name in plan.styles)
    assert plan.styles["layers.0.linear1"] == "colwise" and plan.styles["layers.0.linear2"] == "rowwise"
    assert plan.styles["embed"] == "rowwise" and plan.styles["head"] == "colwise_gather"


def test_tied_head_follows_its_embedding() -> None:
    model = gpt()
    plan = auto_plan(nn.ModuleDict({"m": model}), 3)  # vocab 64 does not divide by 3
    assert "m.tok_emb" in plan.replicated and "m.lm_head" in plan.replicated


def test_user_plan_globs_and_replicate() -> None:
    plan = resolve_plan(gpt(), {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"}, 2)
    assert plan.source == "tp_plan"
    assert sorted(plan.styles) == ["blocks.0.attn.proj", "blocks.0.attn.qkv", "blocks.1.attn.proj", "blocks.1.attn.qkv"]
    assert plan.replicated["blocks.0.mlp.fc"] == "not in tp_plan"


@pytest.mark.parametrize(
    ("patterns", "words"),
    [
        ({"blocks.*.attention.qkv": "colwise"}, ["'blocks.*.attention.qkv' matches no module", "blocks.0.attn.qkv"]),
        ({"blocks.*.attn": "colwise"}, ["CausalSelfAttention", "only nn.Linear and nn.Embedding"]),
        ({"tok_emb": "colwise"}, ["embeddings are split by vocabulary", "'rowwise'"]),
        ({"blocks.0.attn.qkv": "colwise"}, ["out_features=144 is not divisible by tensor_parallel_size=5"]),
    ],
)
def test_user_plan_errors_name_the_module_and_the_fix(patterns: dict[str, str], words: list[str]) -> None:
    tp = 5 if "blocks.0.attn.qkv" in patterns else 2
    with pytest.raises(TensorPlanError) as info:
        resolve_plan(gpt(), patterns, tp)
    for word in words:
        assert word in str(info.value)


def cpu(nodes: int, devices: int) -> Topology:
    from lightning_sgdtp.mesh.topology import detect

    return detect("cpu", devices, nodes)


def _resolve(parallelism: str, requested: object, world: int, per_node: int) -> ParallelLayout:
    config = SGDTPConfig(parallelism=parallelism, tensor_parallel_size=requested)
    return ParallelLayout.resolve(config, world, per_node, world // per_node, cpu(world // per_node, per_node))


@pytest.mark.parametrize(
    ("parallelism", "requested", "world", "per_node", "dp", "tp"),
    [
        ("data", None, 8, 4, 8, 1),
        ("tensor", "auto", 2, 2, 1, 2),
        ("tensor", 4, 4, 4, 1, 4),
        ("hybrid", 2, 4, 4, 2, 2),
        ("hybrid", "auto", 8, 4, 2, 4),  # auto: one island (a CPU node) per tensor-parallel group
        ("hybrid", None, 4, 2, 2, 2),
    ],
)
def test_dims(parallelism: str, requested: object, world: int, per_node: int, dp: int, tp: int) -> None:
    dims = _resolve(parallelism, requested, world, per_node)
    assert (dims.dp, dims.tp) == (dp, tp)


@pytest.mark.parametrize(
    ("parallelism", "requested", "world", "per_node", "words"),
    [
        ("tensor", 2, 4, 4, ["tensor_parallel_size=2 != 4 ranks", "parallelism='hybrid'"]),
        ("tensor", None, 4, 2, ["spans nodes", "parallelism='hybrid'"]),
        ("hybrid", 3, 4, 4, ["tensor_parallel_size=3 does not divide the world size 4"]),
        ("hybrid", 4, 8, 2, ["does not divide the 2 devices of a node", "inside one node"]),
    ],
)
def test_dims_errors_say_what_divides_what(
    parallelism: str, requested: object, world: int, per_node: int, words: list[str]
) -> None:
    with pytest.raises(SGDTPConfigError) as info:
        _resolve(parallelism, requested, world, per_node)
    for word in words:
        assert word in str(info.value)


def test_layout_rows_are_tensor_parallel_groups_inside_nodes() -> None:
    dims = _resolve("hybrid", 2, 8, 4)
    assert dims.grid == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.coordinates(5) == {"pp": 0, "dp": 2, "tp": 1}


def test_backend_object_survives_lightnings_compile_wrapper() -> None:
    """With Lightning imported, torch.compile(module, backend=obj) deep-copies its kwargs; a backend holding a
    process group could not be copied. The compiler is shared, not copied."""
    import copy

    import lightning.pytorch  # noqa: F401  (installs Lightning's torch.compile wrapper)
    import torch

    from lightning_sgdtp import SGDTPCompiler

    compiler = SGDTPCompiler()
    assert copy.deepcopy({"backend": compiler})["backend"] is compiler
    model = nn.Linear(4, 2)
    torch.compile(model, backend=compiler)(torch.randn(3, 4)).sum().backward()
    assert compiler.graphs, "the graphs were compiled by a copy, not by this backend object"
    torch._dynamo.reset()


def test_compile_backend_with_tensor_and_hybrid_strategies() -> None:
    """The design documents' torch.compile form: "tensor" compiles without gradient sync (nothing to average);
    "hybrid" cannot know the data-parallel group and says what to do instead."""
    import torch

    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    tensor = torch.compile(model, backend="sgdtp", options={"distributed": {"plugin": "sgdtp", "strategy": "tensor"}})
    tensor(x).sum().backward()
    assert model.weight.grad is not None
    torch._dynamo.reset()
    hybrid = torch.compile(model, backend="sgdtp", options={"distributed": {"plugin": "sgdtp", "strategy": "hybrid"}})
    with pytest.raises(Exception, match="cannot know your data-parallel group"):
        hybrid(x)
    torch._dynamo.reset()


def test_sequence_parallel_where_it_is_correct() -> None:
    plan = auto_plan(gpt(), 2, sequence_parallel=True)
    assert plan.sequence_blocks == ["blocks.0", "blocks.1"]
    assert {plan.styles[f"blocks.{i}.{n}"] for i in range(2) for n in ("ln_1", "ln_2")} == {"sequence"}
    assert "ln_f" not in plan.styles  # outside the stack: the stream is gathered when it leaves the last block
    assert plan.describe()[-1].startswith("  sequence parallel: on: the residual stream of blocks.0 .. blocks.1")
    llama = auto_plan(Llama(), 2, sequence_parallel=True)
    assert llama.sequence_blocks == ["layers.0", "layers.1"]
    assert [n for n, s in llama.styles.items() if s == "sequence"] == [f"layers.{i}.input_layernorm" for i in range(2)]
    assert not auto_plan(gpt(), 2).sequence_blocks  # off unless asked (sequence_parallel=True, on any device)


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (lambda: MHALanguageModel(), "layers.0.self_attn is an nn.MultiheadAttention"),
        (lambda: gpt(n_head=3), "blocks.0.attn.qkv is not split"),
        (lambda: nn.Sequential(nn.Linear(4, 4)), "no stack of repeated blocks"),
    ],
)
def test_sequence_parallel_is_not_applied_where_it_would_be_wrong(model: object, reason: str) -> None:
    plan = auto_plan(model(), 2, sequence_parallel=True)
    assert not plan.sequence_blocks and reason in plan.sequence_reason
    assert "sequence" not in plan.styles.values()


# -------------------------------------------------------------------------------------------- coverage
def _plan_of(name: str):
    """The plan the strategy makes for zoo model ``name`` (unchanged transformers code) on 2 tensor-parallel ranks."""
    from helpers.zoo import zoo_module

    from lightning_sgdtp.engine.parallelize import plan_part
    from lightning_sgdtp.mesh.topology import detect

    config = SGDTPConfig(parallelism="tensor")
    dims = ParallelLayout.resolve(config, 2, 2, 1, detect("cpu", 2, 1))
    return plan_part(config, dims, zoo_module(name)).tensor_plan


#: Issue 24's bar: on 2 tensor-parallel ranks each rank holds at most 60% of the parameter bytes. The modules whose
#: style shows the layer kind is understood: transformers Conv1D (GPT-2), fused q/k/v and gate/up (Phi-3, GPT-NeoX),
#: experts as 3-D parameters (Mixtral: expert parallel) and as a ModuleList of MLPs (the zoo's MoE: per-expert split).
DIVIDED = {
    "gpt2": {"transformer.h.0.mlp.c_fc": "colwise", "transformer.h.0.mlp.c_proj": "rowwise",
             "transformer.h.0.attn.c_attn": "colwise", "transformer.h.0.attn.c_proj": "rowwise"},
    "llama": {"model.layers.0.self_attn.q_proj": "colwise", "model.layers.0.mlp.down_proj": "rowwise"},
    "qwen2": {"model.layers.0.self_attn.k_proj": "colwise"},
    "mistral": {"model.layers.0.self_attn.v_proj": "colwise"},
    "phi": {"model.layers.0.mlp.fc1": "colwise", "model.layers.0.mlp.fc2": "rowwise"},
    "mixtral": {"model.layers.0.mlp.experts": "experts", "model.layers.0.self_attn.o_proj": "rowwise"},
    "moe": {"blocks.0.moe.experts.0.0": "colwise", "blocks.0.moe.experts.3.2": "rowwise"},
    "phi3": {"model.layers.0.self_attn.qkv_proj": "colwise", "model.layers.0.mlp.gate_up_proj": "colwise",
             "model.layers.0.mlp.down_proj": "rowwise"},
    "neox": {"gpt_neox.layers.0.attention.query_key_value": "colwise",
             "gpt_neox.layers.0.attention.dense": "rowwise"},
    "litgpt": {"transformer.h.0.attn.qkv": "colwise", "transformer.h.0.mlp.fc_1": "colwise",
               "transformer.h.0.mlp.fc_2": "colwise", "transformer.h.0.mlp.proj": "rowwise"},
    # issue 43: Falcon (grouped fused QKV; and its multi-query default: one key/value head), BLOOM (fused QKV, a norm
    # after the vocabulary-parallel embedding), MBart's decoder (a norm after a scaled embedding subclass), GPT-J
    "falcon": {"transformer.h.0.self_attention.query_key_value": "colwise",
               "transformer.h.0.self_attention.dense": "rowwise", "transformer.h.0.mlp.dense_4h_to_h": "rowwise"},
    "falcon_mq": {"transformer.h.0.self_attention.query_key_value": "colwise",
                  "transformer.h.0.self_attention.dense": "rowwise"},
    "bloom": {"transformer.h.0.self_attention.query_key_value": "colwise", "transformer.word_embeddings": "rowwise"},
    "mbart": {"model.decoder.layers.0.self_attn.q_proj": "colwise", "model.decoder.layers.0.fc2": "rowwise",
              "model.decoder.embed_tokens": "rowwise"},
    "gptj": {"transformer.h.0.attn.k_proj": "colwise", "transformer.h.0.mlp.fc_out": "rowwise"},
}  # fmt: skip


@pytest.mark.parametrize("name", list(DIVIDED))
def test_tensor_parallel_divides_the_model(name: str) -> None:
    """The split fraction the strategy records in ``plan['tensor']``, counted from the parameters: <= 60% per rank."""
    plan = _plan_of(name)
    for module, style in DIVIDED[name].items():
        assert plan.styles.get(f"model.{module}") == style, (module, plan.styles, plan.replicated)
    c = plan.coverage
    assert c["held_fraction"] <= 0.6 and c["split_fraction"] >= 0.8, c
    assert c["block_replicated_fraction"] < 0.05, (c, plan.replicated)
    assert not any("WARNING" in line for line in plan.describe())
    fused = [n for n in plan.styles if "fused" in plan.notes.get(n, "")]
    assert bool(fused) == (name in ("gpt2", "phi3", "neox", "litgpt", "falcon", "falcon_mq", "bloom")), plan.notes


class TwoNamedAlike(nn.Module):
    """``fc_1`` -> ``fc_2`` (the names LitGPT gives gate and up, used elsewhere for in and out)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.fc_1, self.fc_2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)


def test_names_that_are_inputs_in_one_model_and_outputs_in_another_pair_by_their_partner() -> None:
    alone = auto_plan(nn.ModuleDict({"mlp": TwoNamedAlike()}), 2).styles
    assert (alone["mlp.fc_1"], alone["mlp.fc_2"]) == ("colwise", "rowwise"), alone


def test_a_norm_over_each_head_is_put_on_the_mesh_and_a_blocks_norms_are_not() -> None:
    """Qwen3's q_norm / k_norm (RMSNorm over head_dim) read the column-parallel q and k: their weights become
    replicated DTensors (a plain weight got a DTensor gradient, which sharding's read could not take). The norms of
    nn.TransformerEncoderLayer sit beside its linear1 -> linear2 pair too, but have the stream's width: left alone."""
    qwen3 = _plan_of("qwen3")
    on_mesh = sorted(n for n, s in qwen3.styles.items() if s == "head_norm")
    assert on_mesh == [f"model.model.layers.{i}.self_attn.{k}_norm" for i in (0, 1) for k in "kq"], on_mesh
    assert "4 head_norm" in qwen3.describe()[0]
    assert qwen3.coverage["split_fraction"] >= 0.8, "a norm on the mesh is not counted as split"
    assert "head_norm" not in auto_plan(MHALanguageModel(), 2).styles.values()


def test_coverage_is_counted_and_a_mostly_replicated_model_is_named() -> None:
    """BERT's attention and MLP pairs span two modules each (BertSelfAttention -> BertSelfOutput): its blocks stay
    replicated, each layer with the reason, and the warning names the largest with the fix."""
    bert = _plan_of("bert")
    c = bert.coverage
    assert c["held_fraction"] > 0.9 and c["block_replicated_fraction"] == 1.0, c
    assert c["largest_replicated"] in bert.replicated
    assert any("WARNING" in line and "tp_plan" in line for line in bert.describe())
    assert bert.to_dict()["coverage"] == c


def test_experts_that_do_not_divide_stay_replicated() -> None:
    from helpers.zoo import zoo_module

    plan = auto_plan(zoo_module("mixtral"), 3)
    assert "4 experts are not divisible by tp=3" in plan.replicated["model.model.layers.0.mlp.experts"]


def test_coverage_counts_a_tied_weight_once() -> None:
    from lightning_sgdtp.parallel.tensor.plan import TensorPlan, coverage

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied: 40 floats, once
    plan = TensorPlan(tp=2, styles={"0": "rowwise", "1": "colwise_gather"})
    assert coverage(model, plan) == {
        "split_fraction": 1.0, "held_fraction": 0.5, "block_replicated_fraction": 0.0, "largest_replicated": None,
    }  # fmt: skip


def _qwen2(heads: int = 4, kv: int = 2, width: int = 32) -> nn.Module:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=96, hidden_size=width, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


@pytest.mark.parametrize("kv", [2, 1])
def test_fewer_key_value_heads_than_tp_replicates_them_and_splits_the_query_heads(kv: int) -> None:
    """transformers 5 keeps no head counts on its attention: they are read from the projections' widths over
    ``head_dim``. Before, k_proj (2 heads) was split over 4 ranks and Dynamo failed at the first step ("Cannot unflatten
    unevenly sharded tensor"). Now q/o split by head, k/v whole on every rank, repeated to tp heads, and said so."""
    pytest.importorskip("transformers")
    plan = auto_plan(_qwen2(kv=kv), 4)
    attn = "model.layers.0.self_attn"
    assert plan.styles[f"{attn}.q_proj"] == "colwise" and plan.styles[f"{attn}.o_proj"] == "rowwise"
    assert plan.styles[f"{attn}.k_proj"] == plan.styles[f"{attn}.v_proj"] == "kv_replicated"
    assert plan.expanded_kv[attn] == (kv, 4, 8)  # kv divides tp: repeated to tp heads (each rank's group keeps one)
    assert f"{kv} key/value heads do not divide tp=4" in plan.replicated[f"{attn}.k_proj"]
    assert any("kv_replicated" in line for line in plan.describe())
    assert any(f"{kv} key/value heads do not divide tp=4" in line for line in plan.describe())
    assert plan.styles["model.layers.0.mlp.down_proj"] == "rowwise"
    assert not plan.indivisible_heads


def test_key_value_heads_that_do_not_divide_tp_are_repeated_per_query_head() -> None:
    """3 key/value heads, tp 4, 12 query heads: a rank's 3 query heads read two different key/value heads, so the
    keys are repeated to one per query head (12) and split by head."""
    pytest.importorskip("transformers")
    plan = auto_plan(_qwen2(heads=12, kv=3, width=96), 4)
    assert plan.expanded_kv["model.layers.0.self_attn"] == (3, 12, 8)


@pytest.mark.parametrize("kv", [2, 1, 3])
def test_repeated_key_value_heads_compute_what_the_model_computed(kv: int) -> None:
    """The repeat (a hook on k_proj / v_proj, ``num_key_value_groups`` lowered to match) is exact: the same logits and
    gradients in one process, with plain tensors (what a pipeline traces)."""
    pytest.importorskip("transformers")
    import torch

    from lightning_sgdtp.parallel.tensor.heads import repeat_key_value_heads

    torch.manual_seed(0)
    heads, width = (12, 96) if kv == 3 else (4, 32)
    model = _qwen2(heads=heads, kv=kv, width=width)
    tokens = torch.randint(0, 96, (2, 10))
    before = model(tokens).logits
    grads = torch.autograd.grad(before.square().sum(), list(model.parameters()))
    plan = auto_plan(model, 4)
    repeat_key_value_heads(model, plan.expanded_kv, plan.styles)
    assert model.model.layers[0].self_attn.num_key_value_groups == (1 if kv == 3 else heads // 4)
    after = model(tokens).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(after.square().sum(), list(model.parameters())), grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_tensor_parallel_size_that_divides_no_query_heads_is_refused_with_the_sizes_that_work() -> None:
    pytest.importorskip("transformers")
    from lightning_sgdtp.parallel.tensor.plan import check_heads

    plan = auto_plan(_qwen2(heads=6, kv=2, width=48), 4)
    assert plan.indivisible_heads == {6: "model.layers.0.self_attn"}
    with pytest.raises(TensorPlanError, match=r"tensor_parallel_size=4 does not divide the query heads \(6 heads in"):
        check_heads(plan, 8)
    try:
        check_heads(plan, 8)
    except TensorPlanError as err:
        assert "[1, 2]" in str(err), err  # 3 and 6 divide the heads, not the 8 ranks


def test_hybrid_sizes_tp_by_the_query_heads_when_the_model_is_known() -> None:
    """parallelism="hybrid" without tensor_parallel_size: the island's size (8), lowered to the largest divisor of it
    that the model splits over (12 heads: 4); an explicit size is left to the plan's refusal."""
    config = SGDTPConfig(parallelism="hybrid")
    heads_12 = lambda tp: 12 % tp == 0
    from lightning_sgdtp.mesh.dims import ParallelDims

    assert ParallelDims.resolve(config, 16, 8).tp == 8
    assert ParallelDims.resolve(config, 16, 8, fits=heads_12).tp == 4
    assert ParallelDims.resolve(SGDTPConfig(parallelism="hybrid", tensor_parallel_size=8), 16, 8, fits=heads_12).tp == 8
    assert (
        config.sizes_tp_from_model and not SGDTPConfig(parallelism="hybrid", tensor_parallel_size=2).sizes_tp_from_model
    )
