"""Byte-level language-modelling data from the Python documentation that ships with CPython.

The corpus is ``pydoc_data.topics.topics`` (the text behind ``help("if")`` and friends): it is part of
every CPython install, so nothing is downloaded and nothing is copied into this repository. About
0.47 MB of UTF-8 (Python 3.11), encoded as bytes, so the vocabulary is always 256.

Run ``python examples/data.py`` to print the corpus and split sizes.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, Dataset

VOCAB_SIZE = 256


def load_corpus() -> bytes:
    """All pydoc topics, concatenated in sorted-key order, as UTF-8 bytes."""
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics)).encode("utf-8")


def encode(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: torch.Tensor) -> str:
    return bytes(ids.tolist()).decode("utf-8", errors="replace")


class WindowDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens, served as ``(x, y)`` with ``y`` shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int, max_windows: int | None = None) -> None:
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for one window of block_size={block_size}")
        self.tokens = tokens
        self.block_size = block_size
        n = (len(tokens) - 1) // block_size
        self.n_windows = n if max_windows is None else min(n, max_windows)

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n_windows:
            raise IndexError(i)
        chunk = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class PydocDataModule(L.LightningDataModule):
    """Train on the first 90% of the corpus; validate, test and predict on the last 10%.

    Args:
        block_size: Tokens per training example (each window holds ``block_size + 1`` bytes).
        batch_size: Per-process batch size. Under a distributed strategy Lightning adds the sampler.
        max_train_windows: Cap on the number of training windows (tests use a tiny dataset).
        predict_windows: Number of validation windows served by ``predict_dataloader``.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 32,
        max_train_windows: int | None = None,
        predict_windows: int = 64,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_train_windows = max_train_windows
        self.predict_windows = predict_windows

    def setup(self, stage: str | None = None) -> None:
        if hasattr(self, "train_set"):
            return
        data = torch.frombuffer(bytearray(load_corpus()), dtype=torch.uint8).long()
        n_train = int(0.9 * len(data))
        self.train_set = WindowDataset(data[:n_train], self.block_size, self.max_train_windows)
        self.val_set = WindowDataset(data[n_train:], self.block_size)
        self.predict_set = WindowDataset(data[n_train:], self.block_size, self.predict_windows)
        rank_zero_info(
            f"pydoc corpus: {len(data):,} bytes; train {n_train:,} bytes ({len(self.train_set):,} windows),"
            f" val {len(data) - n_train:,} bytes ({len(self.val_set):,} windows) of {self.block_size + 1} tokens"
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=0)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.predict_set, batch_size=self.batch_size, shuffle=False, num_workers=0)


if __name__ == "__main__":
    corpus = load_corpus()
    print(f"pydoc_data.topics: {len(corpus):,} bytes of UTF-8, vocab {VOCAB_SIZE} (bytes)")
    dm = PydocDataModule()
    dm.setup()
    print(f"train windows: {len(dm.train_set):,}  val windows: {len(dm.val_set):,}  (block_size={dm.block_size})")
    print("sample:", repr(decode(dm.train_set[0][0])[:100]))
