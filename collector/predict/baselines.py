"""The baselines NCPP must beat, each fitted on log(target) as NCPP is: the median of the same
configuration (priors.py), ridge regression, and gradient-boosted trees (scikit-learn's histogram GBRT,
native categories); for step time also the analytic model (analytic.py). A baseline and NCPP share one
surface (priors.py's `Predictor`): `fit(table, target)`, then `predict(table)`. The median and the analytic
model are also NCPP's priors: the predictions its network learns to correct, evaluated with numpy alone."""

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from collector.predict.groups import Encoder, as_text
from collector.predict.priors import Prior


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
