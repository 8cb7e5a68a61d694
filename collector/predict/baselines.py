"""The baselines NCPP must beat, each fitted on log(target) as NCPP is: the median of the same
configuration, ridge regression, and gradient-boosted trees (scikit-learn's histogram GBRT, native
categories); for step time also the analytic model (analytic.py). A baseline and NCPP share one
surface: `fit(table, target)`, then `predict(table)`."""

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np
import pandas as pd

from collector.predict.analytic import Analytic
from collector.predict.groups import Encoder, as_text


class Predictor(Protocol):
    name: str

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Predictor": ...

    def predict(self, table: pd.DataFrame) -> np.ndarray: ...


class Median:
    """The median of the rows of the same configuration (`keys`), falling back to fewer keys, then to
    every row, where the configuration was not seen: what a user would guess from past runs."""

    name = "median"

    def __init__(self, keys: Sequence[str]):
        self.keys = list(keys)

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Median":
        self.keys = [k for k in self.keys if k in table]  # a table without one is judged on the rest
        log = pd.Series(np.log(target), index=table.index)
        self.levels = [
            log.groupby([as_text(table[k]) for k in self.keys[:depth]]).median().to_dict()
            for depth in range(len(self.keys), 0, -1)
        ]
        self.overall = float(log.median())
        return self

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        out = np.full(len(table), self.overall)
        known = np.zeros(len(table), dtype=bool)
        for depth, level in zip(range(len(self.keys), 0, -1), self.levels, strict=True):
            columns = [as_text(table[k]) if k in table else [""] * len(table) for k in self.keys[:depth]]
            keys = zip(*columns, strict=True)
            for i, key in enumerate(keys):
                value = level.get(key[0] if depth == 1 else key)
                if not known[i] and value is not None:
                    out[i], known[i] = value, True
        return np.exp(out)


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
    """NCPP's network on the same surface, fitted with torch, evaluated as the collector does (numpy)."""

    name = "ncpp"

    def __init__(
        self,
        groups: Mapping[str, Sequence[str]],
        epochs: int = 600,
        seed: int = 0,
        prior: Analytic | None = None,
        target: str = "target",
    ):
        """`prior`: an analytic model the network learns to correct (fitted anew with it); `target`: what
        it predicts, in words (saved with it)."""
        self.groups, self.epochs, self.seed, self.prior, self.target = groups, epochs, seed, prior, target

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Ncpp":
        from collector.predict.fit import fit

        groups = {g: list(c) for g, c in self.groups.items()}
        prior = None if self.prior is None else Analytic(self.prior.log_work, self.prior.clock)
        self.model = fit(table, target, groups, name=self.target, epochs=self.epochs, seed=self.seed, prior=prior)
        return self

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        return self.model.predict(table)
