"""What every predictor of step time shares (`Predictor`: fit, then predict), and NCPP's priors: the
predictions its network learns to correct (`Prior`), saved with a model as JSON and evaluated in the
collector with numpy alone; the median of the same configuration is one (analytic.py's model the other).
Apart from the baselines (baselines.py), which fit NCPP itself, so that NCPP's evaluation (ncpp.py)
imports no fitting."""

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pandas as pd

from collector.predict.groups import as_text


class Predictor(Protocol):
    name: str

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Predictor": ...

    def predict(self, table: pd.DataFrame) -> np.ndarray: ...


class Prior(Predictor, Protocol):
    """A baseline NCPP may correct: saved with the model as JSON, and evaluated in the collector."""

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Prior": ...

    def covers(self, table: pd.DataFrame) -> np.ndarray:
        """Which rows it predicts from rows of their own kind: where a correction learnt on it applies."""
        ...

    def to_json(self) -> dict: ...


class Median:
    """The median of the rows of the same configuration (`keys`), falling back to fewer keys, then to
    every row, where the configuration was not seen: what a user would guess from past runs."""

    name = "median"

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)
        self.levels: list[dict[tuple[str, ...], float]] = []  # log medians by configuration, all keys first
        self.overall = float("nan")

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Median":
        self.keys = [k for k in self.keys if k in table]  # a table without one is judged on the rest
        log = pd.Series(np.log(target), index=table.index)
        columns = [as_text(table[k]) for k in self.keys]
        self.levels = []
        for depth in range(len(self.keys), 0, -1):
            medians = log.groupby(columns[:depth]).median()
            self.levels.append({k if isinstance(k, tuple) else (k,): float(v) for k, v in medians.items()})
        self.overall = float(log.median())
        return self

    def _matched(self, table: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        """Each row's log median, and how many of its keys the median matched (0: every row's)."""
        columns = [as_text(table[k]) if k in table else pd.Series("", index=table.index) for k in self.keys]
        log, depth = np.full(len(table), self.overall), np.zeros(len(table), dtype=np.int64)
        for i, key in enumerate(zip(*columns, strict=True) if columns else ()):
            for d, level in zip(range(len(self.keys), 0, -1), self.levels, strict=True):
                value = level.get(key[:d])
                if value is not None:
                    log[i], depth[i] = value, d
                    break
        return log, depth

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        return np.exp(self._matched(table)[0])

    def covers(self, table: pd.DataFrame) -> np.ndarray:
        """The rows whose whole configuration was seen: what differs between those is the rows' own
        state; a configuration not seen is a guess from coarser ones, which no state corrects."""
        return self._matched(table)[1] == max(len(self.keys), 1)

    def to_json(self) -> dict:
        levels = [[[*key, value] for key, value in level.items()] for level in self.levels]
        return {"keys": self.keys, "levels": levels, "overall": self.overall}

    @classmethod
    def from_json(cls, saved: dict) -> "Median":
        median = cls(saved["keys"])
        median.levels = [{tuple(entry[:-1]): float(entry[-1]) for entry in level} for level in saved["levels"]]
        median.overall = float(saved["overall"])
        return median
