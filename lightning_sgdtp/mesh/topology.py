"""What the hardware looks like, and a rank layout that puts tensor-parallel groups on the fastest links.

Everything here is a pure function over plain data (no Lightning, no ``torch.distributed``), so it can be
tested from recorded ``nvidia-smi topo -m`` output. The only side effects are in :func:`links_from_nvml`
(NVML queries) and :func:`detect` (NVML, then a ``nvidia-smi topo -m`` subprocess).

Conventions: global rank = ``node * devices_per_node + local_rank`` and local rank ``r`` drives local device ``r``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_sgdtp.parallel.technique import divisors

__all__ = [
    "LINK_RANK",
    "Topology",
    "TopologyError",
    "detect",
    "link_rank",
    "links_from_nvml",
    "parse_nvidia_smi_topo",
    "rank_layout",
]

Links = tuple[tuple[str, ...], ...]


class TopologyError(ValueError):
    """A topology or a requested tensor-parallel size that cannot work."""


_NV_RE = re.compile(r"NV(\d+)")
_NV_BASE = 6  # NV<n> ranks _NV_BASE + n: NV1 sits just above LOCAL.
_SELF_RANK = 1_000_000
_MAX_LISTED_NV = 64

#: nvidia-smi link code -> speed rank, higher = faster. ``NV<n>`` is listed for n <= 64; :func:`link_rank`
#: also ranks any larger n and unknown codes (0, lowest). "SOC" is the pre-2017 nvidia-smi name of "SYS".
LINK_RANK: dict[str, int] = {
    "SYS": 1,
    "SOC": 1,
    "NODE": 2,
    "PHB": 3,
    "PXB": 4,
    "PIX": 5,
    "LOCAL": 6,
    **{f"NV{n}": _NV_BASE + n for n in range(1, _MAX_LISTED_NV + 1)},
    "X": _SELF_RANK,
}


def link_rank(code: str) -> int:
    """Speed rank of one link code (see :data:`LINK_RANK`); any ``NV<n>`` ranks by n, unknown codes rank 0."""
    code = code.strip()
    if code in LINK_RANK:
        return LINK_RANK[code]
    match = _NV_RE.fullmatch(code)
    if match and int(match.group(1)) >= 1:
        return min(_NV_BASE + int(match.group(1)), _SELF_RANK - 1)
    return 0


def _is_nvlink(code: str) -> bool:
    match = _NV_RE.fullmatch(code.strip())
    return bool(match) and int(match.group(1)) >= 1


@dataclass(frozen=True)
class Topology:
    """Devices of one kind on ``num_nodes`` identical nodes, with the link matrix of one node."""

    num_nodes: int
    devices_per_node: int
    device_type: str  # "cuda" or "cpu"
    links: Links  # devices_per_node x devices_per_node link codes within one node, "X" on the diagonal
    source: str  # "nvml", "nvidia-smi", "cpu", "recorded" or "unknown"

    def __post_init__(self) -> None:
        for name in ("num_nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        if self.device_type not in ("cuda", "cpu"):
            raise TopologyError(f"device_type must be 'cuda' or 'cpu', got {self.device_type!r}")
        links = tuple(tuple(str(code).strip() for code in row) for row in self.links)
        n = self.devices_per_node
        if len(links) != n or any(len(row) != n for row in links):
            shape = f"{len(links)} x {sorted({len(row) for row in links})}"
            raise TopologyError(f"links must be a {n} x {n} matrix (devices_per_node={n}), got {shape}")
        bad = [i for i in range(n) if links[i][i] != "X"]
        if bad:
            raise TopologyError(f"links must have 'X' on the diagonal; device(s) {bad} do not")
        object.__setattr__(self, "links", links)

    @classmethod
    def from_nvidia_smi(cls, text: str, num_nodes: int = 1, devices_per_node: int | None = None) -> Topology:
        """A cuda topology from recorded ``nvidia-smi topo -m`` text (source "recorded"); first N GPUs if given."""
        links = parse_nvidia_smi_topo(text)
        n = len(links) if devices_per_node is None else devices_per_node
        if n > len(links):
            raise TopologyError(f"devices_per_node={n} but the recording has only {len(links)} GPU(s)")
        return cls(num_nodes, n, "cuda", _submatrix(links, list(range(n))), "recorded")

    def _rank(self, i: int, j: int) -> int:
        return min(link_rank(self.links[i][j]), link_rank(self.links[j][i]))

    def _nvlinked(self, i: int, j: int) -> bool:
        return _is_nvlink(self.links[i][j]) and _is_nvlink(self.links[j][i])

    def has_nvlink(self) -> bool:
        """Whether any two local devices are joined by NVLink."""
        n = self.devices_per_node
        return any(self._nvlinked(i, j) for i in range(n) for j in range(i + 1, n))

    def islands(self) -> list[list[int]]:
        """Groups of local devices joined pairwise by NVLink (CPU: all local devices); sorted, by first element.

        Each connected component of the NVLink graph is one island when every pair in it is NVLinked. A component
        that is not fully connected (e.g. the DGX-1 hybrid cube mesh) is split by repeatedly taking its largest
        fully connected subset (ties: lexicographically smallest). A GPU without NVLink is its own island.
        """
        n = self.devices_per_node
        if self.device_type == "cpu":
            return [list(range(n))]
        adjacent = [{j for j in range(n) if j != i and self._nvlinked(i, j)} for i in range(n)]
        islands: list[list[int]] = []
        seen: set[int] = set()
        for start in range(n):
            if start in seen:
                continue
            component, stack = {start}, [start]
            while stack:
                for j in adjacent[stack.pop()] - component:
                    component.add(j)
                    stack.append(j)
            seen |= component
            islands.extend(_clique_partition(sorted(component), adjacent))
        return sorted(islands)

    def auto_tp_size(self) -> int:
        """A tensor-parallel size that keeps every group on the fastest links.

        CPU, or GPUs without any NVLink: ``devices_per_node`` (intra-node links still beat the network). Otherwise
        the largest s such that each node splits into groups of s devices that each lie inside one NVLink island,
        i.e. the gcd of the island sizes (the island size when all islands are equal; at least 1).
        """
        if self.device_type == "cpu" or not self.has_nvlink():
            return self.devices_per_node
        return math.gcd(*(len(island) for island in self.islands()))

    def describe(self) -> str:
        """One line, e.g. ``2 node(s) x 8 cuda devices, NVLink islands [[0..7]] (from nvidia-smi)``."""
        head = f"{self.num_nodes} node(s) x {self.devices_per_node} {self.device_type} devices"
        islands = "[" + ", ".join(_format_group(island) for island in self.islands()) + "]"
        if self.device_type == "cpu":
            body = f"one local island per node {islands}"
        elif self.has_nvlink():
            body = f"NVLink islands {islands}"
        else:
            body = "no NVLink (PCIe/system links only)"
        return f"{head}, {body} (from {self.source})"


def _clique_partition(component: list[int], adjacent: list[set[int]]) -> list[list[int]]:
    """Split a connected NVLink component into fully connected groups, largest first."""
    remaining = list(component)
    groups: list[list[int]] = []
    while remaining:
        best = _largest_clique(remaining, adjacent)
        groups.append(best)
        remaining = [d for d in remaining if d not in best]
    return groups


def _largest_clique(candidates: list[int], adjacent: list[set[int]]) -> list[int]:
    """The largest fully connected subset of ``candidates`` (sorted); ties: lexicographically smallest."""
    best: list[int] = [candidates[0]]

    def grow(members: list[int], pool: list[int]) -> None:
        nonlocal best
        if len(members) > len(best):
            best = list(members)
        for k, device in enumerate(pool):
            if len(members) + len(pool) - k <= len(best):
                return  # cannot beat the best any more (and ties keep the earlier, smaller one)
            members.append(device)
            grow(members, [d for d in pool[k + 1 :] if d in adjacent[device]])
            members.pop()

    grow([], list(candidates))
    return best


def _format_group(group: Sequence[int]) -> str:
    if len(group) >= 3 and list(group) == list(range(group[0], group[-1] + 1)):
        return f"[{group[0]}..{group[-1]}]"
    return "[" + ", ".join(str(d) for d in group) + "]"


def _submatrix(links: Links, indices: Sequence[int]) -> Links:
    return tuple(tuple(links[i][j] for j in indices) for i in indices)


# --------------------------------------------------------------------------------------------------- nvidia-smi

_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU_RE = re.compile(r"GPU(\d+)")


def _cells(line: str, tabbed: bool) -> list[str]:
    return [cell.strip() for cell in line.split("\t")] if tabbed else line.split()


def parse_nvidia_smi_topo(text: str) -> Links:
    """Parse the GPU-to-GPU part of `nvidia-smi topo -m` output into a link matrix (only the GPU<n> rows/columns;
    ignore NIC/mlx columns, CPU Affinity, NUMA Affinity, GPU NUMA ID columns and the Legend).

    Reads the tab-separated layout nvidia-smi prints (and, failing tabs, whitespace-separated copies whose GPU
    columns come first). Raises :class:`TopologyError` when no complete, square GPU table is found.
    """
    lines = _ANSI_RE.sub("", text).replace("\r", "").split("\n")
    tabbed = any("\t" in line for line in lines)
    header_at = None
    for k, line in enumerate(lines):
        cells = _cells(line, tabbed)
        # The header row has an empty first cell (it starts with a tab / blanks); data rows start with their label.
        if line[:1].isspace() and any(_GPU_RE.fullmatch(cell) for cell in cells):
            header_at = k
            break
    if header_at is None:
        raise TopologyError("no GPU table found in the `nvidia-smi topo -m` output")
    header = _cells(lines[header_at], tabbed)
    if not tabbed or header[:1] != [""]:
        header = [""] + [cell for cell in header if cell]
    columns = {int(m.group(1)): col for col, cell in enumerate(header) if (m := _GPU_RE.fullmatch(cell))}
    n = len(columns)
    if sorted(columns) != list(range(n)):
        raise TopologyError(f"GPU columns are not GPU0..GPU{n - 1}: {sorted(columns)}")
    if not tabbed and sorted(columns.values()) != list(range(1, n + 1)):
        raise TopologyError("whitespace-separated output must list the GPU columns first")
    rows: dict[int, tuple[str, ...]] = {}
    for line in lines[header_at + 1 :]:
        if not line.strip():
            break  # the table ends at the first blank line; the Legend follows
        cells = _cells(line, tabbed)
        label = _GPU_RE.fullmatch(cells[0])
        if not label:
            continue  # NIC / mlx5 rows
        gpu = int(label.group(1))
        if gpu in rows or gpu >= n:
            raise TopologyError(f"unexpected or repeated row GPU{gpu} in the `nvidia-smi topo -m` output")
        try:
            codes = tuple(cells[columns[j]] for j in range(n))
        except IndexError:
            raise TopologyError(f"row GPU{gpu} has fewer cells than the header") from None
        if any(not code for code in codes) or codes[gpu] != "X":
            raise TopologyError(f"row GPU{gpu} is malformed: {list(codes)}")
        rows[gpu] = codes
    if sorted(rows) != list(range(n)):
        raise TopologyError(f"expected rows GPU0..GPU{n - 1}, found {sorted(rows)}")
    return tuple(rows[i] for i in range(n))


def _links_from_nvidia_smi() -> Links | None:
    """`nvidia-smi topo -m`, parsed; None when the tool is missing, fails, times out or prints no GPU table."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    try:
        return parse_nvidia_smi_topo(proc.stdout)
    except TopologyError:
        return None


# ---------------------------------------------------------------------------------------------------------- NVML

# nvmlDeviceGetTopologyCommonAncestor levels (NVML_TOPOLOGY_*) -> nvidia-smi codes.
_NVML_PCIE_CODES = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_BUS_RE = re.compile(r"(?:([0-9a-f]+):)?([0-9a-f]+):([0-9a-f]+)\.([0-9a-f]+)")


def _bus_key(bus_id: Any) -> Any:
    """Normalise a PCI bus id ("00000000:18:00.0", b"0000:18:00.0", ...) for comparison."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    text = str(bus_id).strip("\x00 ").lower()
    match = _BUS_RE.fullmatch(text)
    if not match:
        return text
    return tuple(int(part, 16) if part else 0 for part in match.groups())


def links_from_nvml() -> Links | None:
    """With `pynvml` (package nvidia-ml-py) importable and GPUs present: build the same matrix (NV<n> from the
    number of active NVLinks between two GPUs via nvmlDeviceGetNvLinkState/nvmlDeviceGetNvLinkRemotePciInfo, else
    the PCIe relation from nvmlDeviceGetTopologyCommonAncestor mapped to PIX/PXB/PHB/NODE/SYS). Return None when
    pynvml or GPUs are missing or any NVML call fails.

    NVLinks whose far end is not a GPU of this box (an NVSwitch) count as switch links: two GPUs that both have
    switch links are NV<min of their switch-link counts> apart, as nvidia-smi shows on NVSwitch systems (DGX
    A100/H100: NV12/NV18 everywhere), unless nvmlDeviceGetP2PStatus says NVLink P2P between them is not OK.
    """
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    nvml_error = getattr(pynvml, "NVMLError", RuntimeError)
    try:
        pynvml.nvmlInit()
    except (nvml_error, OSError, AttributeError):  # no driver library / no GPU / not NVML at all
        return None
    try:
        return _nvml_links(pynvml)
    except (nvml_error, OSError, AttributeError, TypeError, ValueError):  # failed call, or an old pynvml
        return None
    finally:
        with contextlib.suppress(nvml_error, OSError):
            pynvml.nvmlShutdown()


def _nvml_links(nv: Any) -> Links | None:
    count = int(nv.nvmlDeviceGetCount())
    if count < 1:
        return None
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    by_bus = {_bus_key(nv.nvmlDeviceGetPciInfo(handle).busId): i for i, handle in enumerate(handles)}
    nvml_error = getattr(nv, "NVMLError", RuntimeError)
    no_such_link = {getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(nv, "NVML_ERROR_INVALID_ARGUMENT", 2)}
    enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
    not_a_switch = {getattr(nv, "NVML_NVLINK_DEVICE_TYPE_GPU", 0), getattr(nv, "NVML_NVLINK_DEVICE_TYPE_IBMNPU", 1)}
    remote_type: Callable[..., Any] | None = getattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", None)

    direct = [[0] * count for _ in range(count)]
    to_switch = [0] * count
    for i, handle in enumerate(handles):
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                state = nv.nvmlDeviceGetNvLinkState(handle, link)
            except nvml_error as exc:
                if getattr(exc, "value", None) in no_such_link:
                    continue  # no NVLink on this GPU, or past its last link
                raise
            if state != enabled:
                continue
            j = by_bus.get(_bus_key(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
            if j is not None:
                if j != i:
                    direct[i][j] += 1
                continue
            kind = None
            if remote_type is not None:
                try:
                    kind = remote_type(handle, link)
                except nvml_error:  # older drivers: unknown, treat like a switch
                    kind = None
            if kind not in not_a_switch:
                to_switch[i] += 1

    p2p_status: Callable[..., Any] | None = getattr(nv, "nvmlDeviceGetP2PStatus", None)

    def switch_p2p_ok(a: int, b: int) -> bool:
        if p2p_status is None:
            return True
        try:
            status = p2p_status(handles[a], handles[b], getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", 2))
        except nvml_error:  # cannot confirm; trust the switch links
            return True
        return status == getattr(nv, "NVML_P2P_STATUS_OK", 0)

    matrix = [["X"] * count for _ in range(count)]
    for i in range(count):
        for j in range(i + 1, count):
            links = max(direct[i][j], direct[j][i])
            if links:
                code = f"NV{links}"
            elif to_switch[i] and to_switch[j] and switch_p2p_ok(i, j):
                code = f"NV{min(to_switch[i], to_switch[j])}"
            else:
                level = nv.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                code = _NVML_PCIE_CODES.get(int(level), "SYS")
            matrix[i][j] = matrix[j][i] = code
    return tuple(tuple(row) for row in matrix)


# -------------------------------------------------------------------------------------------------------- detect


def _visible_indices(devices_per_node: int, available: int) -> list[int] | None:
    """Physical GPU indices of local devices 0..N-1: CUDA_VISIBLE_DEVICES when it lists plain indices, else 0..N-1.

    NVML and nvidia-smi number GPUs by PCI bus id, as CUDA does on boxes of identical GPUs. UUID entries in
    CUDA_VISIBLE_DEVICES cannot be mapped without NVML, so they fall back to 0..N-1. None: not enough GPUs.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    indices = list(range(devices_per_node))
    if visible is not None:
        entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
        if entries and all(entry.isdigit() for entry in entries):
            indices = [int(entry) for entry in entries][:devices_per_node]
    if len(indices) < devices_per_node or any(i >= available for i in indices):
        return None
    return indices


def detect(device_type: str, devices_per_node: int, num_nodes: int) -> Topology:
    """cpu -> one island per node (source "cpu"). cuda -> links_from_nvml(), else `nvidia-smi topo -m`
    (subprocess, timeout 10 s) parsed, else assume all "SYS" (source "unknown"). Only the first devices_per_node
    GPUs count (sub-matrix; the GPUs named by CUDA_VISIBLE_DEVICES when it lists indices).
    """
    n = devices_per_node
    if device_type == "cpu":
        links = tuple(tuple("X" if i == j else "LOCAL" for j in range(n)) for i in range(n))
        return Topology(num_nodes, n, "cpu", links, "cpu")
    if device_type != "cuda":
        raise TopologyError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    sources: tuple[tuple[str, Callable[[], Links | None]], ...] = (
        ("nvml", links_from_nvml),
        ("nvidia-smi", _links_from_nvidia_smi),
    )
    for source, read in sources:
        full = read()
        if full is None:
            continue
        indices = _visible_indices(n, len(full))
        if indices is not None:
            return Topology(num_nodes, n, "cuda", _submatrix(full, indices), source)
    links = tuple(tuple("X" if i == j else "SYS" for j in range(n)) for i in range(n))
    return Topology(num_nodes, n, "cuda", links, "unknown")


# --------------------------------------------------------------------------------------------------- rank layout


def _divisors(n: int) -> str:
    found = [str(d) for d in divisors(n)]
    return found[0] if len(found) == 1 else ", ".join(found[:-1]) + " or " + found[-1]


def _local_groups(topology: Topology, tp: int) -> list[list[int]]:
    """Greedy: the lowest unassigned device plus the tp-1 others that maximise the group's slowest link."""
    n = topology.devices_per_node
    if tp == 1:
        return [[d] for d in range(n)]
    rank = [[topology._rank(i, j) for j in range(n)] for i in range(n)]
    unassigned = list(range(n))
    groups: list[list[int]] = []
    while unassigned:
        best = _best_group(unassigned[0], unassigned[1:], rank, tp)
        groups.append(best)
        unassigned = [d for d in unassigned if d not in best]
    if sorted(d for group in groups for d in group) != list(range(n)) or any(len(g) != tp for g in groups):
        raise TopologyError(f"internal error: bad tensor-parallel groups {groups} for {n} devices")  # pragma: no cover
    return groups


def _best_group(first: int, rest: list[int], rank: list[list[int]], tp: int) -> list[int]:
    """``first`` plus the tp-1 devices of ``rest`` that maximise the group's slowest link; ties: lowest indices.

    Depth-first in lexicographic order with pruning: a branch whose slowest link is already no better than the
    best group found so far is dropped, and the search stops once a group reaches ``first``'s fastest link.
    """
    ceiling = max(rank[first][d] for d in rest)  # no group with `first` can beat its best link
    best: list[int] = []
    best_score = -1

    def search(start: int, members: list[int], score: int) -> None:
        nonlocal best, best_score
        if len(members) == tp:
            if score > best_score:  # strict: ties keep the earlier, lexicographically smaller group
                best, best_score = list(members), score
            return
        need = tp - len(members)
        for k in range(start, len(rest) - need + 1):
            if best_score >= ceiling:
                return
            candidate = rest[k]
            new_score = min(score, *(rank[candidate][m] for m in members))
            if new_score <= best_score:
                continue
            members.append(candidate)
            search(k + 1, members, new_score)
            members.pop()

    search(0, [first], _SELF_RANK)
    return best


def rank_layout(topology: Topology, tp: int) -> list[list[int]]:
    """The data-parallel x tensor-parallel grid of GLOBAL ranks: result[d][t] = global rank at dp index d, tp
    index t. Global rank = node * devices_per_node + local_rank, and local rank r drives local device r.

    Each row (one tensor-parallel group, ascending) lies inside one node and maximises the slowest link inside
    the group, chosen greedily from the lowest unassigned device; ties keep ranks in ascending order, so an
    all-NVLink box or CPU gives plain row-major (as torch's init_device_mesh). Rows go node by node, then by
    first rank; every node uses the same local layout. Raises :class:`TopologyError` for a tp that is < 1,
    larger than a node, or not a divisor of devices_per_node.
    """
    n = topology.devices_per_node
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise TopologyError(f"tensor_parallel_size must be an integer, got {tp!r}")
    if tp < 1:
        raise TopologyError(f"tensor_parallel_size={tp} is invalid: it must be at least 1 (1 = no tensor parallel)")
    if tp > n:
        raise TopologyError(
            f"tensor_parallel_size={tp} spans more than one node ({n} devices per node): tensor parallel needs the "
            f"fastest links; use a tensor_parallel_size that divides {n}, e.g. {topology.auto_tp_size()}"
        )
    if n % tp:
        raise TopologyError(
            f"tensor_parallel_size={tp} does not divide {n} (the devices per node): each node must split evenly "
            f"into tensor-parallel groups that never span nodes; use a tensor_parallel_size that divides {n} "
            f"({_divisors(n)}), e.g. {topology.auto_tp_size()}"
        )
    local = _local_groups(topology, tp)
    return [[node * n + d for d in group] for node in range(topology.num_nodes) for group in local]
