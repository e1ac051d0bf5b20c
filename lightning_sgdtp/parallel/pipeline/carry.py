"""Values a later pipeline stage needs are carried stage to stage, so every stage receives only from the one before.

A transformers model computes a few values once, before its block stack, and gives them to every block: the
rotary ``cos``/``sin``, the attention mask, the position ids. Traced by ``torch.distributed.pipelining``, they are
outputs of stage 0 that stages 1, 2, 3 ... each receive straight from stage 0. torch 2.13 trains neither way:
the interleaved schedules (``PipelineScheduleMulti``: ``interleaved_1f1b``) refuse it ("only supports
adjacent-stage communication"), and with one stage per rank a value sent to several stages fails at the first
backward ("Backward of skip connections not supported yet", ``stage.py``): an unchanged Llama, Qwen2 or GPT-2 could
not be trained on 3 or more stages.

:func:`carry_stage_inputs` edits torch's split graph before the stages are built: a value made by stage ``i`` and
read by stage ``j > i + 1`` becomes an extra input and an extra output (the same tensor, unchanged) of every stage
between them, and stage ``j`` reads it from stage ``j - 1``. The graph computes what it computed before (the
pass-through is the identity; autograd hands a carried value's gradient back the same way), and what the stages
hold does not change. Written here because torch's pipelining has no such option; the edit is the one its
``_PipelineStage`` reads: the stage submodules' placeholders and output, and the top graph's ``call_module``
arguments and ``getitem`` users, in output order.

**Model inputs** read first by a later stage are routed the same way, with every schedule: torch's stages give the
micro-batch to stage 0 only (``_PipelineStage``: a later stage's inputs are what it receives). An encoder-decoder
cut inside its encoder (T5: the decoder's token ids are first read where the decoder starts) gets them as extra
inputs of stage 0, in the model's argument order, carried to the stage that reads them.

The cost: a carried tensor crosses each boundary between the two stages once per micro-batch (forward, and its
gradient backward if it is floating point), instead of one send. Rotary tables and masks are small next to the
hidden states.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import fx


def _stage_calls(split_gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in split_gm.graph.nodes if n.op == "call_module"]


def _producer(node: Any) -> fx.Node | None:
    """The stage call whose output ``node`` is (through ``getitem``), or None (a model input, a constant)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "call_module" else None


class _Stage:
    """One stage: its call in the top graph and its submodule's graph, with the edits a pass-through needs."""

    def __init__(self, split_gm: fx.GraphModule, call: fx.Node) -> None:
        self.top = split_gm.graph
        self.call = call
        self.module: fx.GraphModule = split_gm.get_submodule(str(call.target))
        self.graph = self.module.graph
        self.output = next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def _outputs_as_tuple(self) -> list[Any]:
        """The stage's outputs, made a tuple if it returned one value (its readers then read item 0)."""
        result = self.output.args[0]
        if isinstance(result, (tuple, list)):
            return list(result)
        readers = list(self.call.users)
        with self.top.inserting_after(self.call):
            first = self.top.call_function(operator.getitem, (self.call, 0))
        first.meta = dict(self.call.meta)
        for reader in readers:
            reader.replace_input_with(self.call, first)
        return [result]

    def take_model_input(self, value: fx.Node, order: dict[fx.Node, int]) -> None:
        """Stage 0 only: make the model input ``value`` one of this stage's inputs, at its place in the model's
        argument order (torch calls stage 0 with the micro-batch's arguments, in order)."""
        args = list(self.call.args)
        if value in args:
            return
        at = sum(1 for a in args if order[a] < order[value])
        placeholders = self.placeholders()
        anchor = placeholders[at - 1] if at else None
        where = self.graph.inserting_after(anchor) if anchor is not None else self.graph.inserting_before()
        with where:
            placeholder = self.graph.placeholder(str(value.target))
        placeholder.meta["val"] = value.meta.get("val")
        args.insert(at, value)
        self.call.args = tuple(args)

    def order_inputs_as_sent(self) -> bool:
        """Put this stage's inputs in the order of the previous stage's outputs. torch's stage sends its input
        gradients back in input order and the previous stage receives them in output order: a carried value
        read before one of the previous stage's own outputs would pair a gradient with a buffer of another size
        (gloo: "Received data size doesn't match expected size")."""
        args = list(self.call.args)
        slot = [a.args[1] if isinstance(a, fx.Node) and a.target is operator.getitem else -1 for a in args]
        order = sorted(range(len(args)), key=lambda i: slot[i])
        if order == list(range(len(args))):
            return False
        placeholders = self.placeholders()
        body = next(n for n in self.graph.nodes if n.op != "placeholder")
        for i in order:
            body.prepend(placeholders[i])
        self.call.args = tuple(args[i] for i in order)
        return True

    def pass_through(self, value: fx.Node, example: Any, name: str) -> fx.Node:
        """Make ``value`` (a top-graph node) an input of this stage and the same tensor an output; return the
        top-graph node of that output."""
        outputs = self._outputs_as_tuple()
        if value in self.call.args:  # the stage reads it itself: send on what it received
            placeholder = self.placeholders()[list(self.call.args).index(value)]
        else:
            with self.graph.inserting_after(self.placeholders()[-1]):
                placeholder = self.graph.placeholder(f"carried_{name}")
            placeholder.meta["val"] = example
            self.call.args = (*self.call.args, value)
        self.output.args = (tuple(outputs + [placeholder]),)
        last_reader = list(self.call.users)[-1]  # the getitems, in output order: the new one goes after them
        with self.top.inserting_after(last_reader):
            carried = self.top.call_function(operator.getitem, (self.call, len(outputs)))
        carried.meta["val"] = example
        return carried


def carry_stage_inputs(split_gm: fx.GraphModule) -> list[str]:
    """Rewrite torch's split graph so that stage 0 reads every model input a stage reads and each later stage only
    what the stage before it sends, with every schedule. Returns what was carried (``"submod_0 output getitem_1 ->
    stage 3 (through 1, 2)"``), for the plan."""
    calls = _stage_calls(split_gm)
    index = {call: i for i, call in enumerate(calls)}
    inputs = {n: i for i, n in enumerate(n for n in split_gm.graph.nodes if n.op == "placeholder")}
    stages = [_Stage(split_gm, call) for call in calls]
    carried: dict[tuple[fx.Node, int], fx.Node] = {}  # (value, stage) -> that stage's pass-through output of it
    notes: list[str] = []
    edited: set[int] = set()  # stages whose code is generated again once, at the end
    for j, stage in enumerate(stages):
        examples = [p.meta.get("val") for p in stage.placeholders()]
        for position, value in enumerate(list(stage.call.args)):
            producer = _producer(value)
            if value in inputs and j > 0:  # a model input: stage 0 takes it, the stages before j carry it
                stages[0].take_model_input(value, inputs)
                edited.add(0)
                source = -1
            elif producer is None or index[producer] >= j - 1:
                continue
            else:
                source = index[producer]
            current = value
            for k in range(source + 1, j):
                if (value, k) not in carried:
                    carried[(value, k)] = stages[k].pass_through(current, examples[position], value.name)
                    edited.add(k)
                current = carried[(value, k)]
            stage.call.update_arg(position, current)
            made = f"model input {value.name}" if source < 0 else f"{calls[source].name} output {value.name}"
            notes.append(f"{made} -> stage {j} (through {', '.join(map(str, range(source + 1, j)))})")
    edited |= {j for j, stage in enumerate(stages) if j > 0 and stage.order_inputs_as_sent()}
    for k in edited:
        stages[k].module.recompile()
    split_gm.graph.lint()
    split_gm.recompile()
    return notes
