"""lightning_sgdtp.mesh.topology on recorded `nvidia-smi topo -m` output (tests/data/topology/*.txt) and fake NVML.

Recordings: a DGX H100 (8 x NV18 through NVSwitch, 12 NICs, driver 535+ layout with NIC Legend and GPU NUMA ID),
a DGX-1 V100 (hybrid cube mesh: NV1/NV2, the NVLink graph is connected but not complete), an A100-PCIe box with
NVLink bridges on pairs (0,1),(2,3),(4,5),(6,7), a 4-GPU box with NVLink pairs (0,3),(1,2) (row-major would be
wrong), and a PCIe-only 4-GPU box on two sockets (older layout with the NIC named mlx5_0 in the header).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import types

import pytest
from helpers import DATA as TEST_DATA

from lightning_sgdtp.mesh import topology as topo
from lightning_sgdtp.mesh.topology import (
    LINK_RANK,
    Topology,
    TopologyError,
    detect,
    link_rank,
    links_from_nvml,
    parse_nvidia_smi_topo,
    rank_layout,
)

DATA = TEST_DATA / "topology"
DOCTOR_H100 = TEST_DATA / "doctor" / "h100-8x-nvlink.json"


def _text(name: str) -> str:
    return (DATA / f"{name}.txt").read_text()


def _matrix(rows: str) -> tuple[tuple[str, ...], ...]:
    """'X NV4 | NV4 X' -> (('X', 'NV4'), ('NV4', 'X'))."""
    return tuple(tuple(row.split()) for row in rows.split("|"))


def _recorded(name: str, num_nodes: int = 1) -> Topology:
    return Topology.from_nvidia_smi(_text(name), num_nodes=num_nodes)


def _cuda(rows: str, num_nodes: int = 1) -> Topology:
    links = _matrix(rows)
    return Topology(num_nodes, len(links), "cuda", links, "recorded")


@pytest.fixture(autouse=True)
def _no_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


# ------------------------------------------------------------------------------------------------ link ranks

RANK_ORDER = ["X", "NV18", "NV12", "NV4", "NV2", "NV1", "LOCAL", "PIX", "PXB", "PHB", "NODE", "SYS", "N/A"]


@pytest.mark.parametrize("faster, slower", list(itertools.pairwise(RANK_ORDER)))
def test_link_rank_order(faster: str, slower: str) -> None:
    assert link_rank(faster) > link_rank(slower)
    if slower in LINK_RANK:
        assert LINK_RANK[faster] > LINK_RANK[slower]


@pytest.mark.parametrize(
    "code, expected",
    [("NV18", LINK_RANK["NV18"]), (" PIX ", LINK_RANK["PIX"]), ("SOC", LINK_RANK["SYS"]), ("NV0", 0), ("XYZ", 0)],
)
def test_link_rank_values(code: str, expected: int) -> None:
    assert link_rank(code) == expected


def test_link_rank_any_nvlink_count() -> None:
    assert "NV100" not in LINK_RANK
    assert LINK_RANK["NV64"] < link_rank("NV100") < LINK_RANK["X"]


# ------------------------------------------------------------------------------------------------- parsing

PAIRS_4X = "X PHB SYS NV4 | PHB X NV4 SYS | SYS NV4 X PHB | NV4 SYS PHB X"
PCIE_4X = "X PIX SYS SYS | PIX X SYS SYS | SYS SYS X PIX | SYS SYS PIX X"
PAIRS_8X = (
    "X NV12 NODE NODE SYS SYS SYS SYS | NV12 X NODE NODE SYS SYS SYS SYS | "
    "NODE NODE X NV12 SYS SYS SYS SYS | NODE NODE NV12 X SYS SYS SYS SYS | "
    "SYS SYS SYS SYS X NV12 NODE NODE | SYS SYS SYS SYS NV12 X NODE NODE | "
    "SYS SYS SYS SYS NODE NODE X NV12 | SYS SYS SYS SYS NODE NODE NV12 X"
)
DGX1 = (
    "X NV1 NV1 NV2 NV2 SYS SYS SYS | NV1 X NV2 NV1 SYS NV2 SYS SYS | NV1 NV2 X NV2 SYS SYS NV1 SYS | "
    "NV2 NV1 NV2 X SYS SYS SYS NV1 | NV2 SYS SYS SYS X NV1 NV1 NV2 | SYS NV2 SYS SYS NV1 X NV2 NV1 | "
    "SYS SYS NV1 SYS NV1 NV2 X NV2 | SYS SYS SYS NV1 NV2 NV1 NV2 X"
)
H100 = " | ".join(" ".join("X" if i == j else "NV18" for j in range(8)) for i in range(8))


@pytest.mark.parametrize(
    "name, expected",
    [
        ("dgx-h100-8x-nvlink", H100),
        ("dgx1-v100-8x-hybrid-cube-mesh", DGX1),
        ("nvlink-pairs-4x", PAIRS_4X),
        ("nvlink-pairs-8x", PAIRS_8X),
        ("pcie-4x", PCIE_4X),
    ],
)
def test_parse_recordings(name: str, expected: str) -> None:
    assert parse_nvidia_smi_topo(_text(name)) == _matrix(expected)


def test_recordings_carry_the_noise_the_parser_must_skip() -> None:
    h100 = _text("dgx-h100-8x-nvlink")
    for noise in ("NIC11", "mlx5_0", "CPU Affinity", "NUMA Affinity", "GPU NUMA ID", "Legend:", "\n  X    = Self"):
        assert noise in h100
    assert "\tmlx5_0\t" in _text("pcie-4x")  # the older layout names the NIC in the header


def test_parse_whitespace_copy_and_ansi() -> None:
    # A copy-paste that lost its tabs, with the underline escapes nvidia-smi prints on a terminal.
    text = "\x1b[4m        GPU0    GPU1    GPU2    GPU3    CPU Affinity    NUMA Affinity\x1b[0m\n"
    for i, row in enumerate(_matrix(PAIRS_4X)):
        text += f"GPU{i}     " + "    ".join(f" {c} " if c == "X" else c for c in row) + "    0-15    0\n"
    assert parse_nvidia_smi_topo(text) == _matrix(PAIRS_4X)


def test_parse_windows_line_endings() -> None:
    assert parse_nvidia_smi_topo(_text("pcie-4x").replace("\n", "\r\n")) == _matrix(PCIE_4X)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no GPU table"),
        ("No devices were found\n", "no GPU table"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n", r"expected rows GPU0..GPU1, found \[0\]"),
        ("\tGPU0\tGPU1\nGPU0\tNV4\tNV4\nGPU1\tNV4\t X \n", "row GPU0 is malformed"),
        ("\tGPU0\tGPU2\nGPU0\t X \tNV4\nGPU2\tNV4\t X \n", "not GPU0..GPU1"),
        ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tNV4\t X \n", "fewer cells"),
    ],
)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        parse_nvidia_smi_topo(text)


def test_doctor_recording_is_partial_and_rejected() -> None:
    # tests/data/doctor/h100-8x-nvlink.json keeps only the first two rows of the H100 table.
    text = json.loads(DOCTOR_H100.read_text())["gpu_topology"]
    with pytest.raises(TopologyError, match=r"expected rows GPU0..GPU7, found \[0, 1\]"):
        parse_nvidia_smi_topo(text)


# -------------------------------------------------------------------------------- islands / auto / describe


@pytest.mark.parametrize(
    "name, islands, auto",
    [
        ("dgx-h100-8x-nvlink", [[0, 1, 2, 3, 4, 5, 6, 7]], 8),
        ("dgx1-v100-8x-hybrid-cube-mesh", [[0, 1, 2, 3], [4, 5, 6, 7]], 4),
        ("nvlink-pairs-4x", [[0, 3], [1, 2]], 2),
        ("nvlink-pairs-8x", [[0, 1], [2, 3], [4, 5], [6, 7]], 2),
        ("pcie-4x", [[0], [1], [2], [3]], 4),
    ],
)
def test_islands_and_auto_tp(name: str, islands: list[list[int]], auto: int) -> None:
    t = _recorded(name, num_nodes=2)
    assert t.islands() == islands
    assert t.auto_tp_size() == auto


@pytest.mark.parametrize(
    "rows, islands, auto",
    [
        # One NV island of 4 and two NV pairs: groups of 2 fit inside every island, groups of 4 do not.
        (
            (
                "X NV4 NV4 NV4 SYS SYS SYS SYS | NV4 X NV4 NV4 SYS SYS SYS SYS | NV4 NV4 X NV4 SYS SYS SYS SYS | "
                "NV4 NV4 NV4 X SYS SYS SYS SYS | SYS SYS SYS SYS X NV2 SYS SYS | SYS SYS SYS SYS NV2 X SYS SYS | "
                "SYS SYS SYS SYS SYS SYS X NV2 | SYS SYS SYS SYS SYS SYS NV2 X"
            ),
            [[0, 1, 2, 3], [4, 5], [6, 7]],
            2,
        ),
        # An island of 3 next to a GPU without NVLink: only tp=1 keeps every group inside an island.
        ("X NV2 NV2 PHB | NV2 X NV2 PHB | NV2 NV2 X PHB | PHB PHB PHB X", [[0, 1, 2], [3]], 1),
        # A single GPU.
        ("X", [[0]], 1),
    ],
)
def test_islands_of_mixed_sizes(rows: str, islands: list[list[int]], auto: int) -> None:
    t = _cuda(rows)
    assert t.islands() == islands
    assert t.auto_tp_size() == auto


@pytest.mark.parametrize(
    "topology, line",
    [
        (
            lambda: _recorded("dgx-h100-8x-nvlink", num_nodes=2),
            "2 node(s) x 8 cuda devices, NVLink islands [[0..7]] (from recorded)",
        ),
        (
            lambda: _recorded("nvlink-pairs-4x"),
            "1 node(s) x 4 cuda devices, NVLink islands [[0, 3], [1, 2]] (from recorded)",
        ),
        (
            lambda: _recorded("pcie-4x"),
            "1 node(s) x 4 cuda devices, no NVLink (PCIe/system links only) (from recorded)",
        ),
        (lambda: detect("cpu", 4, 2), "2 node(s) x 4 cpu devices, one local island per node [[0..3]] (from cpu)"),
    ],
)
def test_describe(topology, line: str) -> None:
    assert topology().describe() == line


# ------------------------------------------------------------------------------------------------ rank layout


@pytest.mark.parametrize(
    "name, num_nodes, tp, expected",
    [
        ("dgx-h100-8x-nvlink", 2, 8, [list(range(8)), list(range(8, 16))]),
        ("dgx-h100-8x-nvlink", 2, 4, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]),
        ("dgx-h100-8x-nvlink", 1, 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("dgx-h100-8x-nvlink", 1, 1, [[0], [1], [2], [3], [4], [5], [6], [7]]),
        ("nvlink-pairs-4x", 1, 2, [[0, 3], [1, 2]]),
        ("nvlink-pairs-4x", 2, 2, [[0, 3], [1, 2], [4, 7], [5, 6]]),
        ("nvlink-pairs-4x", 2, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("pcie-4x", 1, 2, [[0, 1], [2, 3]]),
        ("pcie-4x", 2, 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ("nvlink-pairs-8x", 1, 2, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        # Groups of 4 on the bridged box stay on one socket (NODE) instead of crossing it (SYS).
        ("nvlink-pairs-8x", 1, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # DGX-1: partners over a double NVLink (NV2) rather than row-major neighbours over a single one (NV1).
        ("dgx1-v100-8x-hybrid-cube-mesh", 1, 2, [[0, 3], [1, 2], [4, 7], [5, 6]]),
        ("dgx1-v100-8x-hybrid-cube-mesh", 2, 4, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]),
    ],
)
def test_rank_layout(name: str, num_nodes: int, tp: int, expected: list[list[int]]) -> None:
    assert rank_layout(_recorded(name, num_nodes), tp) == expected


def test_rank_layout_groups_sit_on_the_fastest_links() -> None:
    # A shuffled version of the 8-GPU bridge box: pairs (0,5),(1,6),(2,7),(3,4); the rest is SYS.
    partner = {0: 5, 5: 0, 1: 6, 6: 1, 2: 7, 7: 2, 3: 4, 4: 3}
    rows = " | ".join(
        " ".join("X" if i == j else ("NV12" if partner[i] == j else "SYS") for j in range(8)) for i in range(8)
    )
    t = _cuda(rows, num_nodes=3)
    layout = rank_layout(t, 2)
    assert layout[:4] == [[0, 5], [1, 6], [2, 7], [3, 4]]
    assert layout[4:8] == [[8, 13], [9, 14], [10, 15], [11, 12]]
    assert sorted(r for row in layout for r in row) == list(range(24))


def test_rank_layout_ties_keep_ascending_order() -> None:
    # NVLink pairs (0,1),(2,3),(4,5),(6,7) behind one PCIe switch: every 4-group holds a PIX link, so all tie.
    rows = " | ".join(
        " ".join("X" if i == j else ("NV12" if i // 2 == j // 2 else "PIX") for j in range(8)) for i in range(8)
    )
    assert rank_layout(_cuda(rows), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank_layout(_cuda(rows), 8) == [list(range(8))]


def test_one_sided_link_counts_as_the_slower_direction() -> None:
    # GPU0 claims NVLink to GPU3, GPU3 does not (a half-recorded matrix): trust the slower side.
    t = _cuda("X PHB SYS NV4 | PHB X NV4 SYS | SYS NV4 X PHB | SYS SYS PHB X")
    assert t.islands() == [[0], [1, 2], [3]]
    assert rank_layout(t, 2) == [[0, 1], [2, 3]]


def test_rank_layout_cpu() -> None:
    t = detect("cpu", 4, 2)
    assert (t.source, t.device_type, t.islands(), t.auto_tp_size()) == ("cpu", "cpu", [[0, 1, 2, 3]], 4)
    assert t.links[0] == ("X", "LOCAL", "LOCAL", "LOCAL")
    assert rank_layout(t, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_layout(t, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_rank_layout_many_cpu_processes_is_fast() -> None:
    # 64 processes per node: the search must not enumerate combinations.
    assert rank_layout(detect("cpu", 64, 1), 32) == [list(range(32)), list(range(32, 64))]


@pytest.mark.parametrize(
    "tp, message",
    [
        (
            16,
            "^"
            + re.escape(
                "tensor_parallel_size=16 spans more than one node (8 devices per node): tensor parallel needs the "
                "fastest links; use a tensor_parallel_size that divides 8, e.g. 8"
            )
            + "$",
        ),
        (3, r"tensor_parallel_size=3 does not divide 8 .*divides 8 \(1, 2, 4 or 8\), e.g. 8"),
        (0, "tensor_parallel_size=0 is invalid: it must be at least 1"),
        (-2, "tensor_parallel_size=-2 is invalid"),
        (2.0, "must be an integer"),
        (True, "must be an integer"),
    ],
)
def test_rank_layout_errors(tp, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        rank_layout(_recorded("dgx-h100-8x-nvlink", 2), tp)


def test_rank_layout_error_suggests_the_auto_size() -> None:
    with pytest.raises(TopologyError, match="divides 4, e.g. 2$"):
        rank_layout(_recorded("nvlink-pairs-4x"), 8)
    with pytest.raises(ValueError):  # TopologyError is a ValueError
        rank_layout(_recorded("pcie-4x"), 3)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_nodes": 0}, "num_nodes must be a positive integer"),
        ({"devices_per_node": 3}, r"links must be a 3 x 3 matrix"),
        ({"device_type": "mps"}, "device_type must be 'cuda' or 'cpu'"),
        ({"links": _matrix("X NV4 | NV4 NV4")}, r"'X' on the diagonal; device\(s\) \[1\]"),
    ],
)
def test_topology_validation(kwargs: dict, message: str) -> None:
    fields = {"num_nodes": 1, "devices_per_node": 2, "device_type": "cuda", "links": _matrix("X NV4 | NV4 X")}
    with pytest.raises(TopologyError, match=message):
        Topology(**{**fields, **kwargs}, source="recorded")


def test_topology_normalises_lists_and_is_frozen() -> None:
    t = Topology(1, 2, "cuda", [["X", " NV4 "], ["NV4", "X"]], "recorded")  # type: ignore[arg-type]
    assert t.links == (("X", "NV4"), ("NV4", "X"))
    with pytest.raises(AttributeError):
        t.num_nodes = 2  # type: ignore[misc]


def test_from_nvidia_smi_takes_the_first_devices() -> None:
    t = Topology.from_nvidia_smi(_text("nvlink-pairs-8x"), num_nodes=1, devices_per_node=4)
    assert t.links == _matrix("X NV12 NODE NODE | NV12 X NODE NODE | NODE NODE X NV12 | NODE NODE NV12 X")
    assert t.source == "recorded"
    with pytest.raises(TopologyError, match="only 4 GPU"):
        Topology.from_nvidia_smi(_text("pcie-4x"), devices_per_node=8)


# ------------------------------------------------------------------------------------------------------ NVML


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


def _fake_pynvml(
    bus_ids: list[str],
    nvlinks: dict[int, list[str]],
    ancestor: dict[frozenset[int], int],
    *,
    remote_types: dict[str, int] | None = None,
    fail: str | None = None,
) -> types.ModuleType:
    """A stand-in for nvidia-ml-py: GPU i has handle i, PCI bus ``bus_ids[i]`` and links to ``nvlinks[i]``.

    GPUs without an entry in ``nvlinks`` answer NOT_SUPPORTED; link numbers past a GPU's links INVALID_ARGUMENT.
    ``fail`` names a function that raises NVMLError(UNKNOWN).
    """
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError
    nv.NVML_ERROR_INVALID_ARGUMENT, nv.NVML_ERROR_NOT_SUPPORTED, unknown = 2, 3, 999
    nv.NVML_FEATURE_DISABLED, nv.NVML_FEATURE_ENABLED = 0, 1
    nv.NVML_NVLINK_MAX_LINKS = 18
    nv.NVML_NVLINK_DEVICE_TYPE_GPU, nv.NVML_NVLINK_DEVICE_TYPE_IBMNPU, nv.NVML_NVLINK_DEVICE_TYPE_SWITCH = 0, 1, 2
    nv.calls = []  # type: ignore[attr-defined]

    def api(fn):
        def wrapper(*args):
            nv.calls.append(fn.__name__)
            if fn.__name__ == fail:
                raise FakeNVMLError(unknown)
            return fn(*args)

        wrapper.__name__ = fn.__name__
        setattr(nv, fn.__name__, wrapper)
        return wrapper

    @api
    def nvmlInit():
        return None

    @api
    def nvmlShutdown():
        return None

    @api
    def nvmlDeviceGetCount():
        return len(bus_ids)

    @api
    def nvmlDeviceGetHandleByIndex(i):
        return i

    @api
    def nvmlDeviceGetPciInfo(h):
        return types.SimpleNamespace(busId=bus_ids[h].encode())  # older pynvml hands back bytes

    @api
    def nvmlDeviceGetNvLinkState(h, link):
        if h not in nvlinks:
            raise FakeNVMLError(nv.NVML_ERROR_NOT_SUPPORTED)
        if link >= len(nvlinks[h]):
            raise FakeNVMLError(nv.NVML_ERROR_INVALID_ARGUMENT)
        return nv.NVML_FEATURE_ENABLED if nvlinks[h][link] else nv.NVML_FEATURE_DISABLED

    @api
    def nvmlDeviceGetNvLinkRemotePciInfo(h, link):
        return types.SimpleNamespace(busId=nvlinks[h][link])

    if remote_types is not None:

        @api
        def nvmlDeviceGetNvLinkRemoteDeviceType(h, link):
            return remote_types[nvlinks[h][link]]

    @api
    def nvmlDeviceGetTopologyCommonAncestor(a, b):
        return ancestor[frozenset((a, b))]

    return nv


BUS4 = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:9A:00.0", "00000000:AB:00.0"]
# The same bus ids as the far end of a link reports them (4-digit domain, lower case).
REMOTE4 = ["0000:18:00.0", "0000:2a:00.0", "0000:9a:00.0", "0000:ab:00.0"]
# Sockets: GPU0/1 on one (PHB = 30), GPU2/3 on the other (SYS = 50).
ANCESTOR4 = {
    frozenset(p): (30 if p in ((0, 1), (2, 3)) else 50) for p in ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))
}


def _install(monkeypatch: pytest.MonkeyPatch, fake: types.ModuleType | None) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake)


def test_nvml_nvlink_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pairs (0,3) and (1,2), 4 links each, plus two disabled links on GPU0 that must not count.
    nvlinks = {0: [REMOTE4[3]] * 4 + [""] * 2, 3: [REMOTE4[0]] * 4, 1: [REMOTE4[2]] * 4, 2: [REMOTE4[1]] * 4}
    fake = _fake_pynvml(BUS4, nvlinks, ANCESTOR4)
    _install(monkeypatch, fake)
    assert links_from_nvml() == _matrix(PAIRS_4X)
    assert fake.calls[0] == "nvmlInit" and fake.calls[-1] == "nvmlShutdown"


def test_nvml_pcie_only(monkeypatch: pytest.MonkeyPatch) -> None:
    ancestor = {pair: (10 if pair in (frozenset((0, 1)), frozenset((2, 3))) else 50) for pair in ANCESTOR4}
    _install(monkeypatch, _fake_pynvml(BUS4, {}, ancestor))
    assert links_from_nvml() == _matrix(PCIE_4X)


@pytest.mark.parametrize("level, code", [(0, "PIX"), (10, "PIX"), (20, "PXB"), (30, "PHB"), (40, "NODE"), (50, "SYS")])
def test_nvml_pcie_levels(monkeypatch: pytest.MonkeyPatch, level: int, code: str) -> None:
    _install(monkeypatch, _fake_pynvml(BUS4[:2], {}, {frozenset((0, 1)): level}))
    assert links_from_nvml() == (("X", code), (code, "X"))


@pytest.mark.parametrize("remote_types", [None, {"0000:e1:00.0": 2, "0000:e2:00.0": 2}])
def test_nvml_nvswitch(monkeypatch: pytest.MonkeyPatch, remote_types: dict[str, int] | None) -> None:
    # Every GPU's 18 links end at NVSwitches, as on a DGX H100: nvidia-smi shows NV18 between all pairs.
    bus = [f"00000000:{b:02X}:00.0" for b in (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)]
    switch_links = ["0000:e1:00.0"] * 9 + ["0000:e2:00.0"] * 9
    ancestor = {frozenset((i, j)): 40 for i in range(8) for j in range(8) if i != j}
    _install(monkeypatch, _fake_pynvml(bus, {i: switch_links for i in range(8)}, ancestor, remote_types=remote_types))
    assert links_from_nvml() == parse_nvidia_smi_topo(_text("dgx-h100-8x-nvlink"))


def test_nvml_ignores_links_to_gpus_it_cannot_see(monkeypatch: pytest.MonkeyPatch) -> None:
    # GPU0's links go to a GPU outside this list (remote type GPU): no NVLink between the two visible GPUs.
    nvlinks = {0: ["0000:ff:00.0"] * 4, 1: ["0000:fe:00.0"] * 4}
    types_ = {"0000:ff:00.0": 0, "0000:fe:00.0": 0}
    _install(monkeypatch, _fake_pynvml(BUS4[:2], nvlinks, {frozenset((0, 1)): 30}, remote_types=types_))
    assert links_from_nvml() == (("X", "PHB"), ("PHB", "X"))


@pytest.mark.parametrize(
    "fail",
    [
        "nvmlInit",
        "nvmlDeviceGetCount",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetNvLinkRemotePciInfo",
        "nvmlDeviceGetTopologyCommonAncestor",
    ],
)
def test_nvml_failures_give_none(monkeypatch: pytest.MonkeyPatch, fail: str) -> None:
    nvlinks = {0: [REMOTE4[3]] * 4, 3: [REMOTE4[0]] * 4, 1: [REMOTE4[2]] * 4, 2: [REMOTE4[1]] * 4}
    fake = _fake_pynvml(BUS4, nvlinks, ANCESTOR4, fail=fail)
    _install(monkeypatch, fake)
    assert links_from_nvml() is None
    assert fail in fake.calls
    if fail != "nvmlInit":
        assert fake.calls[-1] == "nvmlShutdown"


def test_nvml_without_gpus_or_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    _install(monkeypatch, _fake_pynvml([], {}, {}))
    assert links_from_nvml() is None
    _install(monkeypatch, None)  # `import pynvml` raises ImportError
    assert links_from_nvml() is None


# ---------------------------------------------------------------------------------------------------- detect


class FakeRun:
    """Stands in for subprocess.run; records the call and answers with a recording (or raises)."""

    def __init__(self, stdout: str = "", returncode: int = 0, raises: Exception | None = None) -> None:
        self.stdout, self.returncode, self.raises = stdout, returncode, raises
        self.calls: list[tuple[list[str], dict]] = []

    def __call__(self, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        self.calls.append((cmd, kwargs))
        if self.raises is not None:
            raise self.raises
        return subprocess.CompletedProcess(cmd, self.returncode, self.stdout, "")


def _smi(monkeypatch: pytest.MonkeyPatch, run: FakeRun | None, nvml=None) -> None:
    monkeypatch.setattr(topo, "links_from_nvml", lambda: nvml)
    monkeypatch.setattr(topo.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if run is not None else None)
    monkeypatch.setattr(topo.subprocess, "run", run if run is not None else FakeRun(raises=AssertionError("ran")))


def test_detect_cuda_from_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    run = FakeRun(_text("dgx-h100-8x-nvlink"))
    _smi(monkeypatch, run)
    t = detect("cuda", 8, 2)
    assert (t.source, t.num_nodes, t.devices_per_node, t.device_type) == ("nvidia-smi", 2, 8, "cuda")
    assert t.links == _matrix(H100)
    assert t.describe() == "2 node(s) x 8 cuda devices, NVLink islands [[0..7]] (from nvidia-smi)"
    (cmd, kwargs), *_ = run.calls
    assert cmd == ["/usr/bin/nvidia-smi", "topo", "-m"]
    assert kwargs["timeout"] == 10


def test_detect_cuda_first_devices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    _smi(monkeypatch, FakeRun(_text("nvlink-pairs-4x")))
    t = detect("cuda", 2, 1)
    assert t.links == (("X", "PHB"), ("PHB", "X"))
    assert t.islands() == [[0], [1]]


def test_detect_cuda_honours_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    _smi(monkeypatch, FakeRun(_text("nvlink-pairs-4x")))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    t = detect("cuda", 2, 1)
    assert t.links == (("X", "NV4"), ("NV4", "X"))
    assert rank_layout(t, 2) == [[0, 1]]


def test_detect_prefers_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    _smi(monkeypatch, None, nvml=_matrix(PAIRS_4X))
    t = detect("cuda", 4, 2)
    assert (t.source, t.links) == ("nvml", _matrix(PAIRS_4X))
    assert rank_layout(t, 2) == [[0, 3], [1, 2], [4, 7], [5, 6]]


@pytest.mark.parametrize(
    "run",
    [
        None,  # no nvidia-smi on PATH
        FakeRun("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", returncode=9),
        FakeRun(raises=subprocess.TimeoutExpired(["nvidia-smi"], 10)),
        FakeRun(raises=PermissionError("denied")),
        FakeRun("No devices were found\n"),
        FakeRun(_text("pcie-4x")),  # fewer GPUs than devices_per_node
    ],
)
def test_detect_cuda_unknown(monkeypatch: pytest.MonkeyPatch, run: FakeRun | None) -> None:
    _smi(monkeypatch, run)
    t = detect("cuda", 8, 1)
    assert t.source == "unknown"
    assert set(t.links[0]) == {"X", "SYS"}
    assert t.auto_tp_size() == 8
    assert rank_layout(t, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_detect_cpu_ignores_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _smi(monkeypatch, FakeRun(raises=AssertionError("cpu must not run nvidia-smi")), nvml=_matrix(PAIRS_4X))
    monkeypatch.setattr(topo, "links_from_nvml", lambda: pytest.fail("cpu must not query NVML"))
    t = detect("cpu", 4, 2)
    assert (t.source, t.islands(), t.auto_tp_size()) == ("cpu", [[0, 1, 2, 3]], 4)


def test_detect_rejects_other_device_types() -> None:
    with pytest.raises(TopologyError, match="'mps'"):
        detect("mps", 1, 1)
