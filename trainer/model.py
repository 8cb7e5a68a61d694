"""A small decoder-only transformer (GPT): sizes from a few M parameters for CPU
tests to configs that fill a GPU."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 512
    seq_len: int = 64
    layers: int = 2
    heads: int = 4
    dim: int = 128


CONFIGS = {
    "tiny": GPTConfig(),  # ~0.5M parameters: CPU tests and the demo
    "small": GPTConfig(vocab=8192, seq_len=256, layers=6, heads=8, dim=512),  # ~25M
    "gpt2": GPTConfig(vocab=50304, seq_len=1024, layers=12, heads=12, dim=768),  # ~124M
    "1b": GPTConfig(vocab=50304, seq_len=2048, layers=24, heads=16, dim=2048),  # ~1.3B: fills a GPU
}


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.norm1, self.norm2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.qkv, self.proj = nn.Linear(c.dim, 3 * c.dim), nn.Linear(c.dim, c.dim)
        self.mlp = nn.Sequential(nn.Linear(c.dim, 4 * c.dim), nn.GELU(), nn.Linear(4 * c.dim, c.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Parameter(torch.zeros(c.seq_len, c.dim))
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied embeddings
        for module in self.modules():  # GPT-2's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
