"""What the planner refuses before it plans (lightning_sgdtp/planner/inputs.py): each impossible input of `sgdtp plan`
(in-process) and of ``parallelism="auto"``, refused with its message; a valid input still plans. The command in a
fresh interpreter (exit code 2, the `sgdtp plan: ...` line): tests/integration/test_cli.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import REPO
from torch import nn

from lightning_sgdtp.cli import main
from lightning_sgdtp.config import SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.planner.auto import decide
from lightning_sgdtp.planner.cost import HARDWARE
from lightning_sgdtp.planner.inputs import CLI, STRATEGY, PlannerInputError, check_inputs, parse_fix
from lightning_sgdtp.planner.shapes import SHAPES, Shape

GPT = f"{REPO / 'examples' / 'gpt.py'}:GPTLightningModule"


class Stack(nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16)) for _ in range(blocks))
        self.head = nn.Linear(16, 64)
        self.example_input_array = torch.zeros(4, 8, dtype=torch.long)


class Declared(Stack):
    """A model whose own attribute states 0 layers (its stack empty)."""

    def __init__(self) -> None:
        super().__init__(blocks=0)
        self.n_layers = 0


#: What `sgdtp plan` passes for a valid command: every input given.
VALID = {
    "nodes": 2,
    "devices_per_node": 4,
    "memory": "80GB",
    "tokens": 128,
    "batch": 8,
    "global_batch": 64,
    "optimizer_states": 2,
    "rows": 12,
    "fixed": {"tp": 2, "sharding": "full", "shard_size": "node", "checkpointing": False, "pipeline": "gpipe"},
}
NO_LAYERS = "a model without layers has no blocks to split over stages, shard or checkpoint"
#: (what is wrong, the inputs that differ from VALID, the message with sgdtp plan's spelling)
REFUSED = [
    ("no nodes", {"nodes": 0}, "--nodes 0: a job runs on at least one node. Give --nodes 1 or more."),
    ("negative nodes", {"nodes": -2}, "--nodes -2: a job runs on at least one node. Give --nodes 1 or more."),
    (
        "no GPUs per node",
        {"devices_per_node": 0},
        (
            "--gpus-per-node 0: a node has at least one GPU. Give --gpus-per-node 1 or more (default 8, or the topology"
            " file's)."
        ),
    ),
    (
        "a count that is not whole",
        {"devices_per_node": 1.5},
        (
            "--gpus-per-node 1.5: a node has at least one GPU. Give --gpus-per-node 1 or more (default 8, or the topology"
            " file's)."
        ),
    ),
    (
        "a topology of other nodes",
        {"topology_devices": 8},
        (
            "--gpus-per-node 4 but the topology file has 8 GPUs: drop --gpus-per-node or record the topology of the nodes"
            " you plan for."
        ),
    ),
    (
        "no memory",
        {"memory": "0GB"},
        (
            "--gpu-memory: memory '0GB': give a positive number with a unit, e.g. '300MB', '80GB' or '1.5GiB' (units: B,"
            " KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        ),
    ),
    ("negative memory", {"memory": -1}, "--gpu-memory: memory -1: give a positive number with a unit, e.g. '300MB',"),
    ("no tokens", {"tokens": 0}, "--seq-len 0: a sample has at least one token. Give --seq-len 1 or more."),
    (
        "no samples",
        {"batch": 0},
        "--batch 0: each data-parallel replica runs at least one sample per step. Give --batch 1 or more.",
    ),
    (
        "a negative global batch",
        {"global_batch": -8},
        "--global-batch -8: a step runs at least one sample. Give --global-batch 1 or more.",
    ),
    (
        "negative optimizer states",
        {"optimizer_states": -1},
        (
            "--optimizer-states -1: a parameter has 0 or more optimizer state tensors (AdamW 2, SGD with momentum 1, SGD"
            " 0). Give --optimizer-states 0 or more."
        ),
    ),
    ("negative rows", {"rows": -1}, "--rows -1: the table prints 0 or more layouts. Give --rows 0 or more."),
    (
        "no tensor-parallel ranks",
        {"fixed": {"tp": 0}},
        (
            "--fix tp=0: tp counts tensor-parallel ranks, a whole number >= 1. Give tp=1 or more, or leave tp to the"
            " planner."
        ),
    ),
    (
        "a shard size that is no count",
        {"fixed": {"shard_size": "rack"}},
        (
            "--fix shard_size='rack': shard_size counts the ranks a parameter is sharded over, a whole number >= 1 (or"
            " 'node': the data-parallel ranks of one node). Give shard_size=1 or more, or leave shard_size to the planner."
        ),
    ),
    (
        "an unknown sharding",
        {"fixed": {"sharding": "zero3"}},
        (
            "--fix sharding='zero3': sharding is one of ['none', 'optimizer', 'full']. Give that, or leave sharding to the"
            " planner."
        ),
    ),
    (
        "checkpointing that is not a yes or no",
        {"fixed": {"checkpointing": 1}},
        "--fix checkpointing=1: checkpointing is true or false. Give that, or leave checkpointing to the planner.",
    ),
    (
        "an unknown field",
        {"fixed": {"zero": 3}},
        (
            "--fix zero=3: zero is not a field of a layout. Fix one of ['dp', 'tp', 'pp', 'sharding', 'shard_size',"
            " 'checkpointing', 'micro_batches', 'pipeline', 'stages_per_rank']."
        ),
    ),
    (
        "not a module",
        {"module": (Stack(), torch.zeros(1))},
        (
            "TARGET is a tuple, not a torch.nn.Module: the planner reads a model's parameters. Return the module alone"
            " from the factory (sgdtp diagnose's factories also return a batch)."
        ),
    ),
    (
        "no parameters",
        {"module": nn.Sequential(nn.ReLU())},
        (
            "TARGET (Sequential) has no parameters: there is nothing to split, shard or train. Return it with its layers"
            " built (call configure_model() in the factory if they are built there; on the meta device is fine)."
        ),
    ),
    (
        "0 layers",
        {"module": Declared()},
        f"TARGET (Declared) has 0 layers (Declared.n_layers=0): {NO_LAYERS}. Give n_layers 1 or more.",
    ),
]


@pytest.mark.parametrize(("inputs", "message"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_each_impossible_input_of_sgdtp_plan_is_refused_with_the_problem_and_the_fix(
    inputs: dict[str, Any], message: str
) -> None:
    check_inputs(module=Stack(), spelling=CLI, **VALID)  # the control: every input given, every one possible
    with pytest.raises(PlannerInputError) as err:
        check_inputs(**{"module": Stack(), "spelling": CLI, **VALID, **inputs})
    assert str(err.value).startswith(message)


def test_the_strategy_spells_the_same_problems_its_own_way() -> None:
    valid = {"module": Stack(), "world_size": 8, "devices_per_node": 4, "tokens": 8, "batch": 4, "memory": "1GB"}
    check_inputs(**valid)
    check_inputs(**{**valid, "world_size": 3})  # fewer ranks than one node has: one node, partly used
    refused = {
        "world_size": (10, "world size 10 over nodes of 4 devices: a job of more than one node runs on whole nodes,"),
        "devices_per_node": (0, "devices per node 0: a node has at least one GPU. Give devices per node 1 or more"),
        "memory": ("0MB", "max_memory_per_rank: memory '0MB': give a positive number with a unit"),
        "batch": (0, "example_input_array's samples 0: each data-parallel replica runs at least one sample per step."),
    }
    for key, (value, message) in refused.items():
        with pytest.raises(PlannerInputError) as err:
            check_inputs(**{**valid, key: value}, spelling=STRATEGY)
        assert str(err.value).startswith(message), str(err.value)


def test_fix_items_become_typed_fields_and_a_malformed_one_is_named() -> None:
    items = ["tp=8", "sharding=full", "checkpointing=true", "shard_size=node", "pipeline=1f1b", "dp=-1"]
    assert parse_fix(items) == {
        "tp": 8,
        "sharding": "full",
        "checkpointing": True,
        "shard_size": "node",
        "pipeline": "1f1b",
        "dp": -1,  # a count, refused by check_inputs with the field's message
    }
    with pytest.raises(PlannerInputError, match=r"^--fix 'tp': give NAME=VALUE with NAME one of \['dp'"):
        parse_fix(["tp"])


# ------------------------------------------------------------------------------------------------- sgdtp plan
#: (what is wrong, the flags, the start of the line on stderr)
COMMANDS = [
    ("no GPUs per node", ["--gpus-per-node", "0"], "sgdtp plan: --gpus-per-node 0: a node has at least one GPU."),
    ("no nodes", ["--nodes", "0"], "sgdtp plan: --nodes 0: a job runs on at least one node."),
    (
        "no nodes, with a topology",  # named as the nodes, not as a topology file that cannot be read
        ["--nodes", "-1", "--topology", str(REPO / "tests" / "data" / "topology" / "pcie-4x.txt")],
        "sgdtp plan: --nodes -1: a job runs on at least one node.",
    ),
    ("no memory", ["--gpu-memory", "0GB"], "sgdtp plan: --gpu-memory: memory '0GB': give a positive number"),
    ("no tokens", ["--seq-len", "0"], "sgdtp plan: --seq-len 0: a sample has at least one token."),
    ("no samples", ["--batch", "0"], "sgdtp plan: --batch 0: each data-parallel replica runs at least one sample"),
    ("a global batch of 0", ["--global-batch", "0"], "sgdtp plan: --global-batch 0: a step runs at least one sample."),
    ("a fixed size of 0", ["--fix", "pp=0"], "sgdtp plan: --fix pp=0: pp counts pipeline stages, a whole number >= 1."),
    ("a fixed size in words", ["--fix", "tp=two"], "sgdtp plan: --fix tp='two': tp counts tensor-parallel ranks,"),
]


@pytest.mark.parametrize(("flags", "line"), [c[1:] for c in COMMANDS], ids=[c[0] for c in COMMANDS])
def test_sgdtp_plan_refuses_an_impossible_flag(flags: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", GPT, *flags]) == 2
    out = capsys.readouterr()
    assert out.err.startswith(line) and out.err.count("\n") == 1 and out.out == "", out.err


def test_sgdtp_plan_refuses_a_model_without_parameters_or_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    factories = tmp_path / "factories.py"
    factories.write_text(
        "from torch import nn\n"
        "def empty():\n    return nn.Sequential(nn.ReLU())\n"
        "def pair():\n    return nn.Linear(2, 2), None\n"
    )
    assert main(["plan", f"{factories}:empty"]) == 2
    assert f"sgdtp plan: TARGET {factories}:empty (Sequential) has no parameters:" in capsys.readouterr().err
    assert main(["plan", f"{factories}:pair"]) == 2
    assert f"sgdtp plan: TARGET {factories}:pair is a tuple, not a torch.nn.Module" in capsys.readouterr().err
    assert main(["plan", f"{GPT.rpartition(':')[0]}:GPT"]) == 2  # needs a config: refused before any check
    assert "GPT() failed: TypeError" in capsys.readouterr().err
    # a named shape with 0 layers: built, then refused
    tiny = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2}
    monkeypatch.setitem(SHAPES, "tiny-0", Shape({**tiny, "num_hidden_layers": 0}, 8, 1, "no layers"))
    assert main(["plan", "tiny-0"]) == 2
    assert capsys.readouterr().err == (
        f"sgdtp plan: TARGET tiny-0 (LlamaForCausalLM) has 0 layers (LlamaForCausalLM.config.num_hidden_layers=0):"
        f" {NO_LAYERS}. Give num_hidden_layers 1 or more.\n"
    )
    monkeypatch.setitem(SHAPES, "tiny-2", Shape({**tiny, "num_hidden_layers": 2}, 8, 1, "two layers"))
    assert main(["plan", "tiny-2", "--gpus-per-node", "2", "--rows", "1"]) == 0  # the control: it plans
    assert "\nchosen: " in capsys.readouterr().out


def test_sgdtp_plan_still_plans_a_valid_command_and_argparse_refuses_a_count_that_is_no_number(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ["--nodes", "2", "--gpus-per-node", "3", "--seq-len", "16", "--batch", "2", "--optimizer-states", "0"]
    assert main(["plan", GPT, *flags, "--fix", "shard_size=node", "--fix", "sharding=full", "--rows", "0"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit and are built" in out and "\nchosen: dp 6, sharding=full in groups of 3" in out
    with pytest.raises(SystemExit) as exit_:
        main(["plan", GPT, "--gpus-per-node", "1.5"])
    assert exit_.value.code == 2 and "argument --gpus-per-node: invalid int value: '1.5'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ parallelism="auto"
def test_parallelism_auto_refuses_an_impossible_job_before_it_plans() -> None:
    auto = SGDTPConfig(parallelism="auto")
    resolved, _, _ = decide(auto, {"parallelism"}, Stack(), 4, 2, HARDWARE["h100"], 4)  # the control: it plans
    assert resolved.parallelism in ("data", "tensor", "hybrid")
    empty = Stack()
    empty.example_input_array = torch.zeros(0, 8, dtype=torch.long)
    cases = [
        (Stack(), 6, 4, "parallelism='auto': world size 6 over nodes of 4 devices: a job of more than one node"),
        (empty, 2, 2, "parallelism='auto': example_input_array's samples 0: each data-parallel replica runs at least"),
        (nn.Sequential(), 2, 2, "parallelism='auto': the module (Sequential) has no parameters: there is nothing to"),
        (Declared(), 2, 2, "parallelism='auto': the module (Declared) has 0 layers (Declared.n_layers=0): a model"),
    ]
    for module, world, per_node, message in cases:
        with pytest.raises(SGDTPConfigError) as err:
            decide(auto, {"parallelism"}, module, world, per_node, HARDWARE["h100"], 4)
        assert str(err.value).startswith(message), str(err.value)
