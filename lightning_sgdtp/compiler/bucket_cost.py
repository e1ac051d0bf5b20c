"""Buckets sized by measurement: a cost model of the link and of backward, and the bucket plan it prefers.

At setup the strategy measures, on every rank of the data-parallel group (a few tens of ms, once):

- the link: all-reduce time of a few message sizes, fitted to ``latency + bytes / bandwidth``;
- the device: matmul throughput (flop/s) and memory throughput (bytes/s).

The ranks take the slowest rank's figures (one MAX all-reduce), so that every rank plans the same buckets.

When the bucket pass rewrites a backward graph it knows the order in which gradients are produced. The model
estimates when each one is ready (the matmul flops and bytes written of the nodes before it) and chooses the
contiguous bucket boundaries that finish the last all-reduce earliest after the end of backward: one all-reduce
channel, bucket ``k`` starts when its last gradient exists and bucket ``k-1`` is done. That gives a first bucket
as soon as enough gradients exist to pay the latency, and a small last bucket, because whatever is sent after the
last matmul is exposed. The prediction goes into the plan next to what the timeline measures.

What the model leaves out: on CPU, gloo's all-reduce takes CPU time from the compute threads (measured in
``benchmarks/README.md``), so the measured exposure is above the prediction there.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

aten = torch.ops.aten
_MATMULS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm", aten.baddbmm.default: "bmm"}
#: The sizes timed at setup (bytes): latency-bound, middle, bandwidth-bound.
PROBE_BYTES = (16 * 2**10, 2**20, 8 * 2**20)


@dataclass(frozen=True)
class CostModel:
    """What the link and the device cost, as measured (seconds, bytes, flops)."""

    latency_s: float
    seconds_per_byte: float
    flops_per_s: float
    bytes_per_s: float

    def comm_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte

    def describe(self) -> dict[str, Any]:
        return {
            "all_reduce_latency_us": round(self.latency_s * 1e6, 1),
            "all_reduce_bandwidth_GBps": round(1 / self.seconds_per_byte / 1e9, 3) if self.seconds_per_byte else None,
            "compute_GFLOPs": round(self.flops_per_s / 1e9, 1),
            "memory_GBps": round(self.bytes_per_s / 1e9, 1),
        }

    def key(self) -> str:
        """Part of the compile caches' key (the plan depends on it)."""
        return ":".join(f"{v:.3g}" for v in asdict(self).values())


def _timed(fn: Any, device: torch.device, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def fit_link(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``seconds = latency + bytes * per_byte`` (both clamped at >= 0)."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(seconds) / n
    var = sum((x - mx) ** 2 for x in sizes)
    per_byte = max(sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / var, 0.0) if var else 0.0
    return max(my - per_byte * mx, 0.0), per_byte


def measure(group: dist.ProcessGroup | None, device: torch.device, reps: int = 5) -> CostModel:
    """Time the link and the device on every rank of ``group`` (a collective); every rank gets the slowest."""
    seconds = []
    for nbytes in PROBE_BYTES:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.barrier(group=group)
        seconds.append(_timed(lambda buf=buf: dist.all_reduce(buf, group=group), device, reps))
    latency, per_byte = fit_link(PROBE_BYTES, seconds)
    # its own generator: the user's random stream (dropout, the data's shuffles) must not depend on whether this job
    # measured or read the figures of an earlier one (a cold or a warm cache)
    a = torch.randn(512, 512, device=device, generator=torch.Generator(device=device).manual_seed(0))
    flops = 2 * 512**3 / _timed(lambda: a @ a, device, reps)
    big = torch.empty(4 * 2**20, device=device)
    copy = _timed(lambda: big.mul_(1.0), device, reps)
    mem = 2 * big.numel() * 4 / copy  # read + write
    # The slowest rank decides (1/throughput is what adds up): MAX over latency, s/byte, s/flop, s/byte of memory.
    figures = torch.tensor([latency, per_byte, 1 / flops, 1 / mem], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    latency, per_byte, s_per_flop, s_per_mem = figures.tolist()
    return CostModel(latency, per_byte, 1 / s_per_flop, 1 / s_per_mem)


def measure_once(
    group: dist.ProcessGroup | None, device: torch.device, folder: Path, key: str
) -> tuple[CostModel, Path | None]:
    """The cost model of ``key`` (the layout and the machine), measured by the first job and reused by the later
    ones that share the cache folder (a collective over ``group``).

    The measured figures vary from job to job (by 2x on a loaded CPU), and with them the bucket boundaries and so
    the compiled backward graphs: a later job that measured again would compile its graphs again. The group's
    first rank reads ``folder/KEY.json`` and broadcasts it (every rank plans from the same figures); without one,
    the group measures and the first rank records it, atomically. Returns the model and the file it came from
    (None: measured now). Delete the file, or change the cache folder, to measure again."""
    from lightning_sgdtp.trust.durable import write_atomically

    path = folder / f"{key}.json"
    first = dist.get_rank(group) == 0
    figures = torch.zeros(5, dtype=torch.float64, device=device)
    if first:
        try:
            data = json.loads(path.read_text())
            figures.copy_(torch.tensor([1.0] + [float(data[f.name]) for f in fields(CostModel)], dtype=torch.float64))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not recorded yet (or unreadable): measure
    dist.broadcast(figures, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if figures[0].item() == 1.0:
        return CostModel(*figures[1:].tolist()), path
    model = measure(group, device)
    if first:
        text = json.dumps(asdict(model) | {"key": key}, indent=1).encode()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda f: f.write(text))
        except OSError:
            pass  # a cache folder we cannot write was refused at setup already; never fail a step for this
    return model, None


# ----------------------------------------------------------------------------------------------- backward
def _hint(x: Any) -> float:
    """A size as a number: a symbolic size (a graph compiled for dynamic shapes) by the example it was traced with;
    never a guard."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):
        hint = x.node.hint
        return float(hint) if hint is not None else 1.0
    return float(x)


def node_seconds(node: Any, model: CostModel) -> float:
    """Estimated time of one backward graph node: matmul flops, else the bytes it writes (read + write)."""
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(val, torch.Tensor):
        return 0.0
    numel = _hint(val.numel())
    kind = _MATMULS.get(node.target)
    if kind is not None:
        a = node.args[1] if kind == "addmm" or node.target is aten.baddbmm.default else node.args[0]
        inner = _hint(a.meta["val"].shape[-1])
        return 2 * numel * inner / model.flops_per_s
    if node.target in (aten.convolution_backward.default, aten.convolution.default):
        return 6 * numel * 9 / model.flops_per_s  # a rough stand-in; convolutions are not our target here
    if node.target in (aten.view.default, aten.reshape.default, aten.t.default, aten.permute.default):
        return 0.0
    return 2 * numel * val.element_size() / model.bytes_per_s


@dataclass
class MeasuredPlan:
    """The bucket boundaries the cost model chose, and what it predicts."""

    buckets: list[list[int]]
    backward_s: float
    predicted_exposed_s: float
    single_bucket_exposed_s: float

    def describe(self, model: CostModel) -> dict[str, Any]:
        return {
            "rule": "measured",
            "cost_model": model.describe(),
            "predicted_backward_ms": round(self.backward_s * 1e3, 3),
            "predicted_exposed_ms": round(self.predicted_exposed_s * 1e3, 3),
            "one_bucket_exposed_ms": round(self.single_bucket_exposed_s * 1e3, 3),
        }


def plan_measured(
    ready_s: Sequence[float],
    nbytes: Sequence[int],
    dtypes: Sequence[str],
    backward_s: float,
    model: CostModel,
    max_bytes: int | None = None,
) -> MeasuredPlan:
    """Contiguous buckets over gradients in production order that minimise the time the last all-reduce ends.

    ``ready_s[i]``: when gradient ``i`` exists; ``backward_s``: when backward ends. Dynamic programming over
    prefixes: ``end[j]`` is the earliest time the first ``j`` gradients are all reduced; a bucket never mixes
    dtypes, and holds at most ``max_bytes`` unless it is one gradient (on CPU, a buffer above 32 MiB is mapped and
    unmapped by the allocator every step: see ``benchmarks/README.md``). Among plans that end equally early
    (within 1 %), the one with fewer buckets."""
    n = len(nbytes)
    if n == 0:
        return MeasuredPlan([], backward_s, 0.0, 0.0)
    prefix = [0]
    for b in nbytes:
        prefix.append(prefix[-1] + b)
    inf = float("inf")
    end = [0.0] + [inf] * n
    count = [0] + [0] * n
    choice = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):
            if dtypes[i] != dtypes[j - 1] or (
                max_bytes is not None and i < j - 1 and prefix[j] - prefix[i] > max_bytes
            ):
                break
            finish = max(ready_s[j - 1], end[i]) + model.comm_s(prefix[j] - prefix[i])
            better = finish < end[j] * 0.99 or (finish <= end[j] * 1.01 and count[i] + 1 < count[j])
            if end[j] == inf or better:
                end[j], count[j], choice[j] = finish, count[i] + 1, i
    buckets: list[list[int]] = []
    j = n
    while j > 0:
        i = choice[j]
        buckets.append(list(range(i, j)))
        j = i
    buckets.reverse()
    single = max(ready_s[-1], 0.0) + model.comm_s(prefix[-1])
    return MeasuredPlan(buckets, backward_s, max(end[n] - backward_s, 0.0), max(single - backward_s, 0.0))
