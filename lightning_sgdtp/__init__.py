"""lightning-sgdtp: a Lightning strategy that compiles the training step and puts gradient
communication inside the compiled backward."""

from lightning_sgdtp.config import SGDTPConfig

__all__ = ["SGDTPConfig"]
