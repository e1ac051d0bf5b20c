"""Small LightningModules used by the jobs and the unit tests. Ordinary Lightning code: nothing strategy-specific.

A job's scenario names its model (``"model": "small_gpt"``): ``MODELS`` maps the names to the factories.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from gpt import GPTConfig, GPTLightningModule  # examples/gpt.py (the package helpers put examples/ on sys.path)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ = 64, 16


def token_data(n: int = 64, batch_size: int = 4, seed: int = 1234) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    y = torch.roll(x, -1, dims=1)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class BreaksModel(L.LightningModule):
    """Tied embedding/head, an unused layer, an eager region and graph breaks (``self.log`` and an explicit one)."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        self.emb = nn.Embedding(VOCAB, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.side = nn.Linear(32, 32)  # used in an eager (compiler-disabled) region
        self.head = nn.Linear(32, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.unused = nn.Linear(7, 7)  # never used: no gradient, must not be synced or break anything

    @torch.compiler.disable
    def side_branch(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.side(h))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.emb(x)
        h = h + self.body(h)
        self.log("mid_norm", h.detach().norm())  # a graph break in every training step
        h = h + self.side_branch(h)
        torch._dynamo.graph_break()
        logits = self.head(h)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        h = self.emb(x)
        h = h + self.body(h)
        h = h + self.side_branch(h)
        loss = F.cross_entropy(self.head(h).reshape(-1, VOCAB), y.reshape(-1))
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.validation_step(batch, batch_idx)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return self.head(self.emb(x) + self.body(self.emb(x))).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class ScheduledModel(BreaksModel):
    """RMSprop (no fused kernel in torch: sgdtp compiles its step) with a learning rate that changes every step."""

    def configure_optimizers(self) -> Any:
        opt = torch.optim.RMSprop(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ManualModel(BreaksModel):
    """Manual optimization: two backward calls per step (a gradient accumulated by hand) and clipping."""

    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__(lr)
        self.automatic_optimization = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        # The loop body is a method: a graph break inside a loop (manual_backward is one) makes Dynamo run the
        # whole loop's frame eagerly, while a called method is compiled as its own frame.
        for half in (slice(0, 2), slice(2, 4)):
            loss = self.half_loss(x[half], y[half])
            self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        self.log("train_loss", loss.detach())
        return loss.detach()

    def half_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        h = h + self.body(h)
        logits = self.head(h + self.side_branch(h))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / 2


def small_gpt(lr: float = 1e-2) -> GPTLightningModule:
    config = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=32)
    return GPTLightningModule.from_config(config, lr=lr, weight_decay=0.0)


class MHALanguageModel(L.LightningModule):
    """A small language model built from torch's own ``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention``)."""

    def __init__(self, lr: float = 1e-2, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class LlamaAttention(nn.Module):
    """Separate q/k/v/o projections (Llama's names), heads found with ``view(..., -1, head_dim)``, and a plain
    per-position scale buffer (a stand-in for rotary tables) multiplied into q and k."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = heads, width // heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(width, width, bias=False)
        self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, SEQ).view(1, SEQ, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * self.pos_scale[:, :t], k * self.pos_scale[:, :t]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(width, 2 * width, bias=False), nn.Linear(width, 2 * width, bias=False)
        self.down_proj = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.self_attn, self.mlp = LlamaAttention(width, heads), LlamaMLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaLike(L.LightningModule):
    """A Llama-shaped language model (untied embedding and head, RMSNorm, SwiGLU)."""

    def __init__(self, lr: float = 1e-2, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.lr = lr
        self.embed_tokens = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(LlamaLayer(width, heads) for _ in range(2))
        self.norm = nn.RMSNorm(width)
        self.lm_head = nn.Linear(width, VOCAB, bias=False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.embed_tokens(x)
        for layer in self.layers:
            h = layer(h)
        loss = F.cross_entropy(self.lm_head(self.norm(h)).reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def pp_gpt(lr: float = 1e-2) -> GPTLightningModule:
    """The small GPT with four blocks: two stages of two, or four interleaved stages of one."""
    config = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32)
    return GPTLightningModule.from_config(config, lr=lr, weight_decay=0.0)


# A scenario's "model": the factory that builds it (every one takes ``lr``, defaulting to 1e-2).
MODELS: dict[str, Callable[[], L.LightningModule]] = {
    "BreaksModel": BreaksModel,
    "ManualModel": ManualModel,
    "ScheduledModel": ScheduledModel,
    "small_gpt": small_gpt,
    "MHALanguageModel": MHALanguageModel,
    "LlamaLike": LlamaLike,
    "pp_gpt": pp_gpt,
}
