"""Training anomalies: NaN or infinite loss or gradient norm, loss spikes, gradient-norm spikes.

A pure function from rank-steps to findings. A non-finite value is an anomaly
at once, on whichever rank reports it. A spike is judged on the step's median
over ranks against a moving baseline: the median and MAD of the preceding
`baseline` steps (robust: earlier spikes do not raise it), the MAD floored at
a fraction of the median so a flat loss does not make every wiggle a spike.
A step is spiking when its robust z-score passes `z` and it is at least
`min_rise` above the baseline; the finding fires after `patience` such steps
in a row, and never during `warmup`, when the loss falls fast by nature.
A non-finite value and a loss spike are critical (the collector rolls them
back); a gradient-norm spike is a warning: alone, it is often a natural
excursion of early training while the loss keeps falling.
"""

from dataclasses import dataclass

import numpy as np
import pandas as pd

from collector.analysis.analyzers import Frames, Reads
from collector.findings import ANOMALIES, GRAD_SPIKE, LOSS_SPIKE, NAN, Finding

ANALYZER = ANOMALIES


@dataclass(frozen=True)
class Settings:
    warmup: int = 20  # steps at the start that are never judged for spikes
    baseline: int = 20  # preceding steps a step is judged against
    z: float = 6.0  # robust z-score of a spike
    min_rise: float = 0.5  # and at least this much above the baseline median (50%)
    mad_floor: float = 0.02  # the MAD is floored at this fraction of the baseline median
    patience: int = 1  # spiking steps in a row before a finding


# an anomaly stays firing for a baseline's length after its last step: a spike back within it is the same
# anomaly (one rollback answers it)
READS = Reads(history=Settings().baseline + Settings().patience, linger=Settings().baseline)


def judge(frames: Frames, settings: Settings = Settings()) -> list[Finding]:
    """The anomalies of the steps from `frames.first_new` on, each judged on the steps before it. The
    steps' medians are kept for the next pass (`frames.kept`), which takes those of its new steps alone."""
    if frames.new_steps.empty:
        return []
    kept = frames.kept.setdefault(ANALYZER, {})
    since = frames.first_new - 1 - settings.baseline - settings.patience  # the steps the first new one needs
    medians: pd.DataFrame | None = kept.get("medians")
    fresh = _medians(frames.steps_after(since if medians is None else kept["upto"]))
    medians = fresh if medians is None else pd.concat([medians[medians.index > since], fresh])
    kept.update(medians=medians, upto=int(medians.index.max()))
    return _judge(frames.run_id, frames.new_steps, medians, frames.first_new, settings)


def analyze(steps: pd.DataFrame, settings: Settings = Settings()) -> list[Finding]:
    """Findings for one run, every step judged. `steps`: run_id, rank, step, loss, grad_norm,
    non_finite (one row per rank-step; non_finite: loss or grad_norm was NaN or infinite, which a
    frame cannot tell from a missing value once both are NaN)."""
    if steps.empty:
        return []
    return _judge(str(steps["run_id"].iloc[0]), steps, _medians(steps), int(steps["step"].min()), settings)


def _medians(steps: pd.DataFrame) -> pd.DataFrame:
    """Per step, the median loss and gradient norm over its ranks (of the finite values)."""
    return steps[~steps["non_finite"]].groupby("step")[["loss", "grad_norm"]].median()


def _judge(run_id: str, new: pd.DataFrame, per_step: pd.DataFrame, first_new: int, settings: Settings) -> list[Finding]:
    """The anomalies of the rank-steps `new` (those from `first_new` on), spikes judged on the steps'
    medians (`per_step`, those before `first_new` the baseline)."""
    found = _non_finite(run_id, new)
    for column, kind, what, severity in (
        ("loss", LOSS_SPIKE, "loss", "critical"),
        ("grad_norm", GRAD_SPIKE, "gradient norm", "warning"),
    ):
        found += _spikes(run_id, per_step[column].dropna(), first_new, kind, what, severity, settings)
    return found


def _non_finite(run_id: str, steps: pd.DataFrame) -> list[Finding]:
    bad = steps[steps["non_finite"]]
    if bad.empty:
        return []
    first = int(bad["step"].min())
    ranks = sorted(int(r) for r in bad.loc[bad["step"] == first, "rank"].unique())
    # the job's anomaly, not a rank's: its identity must not change as the other ranks' steps arrive
    return [
        Finding(
            run_id,
            NAN,
            [],
            first,
            int(bad["step"].max()),
            "critical",
            float(bad["step"].nunique()),
            f"loss or gradient norm is not finite since step {first} (ranks {ranks}): training has diverged",
            {"first_step": first, "ranks": ranks, "steps_affected": int(bad["step"].nunique())},
            analyzer=ANALYZER,
        )
    ]


def _spikes(
    run_id: str, series: pd.Series, first_new: int, kind: str, what: str, severity: str, s: Settings
) -> list[Finding]:
    """Each run of spiking steps from `first_new` on (after warmup and `patience` in a row), with its
    evidence at the step that made it one."""
    if len(series) <= s.baseline:
        return []
    values, steps = series.to_numpy(), series.index.to_numpy()
    first = max(int(np.searchsorted(steps, s.warmup)), s.baseline)  # warmup counts from the run's first step, 0
    streak = 0
    episodes: list[list] = []  # [first index, last index, index found at, z, center, spread]
    for i in range(first, len(values)):
        base = values[i - s.baseline : i]
        center = float(np.median(base))
        spread = max(1.4826 * float(np.median(np.abs(base - center))), s.mad_floor * abs(center), 1e-12)
        z = (values[i] - center) / spread
        streak = streak + 1 if z > s.z and values[i] > center * (1 + s.min_rise) else 0
        if streak < s.patience or steps[i] < first_new:
            continue
        if episodes and episodes[-1][1] == i - 1:
            episodes[-1][1] = i
        else:
            episodes.append([i - streak + 1, i, i, z, center, spread])
    found = []
    for start, end, at, z, center, spread in episodes:
        window = series.iloc[max(start - s.baseline, 0) : min(end + 6, len(series))]
        found.append(
            Finding(
                run_id,
                kind,
                [],
                int(steps[start]),
                int(steps[end]),
                severity,
                float(z),
                f"{what} spiked at step {int(steps[start])}: {values[at]:.4g} against a baseline of "
                f"{center:.4g} (robust z {z:.0f})",
                {
                    "baseline_median": center,
                    "baseline_mad": spread / 1.4826,
                    "z": float(z),
                    "values": {int(k): float(v) for k, v in window.items()},
                },
                analyzer=ANALYZER,
            )
        )
    return found
