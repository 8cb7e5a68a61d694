"""The step-time model fitted on stored runs and judged on runs it did not see: what
`rankwatch model fit` saves, and what tells the collector whether to trust it.

Each run is one configuration (model, batch, threads, load on the host, ...): held out one at a
time, so a run's near-identical rank-steps never sit on both sides. NCPP is judged beside the
median of the same workload, ridge, boosted trees and the analytic model; the file keeps the figures,
and a model that did not beat every baseline is kept but not used (`Fitted.trusted`)."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from collector.predict import steptime
from collector.predict.analytic import Analytic
from collector.predict.baselines import Boosted, Ncpp, Ridge
from collector.predict.evaluate import held_out, metrics
from collector.predict.ncpp import Model
from collector.predict.priors import Median, Prior
from rankwatch.agent import semconv as sc

MIN_RUNS = 3  # held out one at a time, a fit sees at least two
RUN = "run_id"  # the column of a fit's table that names each rank-step's run
WORKLOAD = ["log_flops", "log_tokens", "world_size"]  # what the median of the same work groups by


class TooLittleData(ValueError):
    """Not enough runs or rank-steps to fit and judge a model: said in one line."""


@dataclass
class Fitted:
    """A saved step-time model and how it did on held-out runs."""

    model: Model
    figures: dict[str, dict[str, float]]  # predictor: metrics (evaluate.metrics), on held-out runs
    best_baseline: str

    @property
    def trusted(self) -> bool:
        """Whether NCPP beat every baseline on held-out runs (else nothing is drawn from it)."""
        return self.figures["ncpp"]["mape"] < self.figures[self.best_baseline]["mape"]

    @property
    def verdict(self) -> str:
        ncpp, best = self.figures["ncpp"]["mape"], self.figures[self.best_baseline]["mape"]
        if self.trusted:
            return (
                f"NCPP predicts held-out runs within {ncpp:.1f}% (MAPE; "
                f"{self.best_baseline}, the best baseline: {best:.1f}%)"
            )
        return (
            f"NCPP ({ncpp:.1f}% MAPE on held-out runs) does no better than {self.best_baseline} ({best:.1f}%): "
            "no prediction is drawn from it"
        )

    def save(self, path: Path) -> None:
        self.model.save(path, figures=self.figures, best_baseline=self.best_baseline)

    @classmethod
    def load(cls, path: Path) -> "Fitted":
        model, meta = Model.load(path)
        if "figures" not in meta or "best_baseline" not in meta:
            raise ValueError(f"{path}: a model without its held-out figures (not saved by `rankwatch model fit`)")
        return cls(model, meta["figures"], meta["best_baseline"])


def table(con, run_ids: list[str]) -> tuple[pd.DataFrame, np.ndarray]:
    """The runs' rank-steps as features, with the run of each (`RUN`), and their compute times."""
    parts, targets = [], []
    for run_id in run_ids:
        steps, features = steptime.read(con, run_id)
        parts.append(features.assign(**{RUN: run_id}))
        targets.append(steps[steptime.TARGET].to_numpy(dtype=float))
    return pd.concat(parts, ignore_index=True), np.concatenate(targets)


def analytic_prior() -> Analytic:
    """The analytic model of a rank-step's compute time (work / clock), unfitted."""
    return Analytic("log_flops", sc.SM_CLOCK_MHZ)


def workload_median() -> Median:
    """The median compute time of the same work, unfitted."""
    return Median(WORKLOAD)


def ncpp(epochs: int, seed: int) -> Ncpp:
    """NCPP as fitted on stored runs: correcting the analytic model or the median, whichever predicts
    held-out runs better, judged with the runs (`RUN`) held out together."""
    priors: list[Callable[[], Prior]] = [analytic_prior, workload_median]
    return Ncpp(steptime.GROUPS, priors, by=RUN, epochs=epochs, seed=seed, target=steptime.TARGET)


def predictors(epochs: int, seed: int) -> list:
    """NCPP and its baselines, each made afresh for every fit."""
    groups = steptime.GROUPS
    return [
        lambda: ncpp(epochs, seed),
        workload_median,
        lambda: Ridge(groups),
        lambda: Boosted(groups, seed=seed),
        analytic_prior,
    ]


def judge(
    features: pd.DataFrame, target: np.ndarray, epochs: int = 60, seed: int = 0
) -> tuple[dict[str, dict[str, float]], str]:
    """Every predictor's held-out figures (each run of `features[RUN]` held out in turn), and the best
    baseline's name."""
    predicted: dict[str, np.ndarray] = held_out(features, target, features[RUN], predictors(epochs, seed))
    figures = {name: metrics(target, p) for name, p in predicted.items()}
    baselines = {name: f["mape"] for name, f in figures.items() if name != "ncpp"}
    return figures, min(baselines, key=baselines.__getitem__)


def fit(con, run_ids: list[str], epochs: int = 60, seed: int = 0) -> Fitted:
    """NCPP fitted on every rank-step of `run_ids`, with its figures on each run held out."""
    if len(set(run_ids)) < MIN_RUNS:
        raise TooLittleData(f"a model is judged on runs it did not see: give at least {MIN_RUNS} runs")
    features, target = table(con, sorted(set(run_ids)))
    empty = sorted(set(run_ids) - set(features[RUN]))
    if empty:
        raise TooLittleData(f"run(s) {', '.join(empty)} have no step with a compute time")
    figures, best = judge(features, target, epochs, seed)
    return Fitted(ncpp(epochs, seed).fit(features, target).model, figures, best)
