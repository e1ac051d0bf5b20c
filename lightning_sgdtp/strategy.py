"""Placeholder: the real SGDTPStrategy is being written; this stub only exists so registration can be built."""

from lightning.pytorch.strategies.ddp import DDPStrategy


class SGDTPStrategy(DDPStrategy):
    strategy_name = "sgdtp"
