"""The device mesh: :class:`~lightning_sgdtp.mesh.dims.ParallelDims` (every parallel dimension, its process groups and
meshes, built once) and the rank grid it is placed on (:mod:`~lightning_sgdtp.mesh.topology`: nodes, NVLink islands)."""
