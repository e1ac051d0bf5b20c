"""A traced stage graph must not name a value ``self``.

``torch.export`` names the output of a call to a submodule after its attribute. BERT's attention keeps its
self-attention as ``BertAttention.self``, so the unflattened stage graph holds a node named ``self``. FX's code
generation (torch 2.13) does not reserve that name, and the generated ``forward`` of the attention reads

    self = self.self(hidden_states, mask)
    output = self.output(mask, self)       # AttributeError: 'Tensor' object has no attribute 'output'

Torch's pipeline runs a stage through ``fx.Interpreter`` (which never sees the name) unless the stage is compiled:
Dynamo runs the generated code, so every BERT-family model failed at its first pipeline step. The stages here are
compiled, so :func:`rename_self_nodes` renames those nodes (``self_``) in every graph under torch's split graph and
regenerates the code before the stages are built. Only names change; the graphs compute what they computed.
"""

from __future__ import annotations

from torch import fx


def rename_self_nodes(split_gm: fx.GraphModule) -> list[str]:
    """Rename each node called ``self`` in the graphs of ``split_gm``'s modules; returns ``"module: new name"``."""
    renamed: list[str] = []
    for name, module in split_gm.named_modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        nodes = [node for node in graph.nodes if node.name == "self"]
        for node in nodes:
            node._rename("self_")  # the graph's namespace makes the name unique
            renamed.append(f"{name}: {node.name}")
        # an unflattened submodule (torch.export's InterpreterModule) keeps its generated code in graph_module
        code = module if isinstance(module, fx.GraphModule) else module.__dict__.get("graph_module")
        if nodes and code is not None:
            code.recompile()
    return renamed
