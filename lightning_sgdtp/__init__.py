"""lightning-sgdtp: a Lightning strategy that compiles the training step and puts gradient
communication inside the compiled backward.

``import lightning_sgdtp`` registers ``"sgdtp"`` with Lightning's StrategyRegistry and Fabric's
STRATEGY_REGISTRY (and with ``pytorch_lightning``'s / ``lightning_fabric``'s when those are in use) and with
TorchDynamo as a ``torch.compile`` backend.
"""

# `diagnose` is the package lightning_sgdtp.diagnose, callable: lightning_sgdtp.diagnose(...) runs diagnose.diagnose(...)
from lightning_sgdtp import diagnose, graph
from lightning_sgdtp.compiler.backend import SGDTPCompiler, register_backend, sgdtp_backend
from lightning_sgdtp.config import NotAvailableYetError, SGDTPConfig, SGDTPConfigError
from lightning_sgdtp.frontends.fabric import SGDTPFabricStrategy
from lightning_sgdtp.frontends.registration import register_strategies
from lightning_sgdtp.frontends.trainer import SGDTPStrategy
from lightning_sgdtp.runtime.faults import RankLostError
from lightning_sgdtp.runtime.preemption import Preempted
from lightning_sgdtp.runtime.rendezvous import RendezvousError

__version__ = "0.1.0"
__all__ = [
    "NotAvailableYetError",
    "Preempted",
    "RankLostError",
    "RendezvousError",
    "SGDTPCompiler",
    "SGDTPConfig",
    "SGDTPConfigError",
    "SGDTPFabricStrategy",
    "SGDTPStrategy",
    "diagnose",
    "graph",
    "sgdtp_backend",
]

register_backend()
register_strategies()
