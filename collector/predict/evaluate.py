"""How a predictor is judged: percentage errors on rows it did not train on, held out by group (a
server, a run configuration) so that repeats of one measurement never sit on both sides."""

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

from collector.predict.priors import Predictor


def metrics(actual: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """MAPE and P90 of the absolute percentage error, the share within 5%, and R² of log values (the
    targets span orders of magnitude, so R² of raw values would judge the largest alone)."""
    actual, predicted = np.asarray(actual, dtype=float), np.asarray(predicted, dtype=float)
    error = np.abs(predicted - actual) / np.abs(actual) * 100
    log_actual, log_predicted = np.log(actual), np.log(np.maximum(predicted, 1e-300))
    total = float(np.sum((log_actual - log_actual.mean()) ** 2))
    r2 = 1 - float(np.sum((log_actual - log_predicted) ** 2)) / total if total > 0 else float("nan")
    return {
        "mape": float(error.mean()),
        "p90": float(np.percentile(error, 90)),
        "within5": float(np.mean(error <= 5)),
        "r2_log": r2,
    }


def held_out(
    table: pd.DataFrame,
    target: np.ndarray,
    by: Sequence[str] | np.ndarray,
    predictors: Sequence[Callable[[], Predictor]],
) -> dict[str, np.ndarray]:
    """Each predictor's prediction of every row from a fit that did not see the row's group `by`
    (each group held out in turn), by the predictor's name."""
    from sklearn.model_selection import LeaveOneGroupOut

    groups = np.asarray(by)
    out = {}
    for make in predictors:
        predicted = np.full(len(table), np.nan)
        for train, test in LeaveOneGroupOut().split(table, target, groups):
            model = make().fit(table.iloc[train], target[train])
            predicted[test] = model.predict(table.iloc[test])
        out[model.name] = predicted
    return out
