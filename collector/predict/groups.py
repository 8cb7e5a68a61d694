"""Feature groups and their encoding: what NCPP's per-group attention attends over.

A table's columns are named to groups (processor, memory, ... or, for a training step, compute,
memory, power, ...). Each column becomes one feature: a number (standardized on the data it was fitted
on; a missing value is the mean) or a category (a code into its vocabulary; 0 for missing or unseen).
The encoding is fitted once and saved with the model, so the collector encodes live data the same way.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

UNSEEN = 0  # a category's code for missing values and for values the fit did not see


class NothingVaries(ValueError):
    """No grouped column varies in the table an encoder is fitted on: nothing to learn from."""


@dataclass(frozen=True)
class Feature:
    name: str
    group: str
    numeric: bool
    mean: float = 0.0
    std: float = 1.0
    vocabulary: tuple[str, ...] = ()  # a category's values; code i + 1 is vocabulary[i]


@dataclass(frozen=True)
class Encoded:
    """A table as the model reads it: numbers (rows by numeric features) and codes (rows by categories)."""

    numbers: np.ndarray
    codes: np.ndarray


def as_text(column: pd.Series) -> pd.Series:
    """A category column as strings, missing values as "" (pandas' own string type keeps them NaN)."""
    return pd.Series([str(v) if pd.notna(v) else "" for v in column], index=column.index, dtype=object)


def _as_numbers(column: pd.Series) -> pd.Series | None:
    """The column as floats when every value present is a number, else None (a category)."""
    numbers = pd.to_numeric(column, errors="coerce")
    return numbers.astype(float) if numbers.notna().sum() == column.notna().sum() else None


@dataclass(frozen=True)
class Encoder:
    """How each grouped column becomes a feature, fitted on one table and applied to any other."""

    features: tuple[Feature, ...]

    @classmethod
    def fit(cls, table: pd.DataFrame, groups: Mapping[str, Sequence[str]]) -> "Encoder":
        """One feature per grouped column of `table` that varies in it (a constant says nothing)."""
        features = []
        for group, columns in groups.items():
            for name in columns:
                if name not in table or table[name].nunique(dropna=False) < 2:
                    continue
                numbers = _as_numbers(table[name])
                if numbers is not None:
                    std = float(numbers.std(ddof=0))
                    features.append(Feature(name, group, True, float(numbers.mean()), std if std > 0 else 1.0))
                else:
                    vocabulary = tuple(sorted(set(as_text(table[name].dropna()))))
                    features.append(Feature(name, group, False, vocabulary=vocabulary))
        if not features:
            raise NothingVaries("no grouped column varies in the table: nothing to learn from")
        return cls(tuple(features))

    @property
    def numeric(self) -> list[Feature]:
        return [f for f in self.features if f.numeric]

    @property
    def categorical(self) -> list[Feature]:
        return [f for f in self.features if not f.numeric]

    @property
    def groups(self) -> list[str]:
        return list(dict.fromkeys(f.group for f in self.features))

    def encode(self, table: pd.DataFrame) -> Encoded:
        """`table` as the fitted features: a column it lacks reads as missing."""
        n = len(table)
        numbers = np.zeros((n, len(self.numeric)), dtype=np.float32)
        for j, f in enumerate(self.numeric):
            if f.name in table:
                values = pd.to_numeric(table[f.name], errors="coerce").to_numpy(dtype=float)
                numbers[:, j] = np.nan_to_num((values - f.mean) / f.std, nan=0.0)
        codes = np.full((n, len(self.categorical)), UNSEEN, dtype=np.int64)
        for j, f in enumerate(self.categorical):
            if f.name in table:
                lookup = {value: i + 1 for i, value in enumerate(f.vocabulary)}
                codes[:, j] = [lookup.get(v, UNSEEN) for v in as_text(table[f.name])]
        return Encoded(numbers, codes)

    def to_json(self) -> list[dict]:
        return [
            {
                "name": f.name,
                "group": f.group,
                "numeric": f.numeric,
                "mean": f.mean,
                "std": f.std,
                "vocabulary": list(f.vocabulary),
            }
            for f in self.features
        ]

    @classmethod
    def from_json(cls, features: list[dict]) -> "Encoder":
        return cls(tuple(Feature(**{**f, "vocabulary": tuple(f["vocabulary"])}) for f in features))
