"""The baselines NCPP must beat, each fitted on log(target) as NCPP is: the median of the same
configuration, ridge regression, and gradient-boosted trees (scikit-learn's histogram GBRT, native
categories); for step time also the analytic model (analytic.py). A baseline and NCPP share one
surface: `fit(table, target)`, then `predict(table)`. The median and the analytic model are also
NCPP's priors: the predictions its network learns to correct, evaluated with numpy alone."""

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import pandas as pd

from collector.predict.groups import Encoder, as_text


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


def _columns(table: pd.DataFrame, groups: Mapping[str, Sequence[str]]) -> tuple[list[str], list[str]]:
    encoder = Encoder.fit(table, groups)
    return [f.name for f in encoder.numeric], [f.name for f in encoder.categorical]


def _frame(table: pd.DataFrame, numeric: list[str], categorical: list[str]) -> pd.DataFrame:
    out = pd.DataFrame(index=table.index)
    for name in numeric:
        out[name] = pd.to_numeric(table[name], errors="coerce") if name in table else np.nan
    for name in categorical:
        out[name] = as_text(table[name]) if name in table else ""
    return out


class Ridge:
    """Ridge regression on standardized numbers and one-hot categories, its penalty chosen by
    leave-one-out over the training rows."""

    name = "ridge"

    def __init__(self, groups: Mapping[str, Sequence[str]]):
        self.groups = groups

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Ridge":
        from sklearn.compose import make_column_transformer
        from sklearn.impute import SimpleImputer
        from sklearn.linear_model import RidgeCV
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import OneHotEncoder, StandardScaler

        self.numeric, self.categorical = _columns(table, self.groups)
        columns = make_column_transformer(
            (make_pipeline(SimpleImputer(), StandardScaler()), self.numeric),
            (OneHotEncoder(handle_unknown="ignore"), self.categorical),
        )
        self.model = make_pipeline(columns, RidgeCV(alphas=np.logspace(-3, 3, 13)))
        self.model.fit(_frame(table, self.numeric, self.categorical), np.log(target))
        return self

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        return np.exp(self.model.predict(_frame(table, self.numeric, self.categorical)))


class Boosted:
    """Gradient-boosted trees (scikit-learn's HistGradientBoostingRegressor, categories native)."""

    name = "boosted trees"

    def __init__(self, groups: Mapping[str, Sequence[str]], seed: int = 0):
        self.groups, self.seed = groups, seed

    def _frame(self, table: pd.DataFrame) -> pd.DataFrame:
        out = _frame(table, self.numeric, self.categorical)
        for name in self.categorical:
            out[name] = pd.Categorical(out[name], categories=self.vocabulary[name])
        return out

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Boosted":
        from sklearn.ensemble import HistGradientBoostingRegressor

        self.numeric, self.categorical = _columns(table, self.groups)
        self.vocabulary = {name: sorted(set(as_text(table[name]))) for name in self.categorical}
        self.model = HistGradientBoostingRegressor(
            categorical_features="from_dtype",
            min_samples_leaf=max(2, min(20, len(table) // 50)),
            random_state=self.seed,
        )
        self.model.fit(self._frame(table), np.log(target))
        return self

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        return np.exp(self.model.predict(self._frame(table)))


class Ncpp:
    """NCPP on the same surface: its prior chosen and corrected with torch (fit.py), evaluated as the
    collector does (numpy)."""

    name = "ncpp"

    def __init__(
        self,
        groups: Mapping[str, Sequence[str]],
        priors: Sequence[Callable[[], Prior]],
        by: str | None = None,
        epochs: int = 600,
        seed: int = 0,
        target: str = "target",
    ):
        """`priors`: the baselines it may correct, each made afresh for every fit; `by`: the column that
        names each row's group (a server, a run), held out together when the priors and the correction
        are judged (None: each row its own); `target`: what it predicts, in words (saved with it)."""
        self.groups, self.priors, self.by = groups, priors, by
        self.epochs, self.seed, self.target = epochs, seed, target

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Ncpp":
        from collector.predict.fit import fit

        groups = {g: list(c) for g, c in self.groups.items()}
        self.model = fit(
            table, target, groups, self.priors, by=self.by, name=self.target, epochs=self.epochs, seed=self.seed
        )
        return self

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        return self.model.predict(table)
