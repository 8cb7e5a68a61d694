"""Fitting NCPP offline (`rankwatch model fit`, bench/ncpp.py): its prior chosen, its network trained
with torch, its correction shrunk.

The only module of the collector that imports torch; the collector itself never imports it. The
network is the one ncpp.py evaluates, built from torch's own layers' math so the weights export one to
one. It fits the log of the target over the prior's prediction, standardized, by mean squared error (a
relative error, as MAPE judges), with AdamW; tables here are thousands of rows at most.

Everything NCPP chooses is judged on groups of rows (servers, runs) it was not fitted on, split
`FOLDS` ways at most: the prior (the baseline with the lowest MAPE held out), the rows the network
learns from (the prior's errors on held-out groups, where it covers the row: the same situation as on
a new server), and the correction's scale (the smallest that does about as well as the best, fold
by fold; 0 is the prior alone). So across the training groups the model does no worse than its
prior, and better where the state explains the rest.
"""

import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from sklearn.model_selection import GroupKFold
from torch import nn

from collector.predict.evaluate import metrics
from collector.predict.groups import UNSEEN, Encoder, NothingVaries
from collector.predict.ncpp import BLOCK, Model, Network, category_offsets, token_groups
from collector.predict.priors import Prior

UNSEEN_RATE = 0.1  # how often training reads a category as unseen
FOLDS = 5  # the most ways the training groups are split to judge what the fit chooses
SHRINKS = np.linspace(0.0, 1.0, 11)  # the correction's scales tried, the prior alone first


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
    priors: Sequence[Callable[[], Prior]],
    *,
    by: str | None = None,
    name: str = "target",
    epochs: int = 600,
    seed: int = 0,
) -> Model:
    """NCPP fitted to predict `target` (positive) from `table`'s grouped columns, correcting the best of
    `priors`; `by`: the column naming each row's group (None: each row its own)."""
    target = np.asarray(target, dtype=float)
    folds = _folds(table, by)
    if not folds:  # one group: nothing to judge a choice on
        return Model(priors[0]().fit(table, target), name)
    held = [_held_out(make, table, target, folds) for make in priors]
    best = min(range(len(priors)), key=lambda i: metrics(target, held[i][0])["mape"])
    predicted, covered = held[best]
    residual = np.log(target) - np.log(predicted)  # the prior's errors on groups it did not see

    def network(rows: np.ndarray) -> Network:
        return _network(table.iloc[rows], residual[rows], groups, epochs, seed)

    learnt = [(train[covered[train]], test[covered[test]]) for train, test in folds]
    try:
        shrink = _shrink(table, target, predicted, learnt, network)
        correction = network(np.flatnonzero(covered)) if shrink > 0 else None
    except NothingVaries:  # the rows the prior covers share one state: none to correct it by
        shrink, correction = 0.0, None
    return Model(priors[best]().fit(table, target), name, correction, shrink)


def _shrink(
    table: pd.DataFrame,
    target: np.ndarray,
    predicted: np.ndarray,
    folds: list[tuple[np.ndarray, np.ndarray]],
    network: Callable[[np.ndarray], Network],
) -> float:
    """The correction's scale, learnt on each fold's training rows and judged on its held-out rows
    (`predicted`: the prior's predictions of them): the smallest of SHRINKS whose MAPE, fold by fold,
    exceeds the lowest scale's by less than the excess's standard error and is no worse than the
    prior's (the one-standard-error rule: a correction that helps some groups and hurts others is not
    taken). 0 where fewer than two folds have rows on both sides."""
    folds = [(train, test) for train, test in folds if len(train) and len(test)]
    if len(folds) < 2:
        return 0.0
    errors = np.empty((len(folds), len(SHRINKS)))
    for i, (train, test) in enumerate(folds):
        corrected = network(train).predict(table.iloc[test])
        for j, scale in enumerate(SHRINKS):
            errors[i, j] = metrics(target[test], predicted[test] * np.exp(scale * corrected))["mape"]
    mean = errors.mean(axis=0)
    excess = errors - errors[:, [mean.argmin()]]
    tolerated = (excess.mean(axis=0) <= excess.std(axis=0, ddof=1) / np.sqrt(len(folds))) & (mean <= mean[0])
    return float(SHRINKS[np.argmax(tolerated)])


def _folds(table: pd.DataFrame, by: str | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The training and held-out rows of each split of the table's groups (none for one group)."""
    names = np.arange(len(table)) if by is None else table[by].astype(str).to_numpy()
    count = min(len(set(names)), FOLDS)
    return list(GroupKFold(count).split(table, groups=names)) if count > 1 else []


def _held_out(
    make: Callable[[], Prior], table: pd.DataFrame, target: np.ndarray, folds: list[tuple[np.ndarray, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """A prior's prediction of each row from a fit on the other folds, and whether that fit covered it."""
    predicted, covered = np.empty(len(target)), np.empty(len(target), dtype=bool)
    for train, test in folds:
        prior = make().fit(table.iloc[train], target[train])
        predicted[test], covered[test] = prior.predict(table.iloc[test]), prior.covers(table.iloc[test])
    return predicted, covered


def _network(table: pd.DataFrame, log: np.ndarray, groups: dict[str, list[str]], epochs: int, seed: int) -> Network:
    """The network fitted to predict `log` from `table`'s grouped columns."""
    torch.manual_seed(seed)
    encoder = Encoder.fit(table, groups)
    encoded = encoder.encode(table)
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
    return Network(encoder, net.export(), mean, std)


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
