"""Fast single-process checks of the example GPT, its data module and one short CPU training run (examples/ is on
sys.path: tests/conftest.py)."""

import math

import lightning as L
import pytest
import torch
from data import VOCAB_SIZE, PydocDataModule, load_corpus
from gpt import GPT, GPTConfig, GPTLightningModule

TINY = GPTConfig(vocab_size=VOCAB_SIZE, block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(TINY).eval()


def test_forward_shapes(model: GPT) -> None:
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.block_size))
    assert model(idx).shape == (3, TINY.block_size, TINY.vocab_size)
    assert model(idx[:, :7]).shape == (3, 7, TINY.vocab_size)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_structure_and_tied_weights(model: GPT) -> None:
    assert model.lm_head.weight is model.tok_emb.weight
    assert len(model.blocks) == TINY.n_layer
    assert all(type(b) is type(model.blocks[0]) for b in model.blocks)
    names = dict(model.named_parameters())
    assert "lm_head.weight" not in names  # the tied weight is one parameter, counted once
    assert model.num_parameters() == sum(p.numel() for p in names.values())


def test_init_is_deterministic_from_seed() -> None:
    torch.manual_seed(123)
    a = GPT(TINY)
    torch.manual_seed(123)
    b = GPT(TINY)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def test_compile_fullgraph_matches_eager(model: GPT) -> None:
    torch._dynamo.reset()
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.block_size))
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx), model(idx), atol=1e-5, rtol=1e-5)


def test_datamodule_windows() -> None:
    assert len(load_corpus()) > 100_000
    dm = PydocDataModule(block_size=16, batch_size=4, max_train_windows=10)
    dm.setup("fit")
    assert len(dm.train_set) == 10
    assert len(dm.val_set) > 0 and len(dm.predict_set) > 0
    x, y = dm.train_set[3]
    assert x.shape == y.shape == (16,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])
    assert int(torch.cat([x, y]).max()) < VOCAB_SIZE

    again = PydocDataModule(block_size=16, batch_size=4, max_train_windows=10)
    again.setup("fit")
    assert len(again.val_set) == len(dm.val_set)
    for i in (0, 5, 9):
        assert all(torch.equal(a, b) for a, b in zip(dm.train_set[i], again.train_set[i]))

    xb, yb = next(iter(dm.train_dataloader()))
    assert xb.shape == yb.shape == (4, 16)


def test_short_cpu_training_run(tmp_path) -> None:
    L.seed_everything(0)
    dm = PydocDataModule(block_size=TINY.block_size, batch_size=8, max_train_windows=64, predict_windows=8)
    module = GPTLightningModule(
        vocab_size=TINY.vocab_size, block_size=TINY.block_size, n_layer=2, n_head=2, n_embd=32, lr=3e-3
    )
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=dm)
    loss = trainer.callback_metrics["train_loss"]
    assert torch.isfinite(loss)
    assert float(loss) < math.log(VOCAB_SIZE) + 0.5  # no worse than a uniform guess

    (val,) = trainer.validate(module, datamodule=dm, verbose=False)
    assert math.isfinite(val["val_loss"]) and val["val_ppl"] == pytest.approx(math.exp(val["val_loss"]), rel=0.05)

    preds = trainer.predict(module, datamodule=dm)
    assert preds[0].shape == (8, TINY.block_size) and preds[0].dtype == torch.long


def test_precision_defaults_to_bf16_mixed_on_gpus_only() -> None:
    from train_gpt import parse_args

    assert parse_args([]).precision == "32-true"  # the CPU job the README measured, unchanged
    assert parse_args(["--accelerator", "gpu"]).precision == "bf16-mixed"
    assert parse_args(["--accelerator", "cuda"]).precision == "bf16-mixed"
    assert parse_args(["--accelerator", "auto"]).precision == ("bf16-mixed" if torch.cuda.is_available() else "32-true")
    assert parse_args(["--accelerator", "gpu", "--precision", "32-true"]).precision == "32-true"
