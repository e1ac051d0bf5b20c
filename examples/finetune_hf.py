"""Fine-tune a Hugging Face causal language model that does not fit one device (docs/big-models.md).

The model is built in ``configure_model``: with ``pretrained`` given, the strategy runs it on the meta device (no
memory), plans and splits it there, and each rank then reads only its part of the ``*.safetensors`` files. The
planner (``parallelism="auto"``) picks the layout from the model and the memory; checkpoints go to a folder every
node sees; at the end the trained model is written back as a Hugging Face folder (``from_pretrained`` loads it).

    python examples/finetune_hf.py --pretrained PATH --out runs/ft          # every device of this machine
    srun python examples/finetune_hf.py --pretrained PATH --out /shared/ft --num_nodes 2 --devices 8   # SLURM

``--data FILE``: a ``torch.save``d LongTensor of token ids (samples x sequence); without it, random tokens (a
smoke test of the setup, not a fine-tune).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_sgdtp import SGDTPStrategy


class FineTune(L.LightningModule):
    """The LightningModule a user writes around a ``transformers`` causal LM."""

    def __init__(self, pretrained: str, lr: float = 1e-5) -> None:
        super().__init__()
        self.pretrained, self.lr = pretrained, lr
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        import transformers

        if self.model is None:  # Lightning calls it for every trainer function
            config = transformers.AutoConfig.from_pretrained(self.pretrained)
            self.model = transformers.AutoModelForCausalLM.from_config(config)  # on meta: the strategy's context

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def tokens(path: str | None, vocab: int, samples: int = 64, length: int = 32) -> TensorDataset:
    if path is not None:
        return TensorDataset(torch.load(path))
    return TensorDataset(torch.randint(0, vocab, (samples, length), generator=torch.Generator().manual_seed(0)))


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", required=True, help="a Hugging Face model folder (save_pretrained's)")
    parser.add_argument("--out", required=True, help="a folder every node sees: checkpoints and the export")
    parser.add_argument("--data", default=None)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=1000)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--precision", default=None, help="default: bf16-true on GPUs, 32-true on CPU")
    parser.add_argument("--max_memory_per_rank", default=None, help="the planner's limit, e.g. 70GB")
    args = parser.parse_args()
    out = Path(args.out)

    strategy = SGDTPStrategy(
        parallelism="auto", pretrained=args.pretrained, max_memory_per_rank=args.max_memory_per_rank
    )
    gpu = args.accelerator == "gpu" or (args.accelerator == "auto" and torch.cuda.is_available())
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision or ("bf16-true" if gpu else "32-true"),
        max_steps=args.max_steps,
        default_root_dir=str(out),
        callbacks=[L.callbacks.ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=100)],
        logger=False,
        enable_progress_bar=False,
    )
    vocab = transformers.AutoConfig.from_pretrained(args.pretrained).vocab_size
    data = DataLoader(tokens(args.data, vocab), batch_size=args.batch_size, shuffle=True)
    model = FineTune(args.pretrained)
    # a requeued SLURM job resumes from the checkpoint Lightning saved at the signal, by itself
    trainer.fit(model, data)
    trainer.save_checkpoint(out / "checkpoints" / "last.ckpt")  # a sharded folder on a mesh: each rank its part
    trainer.strategy.save_pretrained(out / "hf")  # every rank writes its shards; from_pretrained loads the folder


if __name__ == "__main__":
    main()
