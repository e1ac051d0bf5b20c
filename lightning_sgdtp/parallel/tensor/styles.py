"""The tensor-parallel styles torch's ``torch.distributed.tensor.parallel`` lacks, as ``ParallelStyle`` subclasses.

- :class:`Conv1DColwise` / :class:`Conv1DRowwise`: transformers' ``Conv1D`` (GPT-2, ...) is a linear layer with its
  weight stored transposed, ``(in, out)``, and computed with ``addmm``. torch's ``ColwiseParallel`` /
  ``RowwiseParallel`` accept only ``nn.Linear`` / ``nn.Embedding``; their input and output handling is right as is,
  only the dimension each parameter is split on swaps. So these subclasses replace the partition and nothing else.
- :class:`ReplicateOnMesh`: a module's parameters as replicated DTensors, its inputs and outputs as they are (a norm
  that reads DTensor activations). torch 2.13 has no public style for it; ``distribute_module`` does the work.
- :class:`ReplicatedKeyValue`: the key or value projection of an attention whose key/value heads tp does not divide
  (grouped-query attention with fewer key/value heads than tp ranks; multi-query: one). Its parameters are replicated
  DTensors over the tensor-parallel group; every rank computes every key/value head (a narrow projection:
  ``kv_heads / heads`` of the query projection's work); a hook put on first (``plan.repeat_key_value_heads``)
  repeats the heads to a count tp divides (tp, or one per query head) and the module's ``num_key_value_groups``
  drops to match; the output is then split by head (a local slice), so each rank's query heads read theirs and
  the attention runs split by head as any other. The gradients are whole on every rank: the slice's backward
  gathers each rank's part (one all-gather), the repeat's sums the copies. Megatron and vLLM hold only the heads a
  rank reads (``tp / kv_heads`` copies of each); here each rank holds all of them, a few percent of a block's
  parameters (docs/tensor-parallel.md), so that state dicts, checkpoints and ``pretrained`` keep the model's shapes.
  (Left as a replicated DTensor, the keys would reach the attention whole and be split inside it, and its
  backward failed: a head-split gradient cannot be viewed back into the ``(kv, groups)`` heads of the repeat.)
- :class:`ExpertParallel`: mixture-of-experts experts stored as 3-D parameters ``(experts, ..., ...)`` in
  transformers' experts convention (``num_experts``; a forward ``(hidden_states, top_k_index, top_k_weights)`` that
  skips expert ids ``>= num_experts``: the sentinel transformers' own expert parallelism uses). Each rank of the
  tensor-parallel group owns ``num_experts / tp`` whole experts (the parameters are DTensors split on dim 0, so the
  state dict, the optimizer and checkpoints see the whole tensors). Inside a tensor-parallel group every rank holds
  the same tokens, so no token moves: each rank runs its experts on the tokens routed to them (the others get the
  sentinel and weight 0) and one all-reduce sums the experts' outputs, as a row-parallel layer's. (An all-to-all
  dispatch is what expert parallelism needs when the ranks hold *different* tokens, over the data-parallel group:
  not built; see docs/tensor-parallel.md.) Written by hand: torch has no expert-parallel style.
- :class:`Colwise` / :class:`Rowwise` (and the ``Conv1D`` twins): torch's styles, except that a plain output
  leaves the module as a fresh tensor. torch's ``to_local()`` returns a view made inside a custom autograd Function,
  which autograd forbids to modify in place: ``mlp_output += attention_output`` (Falcon's parallel attention) or
  ``x = wte(ids); x += wpe(pos)`` failed, in eager and at compile ("Output 0 of _ToTorchTensor is a view and is
  being modified inplace"). The copy (:func:`fresh`) is one element-wise pass, which the compiler folds into the
  next element-wise kernel (the residual add).
- :class:`VocabParallelEmbedding`: the token embedding split by vocabulary, computed inside the module: this rank's
  rows looked up, the other ranks' tokens zeroed, one all-reduce. torch's ``RowwiseParallel`` keeps the mask of the
  other ranks' tokens in the output's placement (``_MaskPartial``), a Python object outside the graph, until the
  output hook reduces it: when the compiler puts the lookup and the reduction in different graphs (a graph break
  anywhere in the model makes it compile the embedding's ``forward`` alone: BLOOM, whose attention folds the heads
  into the batch dimension), the mask crossed from one graph's fake tensors into the next ("Mixing fake modes").
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


def fresh(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor of its own: torch's ``to_local()`` is a view made inside a custom autograd Function, which
    autograd refuses to modify in place. A copy (one element-wise pass; fused into the next kernel when compiled)."""
    return t.clone() if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t


def _fresh_output(prepare: Any, *args: Any) -> Any:
    return fresh(prepare(*args))


class Rowwise(RowwiseParallel):
    """torch's ``RowwiseParallel``; a plain output is a fresh tensor (:func:`fresh`), safe to modify in place."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, mesh: Any) -> Any:
        return _fresh_output(RowwiseParallel._prepare_output_fn, output_layouts, use_local_output, mod, outputs, mesh)


class Colwise(ColwiseParallel):
    """torch's ``ColwiseParallel``; a plain output (gathered: an LM head) is a fresh tensor, safe to modify in place."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, mesh: Any) -> Any:
        return _fresh_output(ColwiseParallel._prepare_output_fn, output_layouts, use_local_output, mod, outputs, mesh)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D``: ``weight`` of shape ``(in, out)``, ``bias`` of ``(out,)``, attribute ``nf`` = out."""
    w = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.ndim == 2 and hasattr(module, "nf")


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a transformers ``Conv1D``; None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _distribute(module: nn.Module, mesh: Any, placements: dict[str, Any], src_data_rank: int | None) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


def _distribute_linear(style: ColwiseParallel | RowwiseParallel, module: nn.Module, mesh: Any) -> nn.Module:
    """What torch's styles do for an ``nn.Linear`` (their ``_apply``), for a ``Conv1D``: the style's partition and
    its own input and output handling."""
    return distribute_module(
        module,
        mesh,
        style._partition_linear_fn,
        partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
        partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
    )


class Conv1DColwise(Colwise):
    """``ColwiseParallel`` for a ``Conv1D``: the weight ``(in, out)`` split on dim 1, the bias on dim 0."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        _distribute(module, device_mesh, {"weight": Shard(1), "bias": Shard(0)}, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return _distribute_linear(self, module, device_mesh)


class Conv1DRowwise(Rowwise):
    """``RowwiseParallel`` for a ``Conv1D``: the weight ``(in, out)`` split on dim 0, the bias replicated."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
        _distribute(module, device_mesh, {"weight": Shard(0), "bias": Replicate()}, self.src_data_rank)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return _distribute_linear(self, module, device_mesh)


class ReplicateOnMesh(ParallelStyle):
    """Every parameter of the module a ``Replicate()`` DTensor on the mesh (``distribute_module``'s default)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return distribute_module(module, device_mesh)


def _as_replicated(mod: nn.Module, inputs: tuple[Any, ...], mesh: Any) -> tuple[Any, ...]:
    x, *rest = inputs
    if isinstance(x, DTensor):
        x = x.redistribute(mesh, [Replicate()])
    elif isinstance(x, torch.Tensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return (x, *rest)


def _split_by_head(mod: nn.Module, outputs: Any, mesh: Any) -> Any:
    return outputs.redistribute(mesh, [Shard(-1)]) if isinstance(outputs, DTensor) else outputs


class ReplicatedKeyValue(ParallelStyle):
    """A key/value projection whose heads tp does not divide: replicated weights and input; its output (repeated
    per query-head group by ``plan.repeat_key_value_heads``'s hook, which runs first) split by head (see the module
    doc)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_as_replicated, output_fn=_split_by_head)


def expert_count(module: nn.Module) -> int | None:
    """The number of experts of a module in transformers' experts convention (3-D parameters, ``num_experts``,
    ``_is_expert_parallel``), or None."""
    own = [p for p in module._parameters.values() if p is not None]
    count = getattr(module, "num_experts", None)
    if not own or not isinstance(count, int) or not hasattr(module, "_is_expert_parallel"):
        return None
    return count if all(p.ndim == 3 and p.shape[0] == count for p in own) else None


def _replicated_input(t: torch.Tensor, mesh: Any) -> torch.Tensor:
    """``t`` (the same on every rank) as this rank's input to a partial computation: its gradient is summed over the
    group in backward (each rank's experts contribute only their part of it)."""
    if not isinstance(t, torch.Tensor) or not t.requires_grad:
        return t
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class ExpertParallel(ParallelStyle):
    """Whole experts per rank over a tensor-parallel group whose ranks hold the same tokens (see the module doc)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.nn.utils.stateless import _reparametrize_module

        total = expert_count(module)
        size, rank = device_mesh.size(), device_mesh.get_local_rank()
        assert total is not None and total % size == 0, (type(module).__name__, total, size)
        local = total // size
        names = [n for n, p in module._parameters.items() if p is not None]
        _distribute(module, device_mesh, dict.fromkeys(names, Shard(0)), None)
        # transformers' convention: ids >= num_experts are not this rank's (skipped or given weight 0)
        module.num_experts = local
        module._is_expert_parallel = True
        forward = type(module).forward
        first = rank * local

        def expert_parallel_forward(
            hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
        ) -> torch.Tensor:
            ids = top_k_index - first
            others = (ids < 0) | (ids >= local)
            ids = ids.masked_fill(others, local)
            weights = _replicated_input(top_k_weights, device_mesh).masked_fill(others, 0.0)
            hidden = _replicated_input(hidden_states, device_mesh)
            # this rank's experts: the attribute read, which under sharding='full' gathers them over dp first (the
            # stored parameter is then a (dp, tp) DTensor whose local piece is part of one expert's slice)
            shards = {n: getattr(module, n).to_local() for n in names}
            with _reparametrize_module(module, shards):
                out = forward(module, hidden, ids, weights)
            # the experts' outputs summed over the group (one all-reduce, as a row-parallel layer's)
            return fresh(DTensor.from_local(out, device_mesh, [Partial()], run_check=False).full_tensor())

        module.forward = expert_parallel_forward
        return module


class _VocabParallelLookup(nn.Embedding):
    """``nn.Embedding``'s lookup, split by vocabulary: this rank's rows, the other ranks' tokens zeroed, one
    all-reduce. A split token embedding's class becomes a subclass of its own class and of this one (as FSDP2's
    ``fully_shard`` does), so a subclass that scales the lookup (``super().forward(ids) * scale``: Gemma, MBart) keeps
    its forward and gets this lookup through ``super()``."""

    _sgdtp_vocab: tuple[int, int, int | None, Any]  # first row, rows, padding row (local), mesh

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # the attribute read: under sharding='full', gathered over dp by it first
        if not isinstance(weight, DTensor):  # traced whole for a pipeline (plain parameters): the layer as is
            return nn.Embedding.forward(self, input)
        first, rows, pad, mesh = self._sgdtp_vocab
        ids = input.to_local() if isinstance(input, DTensor) else input  # token ids: the same on every rank
        local = ids - first
        others = (local < 0) | (local >= rows)
        out = F.embedding(
            local.masked_fill(others, 0), weight.to_local(), pad, self.max_norm, self.norm_type,
            self.scale_grad_by_freq, self.sparse,
        )  # fmt: skip
        out = out.masked_fill(others.unsqueeze(-1), 0.0)
        # each token's row from the rank that holds it: one all-reduce (its backward hands each rank its gradient). A
        # replicated DTensor, like the module's other tensors (distribute_module replicates its buffers: Gemma's
        # scale), until the output hook hands the plain tensor out
        return DTensor.from_local(out, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])


_LOOKUP_CLASSES: dict[type, type] = {nn.Embedding: _VocabParallelLookup}


class VocabParallelEmbedding(Rowwise):
    """An ``nn.Embedding`` (or a subclass) split by vocabulary (``Shard(0)``: each rank holds ``num_embeddings / tp``
    rows), the lookup computed inside the module (:class:`_VocabParallelLookup`, see the module doc). Its output is a
    plain, whole tensor of its own, as with torch's ``RowwiseParallel``, whose input and output hooks it keeps: a
    pipeline stage's traced copy of the layer runs those (parallel/pipeline/stage_tensor.py)."""

    def __init__(self) -> None:
        super().__init__(input_layouts=Replicate())  # token ids: the same on every rank

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, mesh: Any) -> Any:
        if not isinstance(outputs, DTensor):  # a subclass's forward that made it plain itself
            return fresh(outputs)
        return Rowwise._prepare_output_fn(output_layouts, use_local_output, mod, outputs, mesh)

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        assert isinstance(module, nn.Embedding) and module.num_embeddings % device_mesh.size() == 0
        super()._apply(module, device_mesh)  # the weight Shard(0), torch's input and output hooks
        rows = module.num_embeddings // device_mesh.size()
        first = device_mesh.get_local_rank() * rows
        pad = module.padding_idx
        module._sgdtp_vocab = (
            first,
            rows,
            pad - first if pad is not None and first <= pad < first + rows else None,
            device_mesh,
        )
        cls = type(module)
        if cls not in _LOOKUP_CLASSES:
            _LOOKUP_CLASSES[cls] = type(f"VocabParallel{cls.__name__}", (cls, _VocabParallelLookup), {})
        module.__class__ = _LOOKUP_CLASSES[cls]
        return module
