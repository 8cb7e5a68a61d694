"""A small decoder-only transformer (GPT): sizes from a few M parameters for CPU
tests to configs that fill a GPU. A pipeline stage is the model with the parts
other stages hold removed (`stage`), as torchtitan cuts its models."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.job import GPTConfig


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.head_dim = c.dim // c.heads
        self.norm1, self.norm2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.qkv, self.proj = nn.Linear(c.dim, 3 * c.dim), nn.Linear(c.dim, c.dim)
        self.mlp = nn.Sequential(nn.Linear(c.dim, 4 * c.dim), nn.GELU(), nn.Linear(4 * c.dim, c.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # each head's q, k and v side by side: a tensor-parallel shard of qkv's outputs is whole heads
        q, k, v = self.qkv(self.norm1(x)).view(b, t, -1, 3, self.head_dim).unbind(3)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
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

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The loss (given targets), else the logits; a stage without the embedding takes the previous
        stage's activations, one without the head returns its own."""
        x = tokens if self.embed is None else self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        logits = self.head(self.norm(x))
        return logits if targets is None else loss(logits, targets)

    def stage(self, index: int, count: int) -> "GPT":
        """This model cut to pipeline stage `index` of `count` (in place): its share of the blocks, the
        embedding on the first stage, the head on the last (untied from the embedding between stages)."""
        layers = len(self.blocks)
        if not 0 < count <= layers:
            raise ValueError(f"{count} pipeline stages need at least as many layers; the model has {layers}")
        first, last = index * layers // count, (index + 1) * layers // count
        if count > 1:
            self.head.weight = nn.Parameter(self.embed.weight.detach().clone())
        self.blocks = nn.ModuleList(list(self.blocks)[first:last])
        if index > 0:
            self.embed, self.pos = None, None  # type: ignore[assignment]
        if index < count - 1:
            self.norm, self.head = None, None  # type: ignore[assignment]
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
