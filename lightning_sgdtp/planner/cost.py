"""The planner, part three: what one training step of a layout costs in time, and the activations it keeps. Pure.

Two kinds of plain data go in:

- :class:`ModelProfile`, read from the module (on the meta device: names and shapes only) and the batch: the
  repeated block's width and its parameters per stage, the parameters that multiply (matmul weights; a tied head
  counted where it multiplies), the vocabulary, tokens per sample, samples per rank.
- :class:`Hardware`: memory per device, the compute rate a step reaches, the memory rate of the optimizer update,
  and three links (a fast-link island such as NVLink, the node, the network between nodes), each a latency and a
  bus bandwidth. ``HARDWARE`` holds given figures for common machines (their sources in ``docs/planner.md``);
  :func:`measured_hardware` builds one from :class:`~lightning_sgdtp.compiler.bucket_cost.CostModel`, what the
  strategy measures on the ranks at setup.

The model of a step, on the slowest rank (every term is in :meth:`StepTime.to_dict` and printed by ``sgdtp plan``):

- compute: ``6 x parameters x tokens`` flops (forward 2, backward 4; 8 with activation checkpointing: the forward
  again) plus attention's ``12 x layers x sequence x width`` per token, over the ``tp`` ranks and the fullest stage's
  share of the blocks;
- the pipeline bubble: ``(stages - 1) / micro-batches`` of the stage's compute (1F1B and GPipe alike; divided by
  the stages per rank ``v`` with interleaved 1F1B, Narayanan et al. 2021), plus one point-to-point send of a
  micro-batch's activation (and of its gradient) per micro-batch and stage a rank holds;
- tensor parallel: per block, two all-reduces of the activation in forward and two in backward (Megatron's split;
  an all-gather and a reduce-scatter each with sequence parallel: the same bytes), not overlapped;
- data parallel: the all-reduce of the gradients (replicated), or the reduce-scatter of the gradients and the
  all-gather of the parameters (once per step with ``sharding="optimizer"``, in forward and again in backward with
  ``"full"``); ``Hardware.overlap`` of it hides behind backward (behind forward too for ``"full"``'s gathers),
  except the last block's share, which always waits;
- the optimizer update: 16 bytes read or written per parameter element held (AdamW: parameter, gradient, two moments).

Collectives over a group of ``g`` ranks cost ``latency + f x bytes / bus_bandwidth`` with the ring factor
``f = 2 (g - 1) / g`` for an all-reduce and ``(g - 1) / g`` for an all-gather or a reduce-scatter; a group takes the
slowest link it spans (``Hardware.link_for``). Ranks are laid out tensor-parallel innermost, then data parallel,
then pipeline stages (the order of ``mesh/dims.py`` and Megatron).

Activations per block (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4: ``s b h (34 + 5 a s / h)`` bytes in 16-bit, ``s b h (10 + 24 / t + 5 a s / (h t))`` with tensor
parallel, ``34 / t`` with sequence parallel): counted here in elements (17 per token and width, 5 + 12 / t under
tensor parallel), times the activation element size; the attention scores (``5 a s / h``) only where attention
keeps them (``Hardware.flash_attention`` False: the CPU's math kernel). With checkpointing a block keeps its input
only, plus one block's whole activations while it is recomputed. A pipeline's first stage keeps ``min(micro-batches,
stages)`` micro-batches in flight with 1F1B (all of them with GPipe; 1F1B's times ``1 + (stages - 1) / (stages x v)``
interleaved, Korthikanti et al. section 4.2.3); the last stage one (all of them with GPipe), plus the logits (tokens
x vocabulary, and their gradient in float32).

What it leaves out: compute that does not scale with parameters (normalisation, activation functions), mixture of
experts' routing (every expert is counted as run), the allocator's overhead, interleaved schedules of more than
2 stages per rank and zero-bubble schedules. ``benchmarks/planner_check.py`` measures how far the predictions are from real
steps on this machine.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from torch import nn

from lightning_sgdtp.parallel import TECHNIQUES
from lightning_sgdtp.planner.memory import Layout

ADAMW_BYTES_PER_ELEMENT = 16  # read p, g, m, v; write p, m, v (4 bytes each, roughly)


@dataclass(frozen=True)
class Link:
    """A level of the interconnect: one collective's fixed cost and its bus bandwidth (bytes/s)."""

    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class Hardware:
    """One kind of machine. ``island``: devices per fast-link island (an NVLink group; None: the whole node)."""

    name: str
    memory_bytes: int | None
    flops_per_s: float  # what a training step reaches (peak x the efficiency), not the peak
    memory_bytes_per_s: float
    island_link: Link
    node_link: Link
    network_link: Link
    island: int | None = None
    overlap: float = 1.0  # the share of data-parallel communication that hides behind compute
    flash_attention: bool = True
    source: str = ""

    def link_for(self, span: int, devices_per_node: int) -> Link:
        """The slowest link a group of ``span`` consecutive ranks crosses."""
        if span > devices_per_node:
            return self.network_link
        if self.island is not None and span > self.island:
            return self.node_link
        return self.island_link

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: PCIe between GPUs of one node that are not NVLinked (a given figure: PCIe 4 x16, about 20 GB/s in practice).
PCIE = Link(15e-6, 20e9)


def _gpu(name: str, memory_gb: int, peak: float, nvlink: float, network: float, source: str) -> Hardware:
    return Hardware(
        name=name,
        memory_bytes=memory_gb * 10**9,  # "80GB" taken as decimal: below what the device reports, never above
        flops_per_s=0.4 * peak,  # 40% of the dense bf16 peak: an assumption, stated in docs/planner.md
        memory_bytes_per_s=2.0e12,
        island_link=Link(10e-6, nvlink),
        node_link=Link(10e-6, nvlink),
        network_link=Link(20e-6, network),
        source=source,
    )


#: Given figures (not measured here): dense bf16 peak, NVLink and network bus bandwidth per GPU.
HARDWARE = {
    "h100": _gpu("h100", 80, 989e12, 360e9, 50e9, "H100 SXM 80GB: 989 TFLOP/s bf16 dense; NVLink 4 (900 GB/s"
                 " both ways), 360 GB/s bus bandwidth for all-reduce assumed; 400 Gb/s network per GPU"),
    "a100": _gpu("a100", 80, 312e12, 180e9, 25e9, "A100 SXM 80GB: 312 TFLOP/s bf16 dense; NVLink 3 (600 GB/s"
                 " both ways), 180 GB/s bus bandwidth assumed; 200 Gb/s network per GPU"),
}  # fmt: skip


def measured_hardware(cost: Any, memory_bytes: int | None = None, devices: str = "cpu") -> Hardware:
    """A :class:`Hardware` from the figures the strategy measures at setup (``bucket_cost.CostModel``: one
    all-reduce fit over the group, matmul and memory throughput). On CPU, gloo's collectives run on the same cores
    as the compute, so nothing is taken as hidden (``overlap=0``) and attention keeps its scores."""
    link = Link(cost.latency_s, 1 / cost.seconds_per_byte if cost.seconds_per_byte else float("inf"))
    cpu = devices == "cpu"
    return Hardware(
        name=f"measured ({devices})",
        memory_bytes=memory_bytes,
        flops_per_s=cost.flops_per_s,
        memory_bytes_per_s=cost.bytes_per_s,
        island_link=link,
        node_link=link,
        network_link=link,
        overlap=0.0 if cpu else 1.0,
        flash_attention=not cpu,
        source="measured at setup (compiler/bucket_cost.py)",
    )


# ------------------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class ModelProfile:
    """What the cost model reads of a model and its batch (plain numbers; :func:`profile` makes one)."""

    blocks: int
    width: int
    heads: int
    vocab: int
    matmul_params: int  # weights that multiply, per token (a tied head counted)
    block_matmul_params: int  # of which inside the block stack
    block_param_bytes: int  # the largest block's parameter bytes (a full gather, the last bucket)
    tokens: int  # per sample
    batch: int  # samples per rank per step
    activation_bytes: int = 4  # per activation element: 4 in float32, 2 under bf16-mixed

    def with_batch(self, batch: int | None = None, tokens: int | None = None) -> ModelProfile:
        return replace(self, batch=batch or self.batch, tokens=tokens or self.tokens)


def _width(block: nn.Module) -> int:
    """The block's residual width: the dimension its parameters' shapes share most (a norm's, every projection's)."""
    dims = Counter(d for p in block.parameters() for d in p.shape)
    return dims.most_common(1)[0][0] if dims else 1


def _heads(module: nn.Module, width: int) -> int:
    for m in module.modules():
        config = getattr(m, "config", None)
        for source in (config, m):
            for name in ("num_attention_heads", "n_head", "num_heads", "n_heads"):
                value = getattr(source, name, None)
                if isinstance(value, int) and value > 0:
                    return value
    return max(width // 64, 1)


def _matmul_params(module: nn.Module, among: set[int] | None = None) -> int:
    """Weights that multiply: every 2-D or larger parameter of a module that is not an embedding table, and an
    embedding table that another module also uses (a tied head). Counted once per module that uses it; only the
    parameters whose ids are in ``among``, if given."""
    return sum(
        p.numel()
        for _, m in module.named_modules(remove_duplicate=False)
        if not isinstance(m, nn.Embedding)
        for p in m._parameters.values()
        if p is not None and p.dim() >= 2 and (among is None or id(p) in among)
    )


def profile(
    module: nn.Module, tokens: int, batch: int, activation_bytes: int = 4, vocab: int | None = None
) -> ModelProfile:
    """The :class:`ModelProfile` of ``module`` (on any device, meta included) for ``batch`` samples of ``tokens``."""
    from lightning_sgdtp.parallel.checkpointing import find_block_stack

    found = find_block_stack(module)
    blocks = list(found[1].children()) if found is not None else [module]
    width = _width(blocks[0])
    matmul = _matmul_params(module)
    block_matmul = sum(_matmul_params(b) for b in blocks)
    tables = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    return ModelProfile(
        blocks=len(blocks) if found is not None else 1,
        width=width,
        heads=_heads(module, width),
        vocab=vocab if vocab is not None else max(tables, default=0),
        matmul_params=matmul,
        block_matmul_params=block_matmul,
        block_param_bytes=max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks),
        tokens=tokens,
        batch=batch,
        activation_bytes=activation_bytes,
    )


def tp_split_fraction(module: nn.Module, layout: Layout) -> float:
    """The share of the weights that multiply which the automatic tensor plan splits over ``layout.tp`` ranks
    (with sharding, embeddings and a head tied to one stay whole: ``memory``'s rule)."""
    if layout.tp == 1:
        return 1.0
    from lightning_sgdtp.planner.memory import _tp_split

    return _matmul_params(module, _tp_split(module, layout)) / max(_matmul_params(module), 1)


# ------------------------------------------------------------------------------------------------ collectives
def all_reduce_s(nbytes: float, group: int, link: Link) -> float:
    return 0.0 if group <= 1 or nbytes <= 0 else link.latency_s + 2 * (group - 1) / group * nbytes / link.bytes_per_s


def gather_s(nbytes: float, group: int, link: Link) -> float:
    """An all-gather (or a reduce-scatter) of ``nbytes`` whole over ``group`` ranks."""
    return 0.0 if group <= 1 or nbytes <= 0 else link.latency_s + (group - 1) / group * nbytes / link.bytes_per_s


def send_s(nbytes: float, link: Link) -> float:
    return link.latency_s + nbytes / link.bytes_per_s


# ------------------------------------------------------------------------------------------------ one step
@dataclass(frozen=True)
class Schedule:
    """What the search adds to a :class:`Layout`: activation checkpointing, micro-batches, the pipeline schedule
    (``pipeline_schedule``: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``) and the stages each rank holds with
    the interleaved one (``pipeline_stages_per_rank``)."""

    checkpointing: bool = False
    micro_batches: int = 1  # per step, with pipeline stages
    pipeline: str = "1f1b"
    stages_per_rank: int = 1

    def describe(self) -> str:
        """The pipeline schedule's words in a layout's name (1F1B, the default, unnamed)."""
        if self.pipeline == "gpipe":
            return ", GPipe"
        if self.pipeline == "interleaved_1f1b":
            return f", interleaved 1F1B x{self.stages_per_rank}"
        return ""


@dataclass
class StepTime:
    """Predicted seconds of one optimizer step on the slowest rank, by part."""

    compute: float
    bubble: float = 0.0
    pipeline_sends: float = 0.0
    tensor_parallel: float = 0.0
    data_parallel: float = 0.0  # exposed
    optimizer: float = 0.0
    #: What registered techniques send beyond the parts above (``Technique.traffic``, over their axis's link).
    technique_sends: float = 0.0
    samples: int = 1  # per step, over all ranks
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.bubble
            + self.pipeline_sends
            + self.tensor_parallel
            + self.data_parallel
            + self.optimizer
            + self.technique_sends
        )

    @property
    def seconds_per_sample(self) -> float:
        return self.total / max(self.samples, 1)

    def to_dict(self) -> dict[str, Any]:
        parts = ("compute", "bubble", "pipeline_sends", "tensor_parallel", "data_parallel", "optimizer")
        extra = {"technique_sends": self.technique_sends} if self.technique_sends else {}
        return {**{k: getattr(self, k) for k in parts}, **extra, "total": self.total, "samples": self.samples}


def stage_share(layout: Layout, blocks: int) -> float:
    """The fullest stage's share of the blocks (whole blocks; what a balanced split gives at best)."""
    return math.ceil(blocks / layout.pp) / blocks if layout.pp > 1 else 1.0


def step_time(
    model: ModelProfile,
    layout: Layout,
    hardware: Hardware,
    devices_per_node: int,
    held_param_bytes: int,
    schedule: Schedule = Schedule(),
    tp_split: float = 1.0,
) -> StepTime:
    """Seconds of one step of ``layout`` on the slowest rank; ``held_param_bytes``: the fullest rank's parameters
    before sharding divides them (``memory.predict_memory`` of the layout without sharding); ``tp_split``: the share
    of the weights that multiply which tensor parallel splits (:func:`tp_split_fraction`; the rest runs whole on
    every tensor-parallel rank)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    tokens = model.batch * model.tokens
    share = stage_share(layout, model.blocks)
    # the fullest stage: its share of whole blocks, or an even share of everything (the head included) if larger
    stage_params = max(model.block_matmul_params * share, model.matmul_params / pp) if pp > 1 else model.matmul_params
    split = 6 * stage_params * tp_split + 12 * model.blocks * share * model.tokens * model.width  # + attention
    whole = 6 * stage_params * (1 - tp_split)  # what the tensor plan leaves replicated (a tied head, ...)
    flops = split / tp + whole
    # what is not a matmul (norms, activations, residual adds, dropout): ~20 activation-sized tensors read or
    # written per block in forward, twice that in backward; not divided by tensor parallel (no sequence parallel)
    moved = 60 * model.width * model.activation_bytes * model.blocks * share
    if schedule.checkpointing:
        flops, moved = flops * 8 / 6, moved * 4 / 3
    compute = tokens * (flops / hardware.flops_per_s + moved / hardware.memory_bytes_per_s)
    out = StepTime(compute=compute, samples=model.batch * dp)
    act = tokens * model.width * model.activation_bytes  # one activation of the whole rank's batch
    stage_blocks = math.ceil(model.blocks * share)
    if pp > 1:
        m, v = schedule.micro_batches, schedule.stages_per_rank
        out.bubble = compute * (pp - 1) / (m * v)
        link = hardware.link_for(tp * dp * pp, devices_per_node)
        out.pipeline_sends = 2 * m * v * send_s(act / m / tp, link)
    if tp > 1:
        link = hardware.link_for(tp, devices_per_node)
        m = schedule.micro_batches if pp > 1 else 1
        per_block = (6 if schedule.checkpointing else 4) * m * all_reduce_s(act / m, tp, link)
        # and the stack's input and output (the embedding's, the head's gradient)
        out.tensor_parallel = stage_blocks * per_block + 2 * m * all_reduce_s(act / m, tp, link)
    if dp > 1:
        out.data_parallel = _data_parallel_s(model, layout, hardware, devices_per_node, held_param_bytes, schedule, out)
    held_elements = held_param_bytes / 4 / (dp if layout.sharding != "none" else 1)
    out.optimizer = held_elements * ADAMW_BYTES_PER_ELEMENT / hardware.memory_bytes_per_s
    for technique in TECHNIQUES:  # the registered techniques' own traffic (today's are priced above: none)
        sent = technique.traffic(layout, act)
        if sent and technique.axis is not None:
            out.technique_sends += send_s(sent, hardware.link_for(layout.size(technique.axis.name), devices_per_node))
    return out


def _data_parallel_s(
    model: ModelProfile,
    layout: Layout,
    hardware: Hardware,
    devices_per_node: int,
    held: int,
    schedule: Schedule,
    step: StepTime,
) -> float:
    """The data-parallel communication left exposed after what hides behind compute. With pipeline stages a
    sharded stage reduce-scatters every micro-batch, and ``"full"`` gathers its parameters every micro-batch too."""
    tp, dp = layout.tp, layout.dp
    shard = layout.shard_group
    m = schedule.micro_batches if layout.pp > 1 else 1
    link = hardware.link_for(tp * dp, devices_per_node)
    shard_link = hardware.link_for(tp * shard, devices_per_node)
    if layout.sharding == "none":
        comm = all_reduce_s(held, dp, link)
    else:
        calls = 3 * m if layout.sharding == "full" else 1 + m  # gathers (forward, backward) + reduce-scatters
        comm = calls * gather_s(held, shard, shard_link)
        if shard < dp:  # the replicas' gradient shards all-reduced across the groups
            comm += all_reduce_s(held / shard, dp // shard, link)
    last = comm * min(model.block_param_bytes / max(held, 1), 1.0)  # the last block's share waits in any case
    # what runs beside it: backward (2/3 of the compute) for the gradients; forward too for "full"'s first gathers
    hidden = hardware.overlap * step.compute * (1.0 if layout.sharding == "full" else 2 / 3)
    return max(comm - hidden, last, 0.0)


# ------------------------------------------------------------------------------------------------ activations
def activation_bytes(model: ModelProfile, layout: Layout, hardware: Hardware, schedule: Schedule = Schedule()) -> int:
    """Bytes of activations on the fullest rank at the peak of a step (the first stage with a pipeline)."""
    tp, pp = layout.tp, layout.pp
    m = schedule.micro_batches if pp > 1 else 1
    tokens = model.batch * model.tokens / m
    h, a, s = model.width, model.heads, model.tokens
    per_token = 17.0 if tp == 1 else 5 + 12 / tp
    if not hardware.flash_attention:
        per_token += 2.5 * a * s / h / tp
    one_block = tokens * h * per_token * model.activation_bytes
    blocks = math.ceil(model.blocks * stage_share(layout, model.blocks))
    in_flight = float(min(m, pp) if pp > 1 else 1)
    if pp > 1 and schedule.pipeline == "gpipe":
        in_flight = m  # every forward before the first backward
    elif pp > 1 and schedule.pipeline == "interleaved_1f1b":
        in_flight *= 1 + (pp - 1) / (pp * schedule.stages_per_rank)

    def kept(micro_batches: float) -> float:
        if schedule.checkpointing:  # each block's input per micro-batch in flight, one block recomputed at a time
            return micro_batches * blocks * tokens * h * model.activation_bytes + one_block
        return micro_batches * blocks * one_block

    logits = tokens * model.vocab / tp * (model.activation_bytes + 4)  # and their float32 gradient
    if pp == 1:  # the one rank holds both
        return int(kept(1) + logits)
    # the first stage holds the most micro-batches in flight; the last, one (every one with GPipe) and the logits
    last = kept(m if schedule.pipeline == "gpipe" else 1) + logits
    return int(max(kept(in_flight), last))
