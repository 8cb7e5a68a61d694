"""Training NCPP's network with torch, offline (`rankwatch model fit`, bench/ncpp.py).

The only module of the collector that imports torch; the collector itself never imports it. The
network is the one ncpp.py evaluates, built from torch's own layers' math so the weights export one to
one. It fits log(target), standardized, by mean squared error (a relative error, as MAPE judges),
full-batch Adam with weight decay; tables here are thousands of rows at most.
"""

import math

import numpy as np
import pandas as pd
import torch
from torch import nn

from collector.predict.analytic import Analytic
from collector.predict.groups import UNSEEN, Encoder
from collector.predict.ncpp import BLOCK, Model, category_offsets, token_groups

UNSEEN_RATE = 0.1  # how often training reads a category as unseen


class _Block(nn.Module):
    """ncpp._block in torch: one pre-norm single-head attention block."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.wq, self.wk, self.wv, self.wo = (
            nn.Parameter(torch.randn(width, width) / math.sqrt(width)) for _ in range(4)
        )
        self.w1 = nn.Parameter(torch.randn(width, hidden) / math.sqrt(width))
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2 = nn.Parameter(torch.randn(hidden, width) / math.sqrt(hidden) * 0.1)
        self.b2 = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = h @ self.wq, h @ self.wk, h @ self.wv
        x = x + torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), -1) @ v @ self.wo
        return x + torch.relu(self.ln2(x) @ self.w1 + self.b1) @ self.w2 + self.b2

    def export(self, prefix: str) -> dict[str, np.ndarray]:
        values = {
            "ln1.w": self.ln1.weight,
            "ln1.b": self.ln1.bias,
            "ln2.w": self.ln2.weight,
            "ln2.b": self.ln2.bias,
            "wq": self.wq,
            "wk": self.wk,
            "wv": self.wv,
            "wo": self.wo,
            "w1": self.w1,
            "b1": self.b1,
            "w2": self.w2,
            "b2": self.b2,
        }
        return {f"{prefix}.{name}": values[name].detach().numpy().astype(np.float32) for name in BLOCK}


class GroupAttention(nn.Module):
    """Feature tokens → per-group attention → cross-group attention → one output."""

    def __init__(self, encoder: Encoder, width: int = 16, hidden: int = 32):
        super().__init__()
        self.groups = [torch.from_numpy(g) for g in token_groups(encoder)]
        self.offsets = torch.from_numpy(category_offsets(encoder))
        categories = sum(len(f.vocabulary) + 1 for f in encoder.categorical)
        self.scale = nn.Parameter(torch.randn(len(encoder.numeric), width) * 0.5)
        self.shift = nn.Parameter(torch.randn(len(encoder.numeric), width) * 0.1)
        self.table = nn.Parameter(torch.randn(max(categories, 1), width) * 0.5)
        self.cls = nn.Parameter(torch.randn(len(self.groups), width) * 0.1)
        self.blocks = nn.ModuleList(_Block(width, hidden) for _ in self.groups)
        self.group = nn.Parameter(torch.randn(len(self.groups), width) * 0.1)
        self.cross = _Block(width, hidden)
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)

    def forward(self, numbers: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        n = numbers.shape[0]
        tokens = torch.cat([numbers[:, :, None] * self.scale + self.shift, self.table[codes + self.offsets]], 1)
        summaries = [
            block(torch.cat([self.cls[g].expand(n, 1, -1), tokens[:, index]], 1))[:, 0]
            for g, (block, index) in enumerate(zip(self.blocks, self.groups, strict=True))
        ]
        x = self.cross(torch.stack(summaries, 1) + self.group).mean(1)
        return self.head(self.ln(x))[:, 0]

    def export(self) -> dict[str, np.ndarray]:
        weights = {
            "num.scale": self.scale,
            "num.shift": self.shift,
            "cat.table": self.table,
            "x.group": self.group,
            "head.ln.w": self.ln.weight,
            "head.ln.b": self.ln.bias,
            "head.b": self.head.bias,
        }
        out = {k: v.detach().numpy().astype(np.float32) for k, v in weights.items()}
        out["head.w"] = self.head.weight.detach().numpy().T.astype(np.float32).copy()
        for g, block in enumerate(self.blocks):
            assert isinstance(block, _Block)
            out.update(block.export(f"g{g}"))
            out[f"g{g}.cls"] = self.cls[g].detach().numpy().astype(np.float32)
        out.update(self.cross.export("x"))
        return out


def fit(
    table: pd.DataFrame,
    target: np.ndarray,
    groups: dict[str, list[str]],
    *,
    name: str = "target",
    epochs: int = 600,
    seed: int = 0,
    prior: Analytic | None = None,
) -> Model:
    """NCPP fitted to predict `target` (positive) from `table`'s grouped columns; with `prior`, to
    predict the target over the prior's prediction (the prior fitted first, on the same rows)."""
    torch.manual_seed(seed)
    encoder = Encoder.fit(table, groups)
    encoded = encoder.encode(table)
    target = np.asarray(target, dtype=float)
    if prior is not None:
        target = target / prior.fit(table, target).predict(table)
    log = np.log(target)
    mean, std = float(log.mean()), float(log.std()) or 1.0
    numbers, codes = torch.from_numpy(encoded.numbers), torch.from_numpy(encoded.codes)
    y = torch.from_numpy(((log - mean) / std).astype(np.float32))
    net = GroupAttention(encoder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only spin
    try:
        _train(net, numbers, codes, y, epochs)
    finally:
        torch.set_num_threads(threads)
    return Model(encoder, net.export(), mean, std, name, prior)


def _train(net: GroupAttention, numbers: torch.Tensor, codes: torch.Tensor, y: torch.Tensor, epochs: int) -> None:
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-3)
    batch = min(len(y), 512)
    with torch.enable_grad():
        for _ in range(epochs):
            for index in torch.randperm(len(y)).split(batch):
                optimizer.zero_grad()
                # a category dropped to "unseen" now and then, so that a value no training row had
                # (a new test, a new CPU model) reads as the average of its kind, not as noise
                seen = codes[index].masked_fill(torch.rand(len(index), codes.shape[1]) < UNSEEN_RATE, UNSEEN)
                loss = torch.mean((net(numbers[index], seen) - y[index]) ** 2)
                loss.backward()
                optimizer.step()
