"""The model zoo: unchanged third-party models at tiny sizes, each inside the LightningModule users write.

Every entry is a model this repo did not write (``transformers``: language, vision, encoder, encoder-decoder) or a pattern users write that
ours do not (``nn.MultiheadAttention``, top-k mixture of experts, a Python branch on a config flag). The
LightningModule around them is the ordinary one: ``training_step`` calls ``self(...)`` once, computes the loss from
what it returns, ``self.log``s it; ``configure_optimizers`` returns the optimizer the scenario names (AdamW by
default). Nothing in here knows about the strategy.

``ZOO`` maps a name to a :class:`ZooEntry`: the factory of the inner model, the kind of data it eats and its loss.
``zoo_module(name)`` builds the LightningModule, ``zoo_data(name, ...)`` its data (deterministic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, SEQ, WIDTH = 96, 16, 32
IMAGE, CLASSES = 16, 10


def _hf(config_cls: str, model_cls: str, **overrides: Any) -> Callable[[], nn.Module]:
    """A ``transformers`` model from a tiny config (2 layers, width 32, 4 heads): the library's own code, unchanged.
    Dropout is off in every zoo model: a parity run compares two trainings, which dropout would make differ."""

    def build(layers: int) -> nn.Module:
        import transformers

        fields: dict[str, Any] = {
            "vocab_size": VOCAB,
            "hidden_size": WIDTH,
            "intermediate_size": 2 * WIDTH,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "max_position_embeddings": 4 * SEQ,
        }
        fields.update(overrides)
        config = getattr(transformers, config_cls)(**fields)
        return getattr(transformers, model_cls)(config)

    return build


def _gpt2(layers: int) -> nn.Module:
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=4 * SEQ,
        n_embd=WIDTH,
        n_layer=layers,
        n_head=4,
        bos_token_id=1,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def _bert(layers: int) -> nn.Module:
    import transformers

    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=2 * WIDTH,
        max_position_embeddings=4 * SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def _t5(layers: int) -> nn.Module:
    import transformers

    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=2 * WIDTH, num_layers=layers, num_decoder_layers=layers, num_heads=4,
        decoder_start_token_id=0, dropout_rate=0.0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _gptj(layers: int) -> nn.Module:
    import transformers

    # parallel residual (attention and MLP both read the block's one norm; out = attn + mlp + residual), rotary on part
    # of each head (rotary_dim of head_dim), untied LM head with a bias
    config = transformers.GPTJConfig(
        vocab_size=VOCAB, n_positions=4 * SEQ, n_embd=WIDTH, n_layer=layers, n_head=4, rotary_dim=4, n_inner=2 * WIDTH,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    return transformers.GPTJForCausalLM(config)


def _mbart(layers: int) -> nn.Module:
    import transformers

    # the decoder alone (a causal LM): a LayerNorm right after the scaled token embedding (a subclass of nn.Embedding
    # with padding row 0) and the learned positions; its cross-attention layers exist and are not called
    config = transformers.MBartConfig(
        vocab_size=VOCAB, d_model=WIDTH, decoder_layers=layers, encoder_layers=layers, decoder_attention_heads=4,
        encoder_attention_heads=4, decoder_ffn_dim=2 * WIDTH, encoder_ffn_dim=2 * WIDTH, max_position_embeddings=4 * SEQ,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, scale_embedding=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=1, decoder_start_token_id=1,
    )  # fmt: skip
    return transformers.MBartForCausalLM(config)


def _resnet(layers: int) -> nn.Module:
    import transformers

    # BatchNorm everywhere: running statistics are buffers. 2 stages of one basic block each.
    config = transformers.ResNetConfig(
        embedding_size=16,
        hidden_sizes=[16 * 2 ** (i // 2) for i in range(layers)],
        depths=[1] * layers,
        layer_type="basic",
        num_labels=CLASSES,
    )
    return transformers.ResNetForImageClassification(config)


def _vit(layers: int) -> nn.Module:
    import transformers

    config = transformers.ViTConfig(
        image_size=IMAGE, patch_size=4, hidden_size=WIDTH, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=2 * WIDTH, num_labels=CLASSES, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config)


class MHABlock(nn.Module):
    """A pre-norm block around ``nn.MultiheadAttention`` (batch_first), as users write them."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class MoE(nn.Module):
    """Top-2 routing over 4 experts, computed densely with the routing weights (data-dependent, no dropped token)."""

    def __init__(self, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(WIDTH, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.router(x).softmax(-1)
        weight, index = scores.topk(self.top_k, dim=-1)
        gate = torch.zeros_like(scores).scatter(-1, index, weight / weight.sum(-1, keepdim=True))
        return sum(gate[..., e : e + 1] * expert(x) for e, expert in enumerate(self.experts))


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.moe = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class TokenStack(nn.Module):
    """Embedding -> blocks -> norm -> head, over ``block()`` blocks. ``gated``: a Python branch on a config flag."""

    def __init__(self, block: Callable[[], nn.Module], layers: int = 2, gated: bool = False) -> None:
        super().__init__()
        self.gated = gated
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(SEQ, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(block() for _ in range(layers))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        if self.gated:  # a config flag, fixed for the model's life: dynamo specialises on it
            h = h * torch.sigmoid(h)
        return self.head(self.norm(h))


class LitGPTShape(nn.Module):
    """LitGPT's ``GPT`` (litgpt 0.5.13, ``litgpt/model.py``) in its Llama configuration, written here with its module
    names: ``transformer.wte`` / ``transformer.h[i]`` (``norm_1``, ``attn.qkv`` one fused projection with grouped
    queries, ``attn.proj``, ``norm_2``, ``mlp.fc_1`` / ``fc_2`` / ``proj`` SwiGLU) / ``transformer.ln_f``, ``lm_head``,
    RMSNorm, and the rotary ``cos`` / ``sin`` tables as non-persistent buffers, called as ``model(idx)``. The package
    itself is not a test dependency: litgpt 0.5.13 requires huggingface-hub<1.4 and jsonargparse<=4.41, which
    transformers 5 and our pins contradict (``pip install --no-deps litgpt psutil`` imports and runs, docs/fabric.md)."""

    def __init__(self, layers: int = 2, heads: int = 4, query_groups: int = 2) -> None:
        super().__init__()
        self.heads, self.groups, self.head_size = heads, query_groups, WIDTH // heads
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(VOCAB, WIDTH),
                "h": nn.ModuleList(self._block() for _ in range(layers)),
                "ln_f": nn.RMSNorm(WIDTH, eps=1e-5),
            }
        )
        half = self.head_size // 2
        angles = torch.outer(torch.arange(4 * SEQ).float(), 1.0 / 10000 ** (torch.arange(half).float() / half))
        self.register_buffer("cos", angles.cos().repeat(1, 2), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2), persistent=False)

    def _block(self) -> nn.Module:
        qkv_out = (self.heads + 2 * self.groups) * self.head_size
        attn = nn.ModuleDict(
            {"qkv": nn.Linear(WIDTH, qkv_out, bias=False), "proj": nn.Linear(WIDTH, WIDTH, bias=False)}
        )
        mlp = nn.ModuleDict(
            {
                n: nn.Linear(*shape, bias=False)
                for n, shape in (
                    ("fc_1", (WIDTH, 2 * WIDTH)),
                    ("fc_2", (WIDTH, 2 * WIDTH)),
                    ("proj", (2 * WIDTH, WIDTH)),
                )
            }
        )
        return nn.ModuleDict(
            {"norm_1": nn.RMSNorm(WIDTH, eps=1e-5), "attn": attn, "norm_2": nn.RMSNorm(WIDTH, eps=1e-5), "mlp": mlp}
        )

    def _rope(self, x: torch.Tensor, t: int) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos[:t] + rotated * self.sin[:t]

    def _attention(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q_per_kv, hs = self.heads // self.groups, self.head_size
        qkv = attn["qkv"](x).view(b, t, self.groups, q_per_kv + 2, hs).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)  # per query group: its queries, one key, one value
        q = q.reshape(b, -1, t, hs)
        k, v = (z.expand(b, self.groups, q_per_kv, t, hs).reshape(b, -1, t, hs) for z in (k, v))
        y = F.scaled_dot_product_attention(self._rope(q, t), self._rope(k, t), v, is_causal=True)
        return attn["proj"](y.transpose(1, 2).reshape(b, t, -1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer["wte"](idx)
        for block in self.transformer["h"]:
            x = x + self._attention(block["attn"], block["norm_1"](x))
            mlp, h = block["mlp"], block["norm_2"](x)
            x = x + mlp["proj"](F.silu(mlp["fc_1"](h)) * mlp["fc_2"](h))
        return self.lm_head(self.transformer["ln_f"](x))


@dataclass(frozen=True)
class ZooEntry:
    """``build`` makes the inner model; ``data`` is ``"tokens"``, ``"mlm"``, ``"seq2seq"`` or ``"images"``;
    ``family`` says where it comes from."""

    build: Callable[[int], nn.Module]
    data: str
    family: str
    #: BatchNorm: batch statistics per rank, so with data parallelism the reference is Lightning's DDP on the same
    #: ranks (SyncBatchNorm would need CUDA: torch's runs on GPUs only).
    batch_norm: bool = False


ZOO: dict[str, ZooEntry] = {
    "gpt2": ZooEntry(_gpt2, "tokens", "transformers GPT2LMHeadModel"),
    "llama": ZooEntry(_hf("LlamaConfig", "LlamaForCausalLM"), "tokens", "transformers LlamaForCausalLM"),
    "qwen2": ZooEntry(
        _hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2), "tokens", "transformers Qwen2ForCausalLM (GQA)"
    ),
    # fewer key/value heads than a 4-rank tensor-parallel group (issue 55): grouped-query (2) and multi-query (1)
    "llama_gqa": ZooEntry(
        _hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2), "tokens", "transformers LlamaForCausalLM (GQA)"
    ),
    "llama_mq": ZooEntry(
        _hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=1), "tokens", "transformers LlamaForCausalLM (MQA)"
    ),
    "qwen2_mq": ZooEntry(
        _hf("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=1), "tokens", "transformers Qwen2ForCausalLM (MQA)"
    ),
    # 6 query heads (2 key/value): 4 ranks' island does not divide them; parallelism="hybrid" sizes tp 2 by itself
    "qwen2_6h": ZooEntry(
        _hf("Qwen2Config", "Qwen2ForCausalLM", hidden_size=48, num_attention_heads=6, num_key_value_heads=2),
        "tokens",
        "transformers Qwen2ForCausalLM (6 heads)",
    ),
    "mistral": ZooEntry(
        _hf("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=8),
        "tokens",
        "transformers MistralForCausalLM (GQA, sliding window 8)",
    ),
    "phi": ZooEntry(
        _hf("PhiConfig", "PhiForCausalLM", resid_pdrop=0.0, embd_pdrop=0.0), "tokens", "transformers PhiForCausalLM"
    ),
    "qwen3": ZooEntry(
        _hf("Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=8),
        "tokens",
        "transformers Qwen3ForCausalLM",
    ),
    # mixture of experts as transformers 5 stores it (experts as 3-D parameters, top-2 of 4, grouped_mm)
    "mixtral": ZooEntry(
        _hf("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
        "tokens",
        "transformers MixtralForCausalLM (MoE, 3-D experts)",
    ),
    # buffers: the embedding's scale and the rotary tables (non-persistent), logit soft-capping, sliding window
    "gemma2": ZooEntry(
        _hf("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=8, sliding_window=8),
        "tokens",
        "transformers Gemma2ForCausalLM (buffers)",
    ),
    # fused projections: q, k and v in one Linear (GQA), gate and up in one
    "phi3": ZooEntry(
        _hf(
            "Phi3Config",
            "Phi3ForCausalLM",
            num_key_value_heads=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        ),
        "tokens",
        "transformers Phi3ForCausalLM (fused qkv, fused gate/up)",
    ),
    "neox": ZooEntry(
        _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", hidden_dropout=0.0, attention_dropout=0.0),
        "tokens",
        "transformers GPTNeoXForCausalLM (fused query_key_value)",
    ),
    # parallel attention: the attention output added in place into the MLP's (`mlp_output += attention_output`);
    # new_decoder_architecture: grouped fused QKV (2 key/value heads), two norms per block
    "falcon": ZooEntry(
        _hf(
            "FalconConfig",
            "FalconForCausalLM",
            new_decoder_architecture=True,
            num_kv_heads=2,
            bos_token_id=1,
            eos_token_id=1,
        ),
        "tokens",
        "transformers FalconForCausalLM (new_decoder_architecture, grouped fused QKV, in-place residual)",
    ),
    # Falcon's defaults: multi-query attention (one key/value head), parallel_attn, one norm per block
    "falcon_mq": ZooEntry(
        _hf("FalconConfig", "FalconForCausalLM", bos_token_id=1, eos_token_id=1),
        "tokens",
        "transformers FalconForCausalLM (multi-query, parallel_attn, in-place residual)",
    ),
    # a LayerNorm right after the (vocabulary-parallel) token embedding, ALiBi, fused query_key_value
    "bloom": ZooEntry(
        _hf("BloomConfig", "BloomForCausalLM", bos_token_id=1, eos_token_id=1),
        "tokens",
        "transformers BloomForCausalLM (embedding LayerNorm, ALiBi)",
    ),
    "gptj": ZooEntry(_gptj, "tokens", "transformers GPTJForCausalLM (parallel residual, partial rotary)"),
    "mbart": ZooEntry(
        _mbart, "tokens", "transformers MBartForCausalLM (embedding LayerNorm, scaled embedding subclass)"
    ),
    "bert": ZooEntry(_bert, "mlm", "transformers BertForMaskedLM"),
    "t5": ZooEntry(_t5, "seq2seq", "transformers T5ForConditionalGeneration"),
    "resnet": ZooEntry(_resnet, "images", "transformers ResNetForImageClassification (BatchNorm)", batch_norm=True),
    "vit": ZooEntry(_vit, "images", "transformers ViTForImageClassification"),
    "mha": ZooEntry(lambda layers: TokenStack(MHABlock, layers), "tokens", "nn.MultiheadAttention blocks"),
    "litgpt": ZooEntry(
        LitGPTShape, "tokens", "LitGPT's GPT shape (Llama config: fused GQA qkv, SwiGLU, RMSNorm, rope)"
    ),
    "moe": ZooEntry(lambda layers: TokenStack(MoEBlock, layers), "tokens", "top-2 mixture of experts"),
    "branch": ZooEntry(
        lambda layers: TokenStack(MHABlock, layers, gated=True), "tokens", "a Python branch on a config flag"
    ),
}


class ZooModule(L.LightningModule):
    """The LightningModule users write around a model they did not write."""

    def __init__(self, name: str, optimizer: str = "adamw", lr: float = 1e-2, layers: int = 2) -> None:
        super().__init__()
        self.kind, self.optimizer_name, self.lr = ZOO[name].data, optimizer, lr
        self.model = ZOO[name].build(layers)

    def forward(self, x: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        if self.kind == "images":
            return self.model(pixel_values=x).logits
        if self.kind == "seq2seq":
            return self.model(input_ids=x, decoder_input_ids=extra[0]).logits
        if isinstance(self.model, (TokenStack, LitGPTShape)):  # logits from the token ids, as LitGPT's GPT(idx)
            return self.model(x)
        return self.model(input_ids=x).logits

    def _loss(self, batch: list[torch.Tensor]) -> torch.Tensor:
        if self.kind == "images":
            x, y = batch
            return F.cross_entropy(self(x), y)
        if self.kind == "seq2seq":
            x, decoder_in, y = batch
            logits = self(x, decoder_in)
        else:
            x, y = batch
            logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def zoo_module(name: str, optimizer: str = "adamw", lr: float = 1e-2, layers: int = 2) -> ZooModule:
    return ZooModule(name, optimizer, lr, layers)


def zoo_data(name: str, n: int = 64, batch_size: int = 4, seed: int = 1234, padded: bool = False) -> DataLoader:
    """Deterministic data for ``name``'s kind: next-token pairs, masked-LM pairs, seq2seq triples or images.
    ``padded`` (next-token pairs): each sample is 2 .. SEQ tokens long, padded with id 0 and labelled -100 on the
    padding, as a fine-tuning collator pads (``cross_entropy`` averages over the real tokens)."""
    g = torch.Generator().manual_seed(seed)
    kind = ZOO[name].data
    if kind == "images":
        x = torch.randn(n, 3, IMAGE, IMAGE, generator=g)
        tensors: tuple[torch.Tensor, ...] = (x, torch.randint(0, CLASSES, (n,), generator=g))
    else:
        x = torch.randint(1, VOCAB, (n, SEQ), generator=g)
        if kind == "mlm":  # 15% of the tokens masked (id 0), the model predicts every position's original token
            masked = torch.rand(n, SEQ, generator=g) < 0.15
            tensors = (x.masked_fill(masked, 0), x)
        elif kind == "seq2seq":  # predict the reversed sequence, teacher-forced
            y = x.flip(1)
            tensors = (x, torch.cat([torch.zeros(n, 1, dtype=x.dtype), y[:, :-1]], dim=1), y)
        else:
            y = torch.roll(x, -1, dims=1)
            if padded:
                pad = torch.arange(SEQ) >= torch.randint(2, SEQ + 1, (n, 1), generator=g)
                x, y = x.masked_fill(pad, 0), y.masked_fill(pad, -100)
            tensors = (x, y)
    return DataLoader(TensorDataset(*tensors), batch_size=batch_size, shuffle=False)
