"""What each rank-step's compute should have taken, from the state it ran in (NCPP's step-time model,
collector/predict), against what it took.

Two conclusions, pure functions of the rank-steps, their features and a fitted model:

- `explain`: a straggler finding gains how much of its slowdown the rank's own state explains, and
  through which group: each group of the rank's features set to its peers' in turn, the drop in
  predicted compute time is that group's share, in points of the slowdown. A slowdown the GPU's state
  (compute, memory, power/thermal, interconnect) explains for the most part is the hardware's; else its
  cause lies outside the GPU (the host, the data, the software).
- `judge`: the whole job computing slower than its predicted step time for `patience` steps in a row,
  by more than the model's own held-out error: a slowdown every rank shares, which comparing ranks
  cannot see. Its finding gives the predicted and measured times.
"""

from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from collector.analysis.analyzers import Finding
from collector.predict import steptime
from collector.predict.stepmodel import Fitted

ANALYZER = "predicted"
SLOWER = "slower_than_predicted"


@dataclass(frozen=True)
class Settings:
    margin: float = 0.10  # slower than predicted by at least this share...
    error_multiple: float = 2.0  # ...and by this many times the model's held-out MAPE
    patience: int = 5  # steps in a row


def predict(fitted: Fitted, features: pd.DataFrame) -> np.ndarray:
    """Each rank-step's predicted compute time, s."""
    return fitted.model.predict(features)


def judge(
    run_id: str, steps: pd.DataFrame, predicted: np.ndarray, fitted: Fitted, s: Settings = Settings()
) -> list[Finding]:
    """The stretches of at least `patience` steps whose median rank computed slower than predicted by
    more than the margin. `steps`: step, compute_s (one row per rank-step, `predicted` aligned)."""
    if not fitted.trusted or steps.empty:
        return []
    per_step = (
        pd.DataFrame(
            {"step": steps["step"].to_numpy(), "measured": steps["compute_s"].to_numpy(), "predicted": predicted}
        )
        .groupby("step")
        .median()
    )
    margin = max(s.margin, s.error_multiple * fitted.figures["ncpp"]["mape"] / 100)
    slow = (per_step["measured"] > (1 + margin) * per_step["predicted"]).to_numpy()
    found = []
    edges = np.flatnonzero(np.diff(np.r_[0, slow.astype(np.int8), 0]))
    for start, stop in zip(edges[::2], edges[1::2], strict=True):
        if stop - start < s.patience:
            continue
        stretch = per_step.iloc[start:stop]
        measured, expected = float(stretch["measured"].median()), float(stretch["predicted"].median())
        first, last = int(stretch.index[0]), int(stretch.index[-1])
        ratio = measured / expected
        found.append(
            Finding(
                run_id,
                SLOWER,
                [],
                first,
                last,
                "critical" if ratio >= 1.3 else "warning",
                ratio,
                f"the whole job computes {100 * (ratio - 1):.0f}% slower than its predicted step time since step "
                f"{first} ({measured * 1e3:.1f} ms measured, {expected * 1e3:.1f} ms predicted from its devices' "
                "and hosts' state, median rank): every rank at once, so no rank stands out; the cause is one "
                "they share that the model does not read (software, data, the input pipeline, a job beside it)",
                {"measured_s": measured, "predicted_s": expected, "margin": margin, "model": fitted.verdict},
                analyzer=ANALYZER,
            )
        )
    return found


def explain(finding: Finding, steps: pd.DataFrame, features: pd.DataFrame, fitted: Fitted) -> Finding:
    """A straggler finding (of a rank or a node) with how much of its slowdown each group of the slow
    ranks' state explains, in points (`evidence["explained"]`) and in its summary. `steps`: rank, step,
    compute_s; `features` aligned with it."""
    if not fitted.trusted or not finding.ranks or finding.step_start is None or finding.step_end is None:
        return finding
    during = steps["step"].between(finding.step_start, finding.step_end).to_numpy()
    theirs = steps["rank"].isin(finding.ranks).to_numpy()
    if not (during & theirs).any() or not (during & ~theirs).any():
        return finding
    measured, peers_measured = (float(steps["compute_s"][during & w].median()) for w in (theirs, ~theirs))
    slower = 100 * (measured / peers_measured - 1)
    mine, peers = features[during & theirs], features[during & ~theirs]
    predicted, peers_predicted, shares = steptime.explain(fitted.model, mine, peers)
    points = {group: 100 * share / peers_measured for group, share in shares.items()}
    hardware = sum(p for g, p in points.items() if g in steptime.HARDWARE)
    top = steptime.named(shares)
    cause = "hardware" if hardware >= slower / 2 else "outside the GPU"
    if top and points[top] >= 0.5:
        said = f"; its {top} state explains {points[top]:.1f} of its {slower:.1f} points"
        said += " (the hardware's)" if cause == "hardware" else " (not the GPU's: look at the host, data, software)"
    else:
        said = f"; its state explains none of its {slower:.1f} points: the cause is outside what the model reads"
    explained = {
        "slower_percent": slower,
        "predicted_s": predicted,
        "peer_predicted_s": peers_predicted,
        "points_by_group": points,
        "hardware_points": hardware,
        "cause": cause,
    }
    return replace(finding, summary=finding.summary + said, evidence={**finding.evidence, "explained": explained})
