"""The analytic model of step time: a rank does its work at one rate per clock cycle, so its time
scales as work / clock. What the power analyzer assumes under a cap; a baseline NCPP is judged
against, and a prior it may correct (its network then predicts the measured time over this one's,
so that what physics already says it need not learn from a few runs)."""

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd


@dataclass
class Analytic:
    """`log_work`: the column of the log of a rank-step's work (its FLOPs); `clock`: the SM clock's. A
    table without them reads as work 1 and clock 1 (a CPU has no SM clock); a missing value, as the
    table's median."""

    log_work: str
    clock: str
    rate: float = float("nan")  # work per clock cycle per second: the training rows' median

    name = "analytic"

    def _cycles(self, table: pd.DataFrame) -> np.ndarray:
        work = pd.Series(1.0, table.index)
        if self.log_work in table:
            work = np.exp(pd.to_numeric(table[self.log_work], errors="coerce"))
            work = work.fillna(work.median() if work.notna().any() else 1.0)
        clock = pd.Series(1.0, table.index)
        if self.clock in table:
            clock = pd.to_numeric(table[self.clock], errors="coerce")
        return (work / clock.fillna(clock.median() if clock.notna().any() else 1.0)).to_numpy(dtype=float)

    def fit(self, table: pd.DataFrame, target: np.ndarray) -> "Analytic":
        self.rate = float(np.nanmedian(self._cycles(table) / target))
        return self

    def predict(self, table: pd.DataFrame) -> np.ndarray:
        return self._cycles(table) / self.rate

    def covers(self, table: pd.DataFrame) -> np.ndarray:
        """Every row: a formula knows every configuration, so a correction learnt on it applies to all."""
        return np.ones(len(table), dtype=bool)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, saved: dict) -> "Analytic":
        return cls(**saved)
