"""Pipeline parallel in one folder: the split into stages (``split``), their boundaries, carried values, names and
memory, the stage tensors, the schedules, and the runner that drives ``torch.distributed.pipelining``."""
