"""Checkpoints: Lightning's checkpoint hooks for split models, the sharded (DCP) layout, Fabric's layout, and resuming
into another layout."""
