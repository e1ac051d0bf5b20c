"""Train a small byte-level GPT on the Python docs with Lightning and the ``sgdtp`` strategy.

    python examples/train_gpt.py                     # 2 CPU processes, strategy sgdtp
    python examples/train_gpt.py --strategy ddp      # the same run with Lightning's DDP, for reference
    python examples/train_gpt.py --accelerator gpu --devices 8 --num_nodes 2   # bf16-mixed by default on GPUs

On GPUs (CUDA, NCCL) this script is written but has never been run by this project: only CPU runs with gloo are.

See examples/README.md for the expected runtime and perplexity.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # so gpt.py and data.py import

import lightning as L
import torch
from data import PydocDataModule
from gpt import GPTLightningModule
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_only


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", default="2", help="number of devices per node, or 'auto'")
    p.add_argument("--num_nodes", type=int, default=1)
    p.add_argument("--strategy", default="sgdtp", help="'sgdtp', or any Lightning strategy name, e.g. 'ddp'")
    p.add_argument("--max_steps", type=int, default=360)
    p.add_argument("--precision", default=None, help="default: bf16-mixed on GPUs, 32-true on CPU")
    p.add_argument("--accumulate_grad_batches", type=int, default=1)
    p.add_argument("--gradient_clip_val", type=float, default=1.0)
    p.add_argument("--parallelism", default="data", help="sgdtp only: 'data', 'tensor' or 'hybrid'")
    p.add_argument("--tensor_parallel_size", default=None, help="sgdtp only (tensor/hybrid): an int or 'auto'")
    p.add_argument("--pipeline_stages", type=int, default=None, help="sgdtp only: ranks per pipeline (>= 2)")
    p.add_argument("--pipeline_chunks", type=int, default=None, help="sgdtp only: micro-batches per step")
    p.add_argument("--pipeline_schedule", default=None, help="sgdtp only: '1f1b', 'gpipe' or 'interleaved_1f1b'")
    p.add_argument("--activation_checkpointing", action="store_true", help="sgdtp only: recompute each block")
    p.add_argument(
        "--no_regional_compile", action="store_true", help="sgdtp only: compile the step as one graph, layer by layer"
    )
    p.add_argument(
        "--bucket_cap_mb", type=float, default=None, help="sgdtp only: MiB per fused all-reduce (default: measured)"
    )
    p.add_argument("--optimizer_update", default=None, help="sgdtp only: 'auto', 'fused', 'compiled' or 'eager'")
    p.add_argument(
        "--profile_steps", type=int, nargs=2, default=None, metavar=("FIRST", "LAST"), help="sgdtp only: a timeline"
    )
    p.add_argument("--default_root_dir", default="runs/train_gpt")
    p.add_argument("--limit_val_batches", type=float, default=1.0, help="fraction (<= 1.0) or number of val batches")
    p.add_argument("--checkpoint_every", type=int, default=0, help="save last.ckpt every N steps (0: at epoch end)")
    p.add_argument("--resume", action="store_true", help="resume from default_root_dir/checkpoints/last.ckpt if any")
    p.add_argument("--save_weights", default=None, help="rank 0 saves the final state_dict to this file")
    p.add_argument("--collective_timeout", type=float, default=None, help="sgdtp only: seconds (1800)")
    p.add_argument("--seed", type=int, default=1234)
    # Model and data.
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=32, help="per process")
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=4)
    p.add_argument("--n_embd", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.1)
    args = p.parse_args(argv)
    args.precision = args.precision or default_precision(args.accelerator)
    return args


def default_precision(accelerator: str) -> str:
    """``bf16-mixed`` on CUDA GPUs (what examples/README.md suggests there; untested: no GPU run yet), ``32-true``
    elsewhere: on CPU the run stays the one examples/README.md measured."""
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "bf16-mixed" if on_gpu else "32-true"


def build_strategy(args: argparse.Namespace) -> str | Strategy:
    """``sgdtp`` gets its options; any other name goes to Lightning as is, so this script is also the reference."""
    if args.strategy != "sgdtp":
        return args.strategy
    from lightning_sgdtp import SGDTPStrategy

    tp = args.tensor_parallel_size
    return SGDTPStrategy(
        parallelism=args.parallelism,
        tensor_parallel_size=int(tp) if tp and tp.isdigit() else tp,
        bucket_cap_mb=args.bucket_cap_mb,
        activation_checkpointing=args.activation_checkpointing,
        regional_compile=not args.no_regional_compile,
        collective_timeout=args.collective_timeout,
        pipeline_stages=args.pipeline_stages,
        pipeline_chunks=args.pipeline_chunks,
        pipeline_schedule=args.pipeline_schedule,
        optimizer_update=args.optimizer_update,
        profile_steps=tuple(args.profile_steps) if args.profile_steps else None,
    )


def full_state_dict(trainer: L.Trainer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict: sgdtp gathers split parameters and collects pipeline stages (a collective)."""
    full = getattr(trainer.strategy, "full_state_dict", None)
    return full() if full is not None else model.state_dict()


@rank_zero_only
def print0(message: str) -> None:
    """Print once per job (global rank 0), not once per process."""
    print(message, flush=True)


def main(args: argparse.Namespace) -> None:
    L.seed_everything(args.seed, workers=True)
    datamodule = PydocDataModule(block_size=args.block_size, batch_size=args.batch_size)
    model = GPTLightningModule(
        vocab_size=datamodule.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        lr=args.lr,
        weight_decay=args.weight_decay,
    )
    # Validate three times during training (counted in batches, across epoch boundaries).
    val_every = max(1, args.max_steps * args.accumulate_grad_batches // 3)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=int(args.devices) if args.devices.isdigit() else args.devices,
        num_nodes=args.num_nodes,
        strategy=build_strategy(args),
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate_grad_batches,
        gradient_clip_val=args.gradient_clip_val,
        val_check_interval=val_every,
        check_val_every_n_epoch=None,
        log_every_n_steps=10,
        limit_val_batches=int(args.limit_val_batches) if args.limit_val_batches > 1 else args.limit_val_batches,
        logger=CSVLogger(args.default_root_dir, name="csv"),
        callbacks=[
            ModelCheckpoint(
                dirpath=os.path.join(args.default_root_dir, "checkpoints"),
                every_n_train_steps=args.checkpoint_every or None,
                save_last=True,
            )
        ],
        default_root_dir=args.default_root_dir,
    )
    print0(f"GPT: {model.model.num_parameters():,} parameters; strategy {args.strategy}; precision {args.precision}")
    trainer.fit(model, datamodule=datamodule, ckpt_path="last" if args.resume else None)
    if args.save_weights:
        weights = full_state_dict(trainer, model)  # a collective with split parameters or stages: every rank
        if trainer.is_global_zero:
            torch.save(weights, args.save_weights)
    # The last in-training validation may be up to `val_every` batches old: measure the final weights. They are
    # saved and named explicitly: under SLURM, `ckpt_path=None` would load a preemption checkpoint
    # (hpc_ckpt_N.ckpt) instead, if the job was ever requeued.
    final = os.path.join(args.default_root_dir, "checkpoints", "final.ckpt")
    trainer.save_checkpoint(final)
    (metrics,) = trainer.validate(model, datamodule=datamodule, ckpt_path=final, verbose=False)
    print0(f"final val_loss {metrics['val_loss']:.4f}  val_ppl {metrics['val_ppl']:.3f}")


if __name__ == "__main__":
    main(parse_args())
