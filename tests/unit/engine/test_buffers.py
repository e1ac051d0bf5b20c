"""Which buffers the replicas sync before each step (engine/base.py): state, each once, shards of DTensors."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_sgdtp.engine.base import broadcast_buffers, synced_buffers


class WithBuffers(nn.Module):
    """BatchNorm statistics (state), a rotary table and a scale (non-persistent constants, as Gemma2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.register_buffer("embed_scale", torch.tensor(2.0), persistent=False)
        self.shared = self.norm.running_mean  # the same tensor under two names: once


def test_only_state_each_once() -> None:
    m = WithBuffers()
    got = synced_buffers([m, m.norm])
    assert [id(b) for b in got] == [id(m.norm.running_mean), id(m.norm.running_var), id(m.norm.num_batches_tracked)]


def test_a_dtensor_buffer_is_synced_as_its_shard_beside_plain_ones() -> None:
    """Gemma2 under tensor parallel: DTensor buffers (replicated by torch's parallel styles) next to plain ones;
    ``_sync_params_and_buffers`` concatenates what it is given and refused the mix ("got mixed torch.Tensor and
    DTensor"). A group of one rank runs the real collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        m = WithBuffers()
        m.norm.register_buffer("running_mean", distribute_tensor(torch.ones(4), mesh, [Replicate()]))
        got = synced_buffers([m])
        assert not any(isinstance(b, DTensor) for b in got) and len(got) == 3
        assert got[0].data_ptr() == m.norm.running_mean.to_local().data_ptr()  # the shard itself, written in place
        broadcast_buffers([m], dist.group.WORLD)
        assert torch.equal(m.norm.running_mean.to_local(), torch.ones(4))
    finally:
        if created:
            dist.destroy_process_group()
