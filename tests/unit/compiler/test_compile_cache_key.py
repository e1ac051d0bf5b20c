"""The compile cache's key: what makes a compiled bundle valid (compile_cache.key_fields), no processes."""

from __future__ import annotations

import torch
from torch import nn

from lightning_sgdtp.compiler.cache import GRAPH_OPTIONS, cache_key, key_fields
from lightning_sgdtp.config import SGDTPConfig


def _fields(module: nn.Module | None = None, **options: object) -> dict:
    return key_fields(
        module or nn.Linear(4, 3),
        SGDTPConfig(**options),
        in_graph_sync=True,
        device=torch.device("cpu"),
        world_size=2,
        num_nodes=1,
        devices_per_node=2,
        rank_grid=None,
        process_group_backend="gloo",
        tensor_parallel_plan=None,
    )


def test_key_fields_change_with_what_changes_the_compiled_graphs() -> None:
    fields = _fields()
    assert _fields() == fields and cache_key(_fields()) == cache_key(fields), "the same inputs, the same key"
    assert set(fields["plan"]) == {*GRAPH_OPTIONS, "in_graph_sync"} and fields["layout"]["devices"] == 2
    assert _fields(bucket_cap_mb=1.0) != fields, "an option that changes the graphs changes the key"
    assert _fields(sharding="full") != fields, "sharding puts all-gathers and reduce-scatters in the graphs"
    assert _fields(nn.Linear(4, 5)) != fields, "so do other parameter shapes"
    assert _fields(collective_timeout=60.0) == fields, "an option outside GRAPH_OPTIONS does not"
