"""Small models shared by the example scripts, the benchmarks and the tests.

`TinyLM` is a plain torch transformer (benchmarks, tests); `tiny_llama` a Hugging Face Llama built
from a config, with no download (the example training and generation scripts).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 97, dim: int = 32, layers: int = 2, heads: int = 2, context: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        # a persistent float buffer is published; a non-persistent one is not
        self.register_buffer("logit_scale", torch.tensor([1.0, 0.5, 0.25]))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) * self.logit_scale[0]


def tiny_llama(vocab: int = 97, dim: int = 32, layers: int = 2, heads: int = 2, context: int = 16) -> nn.Module:
    """A Hugging Face `LlamaForCausalLM` built from a config (no download), for the rollout side."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=4 * dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def probe_batch(cfg, seed: int, rows: int = 4) -> Tensor:
    """A fixed batch of token ids, the same wherever it is drawn with the same seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab, (rows, cfg.context), generator=generator)


@torch.no_grad()
def probe_logprobs(model: nn.Module, tokens: Tensor) -> Tensor:
    """Log-probability of each next token of `tokens` under a causal LM (fp32)."""
    logits = model(tokens[:, :-1]).logits.float()
    return logits.log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
